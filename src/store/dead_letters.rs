//! Dead-lettered tasks: listing them, and putting them back in the queue.

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::types::Json;
use sqlx::{FromRow, PgConnection};

use crate::definition::{SIGNAL_HANDLER, SLEEP_HANDLER};
use crate::error::Result;
use crate::ids::{ExecutionId, GroupId, TaskId};
use crate::store::fan_in::{self, Count};

/// One dead-lettered task as listed.
#[derive(Debug, Clone, FromRow)]
pub(crate) struct DeadLetterRow {
    pub id: TaskId,
    pub execution_id: ExecutionId,
    pub workflow_name: String,
    pub workflow_version: i32,
    pub execution_status: String,
    pub stage_index: i32,
    pub stage_name: String,
    pub handler: String,
    pub item_index: i32,
    pub attempt: i32,
    pub reprocessed: i32,
    pub last_error: Option<String>,
    pub finished_at: Option<DateTime<Utc>>,
    pub group_fired: bool,
}

const COLUMNS: &str = "t.id, t.execution_id, t.workflow_name, t.workflow_version,
       e.status AS execution_status, t.stage_index, g.stage_name, t.handler, t.item_index,
       t.attempt, t.reprocessed, t.errors -> -1 ->> 'error' AS last_error, t.finished_at,
       g.fired_at IS NOT NULL AS group_fired";

/// Dead letters, the newest first, optionally of one workflow or one execution.
pub(crate) async fn list(
    conn: &mut PgConnection,
    workflow: Option<&str>,
    execution: Option<ExecutionId>,
    limit: i64,
) -> Result<Vec<DeadLetterRow>> {
    Ok(super::query_as(&format!(
        "SELECT {COLUMNS}
           FROM confluo.task_all t
           JOIN confluo.execution e ON e.id = t.execution_id
           JOIN confluo.stage_group g ON g.id = t.group_id
          WHERE t.status = 'dead'
            AND ($1::text IS NULL OR t.workflow_name = $1)
            AND ($2::uuid IS NULL OR t.execution_id = $2)
          ORDER BY t.finished_at DESC, t.id
          LIMIT $3"
    ))
    .bind(workflow)
    .bind(execution)
    .bind(limit)
    .fetch_all(conn)
    .await?)
}

/// One dead letter with its input and every attempt's error.
#[derive(Debug, Clone, FromRow)]
pub(crate) struct DeadLetterDetailRow {
    #[sqlx(flatten)]
    pub summary: DeadLetterRow,
    pub status: String,
    pub input: Option<Json<Value>>,
    pub errors: Json<Value>,
}

/// Any task, with the fields a dead letter shows (`status` tells whether it is dead).
pub(crate) async fn get(
    conn: &mut PgConnection,
    id: TaskId,
) -> Result<Option<DeadLetterDetailRow>> {
    Ok(super::query_as(&format!(
        "SELECT {COLUMNS}, t.status, t.input, t.errors
           FROM confluo.task_all t
           JOIN confluo.execution e ON e.id = t.execution_id
           JOIN confluo.stage_group g ON g.id = t.group_id
          WHERE t.id = $1"
    ))
    .bind(id)
    .fetch_optional(conn)
    .await?)
}

/// Locks an execution as a stage transition does; returns its status, and whether it has
/// a deadline that has passed.
pub(crate) async fn lock_execution(
    conn: &mut PgConnection,
    id: ExecutionId,
) -> Result<Option<(String, bool)>> {
    Ok(super::query_as(
        "SELECT status, coalesce(deadline_at < now(), false) FROM confluo.execution
          WHERE id = $1 FOR NO KEY UPDATE",
    )
    .bind(id)
    .fetch_optional(conn)
    .await?)
}

/// Whether a group has fired, and whether it is a quorum group ([`Join`](crate::Join)):
/// one that fired went on without its other members, and nothing of it runs again.
pub(crate) async fn group_fired(conn: &mut PgConnection, id: GroupId) -> Result<(bool, bool)> {
    Ok(super::query_as(
        "SELECT fired_at IS NOT NULL, quorum IS NOT NULL FROM confluo.stage_group WHERE id = $1",
    )
    .bind(id)
    .fetch_one(conn)
    .await?)
}

/// What a requeue did.
#[derive(Debug, Clone, FromRow)]
pub(crate) struct RequeuedRow {
    pub id: TaskId,
    pub group_id: GroupId,
}

/// Puts the dead task `id` back in the queue with a fresh attempt budget and, with
/// `resume`, every dead or cancelled task of the execution's unfired groups too (what
/// stopped with the failure; cancelled ones keep their attempt count); counts their
/// groups back up (stripes, then groups, in order), in one statement. Tasks that are no
/// longer dead or cancelled (a concurrent reprocess) match nothing. Requeued tasks are
/// due at once, except a cancelled durable sleep or signal wait (a stage beside the one
/// that failed): it keeps its due time, its wake-up or its timeout (`infinity` for a
/// wait without one), as though it had never stopped. Members of a map of child
/// workflows are set waiting after this, by [`super::children::restart`].
pub(crate) async fn requeue(
    conn: &mut PgConnection,
    id: TaskId,
    execution_id: ExecutionId,
    resume: bool,
) -> Result<Vec<RequeuedRow>> {
    let sql = format!(
        "WITH picked AS (
            SELECT t.id, t.status FROM confluo.task t
             WHERE t.execution_id = $2
               AND ((t.id = $1 AND t.status = 'dead')
                 OR ($3 AND t.status IN ('dead', 'cancelled')
                     AND t.group_id IN (SELECT g.id FROM confluo.stage_group g
                                         WHERE g.execution_id = $2 AND g.fired_at IS NULL)))
             ORDER BY t.id
               FOR NO KEY UPDATE OF t
         ), requeued AS (
            UPDATE confluo.task t
               SET status = 'pending',
                   attempt = CASE WHEN p.status = 'dead' THEN 0 ELSE t.attempt END,
                   held_expiries = CASE WHEN p.status = 'dead' THEN 0 ELSE t.held_expiries END,
                   reprocessed = t.reprocessed + (p.status = 'dead')::int,
                   run_at = CASE WHEN p.status = 'cancelled' AND t.handler = ANY($4)
                                 THEN t.run_at ELSE now() END,
                   lease_token = NULL, lease_expires_at = NULL,
                   worker_id = NULL, started_at = NULL, finished_at = NULL, output = NULL
              FROM picked p
             WHERE t.id = p.id AND t.status = p.status
         RETURNING t.id, t.group_id, t.item_index, p.status AS outcome
         ) {},
         woken AS (
            SELECT pg_notify('{}', '') FROM (SELECT 1 FROM requeued LIMIT 1) r
         )
         SELECT r.id, r.group_id FROM requeued r, (SELECT count(*) FROM woken) w",
        fan_in::counters_sql("requeued", Count::Up),
        super::TASKS_CHANNEL,
    );
    Ok(super::query_as(&sql)
        .bind(id)
        .bind(execution_id)
        .bind(resume)
        .bind([SLEEP_HANDLER, SIGNAL_HANDLER])
        .fetch_all(conn)
        .await?)
}

/// The groups of the execution (just resumed, its lock held) that reached their join
/// while it was stopped and never fired: a stage beside the one that failed (a
/// dependency of the same join) whose members all ended after the failure, or a quorum
/// group ([`Join`](crate::Join)) whose quorum was met then, whatever its other members
/// are now (requeued with the resume, or still running: firing cancels them). Each as
/// `(group, stage_index)`, in stage order.
pub(crate) async fn joined_unfired(
    conn: &mut PgConnection,
    execution_id: ExecutionId,
) -> Result<Vec<(GroupId, i32)>> {
    Ok(super::query_as(
        "SELECT g.id, g.stage_index FROM confluo.stage_group g
          WHERE g.execution_id = $1 AND g.fired_at IS NULL AND g.width > 0
            AND CASE WHEN g.quorum IS NULL
                     THEN NOT EXISTS (SELECT 1 FROM confluo.task t
                                       WHERE t.group_id = g.id
                                         AND t.status IN ('pending', 'running'))
                     ELSE (SELECT count(*) FROM confluo.task q
                            WHERE q.group_id = g.id AND q.status = 'completed') >= g.quorum
                END
          ORDER BY g.stage_index",
    )
    .bind(execution_id)
    .fetch_all(conn)
    .await?)
}

/// Whether the execution has a group with members that has not fired: something a
/// requeued member can still move on.
pub(crate) async fn any_unfired(
    conn: &mut PgConnection,
    execution_id: ExecutionId,
) -> Result<bool> {
    Ok(super::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM confluo.stage_group
                         WHERE execution_id = $1 AND fired_at IS NULL AND width > 0)",
    )
    .bind(execution_id)
    .fetch_one(conn)
    .await?)
}

/// Those of `ids` still waiting in the queue (not cancelled since, by a firing).
pub(crate) async fn still_queued(conn: &mut PgConnection, ids: &[TaskId]) -> Result<Vec<TaskId>> {
    Ok(super::query_scalar(
        "SELECT id FROM confluo.task WHERE id = ANY($1) AND status = 'pending' ORDER BY id",
    )
    .bind(ids)
    .fetch_all(conn)
    .await?)
}
