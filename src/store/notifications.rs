//! The `notification` table: the webhook outbox. Rows are written by the trigger of
//! migration 0009 in the transaction that ends an execution; the delivery loop claims due
//! rows (pushing them past the attempt's timeout, so that an attempt cut off by a dying
//! worker is tried again) and records each attempt's outcome. Every statement here touches
//! notification rows only, one row per statement but the claim, which locks them in
//! `next_attempt_at` order with SKIP LOCKED and so never waits on another worker.

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::types::Json;
use sqlx::FromRow;
use uuid::Uuid;

use crate::error::Result;
use crate::ids::ExecutionId;

/// One notification, as stored.
#[derive(Debug, Clone, FromRow)]
pub(crate) struct NotificationRow {
    pub id: Uuid,
    pub execution_id: ExecutionId,
    pub url: String,
    pub event: String,
    pub payload: Json<Value>,
    pub status: String,
    pub attempts: i32,
    pub next_attempt_at: DateTime<Utc>,
    pub last_status: Option<i32>,
    pub last_error: Option<String>,
    pub created_at: DateTime<Utc>,
    pub delivered_at: Option<DateTime<Utc>>,
    /// The token of the latest claim (NULL before the first); read by delivery only.
    #[cfg_attr(not(feature = "webhooks"), allow(dead_code))]
    pub claim: Option<Uuid>,
}

const COLUMNS: &str = "id, execution_id, url, event, payload, status, attempts, \
                       next_attempt_at, last_status, last_error, created_at, delivered_at, claim";

/// An execution's notifications, oldest first.
pub(crate) async fn of_execution<'e, E: super::Executor<'e>>(
    executor: E,
    execution: ExecutionId,
) -> Result<Vec<NotificationRow>> {
    Ok(super::query_as(&format!(
        "SELECT {COLUMNS} FROM confluo.notification
          WHERE execution_id = $1 ORDER BY created_at, id"
    ))
    .bind(execution)
    .fetch_all(executor)
    .await?)
}

/// Notifications in `status` (any when `None`), the newest first.
pub(crate) async fn list<'e, E: super::Executor<'e>>(
    executor: E,
    status: Option<&str>,
    limit: i64,
) -> Result<Vec<NotificationRow>> {
    Ok(super::query_as(&format!(
        "SELECT {COLUMNS} FROM confluo.notification
          WHERE $1::text IS NULL OR status = $1
          ORDER BY created_at DESC, id LIMIT $2"
    ))
    .bind(status)
    .bind(limit)
    .fetch_all(executor)
    .await?)
}

/// Claims up to `limit` due notifications for one attempt each: counts the attempt and
/// moves `next_attempt_at` `lease_ms` ahead, so that nobody else tries them meanwhile and
/// anyone may once it has passed (the worker died mid-attempt). Autocommitted.
#[cfg(feature = "webhooks")]
pub(crate) async fn claim_due<'e, E: super::Executor<'e>>(
    executor: E,
    limit: i64,
    lease_ms: i64,
) -> Result<Vec<NotificationRow>> {
    Ok(super::query_as(&format!(
        "UPDATE confluo.notification n
            SET attempts = n.attempts + 1, claim = gen_random_uuid(),
                next_attempt_at = now() + $2 * interval '1 millisecond'
           FROM (SELECT id FROM confluo.notification
                  WHERE status = 'pending' AND next_attempt_at <= now()
                  ORDER BY next_attempt_at
                  LIMIT $1
                  FOR UPDATE SKIP LOCKED) due
          WHERE n.id = due.id
         RETURNING {}",
        COLUMNS
            .split(", ")
            .map(|c| format!("n.{c}"))
            .collect::<Vec<_>>()
            .join(", ")
    ))
    .bind(limit)
    .bind(lease_ms)
    .fetch_all(executor)
    .await?)
}

/// Records a delivery (a 2xx answer). Only the attempt holding the latest claim records:
/// a later claim (the lease ran out) replaced the token. A row already delivered stays.
#[cfg(feature = "webhooks")]
pub(crate) async fn delivered<'e, E: super::Executor<'e>>(
    executor: E,
    id: Uuid,
    claim: Uuid,
    http_status: i32,
) -> Result<()> {
    super::query(
        "UPDATE confluo.notification
            SET status = 'delivered', delivered_at = now(), last_status = $3, last_error = NULL
          WHERE id = $1 AND claim = $2 AND status = 'pending'",
    )
    .bind(id)
    .bind(claim)
    .bind(http_status)
    .execute(executor)
    .await?;
    Ok(())
}

/// Records a failed attempt (guarded by its claim, as [`delivered`]): tried again after
/// `retry_in_ms`, or, with `None`, given up (`failed`).
#[cfg(feature = "webhooks")]
pub(crate) async fn attempt_failed<'e, E: super::Executor<'e>>(
    executor: E,
    id: Uuid,
    claim: Uuid,
    http_status: Option<i32>,
    error: &str,
    retry_in_ms: Option<i64>,
) -> Result<()> {
    super::query(
        "UPDATE confluo.notification
            SET status = CASE WHEN $5::int8 IS NULL THEN 'failed' ELSE 'pending' END,
                next_attempt_at = now() + coalesce($5, 0) * interval '1 millisecond',
                last_status = $3, last_error = $4
          WHERE id = $1 AND claim = $2 AND status = 'pending'",
    )
    .bind(id)
    .bind(claim)
    .bind(http_status)
    .bind(error)
    .bind(retry_in_ms)
    .execute(executor)
    .await?;
    Ok(())
}

/// Puts a failed notification back in the queue with a fresh attempt budget, due now.
/// Whether it was failed (a delivered or pending one is left as it is).
pub(crate) async fn retry<'e, E: super::Executor<'e>>(executor: E, id: Uuid) -> Result<bool> {
    let done = super::query(
        "UPDATE confluo.notification
            SET status = 'pending', attempts = 0, next_attempt_at = now(), claim = NULL
          WHERE id = $1 AND status = 'failed'",
    )
    .bind(id)
    .execute(executor)
    .await?;
    Ok(done.rows_affected() == 1)
}
