//! Dead letters: listing them, reading one, and reprocessing one.
//!
//! Reprocessing puts a dead-lettered task back in the queue with a fresh attempt budget
//! and counts its group back up, in one transaction that holds the execution's lock. If
//! the execution had failed (a step, or a member of a stage that fails on member failure,
//! was dead-lettered), it becomes `running` again, and what the failure stopped (the dead
//! and cancelled members of its unfired group) is requeued with it. If the task's group
//! had already fired, the next stage was dispatched with the member listed as failed: the
//! task runs again and its result is recorded, but the group's fired marker keeps the next
//! stage from being dispatched a second time. (A step or parallel stage after it reads
//! its input when claimed, so if claimed after the new result is recorded it sees it; a
//! map after it was given its members' inputs when it was entered.)

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;

use crate::engine::Engine;
use crate::error::{Error, Result, CONFLICT_RETRIES};
use crate::execution::{AttemptError, ExecutionStatus};
use crate::ids::{ExecutionId, TaskId};
use crate::store::children;
use crate::store::dead_letters::{self, DeadLetterRow};
use crate::store::executions;
use crate::store::history;

/// Which dead letters [`Engine::dead_letters`] returns.
///
/// ```
/// use confluo::DeadLetterFilter;
/// let filter = DeadLetterFilter::new().workflow("orders").limit(20);
/// # let _ = filter;
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct DeadLetterFilter {
    /// Only tasks of this workflow.
    pub workflow: Option<String>,
    /// Only tasks of this execution.
    pub execution: Option<ExecutionId>,
    /// At most this many (default 50).
    pub limit: usize,
}

impl Default for DeadLetterFilter {
    fn default() -> Self {
        DeadLetterFilter {
            workflow: None,
            execution: None,
            limit: 50,
        }
    }
}

impl DeadLetterFilter {
    /// Every dead letter, 50 at most.
    pub fn new() -> Self {
        Self::default()
    }

    /// Only dead letters of `workflow`.
    pub fn workflow(mut self, workflow: impl Into<String>) -> Self {
        self.workflow = Some(workflow.into());
        self
    }

    /// Only dead letters of `execution`.
    pub fn execution(mut self, execution: ExecutionId) -> Self {
        self.execution = Some(execution);
        self
    }

    /// At most `limit` dead letters.
    pub fn limit(mut self, limit: usize) -> Self {
        self.limit = limit;
        self
    }
}

/// A dead-lettered task, as listed by [`Engine::dead_letters`].
#[derive(Debug, Clone, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[non_exhaustive]
pub struct DeadLetterSummary {
    /// The task.
    pub task_id: TaskId,
    /// Its execution.
    pub execution_id: ExecutionId,
    /// The workflow.
    pub workflow: String,
    /// The workflow version the execution is pinned to.
    pub version: i32,
    /// Where the execution stands (`failed` when this dead letter failed it).
    pub execution_status: ExecutionStatus,
    /// The stage's position.
    pub stage_index: usize,
    /// The stage's name.
    pub stage: String,
    /// The handler (stage or branch name).
    pub handler: String,
    /// Position in the group.
    pub item_index: u32,
    /// Attempts made since it was last queued.
    pub attempts: u32,
    /// How many times it was reprocessed before.
    pub reprocessed: u32,
    /// The last attempt's error.
    pub last_error: Option<String>,
    /// When it was dead-lettered.
    pub dead_at: Option<DateTime<Utc>>,
    /// Whether its group has fired (the next stage ran with this member listed as failed).
    pub group_fired: bool,
}

impl From<DeadLetterRow> for DeadLetterSummary {
    fn from(r: DeadLetterRow) -> Self {
        DeadLetterSummary {
            task_id: r.id,
            execution_id: r.execution_id,
            workflow: r.workflow_name,
            version: r.workflow_version,
            execution_status: ExecutionStatus::parse(&r.execution_status),
            stage_index: r.stage_index as usize,
            stage: r.stage_name,
            handler: r.handler,
            item_index: r.item_index as u32,
            attempts: r.attempt as u32,
            reprocessed: r.reprocessed as u32,
            last_error: r.last_error,
            dead_at: r.finished_at,
            group_fired: r.group_fired,
        }
    }
}

/// One dead letter in full, as returned by [`Engine::dead_letter`].
#[derive(Debug, Clone, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[non_exhaustive]
pub struct DeadLetterDetail {
    /// What the listing shows.
    #[serde(flatten)]
    pub summary: DeadLetterSummary,
    /// The member's own input (a map element); `None` when it reads the stage input by
    /// reference (a step or a parallel branch).
    pub input: Option<Value>,
    /// Every attempt's error, oldest first (earlier rounds included if reprocessed).
    pub errors: Vec<AttemptError>,
}

/// What [`Engine::reprocess`] did.
#[derive(Debug, Clone, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[non_exhaustive]
pub struct Reprocessed {
    /// The reprocessed task.
    pub task_id: TaskId,
    /// Its execution.
    pub execution_id: ExecutionId,
    /// Whether the execution had failed and is running again.
    pub resumed: bool,
    /// Every task put back in the queue: the reprocessed one, and with a resume the other
    /// dead and cancelled members of the stage that failed; less those of a quorum group
    /// that fired (by the resume, or before) and so cancelled at once.
    pub requeued: Vec<TaskId>,
    /// The child executions started again for requeued members of a map of child
    /// workflows whose child had failed, been cancelled or timed out (each member waits
    /// for its new child; one whose child completed reports its output, one whose child
    /// still runs waits for it).
    pub restarted_children: Vec<ExecutionId>,
    /// Whether the task's group had already fired: its new result is recorded, but the
    /// next stage, which already ran, is not dispatched again.
    pub group_fired: bool,
}

impl Engine {
    /// Dead-lettered tasks matching `filter`, the most recent first.
    ///
    /// # Errors
    /// [`Error::Database`].
    ///
    /// # Cancel safety
    /// Reads only: dropping it changes nothing.
    pub async fn dead_letters(&self, filter: &DeadLetterFilter) -> Result<Vec<DeadLetterSummary>> {
        let mut conn = self.pool().acquire().await?;
        let rows = dead_letters::list(
            &mut conn,
            filter.workflow.as_deref(),
            filter.execution,
            i64::try_from(filter.limit).unwrap_or(i64::MAX),
        )
        .await?;
        Ok(rows.into_iter().map(Into::into).collect())
    }

    /// One dead letter with its input and every attempt's error.
    ///
    /// # Errors
    /// [`Error::TaskNotFound`]; [`Error::NotDeadLettered`] if the task is not dead;
    /// [`Error::Database`].
    ///
    /// # Cancel safety
    /// Reads only: dropping it changes nothing.
    pub async fn dead_letter(&self, task: TaskId) -> Result<DeadLetterDetail> {
        let mut conn = self.pool().acquire().await?;
        let row = dead_letters::get(&mut conn, task)
            .await?
            .ok_or(Error::TaskNotFound(task))?;
        if row.status != "dead" {
            return Err(Error::NotDeadLettered {
                task,
                status: row.status,
            });
        }
        Ok(DeadLetterDetail {
            summary: row.summary.into(),
            input: row.input.map(|j| j.0),
            errors: serde_json::from_value(row.errors.0)?,
        })
    }

    /// Puts a dead-lettered task back in the queue with a fresh attempt budget and counts
    /// its group back up, in one transaction. A member of a quorum group
    /// ([`Join::Any`](crate::Join), [`Join::AtLeast`](crate::Join)) that has fired is
    /// cancelled instead (its output would never be passed on; nothing of a group runs
    /// once its join went on): it leaves the dead letters, `requeued` leaves it out, and
    /// `group_fired` is true. If its execution had failed, the execution
    /// runs again, and the other dead and cancelled members of the stage that failed are
    /// requeued with it. Safe against every concurrent completion: if the group fires
    /// before the reprocess commits, the next stage was dispatched with the member listed
    /// as failed, and the task's new result does not dispatch it again (the group's fired
    /// marker); if the reprocess commits first, the group waits for it. A step or
    /// parallel stage after it reads its input when claimed, so if it has not been claimed
    /// yet it sees the new result; a map after it got its members' inputs when entered.
    ///
    /// Resuming an execution also fires, in the same transaction, its groups that reached
    /// their join while it was failed: a stage beside the failed one whose members all
    /// finished (waited for by the same join: [`Stage::after`](crate::Stage::after)), and
    /// a quorum group ([`Join::Any`](crate::Join), [`Join::AtLeast`](crate::Join)) whose
    /// quorum a member met by completing then. Such a firing cancels what is left of its
    /// group, the members just requeued included (the reprocessed task too, if it was one
    /// of them: it is then not in [`Reprocessed::requeued`], and
    /// [`Reprocessed::group_fired`] is true): nothing of a group runs once its join went
    /// on.
    ///
    /// A requeued member of a map of child workflows whose child failed, was cancelled or
    /// timed out gets a new child (same workflow and version, the member's input), started
    /// in the same transaction, and waits for its end; the old child stays listed under
    /// the parent, no longer linked to the member ([`Reprocessed::restarted_children`]).
    /// One whose child completed reports that child's output, and one whose child still
    /// runs waits for it. To keep a failed child's completed steps instead, under a parent
    /// that still runs (its map lets members fail), reprocess the child's own dead letter
    /// first, then, once the child has completed, the member. Under a parent that has
    /// failed, that does not work (a running child of a stopped parent is cancelled as an
    /// orphan): reprocess the member, which starts a new child.
    ///
    /// ```no_run
    /// # async fn run(engine: confluo::Engine) -> confluo::Result<()> {
    /// for dead in engine.dead_letters(&confluo::DeadLetterFilter::new()).await? {
    ///     let done = engine.reprocess(dead.task_id).await?;
    ///     println!("requeued {} task(s), resumed: {}", done.requeued.len(), done.resumed);
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`Error::TaskNotFound`]; [`Error::NotDeadLettered`] (including when a concurrent
    /// reprocess took it first); [`Error::ExecutionNotResumable`] when the execution is
    /// completed, cancelled or timed out; [`Error::DeadlinePassed`] when it failed and its
    /// deadline has passed since; [`Error::ResumeFailsAtOnce`] when the resume would fail
    /// the execution again at once (nothing is requeued); [`Error::ResumeMovesNothing`]
    /// when it failed on entering a stage and every stage it entered has fired, so that
    /// nothing requeued could move it on (nothing is requeued); [`Error::Database`].
    ///
    /// # Cancel safety
    /// Each try is one transaction: dropped before its commit, nothing is requeued. If the
    /// commit's answer is lost, [`dead_letter`](Self::dead_letter) tells whether the task is still dead.
    pub async fn reprocess(&self, task: TaskId) -> Result<Reprocessed> {
        let mut conflicts = 0;
        loop {
            match self.reprocess_once(task).await {
                Err(e) if e.is_retryable_conflict() && conflicts < CONFLICT_RETRIES => {
                    conflicts += 1
                }
                // The execution changed status between the first read and its lock: look
                // again (a status only changes a few times in an execution's life).
                Ok(None) => {}
                Ok(Some(done)) => return Ok(done),
                Err(e) => return Err(e),
            }
        }
    }

    /// One attempt; `None` when the execution's status changed under it (repeat).
    async fn reprocess_once(&self, task: TaskId) -> Result<Option<Reprocessed>> {
        let mut tx = crate::store::begin(self.pool()).await?;
        let row = dead_letters::get(&mut tx, task)
            .await?
            .ok_or(Error::TaskNotFound(task))?;
        let not_dead = |status: String| Error::NotDeadLettered { task, status };
        if row.status != "dead" {
            return Err(not_dead(row.status));
        }
        let execution = row.summary.execution_id;
        let seen = ExecutionStatus::parse(&row.summary.execution_status);
        let resume = match seen {
            ExecutionStatus::Running => false,
            ExecutionStatus::Failed => true,
            status => return Err(Error::ExecutionNotResumable { execution, status }),
        };
        // The execution first, then tasks and groups (`store::locks`): holding its lock,
        // nothing can stop, time out or fire it before this commits, and a status that
        // changed since the first read is seen.
        let (status, deadline_passed) = dead_letters::lock_execution(&mut tx, execution)
            .await?
            .ok_or(Error::TaskNotFound(task))?;
        if ExecutionStatus::parse(&status) != seen {
            return Ok(None);
        }
        // The children of its dead and cancelled members next (executions before tasks):
        // a requeued member's child is read, and may start again.
        children::lock_of_stopped_members(&mut tx, execution).await?;
        // An archived execution's tasks come back to the task table first (tasks after the
        // execution, in the lock order); a rollback below leaves them archived.
        if resume {
            history::restore(&mut tx, execution).await?;
        }
        let requeued = dead_letters::requeue(&mut tx, task, execution, resume).await?;
        let Some(own) = requeued.iter().find(|r| r.id == task) else {
            // A concurrent reprocess took it first.
            drop(tx);
            let status = dead_letters::get(self.pool().acquire().await?.as_mut(), task)
                .await?
                .map_or_else(|| "deleted".to_owned(), |r| r.status);
            return Err(not_dead(status));
        };
        // Resumed past its deadline, the next sweep would cancel what was requeued.
        if resume && deadline_passed {
            return Err(Error::DeadlinePassed { execution });
        }
        let ids: Vec<TaskId> = requeued.iter().map(|r| r.id).collect();
        // What it failed with, which the resume clears.
        let failed_with = match resume {
            true => executions::get(&mut *tx, execution)
                .await?
                .and_then(|e| e.error),
            false => None,
        };
        let resumed = resume && executions::resume(&mut tx, execution).await?;
        if resumed {
            // A group may have reached its join while the execution was stopped, firing
            // nothing: a stage beside the one that failed (another dependency of a join)
            // that finished, or a quorum met by a member that completed. Fire it now, or
            // what waits for it would wait forever. A quorum group's firing cancels its
            // members requeued above: none of them runs once its join went on.
            for (group, stage) in dead_letters::joined_unfired(&mut tx, execution).await? {
                crate::dispatch::fire(self, &mut tx, execution, group, stage).await?;
            }
        }
        // A member of a quorum group that went on without it is not run again (its output
        // would never be passed on): cancelled at once, as the firing cancelled the rest.
        let (group_fired, quorum) = dead_letters::group_fired(&mut tx, own.group_id).await?;
        if group_fired && quorum {
            crate::store::fan_in::cancel_unjoined(&mut tx, own.group_id).await?;
        }
        let ids = dead_letters::still_queued(&mut tx, &ids).await?;
        let restarted_children = crate::children::restart(self, &mut tx, &ids).await?;
        if resumed {
            // Entering what follows such a stage can fail the execution again, cancelling
            // what was just requeued, the dead letter included: roll it all back instead.
            // (Firing its last stage completes it: that is what resuming was for.)
            let after = executions::get(&mut *tx, execution)
                .await?
                .ok_or(Error::TaskNotFound(task))?;
            match after.status.as_str() {
                "running" => {}
                "completed" => {}
                _ => {
                    return Err(Error::ResumeFailsAtOnce {
                        execution,
                        reason: after
                            .error
                            .unwrap_or_else(|| format!("it is {}", after.status)),
                    })
                }
            }
            // Running, with every group fired: nothing requeued can fire anything, and the
            // execution would stall once they end. It failed entering a stage.
            if after.status == "running" && !dead_letters::any_unfired(&mut tx, execution).await? {
                return Err(Error::ResumeMovesNothing {
                    execution,
                    error: failed_with.unwrap_or_else(|| "no error recorded".to_owned()),
                });
            }
        }
        tx.commit().await?;
        tracing::info!(
            task_id = %task,
            execution_id = %execution,
            resumed,
            requeued = ids.len(),
            restarted_children = restarted_children.len(),
            group_fired,
            "dead letter reprocessed"
        );
        Ok(Some(Reprocessed {
            task_id: task,
            execution_id: execution,
            resumed,
            requeued: ids,
            restarted_children,
            group_fired,
        }))
    }
}
