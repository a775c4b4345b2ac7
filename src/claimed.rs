//! The handle of a claimed attempt: read-only, so that what decides correctness (its
//! strategy, execution and stage, its lease) is what the rows say. A service that stored
//! a task's id and lease token can get the handle back after a restart
//! ([`Engine::claimed`]) and acknowledge with it.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::Value;

use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::execution::ExecutionStatus;
use crate::fanin::FanInStrategy;
use crate::ids::{ExecutionId, GroupId, LeaseToken, TaskId};
use crate::store::millis;
use crate::store::tasks::{self, HandlerKeys};

/// A task claimed for one attempt, as the claim's rows said. Read-only: acknowledge it
/// with [`Engine::complete`], [`Engine::fail`] or [`Engine::release`].
///
/// What decides an acknowledgement (strategy, execution, stage, lease) cannot be changed
/// on the handle:
///
/// ```compile_fail
/// fn tamper(task: &mut confluo::ClaimedTask) {
///     task.fan_in = confluo::FanInStrategy::RowLock; // private: does not compile
/// }
/// ```
#[derive(Clone, Debug)]
pub struct ClaimedTask {
    pub(crate) id: TaskId,
    pub(crate) execution_id: ExecutionId,
    pub(crate) group_id: GroupId,
    pub(crate) workflow: String,
    pub(crate) workflow_version: i32,
    pub(crate) stage_index: usize,
    pub(crate) input_stage: Option<usize>,
    pub(crate) handler: String,
    pub(crate) item_index: u32,
    pub(crate) attempt: u32,
    pub(crate) max_attempts: u32,
    pub(crate) lease: LeaseToken,
    pub(crate) lease_expires_at: DateTime<Utc>,
    pub(crate) timeout: Duration,
    pub(crate) fan_in: FanInStrategy,
    pub(crate) input: Option<Value>,
    pub(crate) execution_status: ExecutionStatus,
}

impl ClaimedTask {
    /// The task.
    pub fn id(&self) -> TaskId {
        self.id
    }

    /// Its execution.
    pub fn execution_id(&self) -> ExecutionId {
        self.execution_id
    }

    /// Its stage's group (the countdown row).
    pub fn group_id(&self) -> GroupId {
        self.group_id
    }

    /// Its workflow.
    pub fn workflow(&self) -> &str {
        &self.workflow
    }

    /// The workflow version its execution is pinned to.
    pub fn workflow_version(&self) -> i32 {
        self.workflow_version
    }

    /// Its stage's position (as [`Workflow::stage_at`](crate::Workflow::stage_at)
    /// numbers them).
    pub fn stage_index(&self) -> usize {
        self.stage_index
    }

    /// The stage whose output is its input; `None`: the execution input. The stage
    /// before it, except after a conditional branch (the last stage of the arm that ran)
    /// and at the start of an arm (the stage before the branch).
    pub fn input_stage(&self) -> Option<usize> {
        self.input_stage
    }

    /// The handler that runs it (stage name, or branch name in a parallel stage).
    pub fn handler(&self) -> &str {
        &self.handler
    }

    /// Its position in the group.
    pub fn item_index(&self) -> u32 {
        self.item_index
    }

    /// This attempt's number, from 1.
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// Attempts allowed in all.
    pub fn max_attempts(&self) -> u32 {
        self.max_attempts
    }

    /// The token that fences this attempt: store it with [`id`](Self::id) to acknowledge
    /// after a restart ([`Engine::claimed`]).
    pub fn lease(&self) -> LeaseToken {
        self.lease
    }

    /// When the lease ran out unless renewed, as of the claim (or the last renewal made
    /// through this handle's engine).
    pub fn lease_expires_at(&self) -> DateTime<Utc> {
        self.lease_expires_at
    }

    /// The stage's per-attempt timeout.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The fan-in strategy of its group, which decides its arrival.
    pub fn fan_in(&self) -> FanInStrategy {
        self.fan_in
    }
}

/// The claimed rows as the tasks a worker runs; those this build cannot read (see
/// [`Engine::readable`]) apart, with why.
pub(crate) fn claimed_tasks(
    rows: Vec<tasks::ClaimedRow>,
) -> (Vec<ClaimedTask>, Vec<(TaskId, LeaseToken, String)>) {
    let mut unreadable = Vec::new();
    let tasks = rows
        .into_iter()
        .filter_map(|r| {
            let fan_in = match r.fan_in.parse::<FanInStrategy>() {
                Ok(fan_in) => fan_in,
                Err(e) => {
                    unreadable.push((r.id, r.lease_token, e.to_string()));
                    return None;
                }
            };
            Some(ClaimedTask {
                id: r.id,
                execution_id: r.execution_id,
                group_id: r.group_id,
                workflow: r.workflow_name,
                workflow_version: r.workflow_version,
                stage_index: r.stage_index as usize,
                input_stage: usize::try_from(r.input_stage).ok(),
                handler: r.handler,
                item_index: r.item_index as u32,
                attempt: r.attempt as u32,
                max_attempts: r.max_attempts as u32,
                lease: r.lease_token,
                lease_expires_at: r.lease_expires_at,
                timeout: Duration::from_millis(r.timeout_ms.max(0) as u64),
                input: r.input.map(|j| j.0),
                execution_status: ExecutionStatus::parse(&r.execution_status),
                fan_in,
            })
        })
        .collect();
    (tasks, unreadable)
}

/// The error for a stage index beyond the workflow's stages.
pub(crate) fn beyond_stages(task: TaskId, index: usize, workflow: &crate::Workflow) -> Error {
    Error::UnreadableTask {
        task,
        reason: format!(
            "its stage index {index} is beyond the {} stage(s) of workflow {} v{}",
            workflow.stage_count(),
            workflow.name(),
            workflow.version()
        ),
    }
}

/// How long a claimed task this build cannot run waits before it is due again.
const SET_ASIDE: Duration = Duration::from_secs(60);

impl Engine {
    /// Claims up to `limit` due tasks of the given `(workflow, handler)` pairs for
    /// `lease`: what a service that runs only some handlers claims. Each pair is one range
    /// of the handler index, so the claim's plan does not depend on statistics (see
    /// [`claim_plan`](Self::claim_plan)).
    ///
    /// # Errors
    /// [`Error::Database`](crate::Error::Database).
    ///
    /// # Cancel safety
    /// As [`claim`](Self::claim).
    pub async fn claim_for(
        &self,
        worker_id: &str,
        handlers: &[(&str, &str)],
        limit: usize,
        lease: Duration,
    ) -> Result<Vec<ClaimedTask>> {
        let keys = HandlerKeys {
            workflows: handlers.iter().map(|(w, _)| (*w).to_owned()).collect(),
            handlers: handlers.iter().map(|(_, h)| (*h).to_owned()).collect(),
        };
        self.claim_matching(worker_id, limit, lease, Some(&keys), false)
            .await
    }

    /// The handle of an attempt still held under `lease`, read back from its row: for a
    /// service that stored the task's id and lease token (say, with the job it handed to
    /// another system) and restarted. `None` when the attempt no longer holds the lease
    /// (it expired and was reclaimed, or was acknowledged).
    ///
    /// ```no_run
    /// # async fn run(engine: confluo::Engine, task: confluo::TaskId, lease: confluo::LeaseToken) -> confluo::Result<()> {
    /// if let Some(held) = engine.claimed(task, lease).await? {
    ///     engine.complete(&held, serde_json::json!({"done": true})).await?;
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`Error::UnreadableTask`] when this build cannot act on the row;
    /// [`Error::Database`](crate::Error::Database).
    ///
    /// # Cancel safety
    /// Reads only: dropping it changes nothing.
    pub async fn claimed(&self, task: TaskId, lease: LeaseToken) -> Result<Option<ClaimedTask>> {
        let row = {
            let mut conn = self.pool().acquire().await?;
            tasks::held(&mut conn, task, lease).await?
        };
        let Some(row) = row else {
            return Ok(None);
        };
        let (mut readable, unreadable) = claimed_tasks(vec![row]);
        if let Some((task, _, reason)) = unreadable.into_iter().next() {
            return Err(Error::UnreadableTask { task, reason });
        }
        Ok(readable.pop())
    }

    /// The claimed rows as tasks, once those this build cannot run are given back: a
    /// fan-in strategy it does not know (written by a newer version, say), a workflow
    /// version or stage it cannot find. Each of those is given back uncounted, due again
    /// in a minute (for a worker that can run it), and reported; the others are returned.
    pub(crate) async fn readable(&self, rows: Vec<tasks::ClaimedRow>) -> Result<Vec<ClaimedTask>> {
        let (tasks, mut unreadable) = claimed_tasks(rows);
        let mut readable = Vec::with_capacity(tasks.len());
        for task in tasks {
            let known = match self.cached_definition(&task.workflow, task.workflow_version) {
                Some(workflow) => Ok(workflow),
                None => {
                    let mut conn = self.pool().acquire().await?;
                    self.definition(&mut conn, &task.workflow, task.workflow_version)
                        .await
                }
            };
            match known {
                Ok(w) if w.stage_at(task.stage_index).is_some() => readable.push(task),
                Ok(w) => unreadable.push((
                    task.id,
                    task.lease,
                    beyond_stages(task.id, task.stage_index, &w).to_string(),
                )),
                Err(e) if e.is_not_found() => unreadable.push((task.id, task.lease, e.to_string())),
                Err(e) => return Err(e),
            }
        }
        if !unreadable.is_empty() {
            for (task, _, reason) in &unreadable {
                let error = Error::UnreadableTask {
                    task: *task,
                    reason: reason.clone(),
                };
                tracing::error!(task_id = %task, "{error}; given back, due again in {SET_ASIDE:?}");
            }
            let (ids, tokens): (Vec<TaskId>, Vec<LeaseToken>) = unreadable
                .iter()
                .map(|(id, token, _)| (*id, *token))
                .unzip();
            let mut conn = self.pool().acquire().await?;
            tasks::set_aside(&mut conn, &ids, &tokens, millis(SET_ASIDE)).await?;
        }
        Ok(readable)
    }
}
