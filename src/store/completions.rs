//! Completions: the guarded writes of a task's `completed` status, each counting its
//! group down as its fan-in strategy says, singly or in batches.
//!
//! Every write is guarded by `status = 'running' AND lease_token = $token`, as in
//! [`tasks`](super::tasks): a replayed, duplicate or stale acknowledgement matches no row
//! and changes nothing.

use serde_json::Value;
use sqlx::types::Json;
use sqlx::{FromRow, PgConnection};

use crate::error::Result;
use crate::ids::{ExecutionId, GroupId, LeaseToken, TaskId};
use crate::store::tasks::MemberRow;

/// What a terminal arrival did to its group's countdown.
#[derive(Debug, Clone, Copy, FromRow)]
pub(crate) struct CountdownRow {
    pub group_id: GroupId,
    pub execution_id: ExecutionId,
    pub stage_index: i32,
    pub remaining: Option<i32>,
}

/// Completes a running attempt and decrements its group, in one statement: the group row
/// is locked last, right before the caller commits. `None`: the guard matched nothing.
pub(crate) async fn complete_counting_down(
    conn: &mut PgConnection,
    id: TaskId,
    token: LeaseToken,
    output: &Value,
) -> Result<Option<CountdownRow>> {
    Ok(sqlx::query_as(
        "WITH done AS (
            UPDATE confluo.task
               SET status = 'completed', output = $3, finished_at = now(), lease_expires_at = NULL
             WHERE id = $1 AND lease_token = $2 AND status = 'running'
         RETURNING group_id
         )
         UPDATE confluo.stage_group g
            SET remaining = g.remaining - 1
           FROM done
          WHERE g.id = done.group_id
      RETURNING g.id AS group_id, g.execution_id, g.stage_index, g.remaining",
    )
    .bind(id)
    .bind(token)
    .bind(Json(output))
    .fetch_optional(conn)
    .await?)
}

/// Completes a running attempt and counts its group (countdown) or its stripe (striped)
/// down in one statement meant to run on its own, outside any transaction, when that
/// cannot be the last arrival: the counter is only touched while it is above 1, and the
/// status only written if the counter was, so the statement either does both or nothing.
/// No BEGIN or COMMIT round trip: the hot row is held for the statement and its commit
/// only. Returns false, having changed nothing, when the counter is at 1 (this may be the
/// last arrival: the caller takes the transactional path, which can fire) or when the
/// guard matches nothing. The task row is locked first, as every completion does.
pub(crate) async fn complete_unless_last(
    conn: &mut PgConnection,
    id: TaskId,
    token: LeaseToken,
    output: &Value,
    striped: bool,
) -> Result<bool> {
    let counted = if striped {
        "UPDATE confluo.group_stripe s SET remaining = s.remaining - 1
           FROM t, confluo.stage_group g
          WHERE g.id = t.group_id AND s.group_id = t.group_id
            AND s.stripe = confluo.stripe_of(t.item_index, g.stripe_run, g.stripes)
            AND s.remaining > 1
      RETURNING s.group_id"
    } else {
        "UPDATE confluo.stage_group g SET remaining = g.remaining - 1
           FROM t WHERE g.id = t.group_id AND g.remaining > 1
      RETURNING g.id"
    };
    let sql = format!(
        "WITH t AS (
            SELECT id, group_id, item_index FROM confluo.task
             WHERE id = $1 AND lease_token = $2 AND status = 'running'
               FOR NO KEY UPDATE
         ), counted AS ({counted}
         ), done AS (
            UPDATE confluo.task x
               SET status = 'completed', output = $3, finished_at = now(),
                   lease_expires_at = NULL
              FROM t, counted WHERE x.id = t.id
         RETURNING x.id
         )
         SELECT count(*) FROM done"
    );
    let done: i64 = sqlx::query_scalar(&sql)
        .bind(id)
        .bind(token)
        .bind(Json(output))
        .fetch_one(conn)
        .await?;
    Ok(done == 1)
}

/// Completes a running attempt without touching its group (strategies that re-count).
pub(crate) async fn complete_plain(
    conn: &mut PgConnection,
    id: TaskId,
    token: LeaseToken,
    output: &Value,
) -> Result<Option<MemberRow>> {
    Ok(sqlx::query_as(
        "UPDATE confluo.task
            SET status = 'completed', output = $3, finished_at = now(), lease_expires_at = NULL
          WHERE id = $1 AND lease_token = $2 AND status = 'running'
      RETURNING group_id, execution_id, stage_index, item_index",
    )
    .bind(id)
    .bind(token)
    .bind(Json(output))
    .fetch_optional(conn)
    .await?)
}

/// Completes a running attempt of a striped group in one statement: the status, its
/// stripe's decrement and, when that drains the stripe, the group's. Every arrival locks
/// a stripe before its group, so arrivals cannot deadlock. `remaining` is the group's
/// count where the statement counted it down.
pub(crate) async fn complete_striping(
    conn: &mut PgConnection,
    id: TaskId,
    token: LeaseToken,
    output: &Value,
) -> Result<Option<CountdownRow>> {
    Ok(sqlx::query_as(
        "WITH done AS (
            UPDATE confluo.task
               SET status = 'completed', output = $3, finished_at = now(), lease_expires_at = NULL
             WHERE id = $1 AND lease_token = $2 AND status = 'running'
         RETURNING group_id, execution_id, stage_index, item_index
         ), stripe AS (
            UPDATE confluo.group_stripe s
               SET remaining = s.remaining - 1
              FROM done, confluo.stage_group g
             WHERE g.id = done.group_id AND s.group_id = done.group_id
               AND s.stripe = confluo.stripe_of(done.item_index, g.stripe_run, g.stripes)
         RETURNING s.group_id, s.remaining
         ), grp AS (
            UPDATE confluo.stage_group g
               SET remaining = g.remaining - 1
              FROM stripe
             WHERE g.id = stripe.group_id AND stripe.remaining = 0
         RETURNING g.remaining
         )
         SELECT done.group_id, done.execution_id, done.stage_index, grp.remaining
           FROM done LEFT JOIN grp ON true",
    )
    .bind(id)
    .bind(token)
    .bind(Json(output))
    .fetch_optional(conn)
    .await?)
}

/// Completes many running attempts and counts them down, all in one statement: each
/// attempt guarded by its own lease token; then, once per stripe, the stripes of striped
/// groups; then, once per group, countdown groups and the striped groups whose stripes
/// drained. Rows are locked stripes first, then groups, each in one order for every
/// batch, so that concurrent batches sharing rows cannot deadlock. Groups of re-counting
/// strategies are not touched. Returns the members it completed, each with what the
/// statement left on its group's counter (`None` where it did not count the group).
pub(crate) async fn complete_many(
    conn: &mut PgConnection,
    ids: &[TaskId],
    tokens: &[LeaseToken],
    outputs: &[Json<&Value>],
) -> Result<Vec<CompletedRow>> {
    Ok(sqlx::query_as(
        "WITH done AS (
            UPDATE confluo.task t
               SET status = 'completed', output = i.output, finished_at = now(),
                   lease_expires_at = NULL
              FROM unnest($1::uuid[], $2::uuid[], $3::jsonb[]) AS i(id, token, output)
             WHERE t.id = i.id AND t.lease_token = i.token AND t.status = 'running'
         RETURNING t.id, t.group_id, t.execution_id, t.stage_index, t.item_index
         ), arrived AS (
            -- fan_in, stripes and stripe_run never change once a group exists.
            SELECT done.*, g.fan_in,
                   confluo.stripe_of(done.item_index, g.stripe_run, g.stripes) AS stripe
              FROM done JOIN confluo.stage_group g ON g.id = done.group_id
         ), per_stripe AS (
            SELECT group_id, stripe, count(*)::int AS n
              FROM arrived WHERE fan_in = 'striped' GROUP BY 1, 2
         ), stripes_locked AS (
            SELECT s.group_id FROM confluo.group_stripe s
              JOIN per_stripe p ON s.group_id = p.group_id AND s.stripe = p.stripe
             ORDER BY s.group_id, s.stripe
               FOR NO KEY UPDATE OF s
         ), stripes_counted AS (
            UPDATE confluo.group_stripe s SET remaining = s.remaining - p.n
              FROM per_stripe p, (SELECT count(*) FROM stripes_locked) l
             WHERE s.group_id = p.group_id AND s.stripe = p.stripe
         RETURNING s.group_id, s.remaining
         ), per_group AS (
            SELECT group_id, count(*)::int AS n
              FROM arrived WHERE fan_in = 'countdown' GROUP BY 1
             UNION ALL
            SELECT group_id, count(*)::int
              FROM stripes_counted WHERE remaining = 0 GROUP BY 1
         ), groups_locked AS (
            SELECT g.id FROM confluo.stage_group g JOIN per_group p ON p.group_id = g.id
             ORDER BY g.id
               FOR NO KEY UPDATE OF g
         ), groups_counted AS (
            UPDATE confluo.stage_group g SET remaining = g.remaining - p.n
              FROM per_group p, (SELECT count(*) FROM groups_locked) l
             WHERE g.id = p.group_id
         RETURNING g.id, g.remaining
         )
         SELECT a.id, a.group_id, a.execution_id, a.stage_index, a.fan_in, c.remaining
           FROM arrived a LEFT JOIN groups_counted c ON c.id = a.group_id",
    )
    .bind(ids)
    .bind(tokens)
    .bind(outputs)
    .fetch_all(conn)
    .await?)
}

/// [`complete_many`] in one statement meant to run on its own, outside any transaction,
/// when the batch holds no group's last arrival: every item must hold its lease, every
/// group must keep a counter (countdown or striped), and every counter it touches must
/// stay above zero; otherwise it changes nothing and returns false, and the caller takes
/// the transactional path, which can fire. Locks are taken as everywhere else: task rows,
/// then stripes, then groups, each in one order.
pub(crate) async fn complete_many_unless_last(
    conn: &mut PgConnection,
    ids: &[TaskId],
    tokens: &[LeaseToken],
    outputs: &[Json<&Value>],
) -> Result<bool> {
    Ok(sqlx::query_scalar(
        "WITH t AS (
            SELECT x.id, x.group_id, x.item_index, i.output
              FROM confluo.task x
              JOIN unnest($1::uuid[], $2::uuid[], $3::jsonb[]) AS i(id, token, output)
                ON x.id = i.id AND x.lease_token = i.token
             WHERE x.status = 'running'
             ORDER BY x.id
               FOR NO KEY UPDATE OF x
         ), arrived AS (
            SELECT t.*, g.fan_in,
                   CASE WHEN g.fan_in = 'striped'
                        THEN confluo.stripe_of(t.item_index, g.stripe_run, g.stripes) END AS stripe
              FROM t JOIN confluo.stage_group g ON g.id = t.group_id
         ), per_counter AS (
            SELECT group_id, stripe, count(*)::int AS n FROM arrived GROUP BY 1, 2
         ), stripes_locked AS (
            SELECT s.group_id, s.stripe, s.remaining, p.n FROM confluo.group_stripe s
              JOIN per_counter p ON s.group_id = p.group_id AND s.stripe = p.stripe
             ORDER BY s.group_id, s.stripe
               FOR NO KEY UPDATE OF s
         ), groups_locked AS (
            SELECT g.id, g.remaining, p.n FROM confluo.stage_group g
              JOIN per_counter p ON g.id = p.group_id AND p.stripe IS NULL
             WHERE g.fan_in = 'countdown'
             ORDER BY g.id
               FOR NO KEY UPDATE OF g
         ), go AS (
            SELECT (SELECT count(DISTINCT id) FROM arrived) = cardinality($1::uuid[])
               AND cardinality($1::uuid[]) = (SELECT count(DISTINCT i) FROM unnest($1::uuid[]) i)
               AND NOT EXISTS (SELECT 1 FROM arrived WHERE fan_in NOT IN ('countdown', 'striped'))
               AND (SELECT count(*) FROM stripes_locked) + (SELECT count(*) FROM groups_locked)
                   = (SELECT count(*) FROM per_counter)
               AND (SELECT coalesce(bool_and(remaining > n), true) FROM stripes_locked)
               AND (SELECT coalesce(bool_and(remaining > n), true) FROM groups_locked) AS ok
         ), stripes_counted AS (
            UPDATE confluo.group_stripe s SET remaining = s.remaining - l.n
              FROM stripes_locked l, go
             WHERE go.ok AND s.group_id = l.group_id AND s.stripe = l.stripe
         ), groups_counted AS (
            UPDATE confluo.stage_group g SET remaining = g.remaining - l.n
              FROM groups_locked l, go
             WHERE go.ok AND g.id = l.id
         ), done AS (
            UPDATE confluo.task x
               SET status = 'completed', output = t.output, finished_at = now(),
                   lease_expires_at = NULL
              FROM t, go
             WHERE go.ok AND x.id = t.id
         )
         SELECT ok FROM go",
    )
    .bind(ids)
    .bind(tokens)
    .bind(outputs)
    .fetch_one(conn)
    .await?)
}

/// A member completed by [`complete_many`].
#[derive(Debug, Clone, FromRow)]
pub(crate) struct CompletedRow {
    pub id: TaskId,
    pub group_id: GroupId,
    pub execution_id: ExecutionId,
    pub stage_index: i32,
    pub fan_in: String,
    /// The group's counter after this statement, where it counted the group down.
    pub remaining: Option<i32>,
}
