//! The `signal` table (signals an execution received, one per name) and the hand-over of
//! a signal to the wait that receives it. Every statement here runs in a transaction that
//! holds the execution's lock ([`super::locks`]): a signal and the entry of its stage are
//! serialised by it, so neither misses the other.

use serde_json::Value;
use sqlx::types::Json;
use sqlx::PgConnection;

use crate::error::Result;
use crate::ids::{ExecutionId, LeaseToken, TaskId};
use crate::store::fan_in::{self, CompletedRow};

/// The worker id a signal's hand-over records on the task it completes.
const RECEIVER: &str = "confluo:signal";

/// Keeps a signal; false if the execution already has one of that name (it stands, and
/// `payload` is dropped).
pub(crate) async fn insert(
    conn: &mut PgConnection,
    execution_id: ExecutionId,
    name: &str,
    payload: &Value,
) -> Result<bool> {
    let inserted = super::query(
        "INSERT INTO confluo.signal (execution_id, name, payload) VALUES ($1, $2, $3)
         ON CONFLICT (execution_id, name) DO NOTHING",
    )
    .bind(execution_id)
    .bind(name)
    .bind(Json(payload))
    .execute(conn)
    .await?
    .rows_affected();
    Ok(inserted == 1)
}

/// The payload of the signal `name` the execution received, if it did.
pub(crate) async fn payload(
    conn: &mut PgConnection,
    execution_id: ExecutionId,
    name: &str,
) -> Result<Option<Value>> {
    Ok(super::query_scalar(
        "SELECT payload FROM confluo.signal WHERE execution_id = $1 AND name = $2",
    )
    .bind(execution_id)
    .bind(name)
    .fetch_optional(conn)
    .await?)
}

/// Takes the pending task of the execution's wait for `name` as an attempt of the signal's
/// own (a lease token the caller then completes it with, in the same transaction): the
/// signal goes through the same guarded completion as any handler's result. `None` when
/// no wait for `name` is pending: not entered yet, or already received, timed out or
/// being timed out (a worker's claim took it first), or cancelled. Locks the task, after
/// the execution the caller holds.
pub(crate) async fn take_wait(
    conn: &mut PgConnection,
    execution_id: ExecutionId,
    name: &str,
) -> Result<Option<(TaskId, LeaseToken)>> {
    Ok(super::query_as(
        "UPDATE confluo.task t
            SET status = 'running', attempt = t.attempt + 1, lease_token = gen_random_uuid(),
                lease_expires_at = now() + interval '1 minute', worker_id = $3,
                started_at = now(), started = true
           FROM confluo.stage_group g
          WHERE g.execution_id = $1 AND g.kind = 'signal' AND g.stage_name = $2
            AND t.group_id = g.id AND t.status = 'pending'
      RETURNING t.id, t.lease_token",
    )
    .bind(execution_id)
    .bind(name)
    .bind(RECEIVER)
    .fetch_optional(conn)
    .await?)
}

/// Hands `payload` to the execution's pending wait for `name`, if there is one: takes its
/// task ([`take_wait`]) and completes it with the payload as its output, counting its
/// group down, in the caller's transaction. Returns the completed member (its group's
/// last: a wait has one), or `None` when no wait for `name` is pending.
pub(crate) async fn hand_over(
    conn: &mut PgConnection,
    execution_id: ExecutionId,
    name: &str,
    payload: &Value,
) -> Result<Option<CompletedRow>> {
    let Some((task, token)) = take_wait(conn, execution_id, name).await? else {
        return Ok(None);
    };
    let done = fan_in::complete_many(conn, &[task], &[token], &[Json(payload)]).await?;
    Ok(done.into_iter().next())
}

/// Whether the execution has entered its wait for `name` (whatever became of it).
pub(crate) async fn wait_entered(
    conn: &mut PgConnection,
    execution_id: ExecutionId,
    name: &str,
) -> Result<bool> {
    Ok(super::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM confluo.stage_group
                         WHERE execution_id = $1 AND kind = 'signal' AND stage_name = $2)",
    )
    .bind(execution_id)
    .bind(name)
    .fetch_one(conn)
    .await?)
}

/// Running executions with a signal kept and its wait pending: a signal that was never
/// received (the auditor's check; the execution's lock makes it impossible, so any
/// row here is a defect). Each as `(execution, signal name)`.
pub(crate) async fn unreceived<'e, E>(
    executor: E,
    limit: i64,
    scope: super::audit::Scope<'_>,
) -> Result<Vec<(ExecutionId, String)>>
where
    E: super::Executor<'e>,
{
    Ok(super::query_as(
        "SELECT s.execution_id, s.name
           FROM confluo.signal s
           JOIN confluo.execution x ON x.id = s.execution_id AND x.status = 'running'
           JOIN confluo.stage_group g
             ON g.execution_id = s.execution_id AND g.kind = 'signal' AND g.stage_name = s.name
           JOIN confluo.task t ON t.group_id = g.id AND t.status = 'pending'
          WHERE $2::uuid[] IS NULL OR x.id = ANY($2)
          ORDER BY s.received_at
          LIMIT $1",
    )
    .bind(limit)
    .bind(scope)
    .fetch_all(executor)
    .await?)
}
