//! Moving ended executions' tasks out of the hot task table (see `store::history`).
//!
//! Every worker does it as part of its housekeeping ([`WorkerBuilder::archive_after`](
//! crate::WorkerBuilder::archive_after)); [`Engine::archive`] is the same step on demand
//! (an operator's backlog, a process that runs no worker).

use std::time::Duration;

use crate::engine::Engine;
use crate::error::Result;
use crate::store::{self, history};

/// What [`Engine::archive`] moved.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Archived {
    /// Executions whose tasks are now in the history.
    pub executions: u64,
    /// Tasks moved.
    pub tasks: u64,
}

impl Engine {
    /// Moves the tasks of executions that ended at least `after` ago (completed, failed,
    /// cancelled or timed out, with no attempt still running) from the task table that
    /// workers claim from into the task history, `batch` executions per statement, until
    /// none is left; returns what it moved.
    ///
    /// Nothing reads differently afterwards: inspecting, outputs, members, dead letters
    /// and activity read both tables (the `confluo.task_all` view), and a reprocess of an
    /// archived execution's dead letter moves its tasks back first. What it buys is a hot
    /// table that holds the work in flight: its vacuums stay small and quick, and
    /// [`purge`](Self::purge) deletes from the history, never from it. Workers do this
    /// on their own ([`WorkerBuilder::archive_after`](crate::WorkerBuilder::archive_after));
    /// this is for a backlog, or a deployment that runs no worker.
    ///
    /// ```no_run
    /// # async fn run(engine: confluo::Engine) -> confluo::Result<()> {
    /// let moved = engine.archive(std::time::Duration::ZERO, 100).await?;
    /// println!("{} tasks of {} executions archived", moved.tasks, moved.executions);
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`Error::Database`](crate::Error::Database); what was moved before stays moved.
    ///
    /// # Cancel safety
    /// Each batch is one transaction: dropped, the batches moved so far stay moved, the
    /// one in progress is not (its tasks stay in the hot table).
    pub async fn archive(&self, after: Duration, batch: usize) -> Result<Archived> {
        let batch = i64::try_from(batch.max(1)).unwrap_or(i64::MAX);
        self.archive_batches(after, batch, None).await
    }

    /// How many ended executions still have their tasks in the hot table, and how many
    /// tasks those are (what [`archive`](Self::archive) would move with no delay).
    ///
    /// # Errors
    /// [`Error::Database`](crate::Error::Database).
    ///
    /// # Cancel safety
    /// Reads only: dropping it changes nothing.
    pub async fn unarchived(&self) -> Result<Archived> {
        let (executions, tasks) = history::unarchived(self.pool()).await?;
        Ok(Archived { executions, tasks })
    }

    /// A worker's housekeeping round of archiving: batches of 50 executions for at most
    /// `budget`, so that the heartbeat and the lease sweep after it are not held up by a
    /// backlog. Failures are logged: the next round tries again.
    pub(crate) async fn archive_round(&self, after: Duration, budget: Duration) {
        match self.archive_batches(after, 50, Some(budget)).await {
            Ok(moved) if moved.tasks > 0 => tracing::debug!(
                executions = moved.executions,
                tasks = moved.tasks,
                "archived ended executions' tasks"
            ),
            Ok(_) => {}
            Err(error) => tracing::warn!(%error, "archiving ended executions' tasks failed"),
        }
    }

    /// Archive statements of `batch` executions until one moves fewer (nothing is left
    /// that no other transaction holds), or, with a `budget`, until that much time has
    /// passed.
    async fn archive_batches(
        &self,
        after: Duration,
        batch: i64,
        budget: Option<Duration>,
    ) -> Result<Archived> {
        let started = std::time::Instant::now();
        let mut total = Archived::default();
        loop {
            let (executions, tasks) =
                history::archive(self.pool(), store::millis(after), batch).await?;
            total.executions += executions;
            total.tasks += tasks;
            if executions < batch as u64 || budget.is_some_and(|b| started.elapsed() >= b) {
                return Ok(total);
            }
        }
    }
}
