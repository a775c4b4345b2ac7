//! The `task` table: claiming, leases, and the transitions that give a task back to the
//! queue. Those that make it terminal count its group down, and live with the rest of
//! the fan-in in [`fan_in`](super::fan_in).
//!
//! Every transition out of `running` is guarded by [`held!`]: the lease token is the
//! per-attempt idempotency key. A replayed, duplicate or stale acknowledgement matches no
//! row and changes nothing.

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::types::Json;
use sqlx::{FromRow, PgConnection};

use crate::error::Result;
use crate::ids::{ExecutionId, GroupId, LeaseToken, TaskId};
use crate::store::fan_in::{by_id, held, held_rows};
use crate::store::plans::{self, Plans};

/// A task as handed to a worker by a claim.
#[derive(Debug, Clone, FromRow)]
pub(crate) struct ClaimedRow {
    pub id: TaskId,
    pub execution_id: ExecutionId,
    pub group_id: GroupId,
    pub workflow_name: String,
    pub workflow_version: i32,
    pub stage_index: i32,
    pub handler: String,
    pub item_index: i32,
    pub input: Option<Json<Value>>,
    /// The stage whose output is its input (-1: the execution input).
    pub input_stage: i32,
    pub attempt: i32,
    pub max_attempts: i32,
    pub timeout_ms: i64,
    pub lease_token: LeaseToken,
    pub lease_expires_at: DateTime<Utc>,
    pub execution_status: String,
    pub fan_in: String,
    /// Seconds from due (`run_at`) to this claim.
    pub waited: f64,
}

/// The handlers a claim may take: pairs of workflow and handler names.
#[derive(Debug, Clone, Default)]
pub(crate) struct HandlerKeys {
    pub workflows: Vec<String>,
    pub handlers: Vec<String>,
}

/// What a claimed row carries besides the task: its input resolved in the claim
/// statement (the execution input, or a step's or a signal wait's one output), unless its
/// input stage was a block (a parallel or map stage's outputs
/// are aggregated when the task runs, not copied into every claim), and the statuses that
/// decide how the attempt is run and acknowledged. Reads the task as `t` and its group as
/// `g`; the input stage is `groups::input_stage_of("g")`.
const CLAIMED_COLUMNS: &str = "
    t.id, t.execution_id, t.group_id, t.workflow_name, t.workflow_version,
    t.stage_index, t.handler, t.item_index, t.attempt, t.max_attempts,
    t.timeout_ms, t.lease_token, t.lease_expires_at,
    CASE WHEN t.input IS NOT NULL THEN t.input
         WHEN COALESCE(g.input_stage, g.stage_index - 1) < 0 THEN
             (SELECT e.input FROM confluo.execution e WHERE e.id = t.execution_id)
         ELSE (SELECT COALESCE(p.output, 'null'::jsonb)
                 FROM confluo.stage_group pg JOIN confluo.task p ON p.group_id = pg.id
                WHERE pg.execution_id = t.execution_id
                  AND pg.stage_index = COALESCE(g.input_stage, g.stage_index - 1)
                  AND pg.kind IN ('step', 'signal')
                LIMIT 1)
    END AS input,
    COALESCE(g.input_stage, g.stage_index - 1) AS input_stage,
    (SELECT e.status FROM confluo.execution e WHERE e.id = t.execution_id) AS execution_status,
    g.fan_in,
    extract(epoch FROM now() - t.run_at)::float8 AS waited";

/// Picks due tasks of the given handlers: each handler's range of `task_claim_handler_idx`
/// is read in index order and stops after `limit` rows, and the ranges are merged by
/// priority and due time. Rows a range locked beyond the merged `limit` are unlocked when
/// the statement ends.
const PICK_BY_HANDLER: &str = "SELECT c.id
               FROM unnest($4::text[], $5::text[]) AS k(workflow_name, handler)
               CROSS JOIN LATERAL (
                    SELECT x.id, x.priority, x.run_at FROM confluo.task x
                     WHERE x.status = 'pending'
                       AND x.workflow_name = k.workflow_name AND x.handler = k.handler
                       AND x.run_at <= now()
                     ORDER BY x.priority DESC, x.run_at
                     LIMIT $1
                     FOR UPDATE SKIP LOCKED
               ) c
              ORDER BY c.priority DESC, c.run_at
              LIMIT $1";

/// The claiming UPDATE, around a `picked` CTE of task ids (already locked). `queued`:
/// the claimer holds the tasks in a local queue before it runs them, and reports their
/// starts later (see [`renew_leases`]); otherwise the claim is the start.
fn claim_sql(picked: &str, queued: bool) -> String {
    let started = if queued { "false" } else { "true" };
    format!(
        "WITH picked AS ({picked})
         UPDATE confluo.task t
            SET status = 'running', attempt = t.attempt + 1, lease_token = gen_random_uuid(),
                lease_expires_at = now() + $2 * interval '1 millisecond',
                worker_id = $3, started_at = now(), started = {started}
           FROM picked, confluo.stage_group g
          WHERE t.id = picked.id AND g.id = t.group_id
      RETURNING {CLAIMED_COLUMNS}"
    )
}

/// Claims up to `limit` due tasks in one statement, highest priority first, then oldest
/// due, locking them `FOR UPDATE SKIP LOCKED`: concurrent claimers never wait for each
/// other and never take the same task. `handlers` restricts the claim to what the caller
/// can run (one index range per handler, merged by priority and due time, so the plan
/// does not depend on statistics); `None` claims anything. `queued`: the tasks wait in a
/// worker's local queue before they run (their attempts count as started only once the
/// worker says so; see [`fail_counting_down`]).
pub(crate) async fn claim(
    conn: &mut PgConnection,
    worker_id: &str,
    limit: i64,
    lease_ms: i64,
    handlers: Option<&HandlerKeys>,
    queued: bool,
) -> Result<Vec<ClaimedRow>> {
    let sql = match handlers {
        None => claim_sql(
            "SELECT id FROM confluo.task
              WHERE status = 'pending' AND run_at <= now()
              ORDER BY priority DESC, run_at
              LIMIT $1
              FOR UPDATE SKIP LOCKED",
            queued,
        ),
        Some(_) => claim_sql(PICK_BY_HANDLER, queued),
    };
    let query = super::query_as(&sql)
        .bind(limit)
        .bind(lease_ms)
        .bind(worker_id);
    let query = match handlers {
        None => query,
        Some(keys) => query.bind(&keys.workflows).bind(&keys.handlers),
    };
    Ok(query.fetch_all(conn).await?)
}

/// Claims, in the transaction that created them, up to `limit` due members of the groups
/// just `entered` that the given handlers run: a batch that fires a group hands its next
/// stage to the worker that fired it, sparing the notification and the claim of another
/// round trip. Nobody else sees these rows before the commit, so nothing is skipped.
pub(crate) async fn claim_entered(
    conn: &mut PgConnection,
    worker_id: &str,
    limit: i64,
    lease_ms: i64,
    handlers: &HandlerKeys,
    entered: &[GroupId],
) -> Result<Vec<ClaimedRow>> {
    let sql = claim_sql(
        "SELECT x.id FROM confluo.task x
           JOIN unnest($4::text[], $5::text[]) AS k(workflow_name, handler)
             ON x.workflow_name = k.workflow_name AND x.handler = k.handler
          WHERE x.group_id = ANY($6) AND x.status = 'pending' AND x.run_at <= now()
          ORDER BY x.priority DESC, x.run_at, x.group_id, x.item_index
          LIMIT $1
            FOR UPDATE OF x SKIP LOCKED",
        true,
    );
    Ok(super::query_as(&sql)
        .bind(limit)
        .bind(lease_ms)
        .bind(worker_id)
        .bind(&handlers.workflows)
        .bind(&handlers.handlers)
        .bind(entered)
        .fetch_all(conn)
        .await?)
}

/// The plans of the claim statement for `handlers` (for tests and diagnostics: it must
/// be an index scan whatever the statistics).
pub(crate) async fn explain_claim(
    conn: &mut PgConnection,
    limit: i64,
    handlers: &HandlerKeys,
) -> Result<Plans> {
    plans::explain(
        conn,
        &claim_sql(PICK_BY_HANDLER, true),
        &["int8", "int8", "text", "text[]", "text[]"],
        &[
            limit.to_string(),
            "60000".to_owned(),
            "explain".to_owned(),
            plans::array(&handlers.workflows),
            plans::array(&handlers.handlers),
        ],
    )
    .await
}

/// Extends a held lease. Returns the execution's status, or `None` if the lease is lost.
pub(crate) async fn renew_lease(
    conn: &mut PgConnection,
    id: TaskId,
    token: LeaseToken,
    lease_ms: i64,
) -> Result<Option<String>> {
    Ok(super::query_scalar(concat!(
        "UPDATE confluo.task t
            SET lease_expires_at = now() + $3 * interval '1 millisecond', started = true
          WHERE ",
        held!("t", "$1", "$2"),
        " RETURNING (SELECT e.status FROM confluo.execution e WHERE e.id = t.execution_id)"
    ))
    .bind(id)
    .bind(token)
    .bind(lease_ms)
    .fetch_optional(conn)
    .await?)
}

/// Extends the leases of many held attempts in one statement (a worker's local queue and
/// the attempts it started since its last renewal); `started[i]` reports that the
/// handler of `ids[i]` started, which makes a later lease expiry cost that task an
/// attempt. Returns the tasks it extended, each with its execution's status (the others
/// lost their lease, or were being written by another transaction).
///
/// Rows another transaction holds are skipped, not waited for: a task that left the
/// local queue meanwhile may be in an acknowledgement batch, which locks its rows in an
/// order of its own, and waiting could deadlock; such a task needs no renewal.
pub(crate) async fn renew_leases(
    conn: &mut PgConnection,
    ids: &[TaskId],
    tokens: &[LeaseToken],
    started: &[bool],
    lease_ms: i64,
) -> Result<Vec<(TaskId, String)>> {
    Ok(super::query_as(concat!(
        "WITH held AS (",
        held_rows!(
            "unnest($1::uuid[], $2::uuid[], $4::bool[]) AS u(id, token, started)",
            "y.execution_id",
            " SKIP LOCKED"
        ),
        ")
         UPDATE confluo.task t
            SET lease_expires_at = now() + $3 * interval '1 millisecond',
                started = t.started OR held.started
           FROM held
          WHERE ",
        by_id!("t", "held"),
        "
      RETURNING t.id, (SELECT e.status FROM confluo.execution e WHERE e.id = t.execution_id)"
    ))
    .bind(ids)
    .bind(tokens)
    .bind(lease_ms)
    .bind(started)
    .fetch_all(conn)
    .await?)
}

/// Gives a claimed task back without counting the attempt (graceful shutdown).
pub(crate) async fn release(
    conn: &mut PgConnection,
    id: TaskId,
    token: LeaseToken,
) -> Result<bool> {
    let rows = super::query(concat!(
        "UPDATE confluo.task t
            SET status = 'pending', attempt = t.attempt - 1, run_at = now(), lease_expires_at = NULL
          WHERE ",
        held!("t", "$1", "$2")
    ))
    .bind(id)
    .bind(token)
    .execute(conn)
    .await?
    .rows_affected();
    Ok(rows == 1)
}

/// Gives many claimed tasks of running executions back in one statement, as [`release`]
/// does one; returns those it gave back. A task whose execution stopped is left to the
/// caller, to be cancelled and counted.
pub(crate) async fn release_many(
    conn: &mut PgConnection,
    ids: &[TaskId],
    tokens: &[LeaseToken],
) -> Result<Vec<TaskId>> {
    Ok(super::query_scalar(concat!(
        "WITH held AS (",
        held_rows!(
            "unnest($1::uuid[], $2::uuid[]) AS u(id, token)",
            "y.execution_id",
            ""
        ),
        ")
         UPDATE confluo.task t
            SET status = 'pending', attempt = t.attempt - 1, run_at = now(),
                lease_expires_at = NULL
           FROM held
          WHERE ",
        by_id!("t", "held"),
        " AND EXISTS (SELECT 1 FROM confluo.execution e
                       WHERE e.id = t.execution_id AND e.status = 'running')
      RETURNING t.id"
    ))
    .bind(ids)
    .bind(tokens)
    .fetch_all(conn)
    .await?)
}

/// Status and latest lease token of a task, to explain why a guarded transition matched
/// nothing (read wherever it is, so that a replay after its execution was archived is
/// still told from a stale attempt).
pub(crate) async fn status_and_token(
    conn: &mut PgConnection,
    id: TaskId,
) -> Result<Option<(String, Option<LeaseToken>)>> {
    Ok(
        super::query_as("SELECT status, lease_token FROM confluo.task_all WHERE id = $1")
            .bind(id)
            .fetch_optional(conn)
            .await?,
    )
}

/// A running task whose lease has expired.
#[derive(Debug, Clone, FromRow)]
pub(crate) struct ExpiredRow {
    pub id: TaskId,
    pub lease_token: LeaseToken,
    pub execution_id: ExecutionId,
    pub workflow_name: String,
    pub workflow_version: i32,
    pub stage_index: i32,
    pub attempt: i32,
    pub max_attempts: i32,
    pub fan_in: String,
}

/// Running tasks whose lease has expired, oldest first.
pub(crate) async fn expired_leases(
    conn: &mut PgConnection,
    limit: i64,
    skip: &[TaskId],
) -> Result<Vec<ExpiredRow>> {
    Ok(super::query_as(
        "SELECT id, lease_token, execution_id, workflow_name, workflow_version, stage_index,
                attempt, max_attempts,
                (SELECT g.fan_in FROM confluo.stage_group g WHERE g.id = t.group_id) AS fan_in
           FROM confluo.task t
          WHERE status = 'running' AND lease_expires_at < now() AND NOT (id = ANY($2))
          ORDER BY lease_expires_at LIMIT $1",
    )
    .bind(limit)
    .bind(skip)
    .fetch_all(conn)
    .await?)
}

/// The row of an attempt still running under `token`, as a claim returns it.
pub(crate) async fn held(
    conn: &mut PgConnection,
    id: TaskId,
    token: LeaseToken,
) -> Result<Option<ClaimedRow>> {
    let sql = format!(
        "SELECT {CLAIMED_COLUMNS}
           FROM confluo.task t JOIN confluo.stage_group g ON g.id = t.group_id
          WHERE {}",
        held!("t", "$1", "$2")
    );
    Ok(super::query_as(&sql)
        .bind(id)
        .bind(token)
        .fetch_optional(conn)
        .await?)
}

/// Gives claimed tasks this build cannot run back, uncounted, due again after `delay_ms`
/// (for a worker that can run them, without this one claiming them again at once).
pub(crate) async fn set_aside(
    conn: &mut PgConnection,
    ids: &[TaskId],
    tokens: &[LeaseToken],
    delay_ms: i64,
) -> Result<u64> {
    Ok(super::query(concat!(
        "WITH held AS (",
        held_rows!(
            "unnest($1::uuid[], $2::uuid[]) AS u(id, token)",
            "y.execution_id",
            ""
        ),
        ")
         UPDATE confluo.task t
            SET status = 'pending', attempt = t.attempt - 1, lease_expires_at = NULL,
                run_at = now() + $3 * interval '1 millisecond', started = true
           FROM held
          WHERE ",
        by_id!("t", "held")
    ))
    .bind(ids)
    .bind(tokens)
    .bind(delay_ms)
    .execute(conn)
    .await?
    .rows_affected())
}

/// Tasks due now, scheduled later (backoff), and running.
#[derive(Debug, Clone, Copy, FromRow)]
pub(crate) struct DepthRow {
    pub due: i64,
    pub scheduled: i64,
    pub running: i64,
}

/// Counts tasks due, scheduled and running (through the partial indexes on both states).
pub(crate) async fn queue_depth(conn: &mut PgConnection) -> Result<DepthRow> {
    Ok(super::query_as(
        "SELECT (SELECT count(*) FROM confluo.task WHERE status = 'pending' AND run_at <= now()) AS due,
                (SELECT count(*) FROM confluo.task WHERE status = 'pending' AND run_at > now()) AS scheduled,
                (SELECT count(*) FROM confluo.task
                  WHERE lease_expires_at IS NOT NULL AND status = 'running') AS running",
    )
    .fetch_one(conn)
    .await?)
}
