//! Child workflows at run time ([`Stage::map_workflow`](crate::Stage::map_workflow)): what
//! a member reports for its child once the child has ended, and the cascade that cancels
//! the children of a parent that stopped.
//!
//! Entering the stage starts the children (`dispatch`); the child's end, in its own
//! transaction, makes its member due (`store::children`); a worker's own handler then
//! runs [`Engine::child_result`], whose answer the worker acknowledges like any
//! handler's: guarded by the attempt's lease token and counted down, so the parent's group
//! fires exactly once, and a member whose parent has stopped is cancelled instead.

use serde_json::Value;
use sqlx::PgConnection;

use crate::dispatch::enter_first_stage_many;
use crate::engine::Engine;
use crate::error::{retry_conflicts, Result};
use crate::execution::ExecutionStatus;
use crate::fanin::FanInStrategy;
use crate::handler::TaskError;
use crate::ids::{ExecutionId, TaskId};
use crate::store::{children, executions, groups};

/// Children cancelled per transaction of the cascade.
const CASCADE_BATCH: i64 = 500;

/// Starts again, in the caller's transaction (a reprocess's), the children of the
/// members among `requeued` whose child did not complete: one new execution each, of the
/// same workflow, version and fan-in as the one it replaces, with the member's input,
/// entering its first stage; the member waits for its end. A member whose child is still
/// running waits for that one, and one whose child completed reports its output. Returns
/// the new children. The ended children must be locked first
/// ([`children::lock_of_stopped_members`]).
pub(crate) async fn restart(
    engine: &Engine,
    conn: &mut PgConnection,
    requeued: &[TaskId],
) -> Result<Vec<ExecutionId>> {
    let plan = children::restart(conn, requeued).await?;
    let mut started = Vec::new();
    // The rows come by group, workflow, version and fan-in: one start per run of them.
    for batch in plan.chunk_by(|a, b| {
        (a.group_id, &a.workflow_name, a.workflow_version, &a.fan_in)
            == (b.group_id, &b.workflow_name, b.workflow_version, &b.fan_in)
    }) {
        let first = &batch[0];
        let child = engine
            .definition_to_start(conn, &first.workflow_name, Some(first.workflow_version))
            .await?;
        // A stored strategy is one the engine wrote; the default covers nothing else.
        let fan_in = first.fan_in.parse().unwrap_or(FanInStrategy::Countdown);
        let members: Vec<TaskId> = batch.iter().map(|r| r.member).collect();
        let ids = children::start(conn, first.group_id, Some(&members), &child, fan_in).await?;
        enter_first_stage_many(engine, conn, &child, &ids, fan_in).await?;
        started.extend(ids);
    }
    Ok(started)
}

impl Engine {
    /// What the member `task` of a map of child workflows reports: its child's output
    /// when the child completed; a permanent failure naming the child and its error when
    /// it failed, was cancelled or timed out (a dead-lettered member); a retryable one
    /// when the database cannot be read.
    pub(crate) async fn child_result(&self, task: TaskId) -> std::result::Result<Value, TaskError> {
        let read = async {
            let found: Option<children::ChildRow> = children::of_member(self.pool(), task).await?;
            let Some(child) = found else {
                return Ok::<_, crate::Error>(Err(format!(
                    "no child execution was started for member {task}"
                )));
            };
            let status = ExecutionStatus::parse(&child.status);
            let which = format!(
                "child execution {} (workflow {} v{})",
                child.id, child.workflow_name, child.workflow_version
            );
            Ok(match (status, child.output_group) {
                (ExecutionStatus::Completed, Some(group)) => {
                    Ok(groups::output(self.pool(), group).await?)
                }
                (ExecutionStatus::Running, _) => Err(format!(
                    "{which} is still running: reprocess this member once it has ended"
                )),
                (status, _) => Err(format!(
                    "{which} {}{}",
                    status.as_str().replace('_', " "),
                    child.error.map(|e| format!(": {e}")).unwrap_or_default()
                )),
            })
        };
        match read.await {
            Ok(Ok(output)) => Ok(output),
            Ok(Err(failure)) => Err(TaskError::permanent(failure)),
            Err(error) => Err(TaskError::retryable(error)),
        }
    }

    /// Cancels the children, and theirs, still running of executions that stopped
    /// (cancelled, failed, timed out) while they ran: at most `limit` of them, in
    /// transactions of a few hundred, oldest stop first. [`cancel`](Self::cancel) runs it
    /// before it returns, and workers' housekeeping (every half lease, at most 5 s apart)
    /// after a failure or a time-out; it is safe to call from every process at once
    /// (parents and children another caller holds are skipped, and taken on the next
    /// call). A cancelled child's late results change nothing: its member in the stopped
    /// parent was cancelled with the parent. A parent resumed by a reprocess keeps its
    /// children: the cascade reads a parent's status only once it holds the parent's row
    /// (`FOR SHARE`), so it waits for a reprocess in flight rather than cancel the child a
    /// resumed member waits for. Returns how many it cancelled.
    ///
    /// # Errors
    /// [`Error::Database`](crate::Error::Database); children cancelled before the error
    /// stay cancelled.
    ///
    /// # Cancel safety
    /// Each batch is one transaction: dropped, the batches committed so far stay
    /// committed, and the next call goes on.
    pub async fn cancel_orphans(&self, limit: usize) -> Result<usize> {
        let mut cancelled = 0;
        while cancelled < limit {
            let batch = CASCADE_BATCH.min(i64::try_from(limit - cancelled).unwrap_or(i64::MAX));
            match retry_conflicts(|| self.cascade_once(batch)).await? {
                Some(n) => cancelled += n,
                None => break,
            }
        }
        Ok(cancelled)
    }

    /// One batch of [`cancel_orphans`](Self::cancel_orphans): `None` when no parent is
    /// left to cascade from (or all are held elsewhere).
    async fn cascade_once(&self, batch: i64) -> Result<Option<usize>> {
        let mut tx = crate::store::begin(self.pool()).await?;
        let Some((parent, resumed)) = children::next_cascade(&mut tx).await? else {
            return Ok(None);
        };
        let ids = if resumed {
            Vec::new()
        } else {
            children::lock_running(&mut tx, parent, batch).await?
        };
        if ids.is_empty() {
            if resumed || !children::any_running(&mut tx, parent).await? {
                children::done_cascading(&mut tx, parent).await?;
                tx.commit().await?;
                return Ok(Some(0));
            }
            // Its running children are all held by transactions about to end them, or
            // by another caller: the next call takes them.
            return Ok(None);
        }
        let reason = format!("cancelled with its parent execution {parent}");
        let n = executions::stop_many(&mut tx, &ids, "cancelled", Some(&reason)).await?;
        tx.commit().await?;
        tracing::debug!(execution_id = %parent, children = n, "children cancelled with their parent");
        Ok(Some(n as usize))
    }
}
