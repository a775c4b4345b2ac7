//! Webhook notifications: the outbox rows announcing executions' ends, and how their
//! delivery went ([`Engine::notifications`], [`Engine::notifications_in`]). Delivering
//! them is the `webhooks` feature's work (`Engine::webhooks`).

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;
use uuid::Uuid;

use crate::engine::Engine;
use crate::error::Result;
use crate::ids::ExecutionId;
use crate::store::notifications::{self, NotificationRow};

/// One announcement of an execution's end, as [`Engine::notifications`] lists it.
#[derive(Debug, Clone, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[non_exhaustive]
pub struct Notification {
    /// Its id: the `Confluo-Idempotency-Key` header of every attempt, the same on each.
    pub id: Uuid,
    /// The execution it announces.
    pub execution_id: ExecutionId,
    /// Where it is posted.
    pub url: String,
    /// `execution.completed`, `execution.failed`, `execution.cancelled` or
    /// `execution.timed_out`.
    pub event: String,
    /// The body posted.
    #[cfg_attr(feature = "openapi", schema(value_type = Object))]
    pub payload: Value,
    /// `pending` (not delivered yet, perhaps retrying), `delivered`, or `failed` (given up
    /// after the last attempt).
    pub status: String,
    /// Attempts made.
    pub attempts: u32,
    /// When the next attempt may be made (pending ones).
    pub next_attempt_at: DateTime<Utc>,
    /// The HTTP status the last attempt got, if it got an answer.
    pub last_status: Option<u16>,
    /// What went wrong with the last attempt, if anything.
    pub last_error: Option<String>,
    /// When the execution's end wrote it.
    pub created_at: DateTime<Utc>,
    /// When a receiver acknowledged it with a 2xx.
    pub delivered_at: Option<DateTime<Utc>>,
}

impl From<NotificationRow> for Notification {
    fn from(r: NotificationRow) -> Self {
        Notification {
            id: r.id,
            execution_id: r.execution_id,
            url: r.url,
            event: r.event,
            payload: r.payload.0,
            status: r.status,
            attempts: r.attempts.max(0) as u32,
            next_attempt_at: r.next_attempt_at,
            last_status: r.last_status.and_then(|s| u16::try_from(s).ok()),
            last_error: r.last_error,
            created_at: r.created_at,
            delivered_at: r.delivered_at,
        }
    }
}

impl Engine {
    /// The notifications announcing `execution`'s ends, oldest first (one per end: an
    /// execution reprocessed after failing and ending again has two).
    ///
    /// # Errors
    /// [`Error::Database`](crate::Error::Database).
    ///
    /// # Cancel safety
    /// Reads only: dropping it changes nothing.
    pub async fn notifications(&self, execution: ExecutionId) -> Result<Vec<Notification>> {
        let rows = notifications::of_execution(self.pool(), execution).await?;
        Ok(rows.into_iter().map(Notification::from).collect())
    }

    /// Up to `limit` notifications in `status` (`pending`, `delivered`, `failed`; any
    /// when `None`), the newest first: e.g. the failed ones, to look at their receivers.
    ///
    /// # Errors
    /// [`Error::Database`](crate::Error::Database).
    ///
    /// # Cancel safety
    /// Reads only: dropping it changes nothing.
    pub async fn notifications_in(
        &self,
        status: Option<&str>,
        limit: usize,
    ) -> Result<Vec<Notification>> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let rows = notifications::list(self.pool(), status, limit).await?;
        Ok(rows.into_iter().map(Notification::from).collect())
    }

    /// Sends a `failed` notification again: back in the queue with a fresh attempt
    /// budget, due now (e.g. once its receiver is fixed). Returns whether it was failed;
    /// a pending or delivered one is left as it is.
    ///
    /// # Errors
    /// [`Error::Database`](crate::Error::Database).
    ///
    /// # Cancel safety
    /// One statement: dropped, it happened or it did not.
    pub async fn retry_notification(&self, id: Uuid) -> Result<bool> {
        notifications::retry(self.pool(), id).await
    }
}
