//! What a caller sees of an execution: status, output, per-stage progress, errors; and the
//! shapes of a fan-in stage's output.

use std::collections::BTreeMap;
use std::fmt;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::ids::{ExecutionId, GroupId, TaskId};

/// Where an execution stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum ExecutionStatus {
    /// Stages are still to run.
    Running,
    /// The last stage fired; the output is available.
    Completed,
    /// A step (or a member of a stage that fails on member failure) was dead-lettered.
    Failed,
    /// Cancelled by a caller.
    Cancelled,
    /// Its deadline passed before it finished; what was pending was cancelled.
    TimedOut,
}

impl ExecutionStatus {
    /// Whether the execution will change no more.
    pub fn is_terminal(self) -> bool {
        !matches!(self, ExecutionStatus::Running)
    }

    pub(crate) fn parse(s: &str) -> Self {
        match s {
            "completed" => ExecutionStatus::Completed,
            "failed" => ExecutionStatus::Failed,
            "cancelled" => ExecutionStatus::Cancelled,
            "timed_out" => ExecutionStatus::TimedOut,
            _ => ExecutionStatus::Running,
        }
    }

    /// The name stored in the database.
    pub fn as_str(self) -> &'static str {
        match self {
            ExecutionStatus::Running => "running",
            ExecutionStatus::Completed => "completed",
            ExecutionStatus::Failed => "failed",
            ExecutionStatus::Cancelled => "cancelled",
            ExecutionStatus::TimedOut => "timed_out",
        }
    }
}

/// A status name that is not one of `running`, `completed`, `failed`, `cancelled`,
/// `timed_out`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown execution status {0:?} (running, completed, failed, cancelled or timed_out)")]
pub struct UnknownStatus(pub String);

impl std::str::FromStr for ExecutionStatus {
    type Err = UnknownStatus;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "running" => Ok(ExecutionStatus::Running),
            "completed" => Ok(ExecutionStatus::Completed),
            "failed" => Ok(ExecutionStatus::Failed),
            "cancelled" | "canceled" => Ok(ExecutionStatus::Cancelled),
            "timed_out" | "timed-out" => Ok(ExecutionStatus::TimedOut),
            other => Err(UnknownStatus(other.to_owned())),
        }
    }
}

impl fmt::Display for ExecutionStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A snapshot of one execution.
#[derive(Clone, Debug, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[non_exhaustive]
pub struct Execution {
    /// Its id.
    pub id: ExecutionId,
    /// The workflow it runs.
    pub workflow: String,
    /// The workflow version it is pinned to.
    pub version: i32,
    /// Where it stands.
    pub status: ExecutionStatus,
    /// The input it was started with.
    pub input: Value,
    /// The idempotency key it was started with, if any.
    pub idempotency_key: Option<String>,
    /// The last stage's output, once completed.
    pub output: Option<Value>,
    /// Why it failed, if it did.
    pub error: Option<String>,
    /// The stage it is in (the number of stages, once completed).
    pub current_stage: usize,
    /// Progress of every stage entered so far, in order.
    pub stages: Vec<StageProgress>,
    /// Dead-lettered members (at most 100), with every attempt's error.
    pub dead_letters: Vec<DeadLetter>,
    /// When it was started.
    pub created_at: DateTime<Utc>,
    /// When it last changed stage or status.
    pub updated_at: DateTime<Utc>,
    /// When it reached a terminal status.
    pub finished_at: Option<DateTime<Utc>>,
    /// When it times out, if it was started with a deadline.
    pub deadline: Option<DateTime<Utc>>,
    /// The execution whose [`Stage::map_workflow`](crate::Stage::map_workflow) started it,
    /// for a child workflow's execution.
    pub parent: Option<ExecutionId>,
}

/// Progress of one stage's group.
#[derive(Clone, Debug, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[non_exhaustive]
pub struct StageProgress {
    /// Position in the workflow.
    pub index: usize,
    /// Stage name.
    pub name: String,
    /// `step`, `parallel`, `map`, `branch`, `sleep` or `signal`.
    pub kind: String,
    /// The group's id.
    pub group_id: GroupId,
    /// Members in all.
    pub width: u32,
    /// Members not yet terminal: the group's countdown for counting strategies, else
    /// counted from the members.
    pub remaining: u32,
    /// The fan-in strategy the group was created with (`None` if this build does not
    /// know it).
    pub fan_in: Option<crate::FanInStrategy>,
    /// For a stage joined `any` or `at_least(k)` ([`Join`](crate::Join)): the completed
    /// members its group needs to fire (1 for `any`); `None` for a join of all.
    pub quorum: Option<u32>,
    /// Members waiting to be claimed (including retries in backoff).
    pub pending: u32,
    /// Members running now.
    pub running: u32,
    /// Members completed.
    pub completed: u32,
    /// Members dead-lettered.
    pub dead: u32,
    /// Members cancelled.
    pub cancelled: u32,
    /// Attempts made by its members (since their last reprocessing).
    pub attempts: u64,
    /// When the stage was entered (its group and members created).
    pub entered_at: DateTime<Utc>,
    /// When the group fired (dispatched the next stage or completed the execution).
    pub fired_at: Option<DateTime<Utc>>,
    /// For a conditional branch (width 0, fired when entered): the arm it took, and the
    /// value that chose it.
    pub branch: Option<crate::BranchChoice>,
    /// For a sleep not yet woken: when its task is due; for a signal wait still waiting,
    /// when it times out (`None`: it has no timeout).
    pub wakes_at: Option<DateTime<Utc>>,
}

/// A dead-lettered member.
#[derive(Clone, Debug, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[non_exhaustive]
pub struct DeadLetter {
    /// The task.
    pub task_id: TaskId,
    /// Its stage's position.
    pub stage_index: usize,
    /// Its handler (stage or branch name).
    pub handler: String,
    /// Its position in the group.
    pub item_index: u32,
    /// Attempts made.
    pub attempts: u32,
    /// Every attempt's error, oldest first.
    pub errors: Vec<AttemptError>,
}

/// One failed attempt.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[non_exhaustive]
pub struct AttemptError {
    /// The attempt number, from 1.
    pub attempt: u32,
    /// What the handler (or the engine: timeout, panic, expired lease) reported.
    pub error: String,
    /// When it was recorded.
    pub at: DateTime<Utc>,
}

/// A member that did not complete, as listed in a fan-in stage's output.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct MemberFailure {
    /// Position in the group (item order for a map, branch order for a parallel block).
    pub index: u32,
    /// The branch name, for a parallel block.
    #[serde(default)]
    pub branch: Option<String>,
    /// `dead`, or `cancelled`: its execution stopped, or its stage's join rule
    /// ([`Join::Any`](crate::Join), [`Join::AtLeast`](crate::Join)) fired without it. A
    /// member still running as such a join fires is listed as `cancelled` at once: it
    /// ends so whatever its attempt does, and its output is never passed on.
    pub status: String,
    /// Attempts made.
    pub attempts: u32,
    /// The last attempt's error.
    #[serde(default)]
    pub error: Option<String>,
}

/// The input of the stage after a map: successful outputs in item order, and the failures.
///
/// ```
/// # use confluo::MapResults;
/// let v = serde_json::json!({"outputs": [1, 4], "failed": [
///     {"index": 1, "branch": null, "status": "dead", "attempts": 3, "error": "boom"}]});
/// let r: MapResults<i64> = serde_json::from_value(v).unwrap();
/// assert_eq!(r.outputs, [1, 4]);
/// assert_eq!(r.failed[0].index, 1);
/// ```
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MapResults<T = Value> {
    /// Outputs of the completed members, in item order.
    pub outputs: Vec<T>,
    /// Members that did not complete.
    pub failed: Vec<MemberFailure>,
}

/// The input of the stage after a parallel block: outputs by branch name, and the failures.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ParallelResults<T = Value> {
    /// Outputs of the completed branches.
    pub outputs: BTreeMap<String, T>,
    /// Branches that did not complete.
    pub failed: Vec<MemberFailure>,
}
