//! The `execution` table.

use std::sync::LazyLock;

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::types::Json;
use sqlx::{FromRow, PgConnection};

use crate::definition::Workflow;
use crate::error::Result;
use crate::fanin::FanInStrategy;
use crate::ids::{ExecutionId, GroupId};
use crate::store::children;
use crate::store::fan_in::{self, Count};

/// One execution row as stored.
#[derive(Debug, Clone, FromRow)]
pub(crate) struct ExecutionRow {
    pub id: ExecutionId,
    pub workflow_name: String,
    pub workflow_version: i32,
    pub status: String,
    pub input: Json<Value>,
    pub idempotency_key: Option<String>,
    pub current_stage: i32,
    pub output_group: Option<GroupId>,
    pub error: Option<String>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    pub finished_at: Option<DateTime<Utc>>,
    pub deadline_at: Option<DateTime<Utc>>,
    /// The parent execution of a child workflow's execution.
    pub parent_execution: Option<ExecutionId>,
}

/// An execution to insert.
#[derive(Debug)]
pub(crate) struct NewExecution<'a> {
    pub id: ExecutionId,
    pub workflow_name: &'a str,
    pub workflow_version: i32,
    pub input: &'a Value,
    pub idempotency_key: Option<&'a str>,
    /// The default strategy of its groups.
    pub fan_in: FanInStrategy,
    /// Its deadline, this many milliseconds from now.
    pub deadline_ms: Option<i64>,
    /// Where to announce its end (the notification trigger reads it).
    pub callback_url: Option<&'a str>,
}

/// Inserts a running execution. With an idempotency key already taken, inserts nothing
/// and returns the existing execution's id with `false`; a concurrent insert of the same
/// key waits for the other transaction and then sees its row.
pub(crate) async fn insert(
    conn: &mut PgConnection,
    new: NewExecution<'_>,
) -> Result<(ExecutionId, bool)> {
    let NewExecution {
        id,
        workflow_name,
        workflow_version,
        input,
        idempotency_key,
        fan_in,
        deadline_ms,
        callback_url,
    } = new;
    let inserted: Option<ExecutionId> = super::query_scalar(
        "INSERT INTO confluo.execution
                (id, workflow_name, workflow_version, input, idempotency_key, fan_in, deadline_at,
                 callback_url)
         VALUES ($1, $2, $3, $4, $5, $6, now() + $7 * interval '1 millisecond', $8)
         ON CONFLICT (workflow_name, idempotency_key) DO NOTHING
         RETURNING id",
    )
    .bind(id)
    .bind(workflow_name)
    .bind(workflow_version)
    .bind(Json(input))
    .bind(idempotency_key)
    .bind(fan_in.as_str())
    .bind(deadline_ms)
    .bind(callback_url)
    .fetch_optional(&mut *conn)
    .await?;
    if let Some(id) = inserted {
        return Ok((id, true));
    }
    let existing: ExecutionId = super::query_scalar(
        "SELECT id FROM confluo.execution WHERE workflow_name = $1 AND idempotency_key = $2",
    )
    .bind(workflow_name)
    .bind(idempotency_key)
    .fetch_one(conn)
    .await?;
    Ok((existing, false))
}

/// One execution of a batch to insert ([`insert_many`]).
#[derive(Debug)]
pub(crate) struct NewExecutionRow<'a> {
    pub id: ExecutionId,
    pub input: &'a Value,
    pub idempotency_key: Option<&'a str>,
    /// Its deadline, this many milliseconds from now.
    pub deadline_ms: Option<i64>,
    /// Where to announce its end.
    pub callback_url: Option<&'a str>,
}

/// [`insert`] for many executions of one workflow version, in one statement (plus one to
/// find the executions of keys already taken). Returns, per item in order, its id and
/// whether it was created: an item whose key was taken, by an earlier start or an
/// earlier item, gets that execution's id.
pub(crate) async fn insert_many(
    conn: &mut PgConnection,
    workflow: &Workflow,
    fan_in: FanInStrategy,
    rows: &[NewExecutionRow<'_>],
) -> Result<Vec<(ExecutionId, bool)>> {
    let ids: Vec<ExecutionId> = rows.iter().map(|r| r.id).collect();
    let inputs: Vec<Json<&Value>> = rows.iter().map(|r| Json(r.input)).collect();
    let keys: Vec<Option<&str>> = rows.iter().map(|r| r.idempotency_key).collect();
    let deadlines: Vec<Option<i64>> = rows.iter().map(|r| r.deadline_ms).collect();
    let callbacks: Vec<Option<&str>> = rows.iter().map(|r| r.callback_url).collect();
    let inserted: Vec<ExecutionId> = super::query_scalar(
        "INSERT INTO confluo.execution
                (id, workflow_name, workflow_version, input, idempotency_key, fan_in, deadline_at,
                 callback_url)
         SELECT v.id, $5, $6, v.input, v.key, $7, now() + v.deadline_ms * interval '1 millisecond',
                v.callback_url
           FROM unnest($1::uuid[], $2::jsonb[], $3::text[], $4::int8[], $8::text[])
                WITH ORDINALITY AS v(id, input, key, deadline_ms, callback_url, ord)
          -- Keys are taken in one order in every batch, so that batches sharing keys
          -- cannot deadlock on them.
          ORDER BY v.key, v.ord
         ON CONFLICT (workflow_name, idempotency_key) DO NOTHING
         RETURNING id",
    )
    .bind(&ids)
    .bind(&inputs)
    .bind(&keys)
    .bind(&deadlines)
    .bind(workflow.name())
    .bind(workflow.version())
    .bind(fan_in.as_str())
    .bind(&callbacks)
    .fetch_all(&mut *conn)
    .await?;
    let inserted: std::collections::HashSet<ExecutionId> = inserted.into_iter().collect();
    let taken: Vec<&str> = rows
        .iter()
        .filter(|r| !inserted.contains(&r.id))
        .filter_map(|r| r.idempotency_key)
        .collect();
    // A new statement: it sees the executions of concurrent starts that committed while
    // the insert waited on their keys, and this statement's own.
    let existing: std::collections::HashMap<String, ExecutionId> = if taken.is_empty() {
        Default::default()
    } else {
        super::query_as::<(String, ExecutionId)>(
            "SELECT idempotency_key, id FROM confluo.execution
              WHERE workflow_name = $1 AND idempotency_key = ANY ($2::text[])",
        )
        .bind(workflow.name())
        .bind(&taken)
        .fetch_all(conn)
        .await?
        .into_iter()
        .collect()
    };
    rows.iter()
        .map(|r| {
            if inserted.contains(&r.id) {
                return Ok((r.id, true));
            }
            r.idempotency_key
                .and_then(|key| existing.get(key))
                .map(|id| (*id, false))
                .ok_or(crate::error::Error::ExecutionNotFound(r.id))
        })
        .collect()
}

/// [`complete_many`]'s statement: the executions completed, each child workflow's end
/// reported to its member ([`children`]). Built once: it runs at every execution's end.
static COMPLETE_MANY: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH ended AS (
            UPDATE confluo.execution x
               SET status = 'completed', current_stage = v.stages, output_group = v.output_group,
                   updated_at = now(), finished_at = now()
              FROM unnest($1::uuid[], $2::int[], $3::uuid[]) AS v(id, stages, output_group)
             WHERE x.id = v.id AND x.status = 'running'
         RETURNING x.parent_task
         ) {}
         SELECT count(*) FROM ended LEFT JOIN LATERAL {} ON true",
        children::report_end_sql("ended"),
        children::notify_woken_sql("$4")
    )
});

/// [`stop_many`]'s first statement: the executions stopped, each child workflow's end
/// reported to its member, each stopped parent with running children recorded for the
/// cascade.
static STOP_MANY: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH ended AS (
            UPDATE confluo.execution
               SET status = $2, error = $3, updated_at = now(), finished_at = now()
             WHERE id = ANY($1) AND status = 'running'
         RETURNING id, parent_task
         ) {}, cascading AS (
            INSERT INTO confluo.cascade (execution_id)
            SELECT e.id FROM ended e
             WHERE EXISTS (SELECT 1 FROM confluo.execution c
                            WHERE c.parent_execution = e.id AND c.status = 'running')
            ON CONFLICT DO NOTHING
         )
         SELECT e.id FROM ended e LEFT JOIN LATERAL {} ON true",
        children::report_end_sql("ended"),
        children::notify_woken_sql("$4")
    )
});

/// [`stop_many`]'s second statement: the stopped executions' pending tasks cancelled and
/// counted down.
static CANCEL_PENDING: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH cancelled AS (
            UPDATE confluo.task SET status = 'cancelled', finished_at = now()
             WHERE execution_id = ANY($1) AND status = 'pending'
         RETURNING group_id, item_index, 'cancelled'::text AS outcome
         ) {}
         SELECT count(*) FROM c_groups",
        fan_in::counters_sql("cancelled", Count::Down)
    )
});

/// [`complete`] for many executions at once, in one statement.
pub(crate) async fn complete_many(
    conn: &mut PgConnection,
    ids: &[ExecutionId],
    stages: &[i32],
    output_groups: &[GroupId],
) -> Result<u64> {
    let done: i64 = super::query_scalar(&COMPLETE_MANY)
        .bind(ids)
        .bind(stages)
        .bind(output_groups)
        .bind(super::TASKS_CHANNEL)
        .fetch_one(conn)
        .await?;
    Ok(done as u64)
}

/// The input an execution was started with.
pub(crate) async fn input(conn: &mut PgConnection, id: ExecutionId) -> Result<Value> {
    let input: Option<Json<Value>> =
        super::query_scalar("SELECT input FROM confluo.execution WHERE id = $1")
            .bind(id)
            .fetch_optional(conn)
            .await?;
    Ok(input.map_or(Value::Null, |j| j.0))
}

/// Completes a running execution; its output is read by reference from `output_group`.
/// A child workflow's execution reports its end to its member in the parent, in the same
/// statement ([`children`]).
pub(crate) async fn complete(
    conn: &mut PgConnection,
    id: ExecutionId,
    stages: i32,
    output_group: GroupId,
) -> Result<bool> {
    Ok(complete_many(conn, &[id], &[stages], &[output_group]).await? == 1)
}

/// Moves a running execution to `failed`, `cancelled` or `timed_out` and cancels its
/// pending tasks, counting their groups down by as many (stripes, then groups, in order),
/// in the caller's transaction. A child workflow's execution reports its end to its
/// member in the parent; an execution with running children of its own is recorded for
/// the [`children`] cascade, which cancels them after this commits.
/// Returns false if the execution was not running.
pub(crate) async fn stop(
    conn: &mut PgConnection,
    id: ExecutionId,
    status: &str,
    error: Option<&str>,
) -> Result<bool> {
    Ok(stop_many(conn, &[id], status, error).await? == 1)
}

/// [`stop`] for many executions (the caller locked them, in id order), in two
/// statements. Returns how many were running.
pub(crate) async fn stop_many(
    conn: &mut PgConnection,
    ids: &[ExecutionId],
    status: &str,
    error: Option<&str>,
) -> Result<u64> {
    let stopped: Vec<ExecutionId> = super::query_scalar(&STOP_MANY)
        .bind(ids)
        .bind(status)
        .bind(error)
        .bind(super::TASKS_CHANNEL)
        .fetch_all(&mut *conn)
        .await?;
    if stopped.is_empty() {
        return Ok(0);
    }
    super::query(&CANCEL_PENDING)
        .bind(&stopped)
        .execute(conn)
        .await?;
    Ok(stopped.len() as u64)
}

/// Moves a failed execution back to `running` (a dead letter of it is being reprocessed),
/// in the caller's transaction, which holds the execution's lock. Returns false if it was
/// not failed.
pub(crate) async fn resume(conn: &mut PgConnection, id: ExecutionId) -> Result<bool> {
    let resumed = super::query(
        "UPDATE confluo.execution
            SET status = 'running', error = NULL, finished_at = NULL, updated_at = now()
          WHERE id = $1 AND status = 'failed'",
    )
    .bind(id)
    .execute(conn)
    .await?
    .rows_affected();
    Ok(resumed == 1)
}

/// Locks one running execution whose deadline has passed, skipping those another
/// transaction holds (a sweeping worker, a completion firing a group).
pub(crate) async fn lock_one_past_deadline(conn: &mut PgConnection) -> Result<Option<ExecutionId>> {
    Ok(super::query_scalar(
        "SELECT id FROM confluo.execution
          WHERE status = 'running' AND deadline_at < now()
          ORDER BY deadline_at
          LIMIT 1
            FOR NO KEY UPDATE SKIP LOCKED",
    )
    .fetch_optional(conn)
    .await?)
}

/// Reads one execution.
pub(crate) async fn get<'e, E>(executor: E, id: ExecutionId) -> Result<Option<ExecutionRow>>
where
    E: super::Executor<'e>,
{
    Ok(
        super::query_as("SELECT * FROM confluo.execution WHERE id = $1")
            .bind(id)
            .fetch_optional(executor)
            .await?,
    )
}

/// Reads only the status (cheap, for waiting).
pub(crate) async fn status<'e, E>(executor: E, id: ExecutionId) -> Result<Option<String>>
where
    E: super::Executor<'e>,
{
    Ok(
        super::query_scalar("SELECT status FROM confluo.execution WHERE id = $1")
            .bind(id)
            .fetch_optional(executor)
            .await?,
    )
}

/// Per-stage progress of one execution, counted from the members.
#[derive(Debug, Clone, FromRow)]
pub(crate) struct StageRow {
    pub id: GroupId,
    pub stage_index: i32,
    pub stage_name: String,
    pub kind: String,
    pub width: i32,
    pub remaining: Option<i32>,
    pub fan_in: String,
    pub quorum: Option<i32>,
    pub fired_at: Option<DateTime<Utc>>,
    pub entered_at: DateTime<Utc>,
    pub branch: Option<Json<crate::definition::BranchChoice>>,
    pub wakes_at: Option<DateTime<Utc>>,
    pub attempts: i64,
    pub pending: i64,
    pub running: i64,
    pub completed: i64,
    pub dead: i64,
    pub cancelled: i64,
}

pub(crate) async fn stages<'e, E>(executor: E, id: ExecutionId) -> Result<Vec<StageRow>>
where
    E: super::Executor<'e>,
{
    Ok(super::query_as(
        "SELECT g.id, g.stage_index, g.stage_name, g.kind, g.width,
                CASE g.fan_in
                    WHEN 'striped' THEN (SELECT sum(s.remaining)::int FROM confluo.group_stripe s
                                          WHERE s.group_id = g.id)
                    ELSE g.remaining END AS remaining,
                g.fan_in, g.quorum, g.fired_at, g.created_at AS entered_at, g.branch,
                CASE WHEN g.kind IN ('sleep', 'signal') THEN (
                    SELECT t.run_at FROM confluo.task_all t
                     WHERE t.group_id = g.id AND t.status = 'pending'
                       AND t.run_at < 'infinity') END AS wakes_at,
                coalesce(m.attempts, 0)::int8 AS attempts,
                m.pending, m.running, m.completed, m.dead, m.cancelled
           FROM confluo.stage_group g
           -- Per group, by its (group_id, item_index) index in both tables: a join would
           -- let the planner hash the whole history when its statistics are missing.
           CROSS JOIN LATERAL (
                SELECT sum(t.attempt) AS attempts,
                       count(*) FILTER (WHERE t.status = 'pending')   AS pending,
                       count(*) FILTER (WHERE t.status = 'running')   AS running,
                       count(*) FILTER (WHERE t.status = 'completed') AS completed,
                       count(*) FILTER (WHERE t.status = 'dead')      AS dead,
                       count(*) FILTER (WHERE t.status = 'cancelled') AS cancelled
                  FROM confluo.task_all t WHERE t.group_id = g.id) m
          WHERE g.execution_id = $1
          ORDER BY g.stage_index",
    )
    .bind(id)
    .fetch_all(executor)
    .await?)
}

/// The errors of dead-lettered members of one execution (at most `limit`).
#[derive(Debug, Clone, FromRow)]
pub(crate) struct DeadTaskRow {
    pub id: crate::ids::TaskId,
    pub stage_index: i32,
    pub handler: String,
    pub item_index: i32,
    pub attempt: i32,
    pub errors: Json<Value>,
}

pub(crate) async fn dead_tasks<'e, E>(
    executor: E,
    id: ExecutionId,
    limit: i64,
) -> Result<Vec<DeadTaskRow>>
where
    E: super::Executor<'e>,
{
    Ok(super::query_as(
        "SELECT id, stage_index, handler, item_index, attempt, errors FROM confluo.task_all
          WHERE execution_id = $1 AND status = 'dead'
          ORDER BY stage_index, item_index LIMIT $2",
    )
    .bind(id)
    .bind(limit)
    .fetch_all(executor)
    .await?)
}

/// How many executions are in each status (statuses with none are left out).
pub(crate) async fn count_by_status<'e, E>(executor: E) -> Result<Vec<(String, i64)>>
where
    E: super::Executor<'e>,
{
    Ok(
        super::query_as("SELECT status, count(*) FROM confluo.execution GROUP BY status")
            .fetch_all(executor)
            .await?,
    )
}

/// Executions, newest first, optionally of one workflow and in one status.
pub(crate) async fn list<'e, E>(
    executor: E,
    workflow: Option<&str>,
    status: Option<&str>,
    parent: Option<ExecutionId>,
    limit: i64,
) -> Result<Vec<ExecutionRow>>
where
    E: super::Executor<'e>,
{
    Ok(super::query_as(
        "SELECT * FROM confluo.execution
          WHERE ($1::text IS NULL OR workflow_name = $1)
            AND ($2::text IS NULL OR status = $2)
            AND ($4::uuid IS NULL OR parent_execution = $4)
          ORDER BY created_at DESC, id
          LIMIT $3",
    )
    .bind(workflow)
    .bind(status)
    .bind(limit)
    .bind(parent)
    .fetch_all(executor)
    .await?)
}

/// Deletes up to `batch` terminal executions that finished before `cutoff` (their groups,
/// stripes and tasks go with them, by cascade); returns how many.
/// How many executions [`purge`] would delete with this cutoff.
pub(crate) async fn purgeable<'e, E>(
    executor: E,
    cutoff: chrono::DateTime<chrono::Utc>,
) -> Result<i64>
where
    E: super::Executor<'e>,
{
    Ok(super::query_scalar(
        "SELECT count(*) FROM confluo.execution
          WHERE status IN ('completed', 'failed', 'cancelled', 'timed_out') AND finished_at < $1
            AND NOT EXISTS (SELECT 1 FROM confluo.notification n
                             WHERE n.execution_id = execution.id AND n.status = 'pending'
                                  AND n.created_at >= $1)",
    )
    .bind(cutoff)
    .fetch_one(executor)
    .await?)
}

pub(crate) async fn purge<'e, E>(
    executor: E,
    cutoff: chrono::DateTime<chrono::Utc>,
    batch: i64,
) -> Result<u64>
where
    E: super::Executor<'e>,
{
    Ok(super::query(
        "DELETE FROM confluo.execution WHERE id IN (
            SELECT id FROM confluo.execution
             WHERE status IN ('completed', 'failed', 'cancelled', 'timed_out') AND finished_at < $1
               -- Its end's webhook is still to be delivered: kept until it is (or fails),
               -- unless it has waited the whole retention window (then no delivery loop
               -- runs, and keeping it would keep it forever).
               AND NOT EXISTS (SELECT 1 FROM confluo.notification n
                                WHERE n.execution_id = execution.id AND n.status = 'pending'
                                  AND n.created_at >= $1)
             ORDER BY finished_at
             LIMIT $2
               FOR UPDATE SKIP LOCKED)",
    )
    .bind(cutoff)
    .bind(batch)
    .execute(executor)
    .await?
    .rows_affected())
}
