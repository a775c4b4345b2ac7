//! Execution deadlines: moving executions whose deadline passed to `timed_out`.

use crate::engine::Engine;
use crate::error::{Result, CONFLICT_RETRIES};
use crate::ids::ExecutionId;
use crate::store::executions;

impl Engine {
    /// Times out up to `limit` running executions whose deadline (see
    /// [`StartOptions::deadline`](crate::StartOptions::deadline)) has passed: each, in one
    /// transaction, moves to `timed_out` and has its pending tasks cancelled and counted
    /// down, exactly as a cancel. Workers call this in their housekeeping pass; it is safe
    /// to call from every process at once (executions held by another caller are
    /// skipped). Returns the executions it timed out.
    ///
    /// # Errors
    /// [`Error::Database`](crate::Error::Database); executions timed out before the error
    /// stay timed out.
    ///
    /// # Cancel safety
    /// Each execution is timed out in a transaction of its own: dropped, those timed out
    /// so far stay timed out, the one in progress is not, and the next call goes on.
    pub async fn time_out_expired(&self, limit: usize) -> Result<Vec<ExecutionId>> {
        let mut timed_out = Vec::new();
        let mut conflicts = 0;
        while timed_out.len() < limit {
            let result = async {
                let mut tx = crate::store::begin(self.pool()).await?;
                let Some(id) = executions::lock_one_past_deadline(&mut tx).await? else {
                    return Ok(None);
                };
                executions::stop(
                    &mut tx,
                    id,
                    "timed_out",
                    Some("the execution's deadline passed"),
                )
                .await?;
                tx.commit().await?;
                Ok::<_, crate::Error>(Some(id))
            }
            .await;
            match result {
                Ok(Some(id)) => {
                    tracing::info!(execution_id = %id, "execution timed out: its deadline passed");
                    timed_out.push(id);
                }
                Ok(None) => break,
                Err(e) if e.is_retryable_conflict() && conflicts < CONFLICT_RETRIES => {
                    conflicts += 1
                }
                Err(e) => return Err(e),
            }
        }
        Ok(timed_out)
    }
}
