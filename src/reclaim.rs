//! Reclaiming expired leases: the tasks of workers that died or stalled come back as
//! failed attempts, and one row this build cannot act on stops nothing else.

use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::queue::{Attempt, Outcome};
use crate::store::tasks::{self, ExpiredRow};

impl Engine {
    /// Reclaims up to `limit` running tasks whose lease expired: each counts as a failed
    /// attempt (retried, or dead-lettered once attempts are exhausted, so a task that
    /// keeps killing its worker cannot loop forever; a task that waited in a worker's
    /// local queue and never started goes back uncounted, a few times at most). Returns
    /// how many were reclaimed. Safe to run from every worker at once.
    ///
    /// A row this build cannot act on (a fan-in strategy it does not know, a workflow
    /// version or stage it cannot find, a value the database refuses) is skipped and
    /// reported once, as [`Error::UnreadableTask`] in the log, and later passes of this
    /// engine skip it: the other expired leases are reclaimed all the same.
    ///
    /// # Errors
    /// [`Error::Database`] when the database cannot be reached (the pass stops; the next
    /// one picks up where it left off).
    ///
    /// # Cancel safety
    /// Each task is reclaimed in a transaction of its own: dropped, the tasks reclaimed
    /// so far stay reclaimed, the one in progress is not, and the rest wait for the next
    /// pass.
    pub async fn reclaim_expired(&self, limit: usize) -> Result<usize> {
        let expired = {
            let skip: Vec<_> = self.unreclaimable().iter().copied().collect();
            let mut conn = self.pool().acquire().await?;
            tasks::expired_leases(&mut conn, limit as i64, &skip).await?
        };
        let mut reclaimed = 0;
        for row in expired {
            match self.reclaim(&row).await {
                Ok(true) => reclaimed += 1,
                Ok(false) => {}
                Err(error) if about_the_row(&error) => {
                    let error = match error {
                        e @ Error::UnreadableTask { .. } => e,
                        other => Error::UnreadableTask {
                            task: row.id,
                            reason: other.to_string(),
                        },
                    };
                    if self.unreclaimable().insert(row.id) {
                        tracing::error!(task_id = %row.id, "{error}; its expired lease is not reclaimed");
                    }
                }
                Err(error) => return Err(error),
            }
        }
        Ok(reclaimed)
    }

    /// Reclaims one expired lease; false when someone else got there first.
    async fn reclaim(&self, row: &ExpiredRow) -> Result<bool> {
        let fan_in = row
            .fan_in
            .parse()
            .map_err(|e: crate::fanin::UnknownStrategy| Error::UnreadableTask {
                task: row.id,
                reason: e.to_string(),
            })?;
        let attempt = Attempt {
            id: row.id,
            lease: row.lease_token,
            execution_id: row.execution_id,
            workflow: &row.workflow_name,
            workflow_version: row.workflow_version,
            stage_index: row.stage_index as usize,
            fan_in,
            attempt: row.attempt as u32,
            max_attempts: row.max_attempts as u32,
        };
        let outcome = self
            .fail_attempt(
                &attempt,
                "lease expired: the worker stopped renewing it",
                false,
                true,
            )
            .await?;
        let counted = !matches!(outcome, Outcome::LeaseLost | Outcome::AlreadyRecorded);
        if counted {
            tracing::warn!(task_id = %row.id, attempt = row.attempt, ?outcome, "reclaimed an expired lease");
        }
        Ok(counted)
    }
}

/// Whether `error` is about the row itself (trying again would fail again) rather than
/// the database being out of reach.
fn about_the_row(error: &Error) -> bool {
    match error {
        Error::Database(sqlx::Error::Database(db)) => {
            // Class 22 (data exception) and 23 (integrity constraint violation).
            db.code()
                .is_some_and(|code| code.starts_with("22") || code.starts_with("23"))
        }
        Error::Database(_) | Error::Migrate(_) | Error::Connect(_) => false,
        _ => true,
    }
}
