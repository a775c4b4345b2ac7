//! The fan-in, in one place: the statements by which a member's attempt ends (completed,
//! failed, cancelled) and moves its group's counter, the one counter fragment that every
//! statement moving a counter uses (also an execution's stop and a reprocess, in their
//! own modules), the decision taken from what they return ([`decide`],
//! [`last_arrivals`]: the re-count of the baseline strategies included), and the fired
//! marker. What a firing does next (enter the next stage, or complete the execution) is
//! `dispatch`'s.
//!
//! # The guard
//! Every transition out of `running` matches the attempt's task only while it is
//! running under the attempt's lease token ([`held!`]): the token is the per-attempt
//! idempotency key. A replayed, duplicate or stale acknowledgement matches no row, so it
//! counts nothing down and fires nothing.
//!
//! # The counters
//! A countdown group counts its non-terminal members on its `stage_group` row; a striped
//! group counts them on its stripes (`group_stripe`), and its `stage_group` row counts
//! the stripes not yet drained. Re-counting strategies (row lock, naive) keep no counter.
//! Every statement that makes members terminal, or brings terminal members back, moves
//! the counters with [`counters_sql`] in that same statement; only
//! [`complete_many_unless_last`] has a form of its own, which refuses to take any
//! counter to zero.
//!
//! # Locks
//! Rows are locked in the one order of [`locks`](super::locks): executions, tasks,
//! stripes, groups; each kind in id order. The statements here lock tasks (a failure's or
//! a cancel's guarded update of its one attempt; a completion's [`held_rows!`] probe per
//! attempt, in id order), then stripes, then groups; the execution, where one is needed,
//! is locked before them by the caller, or by [`lock_and_mark_fired`] when a transaction that
//! already holds the group fires it (see `locks` for why that cannot deadlock).

use std::collections::BTreeMap;
use std::sync::LazyLock;

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::types::Json;
use sqlx::{FromRow, PgConnection};

use super::locks;
use super::plans::{self, Plans};
use super::quorum;
use crate::error::Result;
use crate::fanin::FanInStrategy;
use crate::ids::{ExecutionId, GroupId, LeaseToken, TaskId};

/// The guard of every transition out of `running`, as SQL: the task row `$task` is
/// running under the attempt `$id`, `$token`. `held!("t", "$1", "$2")` reads
/// `t.id = $1 AND t.lease_token = $2 AND t.status = 'running'`.
macro_rules! held {
    ($task:literal, $id:literal, $token:literal) => {
        concat!(
            $task,
            ".id = ",
            $id,
            " AND ",
            $task,
            ".lease_token = ",
            $token,
            " AND ",
            $task,
            ".status = 'running'"
        )
    };
}
pub(crate) use held;

/// The items of a batch whose attempts still hold their leases, as the body of a CTE:
/// `$items` is the batch, a relation with at least `id` and `token` columns (`unnest(...)
/// AS u(id, token, ...)`). Each item is looked up on its own, through the primary key, and
/// its task row locked (`FOR NO KEY UPDATE`, then `$lock`: `""` or `" SKIP LOCKED"`), in
/// id order. The rows are the item's columns and `$columns` of its task row `y`.
///
/// Why a lookup per item rather than a join of the batch with the task table: the planner
/// knows neither the batch's size (a generic plan guesses 10 rows) nor, on a table last
/// analyzed when nothing ran, how many tasks run. A joined form was planned as a nested
/// loop over every running task for each item (`Join Filter`), quadratic in the batch.
/// A lateral lookup can only be driven by the batch, one primary-key probe per item.
/// Statements then write the rows through [`by_id!`].
macro_rules! held_rows {
    ($items:literal, $columns:literal, $lock:literal) => {
        concat!(
            "SELECT i.*, x.* FROM (SELECT * FROM ",
            $items,
            " ORDER BY id) i
              CROSS JOIN LATERAL (SELECT ",
            $columns,
            " FROM confluo.task y WHERE ",
            held!("y", "i.id", "i.token"),
            " FOR NO KEY UPDATE",
            $lock,
            ") x"
        )
    };
}
pub(crate) use held_rows;

/// The task rows `$task` of the CTE `$rows` (made by [`held_rows!`]), as a `WHERE` clause of
/// the statement that writes them: an index condition on the primary key (the rows are
/// already locked, so this finds them whatever the statistics say), and the join.
macro_rules! by_id {
    ($task:literal, $rows:literal) => {
        concat!(
            $task,
            ".id = ANY (ARRAY(SELECT id FROM ",
            $rows,
            ")) AND ",
            $task,
            ".id = ",
            $rows,
            ".id"
        )
    };
}
pub(crate) use by_id;

/// Which way [`counters_sql`] moves the counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Count {
    /// Members became terminal (completed, dead, cancelled): count them down.
    Down,
    /// Terminal members went back to the queue (reprocessed, resumed): count them up.
    Up,
}

/// The CTEs (to follow a `WITH source AS (...)` that yields at least `group_id,
/// item_index, outcome` of the members that changed: `outcome` is the status they took,
/// counting down, or the one they left, counting up) moving their groups' counters by one per
/// member: countdown groups directly; striped groups on their stripes, and on the group
/// row by the number of stripes that drained (down) or came back from zero (up). Rows are
/// locked stripes first, then groups, each in id order, so that no two statements that
/// count can deadlock. Groups of re-counting strategies are not touched.
///
/// Two CTEs are for the statement's own use: `c_members` (the source's rows, each with
/// its group's `fan_in`, `quorum` and `stripe`; so the source must not have columns of
/// those names) and `c_groups` (`id, remaining, reached, unreachable, late` of every
/// group row it moved: a countdown group, or a striped group whose stripes drained or
/// refilled). A quorum group ([`Join`](crate::Join)) also moves `needed` by its
/// completed members and `tolerable` by its dead ones: `reached` is true for the one
/// statement that takes `needed` to zero or below, `unreachable` for the one that takes
/// `tolerable` below zero, and `late` for completions after `needed` got there.
pub(crate) fn counters_sql(source: &str, count: Count) -> String {
    let (op, crossed) = match count {
        Count::Down => ("-", "s.remaining = 0"),
        Count::Up => ("+", "s.remaining = p.n"),
    };
    // A quorum's crossings (RETURNING sees the row as updated): `needed` from above zero
    // to zero or below, `tolerable` from zero or above to below zero; and completions of
    // a group whose `needed` was at zero or below already (late: the group had fired).
    let (reached, unreachable, late) = match count {
        Count::Down => (
            "COALESCE(g.needed <= 0 AND g.needed + p.n_completed > 0, false)",
            "COALESCE(g.tolerable < 0 AND g.tolerable + p.n_dead >= 0, false)",
            "COALESCE(g.needed + p.n_completed <= 0 AND p.n_completed > 0, false)",
        ),
        Count::Up => ("false", "false", "false"),
    };
    format!(
        ", c_members AS (
            -- fan_in, stripes and stripe_run never change once a group exists.
            SELECT m.*, g.fan_in, g.quorum,
                   confluo.stripe_of(m.item_index, g.stripe_run, g.stripes) AS stripe
              FROM {source} m JOIN confluo.stage_group g ON g.id = m.group_id
         ), c_per_stripe AS (
            SELECT group_id, stripe, count(*)::int AS n
              FROM c_members WHERE fan_in = 'striped' GROUP BY 1, 2
         ), c_stripes_locked AS (
            SELECT s.group_id FROM confluo.group_stripe s
              JOIN c_per_stripe p ON s.group_id = p.group_id AND s.stripe = p.stripe
             ORDER BY s.group_id, s.stripe
               FOR NO KEY UPDATE OF s
         ), c_stripes AS (
            UPDATE confluo.group_stripe s SET remaining = s.remaining {op} p.n
              FROM c_per_stripe p, (SELECT count(*) FROM c_stripes_locked) l
             WHERE s.group_id = p.group_id AND s.stripe = p.stripe
         RETURNING s.group_id, {crossed} AS crossed
         ), c_per_group AS (
            SELECT group_id, count(*)::int AS n,
                   count(*) FILTER (WHERE outcome = 'completed')::int AS n_completed,
                   count(*) FILTER (WHERE outcome = 'dead')::int AS n_dead
              FROM c_members WHERE fan_in = 'countdown' GROUP BY 1
             UNION ALL
            SELECT group_id, count(*)::int, 0, 0 FROM c_stripes WHERE crossed GROUP BY 1
         ), c_groups_locked AS (
            SELECT g.id FROM confluo.stage_group g JOIN c_per_group p ON p.group_id = g.id
             ORDER BY g.id
               FOR NO KEY UPDATE OF g
         ), c_groups AS (
            UPDATE confluo.stage_group g SET remaining = g.remaining {op} p.n,
                   needed = g.needed {op} p.n_completed, tolerable = g.tolerable {op} p.n_dead
              FROM c_per_group p, (SELECT count(*) FROM c_groups_locked) l
             WHERE g.id = p.group_id
         RETURNING g.id, g.remaining, {reached} AS reached, {unreachable} AS unreachable,
                   {late} AS late
         )"
    )
}

/// A member completed by [`complete_many`].
#[derive(Debug, Clone, FromRow)]
pub(crate) struct CompletedRow {
    pub id: TaskId,
    pub group_id: GroupId,
    pub execution_id: ExecutionId,
    pub stage_index: i32,
    pub fan_in: String,
    /// The successes its group needs, for a quorum join.
    pub quorum: Option<i32>,
    /// The group's counter after this statement, where it moved the group row (`None`
    /// for re-counting strategies, and for a striped group whose stripe did not drain).
    pub remaining: Option<i32>,
    /// Whether this statement reached its (countdown) group's quorum.
    pub reached: bool,
    /// Whether its (countdown) group had reached its quorum before: a late completion,
    /// which [`complete_many`] cancels.
    pub late: bool,
}

/// Completes running attempts (one or many) and counts their groups down, in one
/// statement: each attempt guarded by its own lease token, each stripe and each group
/// counted once for all its members here ([`counters_sql`]). Returns the members it
/// completed, each with what the statement left on its group's counter. Completions of
/// a quorum group that had fired already (`late`) are then cancelled, in a statement of
/// their own on the rows this one holds: they change nothing.
pub(crate) async fn complete_many(
    conn: &mut PgConnection,
    ids: &[TaskId],
    tokens: &[LeaseToken],
    outputs: &[Json<&Value>],
) -> Result<Vec<CompletedRow>> {
    let query = match (ids, tokens, outputs) {
        ([id], [token], [output]) => super::query_as(&COMPLETE_ONE)
            .bind(id)
            .bind(token)
            .bind(output),
        _ => super::query_as(&COMPLETE_MANY)
            .bind(ids)
            .bind(tokens)
            .bind(outputs),
    };
    let rows: Vec<CompletedRow> = query.fetch_all(&mut *conn).await?;
    let late: Vec<TaskId> = rows.iter().filter(|r| r.late).map(|r| r.id).collect();
    if !late.is_empty() {
        quorum::cancel_late(conn, &late).await?;
    }
    Ok(rows)
}

/// What [`complete_many`] runs for a batch, and for one attempt (`$1`, `$2`, `$3`
/// scalars, a guarded update by key: see [`COMPLETE_ONE_UNLESS_LAST`]).
static COMPLETE_MANY: LazyLock<String> = LazyLock::new(|| {
    complete_sql(concat!(
        "WITH held AS (",
        held_rows!(
            "unnest($1::uuid[], $2::uuid[], $3::jsonb[]) AS u(id, token, output)",
            "y.execution_id",
            ""
        ),
        "
         ), done AS (
            UPDATE confluo.task t
               SET status = 'completed', output = held.output, finished_at = now(),
                   lease_expires_at = NULL
              FROM held
             WHERE ",
        by_id!("t", "held"),
        "
         RETURNING t.id, t.group_id, t.execution_id, t.stage_index, t.item_index,
                   'completed'::text AS outcome
         )"
    ))
});
static COMPLETE_ONE: LazyLock<String> = LazyLock::new(|| {
    complete_sql(concat!(
        "WITH done AS (
            UPDATE confluo.task y
               SET status = 'completed', output = $3::jsonb, finished_at = now(),
                   lease_expires_at = NULL
             WHERE ",
        held!("y", "$1::uuid", "$2::uuid"),
        "
         RETURNING y.id, y.group_id, y.execution_id, y.stage_index, y.item_index,
                   'completed'::text AS outcome
         )"
    ))
});

/// A completion statement: `done` (a CTE of the completed members) counted down, and
/// each member returned with what was left on its group's counter.
fn complete_sql(done: &str) -> String {
    format!(
        "{done} {}
         SELECT m.id, m.group_id, m.execution_id, m.stage_index, m.fan_in, m.quorum,
                c.remaining, COALESCE(c.reached, false) AS reached,
                COALESCE(c.late, false) AS late
           FROM c_members m LEFT JOIN c_groups c ON c.id = m.group_id",
        counters_sql("done", Count::Down)
    )
}

/// [`complete_many`] in one statement meant to run on its own, outside any transaction,
/// when it holds no group's last arrival: every item must hold its lease, every group
/// must keep a counter (countdown or striped), and every counter it touches must stay
/// above zero (a quorum group's `needed` too: this form neither fires one nor cancels a
/// late completion); otherwise it changes nothing and returns false, and the caller takes the
/// transactional path, which can fire. No BEGIN or COMMIT round trip: the hot counter
/// rows are held for the statement and its commit only. Locks as everywhere: task rows,
/// then stripes, then groups, each in id order.
pub(crate) async fn complete_many_unless_last(
    conn: &mut PgConnection,
    ids: &[TaskId],
    tokens: &[LeaseToken],
    outputs: &[Json<&Value>],
) -> Result<bool> {
    let query = match (ids, tokens, outputs) {
        ([id], [token], [output]) => super::query_scalar(COMPLETE_ONE_UNLESS_LAST)
            .bind(id)
            .bind(token)
            .bind(output),
        _ => super::query_scalar(COMPLETE_MANY_UNLESS_LAST)
            .bind(ids)
            .bind(tokens)
            .bind(outputs),
    };
    Ok(query.fetch_one(conn).await?)
}

/// The body of [`complete_many_unless_last`]'s statements: `$held` is the CTE of the
/// attempts that hold their leases, locked (`id, group_id, item_index, output`); `$all`
/// is true when it holds every item of the batch; `$write` finds the task rows `x` of `t`.
macro_rules! unless_last {
    ($held:expr, $all:literal, $write:expr) => {
        concat!(
            "WITH t AS (",
            $held,
            "
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
            SELECT g.id, g.remaining, g.needed, p.n FROM confluo.stage_group g
              JOIN per_counter p ON g.id = p.group_id AND p.stripe IS NULL
             WHERE g.fan_in = 'countdown'
             ORDER BY g.id
               FOR NO KEY UPDATE OF g
         ), go AS (
            SELECT ",
            $all,
            "
               AND NOT EXISTS (SELECT 1 FROM arrived WHERE fan_in NOT IN ('countdown', 'striped'))
               AND (SELECT count(*) FROM stripes_locked) + (SELECT count(*) FROM groups_locked)
                   = (SELECT count(*) FROM per_counter)
               AND (SELECT coalesce(bool_and(remaining > n), true) FROM stripes_locked)
               AND (SELECT coalesce(bool_and(remaining > n AND (needed IS NULL OR needed > n)), true)
                      FROM groups_locked) AS ok
         ), stripes_counted AS (
            UPDATE confluo.group_stripe s SET remaining = s.remaining - l.n
              FROM stripes_locked l, go
             WHERE go.ok AND s.group_id = l.group_id AND s.stripe = l.stripe
         ), groups_counted AS (
            UPDATE confluo.stage_group g SET remaining = g.remaining - l.n, needed = g.needed - l.n
              FROM groups_locked l, go
             WHERE go.ok AND g.id = l.id
         ), done AS (
            UPDATE confluo.task x
               SET status = 'completed', output = t.output, finished_at = now(),
                   lease_expires_at = NULL
              FROM t, go
             WHERE go.ok AND ",
            $write,
            "
         )
         SELECT ok FROM go"
        )
    };
}

const COMPLETE_MANY_UNLESS_LAST: &str = unless_last!(
    held_rows!(
        "unnest($1::uuid[], $2::uuid[], $3::jsonb[]) AS u(id, token, output)",
        "y.group_id, y.item_index",
        ""
    ),
    "(SELECT count(DISTINCT id) FROM arrived) = cardinality($1::uuid[])
               AND cardinality($1::uuid[]) = (SELECT count(DISTINCT i) FROM unnest($1::uuid[]) i)",
    by_id!("x", "t")
);

/// [`COMPLETE_MANY_UNLESS_LAST`] for one attempt (`$1`, `$2`, `$3` scalars): most
/// acknowledgements are one completion, and the batch form's unnest, sort and lateral
/// probe cost a single one up to half its rate (the fan-in bench's striped strategy,
/// one acknowledgement per call: 0.31-0.35x of the floor with the batch form, 0.69x
/// with this one).
const COMPLETE_ONE_UNLESS_LAST: &str = unless_last!(
    concat!(
        "SELECT y.id, y.group_id, y.item_index, $3::jsonb AS output FROM confluo.task y
          WHERE ",
        held!("y", "$1::uuid", "$2::uuid"),
        " FOR NO KEY UPDATE"
    ),
    "(SELECT count(*) FROM arrived) = 1",
    "x.id = $1::uuid AND x.id = t.id"
);

/// The plans of both completion statements ([`complete_many_unless_last`], then
/// [`complete_many`]) for a batch of `batch` attempts (that hold no lease: the plan does
/// not depend on it, and nothing is executed).
pub(crate) async fn explain_completions(
    conn: &mut PgConnection,
    batch: usize,
) -> Result<(Plans, Plans)> {
    if batch == 1 {
        let (id, token) = (uuid::Uuid::new_v4(), uuid::Uuid::new_v4());
        let types = ["uuid", "uuid", "jsonb"];
        let args = [id.to_string(), token.to_string(), "null".to_owned()];
        let unless_last = plans::explain(conn, COMPLETE_ONE_UNLESS_LAST, &types, &args).await?;
        let one = plans::explain(conn, &COMPLETE_ONE, &types, &args).await?;
        return Ok((unless_last, one));
    }
    let ids = plans::array((0..batch).map(|_| uuid::Uuid::new_v4()));
    let tokens = plans::array((0..batch).map(|_| uuid::Uuid::new_v4()));
    let outputs = plans::array((0..batch).map(|_| "null"));
    let types = ["uuid[]", "uuid[]", "jsonb[]"];
    let args = [ids, tokens, outputs];
    let unless_last = plans::explain(conn, COMPLETE_MANY_UNLESS_LAST, &types, &args).await?;
    let many = plans::explain(conn, &COMPLETE_MANY, &types, &args).await?;
    Ok((unless_last, many))
}

/// The result of recording a failed attempt.
#[derive(Debug, Clone, FromRow)]
pub(crate) struct FailedRow {
    /// `pending` (retry scheduled), `dead`, or `cancelled` (its execution stopped, or
    /// its quorum group fired without it).
    pub status: String,
    pub run_at: DateTime<Utc>,
    pub attempt: i32,
    pub group_id: GroupId,
    pub stage_index: i32,
    /// What the statement left on the group's counter, where it moved the group row (as
    /// [`CompletedRow::remaining`]; `None` when the attempt will be retried).
    pub remaining: Option<i32>,
    /// Whether this dead letter made its (countdown) group's quorum unreachable.
    pub unreachable: bool,
}

/// Lease expiries a task may have before any start was reported, each given back
/// uncounted, before expiries count as attempts again: a worker that dies takes its
/// local queue's leases with it, and those tasks never ran; but a task that kills its
/// worker before the worker can report its start (within a second) must still reach
/// its attempt limit and be dead-lettered, not loop forever.
pub(crate) const HELD_EXPIRIES: i32 = 3;

/// Records a failed attempt: schedules a retry with backoff (from the policy persisted on
/// the row), or dead-letters the task when attempts are exhausted or the error is
/// permanent, or cancels it when its execution has stopped or its quorum group fired
/// without it (for a quorum stage, the caller holds the execution's lock: [`UNJOINED`]).
/// A terminal outcome counts the group down in the same statement. With
/// `only_if_expired`, the lease must have expired (reclaiming), so a renewal that won the
/// race keeps the attempt alive, and the attempt's token is cleared: its late
/// acknowledgements are `LeaseLost`, not replays. A reclaimed
/// attempt whose start was never reported (it waited in a dead worker's local queue) is
/// given back uncounted and due at once, at most [`HELD_EXPIRIES`] times per task.
pub(crate) async fn fail(
    conn: &mut PgConnection,
    id: TaskId,
    token: LeaseToken,
    error: &str,
    permanent: bool,
    only_if_expired: bool,
) -> Result<Option<FailedRow>> {
    let sql = format!(
        "WITH stopped AS (
            -- Locked only when the execution has stopped, so that a resume (which holds
            -- the execution's lock) cannot slip between this read and the write.
            SELECT x.id FROM confluo.execution x
             WHERE x.id = (SELECT execution_id FROM confluo.task WHERE id = $1)
               AND x.status <> 'running'
               FOR SHARE
         ), {}, failed AS (
            UPDATE confluo.task t
               SET status = v.next_status,
                   attempt = CASE WHEN v.unstarted THEN t.attempt - 1 ELSE t.attempt END,
                   held_expiries = t.held_expiries + CASE WHEN v.unstarted THEN 1 ELSE 0 END,
                   run_at = CASE WHEN v.unstarted THEN now()
                       WHEN v.next_status = 'pending'
                       THEN now() + least(t.backoff_max_ms::float8,
                                          t.backoff_base_ms * power(2::float8, greatest(t.attempt - 1, 0)))
                                  * (1 - t.backoff_jitter * random()) * interval '1 millisecond'
                       ELSE t.run_at END,
                   errors = CASE WHEN v.unstarted THEN t.errors
                       ELSE t.errors || jsonb_build_array(jsonb_build_object(
                           'attempt', t.attempt, 'error', $3::text, 'at', now())) END,
                   finished_at = CASE WHEN v.next_status = 'pending' THEN NULL ELSE now() END,
                   lease_expires_at = NULL,
                   -- A reclaimed attempt acknowledged nothing, so nothing of it can be
                   -- replayed: clearing its token fences out whatever it sends later.
                   lease_token = CASE WHEN $5 THEN NULL ELSE t.lease_token END
              FROM (SELECT CASE
                        WHEN EXISTS (SELECT 1 FROM stopped) THEN 'cancelled'
                        WHEN EXISTS (SELECT 1 FROM unjoined_fired) THEN 'cancelled'
                        WHEN u.unstarted THEN 'pending'
                        WHEN $4 OR y.attempt >= y.max_attempts THEN 'dead'
                        ELSE 'pending' END AS next_status,
                        u.unstarted AND NOT EXISTS (SELECT 1 FROM stopped)
                          AND NOT EXISTS (SELECT 1 FROM unjoined_fired) AS unstarted
                      FROM confluo.task y
                     CROSS JOIN LATERAL (SELECT $5 AND NOT y.started
                                                AND y.held_expiries < $6 AS unstarted) u
                     WHERE y.id = $1) v
             WHERE {} AND (NOT $5 OR t.lease_expires_at < now())
         RETURNING t.group_id, t.stage_index, t.item_index, t.status, t.run_at, t.attempt
         ), ended AS (
            SELECT group_id, item_index, status AS outcome FROM failed WHERE status <> 'pending'
         ) {}
         SELECT f.status, f.run_at, f.attempt, f.group_id, f.stage_index,
                (SELECT c.remaining FROM c_groups c) AS remaining,
                COALESCE((SELECT c.unreachable FROM c_groups c), false) AS unreachable
           FROM failed f",
        UNJOINED,
        held!("t", "$1", "$2"),
        counters_sql("ended", Count::Down)
    );
    Ok(super::query_as(&sql)
        .bind(id)
        .bind(token)
        .bind(error)
        .bind(permanent)
        .bind(only_if_expired)
        .bind(HELD_EXPIRIES)
        .fetch_optional(conn)
        .await?)
}

/// The CTE `unjoined_fired` of a statement that ends or gives back the attempt of task
/// `$1`: a row when its group is a quorum group ([`Join`](crate::Join)) that has fired,
/// its join gone on without it. Such an attempt is cancelled, never put back in the
/// queue: nothing of a group runs again once its join fired.
///
/// The firing transaction cancels the group's open members itself, but skips those
/// another transaction holds ([`cancel_unjoined`]), so the statement that holds the task
/// asks the group. The caller must hold the execution's lock (taken before the task, as
/// [`locks`] orders): every firing holds it until it commits, so this statement's
/// snapshot, taken after, sees any firing of the group.
const UNJOINED: &str = "unjoined_fired AS (
            SELECT 1 FROM confluo.task t JOIN confluo.stage_group g ON g.id = t.group_id
             WHERE t.id = $1 AND g.quorum IS NOT NULL AND g.fired_at IS NOT NULL
         )";

/// Cancels a claimed attempt that must not run and counts its group down, in one
/// statement: its execution has stopped, or its group is a quorum group that fired
/// without it (the caller holds the execution's lock: see [`UNJOINED`]). False if the
/// attempt lost its lease, or may run (the execution is running again, the group waits).
pub(crate) async fn cancel_claimed(
    conn: &mut PgConnection,
    id: TaskId,
    token: LeaseToken,
) -> Result<bool> {
    let sql = format!(
        "WITH stopped AS (
            -- Under a share lock: a resume that commits first makes this cancel nothing.
            SELECT x.id FROM confluo.execution x
             WHERE x.id = (SELECT execution_id FROM confluo.task WHERE id = $1)
               AND x.status <> 'running'
               FOR SHARE
         ), {UNJOINED}, cancelled AS (
            UPDATE confluo.task t
               SET status = 'cancelled', finished_at = now(), lease_expires_at = NULL,
                   -- The claim counted an attempt that never ran: a resume requeues it whole.
                   attempt = t.attempt - 1
             WHERE {} AND (EXISTS (SELECT 1 FROM stopped) OR EXISTS (SELECT 1 FROM unjoined_fired))
         RETURNING t.group_id, t.item_index, 'cancelled'::text AS outcome
         ) {}
         SELECT count(*) FROM cancelled",
        held!("t", "$1", "$2"),
        counters_sql("cancelled", Count::Down)
    );
    let cancelled: i64 = super::query_scalar(&sql)
        .bind(id)
        .bind(token)
        .fetch_one(conn)
        .await?;
    Ok(cancelled == 1)
}

/// Members of a group that are not terminal, and members in all: the re-read by which
/// the re-counting strategies decide.
pub(crate) async fn count_open_members(
    conn: &mut PgConnection,
    group_id: GroupId,
) -> Result<(i64, i64)> {
    Ok(super::query_as(
        "SELECT count(*) FILTER (WHERE status IN ('pending', 'running')), count(*)
           FROM confluo.task WHERE group_id = $1",
    )
    .bind(group_id)
    .fetch_one(conn)
    .await?)
}

/// What a counting statement left on an arrival's group: what [`decide`] reads.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Counted {
    /// The group's counter after the statement, where it moved the group row.
    pub remaining: Option<i32>,
    /// The successes the group needs, for a quorum join.
    pub quorum: Option<i32>,
    /// The statement reached the group's quorum (countdown).
    pub reached: bool,
    /// The statement made the group's quorum unreachable (countdown).
    pub unreachable: bool,
}

/// What a terminal arrival decides for its group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Nothing: the group waits for more arrivals, or had decided before.
    Wait,
    /// The group fires: its last arrival (join `all`), or the one that met its quorum.
    Fire,
    /// The group's quorum can no longer be met: its stage fails the execution.
    Unreachable,
}

/// Decides what a terminal arrival whose status this transaction already wrote means for
/// its group. `counted` is what that statement left on the group's counters (the
/// statements above move every counting group's counters as they write the status): for
/// join `all`, a counter at zero is the last arrival; for a quorum, the crossings of
/// `needed` and `tolerable`; only one statement can see each, because the counter's row
/// lock serializes them. The re-counting strategies read the group again instead (the
/// row-lock one under the execution's lock); `completed` are the arrivals among them that
/// completed, which a quorum group that has fired already cancels (late completions).
pub(crate) async fn decide(
    strategy: FanInStrategy,
    conn: &mut PgConnection,
    execution_id: ExecutionId,
    group_id: GroupId,
    counted: Counted,
    completed: &[TaskId],
) -> Result<Verdict> {
    let fire = |yes: bool| if yes { Verdict::Fire } else { Verdict::Wait };
    match strategy {
        FanInStrategy::Countdown | FanInStrategy::Striped => Ok(match counted.quorum {
            Some(_) if counted.reached => Verdict::Fire,
            Some(_) if counted.unreachable => Verdict::Unreachable,
            Some(_) => Verdict::Wait,
            None => fire(counted.remaining == Some(0)),
        }),
        FanInStrategy::RowLock => {
            // The execution's lock serializes every completion of the execution until
            // commit, so the last committer sees every sibling terminal.
            locks::execution_for_update(conn, execution_id).await?;
            if counted.quorum.is_some() {
                return recounted(quorum::recount(conn, group_id, completed).await?);
            }
            let (open, total) = count_open_members(conn, group_id).await?;
            Ok(fire(open == 0 && total > 0))
        }
        #[cfg(feature = "naive-fan-in")]
        FanInStrategy::NaiveRecount => {
            // No lock: two members committing together each count the other as
            // unfinished, and nobody fires.
            if counted.quorum.is_some() {
                return recounted(quorum::recount(conn, group_id, completed).await?);
            }
            let (open, total) = count_open_members(conn, group_id).await?;
            Ok(fire(open == 0 && total > 0))
        }
    }
}

/// The verdict of [`quorum::recount`].
fn recounted((reached, unreachable): (bool, bool)) -> Result<Verdict> {
    Ok(if reached {
        Verdict::Fire
    } else if unreachable {
        Verdict::Unreachable
    } else {
        Verdict::Wait
    })
}

/// The groups that fire on arrivals among `completed`, the members that one
/// [`complete_many`] completed (and counted down). Decided once per group, in group
/// order.
pub(crate) async fn last_arrivals(
    conn: &mut PgConnection,
    completed: &[CompletedRow],
) -> Result<Vec<GroupId>> {
    let mut groups: BTreeMap<GroupId, (&CompletedRow, Vec<TaskId>)> = BTreeMap::new();
    for row in completed {
        groups
            .entry(row.group_id)
            .or_insert((row, Vec::new()))
            .1
            .push(row.id);
    }
    let mut fired = Vec::new();
    for (group, (row, ids)) in groups {
        let strategy = row.fan_in.parse::<FanInStrategy>()?;
        let counted = Counted {
            remaining: row.remaining,
            quorum: row.quorum,
            reached: row.reached,
            unreachable: false,
        };
        if decide(strategy, conn, row.execution_id, group, counted, &ids).await? == Verdict::Fire {
            fired.push(group);
        }
    }
    Ok(fired)
}

/// Sets the fired marker of a group that nobody else can hold (an empty map, entered and
/// fired in the transaction that created it): true if this call set it.
pub(crate) async fn mark_fired(conn: &mut PgConnection, group_id: GroupId) -> Result<bool> {
    let fired = super::query(
        "UPDATE confluo.stage_group SET fired_at = now()
          WHERE id = $1 AND fired_at IS NULL",
    )
    .bind(group_id)
    .execute(conn)
    .await?
    .rows_affected();
    Ok(fired == 1)
}

/// An execution locked for a transition, and whether the group's fired marker was set.
#[derive(Debug, Clone, FromRow)]
pub(crate) struct FiringRow {
    pub workflow_name: String,
    pub workflow_version: i32,
    /// The default fan-in strategy recorded when the execution started.
    pub fan_in: String,
    /// True for the one caller that fires the group, if the execution is running.
    pub fired: bool,
    /// Whether the execution is running.
    pub running: bool,
}

/// Locks the execution row for the transition and sets the group's fired marker (a second
/// guard behind every strategy's decision) if the execution is running, in one statement.
pub(crate) async fn lock_and_mark_fired(
    conn: &mut PgConnection,
    id: ExecutionId,
    group_id: GroupId,
) -> Result<Option<FiringRow>> {
    Ok(super::query_as(
        "WITH e AS (
            SELECT status, workflow_name, workflow_version, fan_in FROM confluo.execution
             WHERE id = $1 FOR NO KEY UPDATE
         ), marked AS (
            UPDATE confluo.stage_group SET fired_at = now()
             WHERE id = $2 AND fired_at IS NULL AND (SELECT status FROM e) = 'running'
         RETURNING id
         )
         SELECT e.workflow_name, e.workflow_version, e.fan_in, EXISTS (SELECT 1 FROM marked) AS fired,
                e.status = 'running' AS running
           FROM e",
    )
    .bind(id)
    .bind(group_id)
    .fetch_optional(conn)
    .await?)
}

/// A group whose execution [`lock_and_mark_fired_many`] locked.
#[derive(Debug, Clone, FromRow)]
pub(crate) struct FiringGroupRow {
    pub group_id: GroupId,
    pub execution_id: ExecutionId,
    pub workflow_name: String,
    pub workflow_version: i32,
    pub fan_in: String,
    /// True for the one caller that fires the group, if its execution is running.
    pub fired: bool,
}

/// [`lock_and_mark_fired`] for many groups at once (each paired with its execution), in
/// one statement: the executions are locked in id order. `nowait`: the transaction holds
/// groups and has not locked these executions yet, so it must not wait for them (see
/// [`locks`](super::locks)): a taken one fails the statement with 55P03.
pub(crate) async fn lock_and_mark_fired_many(
    conn: &mut PgConnection,
    executions: &[ExecutionId],
    groups: &[GroupId],
    nowait: bool,
) -> Result<Vec<FiringGroupRow>> {
    let sql = format!(
        "WITH v AS (
            SELECT * FROM unnest($1::uuid[], $2::uuid[]) AS v(execution_id, group_id)
         ), e AS (
            SELECT x.id, x.status, x.workflow_name, x.workflow_version, x.fan_in
              FROM confluo.execution x
             WHERE x.id IN (SELECT execution_id FROM v)
             ORDER BY x.id
               FOR NO KEY UPDATE {}
         ), marked AS (
            UPDATE confluo.stage_group g SET fired_at = now()
              FROM v, e
             WHERE g.id = v.group_id AND e.id = v.execution_id
               AND e.status = 'running' AND g.fired_at IS NULL
         RETURNING g.id
         )
         SELECT v.group_id, v.execution_id, e.workflow_name, e.workflow_version, e.fan_in,
                EXISTS (SELECT 1 FROM marked m WHERE m.id = v.group_id) AS fired
           FROM v JOIN e ON e.id = v.execution_id",
        if nowait { "NOWAIT" } else { "" }
    );
    Ok(super::query_as(&sql)
        .bind(executions)
        .bind(groups)
        .fetch_all(conn)
        .await?)
}

/// The error recorded on a member a quorum group's firing cancelled, as an SQL literal.
pub(crate) const UNJOINED_ERROR_SQL: &str = "'cancelled: its stage''s join fired without it'";

/// Cancels the members of a quorum group that just fired and are still pending or
/// running, and counts them down, in the firing transaction: they will pass nothing on
/// (a running one's acknowledgement then matches nothing). Rows another transaction
/// holds at this instant are skipped, not waited for: the firing transaction holds the
/// group, and a completion that holds a member waits for the group (the one exception
/// to [`locks`]' order, safe because it never waits). Such a member ends cancelled
/// whatever its attempt does: a completion is late, and cancelled by [`complete_many`]
/// or the re-count; a failure, a reclaim or a give-back holds the execution's lock and
/// finds the group fired ([`UNJOINED`]). Until then, the next stage's input lists it as
/// cancelled already (`groups::output_expression`). Returns how many it cancelled.
pub(crate) async fn cancel_unjoined(conn: &mut PgConnection, group_id: GroupId) -> Result<u64> {
    let sql = format!(
        "WITH open AS (
            SELECT id FROM confluo.task
             WHERE group_id = $1 AND status IN ('pending', 'running')
             ORDER BY id
               FOR NO KEY UPDATE SKIP LOCKED
         ), cancelled AS (
            UPDATE confluo.task t
               SET status = 'cancelled', finished_at = now(), lease_expires_at = NULL,
                   -- A running attempt acknowledged nothing: clearing its token makes
                   -- whatever it sends later `LeaseLost`, as after a reclaim.
                   lease_token = CASE WHEN t.status = 'running' THEN NULL ELSE t.lease_token END,
                   errors = t.errors || jsonb_build_array(jsonb_build_object(
                       'attempt', t.attempt, 'at', now(),
                       'error', {UNJOINED_ERROR_SQL}))
              FROM open WHERE t.id = open.id AND t.status IN ('pending', 'running')
         RETURNING t.group_id, t.item_index, 'cancelled'::text AS outcome
         ) {}
         SELECT count(*) FROM cancelled",
        counters_sql("cancelled", Count::Down)
    );
    let cancelled: i64 = super::query_scalar(&sql)
        .bind(group_id)
        .fetch_one(conn)
        .await?;
    Ok(cancelled as u64)
}

/// Dependency fan-in (`store::joins`): counts the dependency `name` (passing on `passed`'s output; `None`: the execution
/// input) down at the join of stage `stage`, which waits for `needs`, creating the row
/// on the first arrival. Returns the dependencies still to come, or `None` when `name`
/// had arrived already (nothing changed).
pub(crate) async fn join_arrival(
    conn: &mut PgConnection,
    execution_id: ExecutionId,
    stage: usize,
    needs: usize,
    name: &str,
    passed: Option<GroupId>,
) -> Result<Option<i32>> {
    Ok(super::query_scalar(
        "INSERT INTO confluo.stage_join AS j (execution_id, stage_index, remaining, arrived)
         VALUES ($1, $2, $3 - 1, jsonb_build_object($4::text, $5::uuid))
         ON CONFLICT (execution_id, stage_index) DO UPDATE
            SET remaining = j.remaining - 1, arrived = j.arrived || EXCLUDED.arrived
          WHERE NOT j.arrived ? $4::text
         RETURNING remaining",
    )
    .bind(execution_id)
    .bind(stage as i32)
    .bind(needs as i32)
    .bind(name)
    .bind(passed)
    .fetch_optional(conn)
    .await?)
}
