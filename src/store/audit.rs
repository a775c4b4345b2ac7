//! Audit queries: states that the engine's transitions never commit. Each finding is read
//! in one statement, so it sees one snapshot of committed transactions: since every
//! transition commits atomically, a concurrent completion can never make a healthy
//! database look broken.

use sqlx::{FromRow, PgConnection};

use crate::error::Result;
use crate::ids::{ExecutionId, GroupId};

/// Which running executions an audit reads: all of them, or a slice (an auditor's round,
/// `Some`: bound as `$1`).
pub(crate) type Scope<'a> = Option<&'a [ExecutionId]>;

/// The condition on the execution `e` that [`Scope`] `scope` sets.
fn within(scope: Scope<'_>) -> &'static str {
    match scope {
        None => "true",
        Some(_) => "e.id = ANY($1)",
    }
}

/// A counter (a group's, or one of its stripes') that disagrees with its members.
#[derive(Debug, Clone, FromRow)]
pub(crate) struct CounterRow {
    pub group_id: GroupId,
    pub execution_id: ExecutionId,
    pub stage_index: i32,
    pub stripe: Option<i32>,
    /// `remaining`, or a quorum's `needed` or `tolerable`.
    pub name: String,
    pub counter: i32,
    pub expected: i32,
}

/// Counters of running executions' groups that disagree with their members: a countdown
/// group's `remaining` against its non-terminal members; a striped group's stripes against
/// their non-terminal members, and its `remaining` against its undrained stripes; a
/// countdown quorum group's `needed` against its quorum less its completed members, and
/// its `tolerable` against its width less its quorum and its dead members.
pub(crate) async fn counter_mismatches(
    conn: &mut PgConnection,
    scope: Scope<'_>,
) -> Result<Vec<CounterRow>> {
    let sql = format!(
        "WITH g AS (
            SELECT g.* FROM confluo.stage_group g
              JOIN confluo.execution e ON e.id = g.execution_id
             WHERE e.status = 'running' AND g.fan_in IN ('countdown', 'striped') AND {}
         ), stripe_truth AS (
            SELECT s.group_id, s.stripe, s.remaining,
                   (SELECT count(*) FROM confluo.task t
                     WHERE t.group_id = s.group_id AND t.status IN ('pending', 'running')
                       AND confluo.stripe_of(t.item_index, g.stripe_run, g.stripes) = s.stripe
                   )::int AS open
              FROM confluo.group_stripe s JOIN g ON g.id = s.group_id
         ), group_truth AS (
            SELECT g.id, g.execution_id, g.stage_index, g.remaining,
                   CASE g.fan_in
                       WHEN 'countdown' THEN (
                           SELECT count(*) FROM confluo.task t
                            WHERE t.group_id = g.id AND t.status IN ('pending', 'running'))
                       ELSE (SELECT count(*) FROM stripe_truth st
                              WHERE st.group_id = g.id AND st.open > 0)
                   END::int AS open
              FROM g
         ), quorum_truth AS (
            SELECT g.id, g.execution_id, g.stage_index, g.needed, g.tolerable,
                   g.quorum - count(*) FILTER (WHERE t.status = 'completed')::int AS needs,
                   g.width - g.quorum - count(*) FILTER (WHERE t.status = 'dead')::int AS tolerates
              FROM g JOIN confluo.task t ON t.group_id = g.id
             WHERE g.fan_in = 'countdown' AND g.quorum IS NOT NULL
             GROUP BY g.id, g.execution_id, g.stage_index, g.needed, g.tolerable, g.quorum, g.width
         )
         SELECT id AS group_id, execution_id, stage_index, NULL::int AS stripe,
                'remaining' AS name, remaining AS counter, open AS expected
           FROM group_truth WHERE remaining IS DISTINCT FROM open
         UNION ALL
         SELECT st.group_id, g.execution_id, g.stage_index, st.stripe, 'remaining',
                st.remaining, st.open
           FROM stripe_truth st JOIN g ON g.id = st.group_id
          WHERE st.remaining <> st.open
         UNION ALL
         SELECT id, execution_id, stage_index, NULL, 'needed', needed, needs
           FROM quorum_truth WHERE needed <> needs
         UNION ALL
         SELECT id, execution_id, stage_index, NULL, 'tolerable', tolerable, tolerates
           FROM quorum_truth WHERE tolerable <> tolerates
         ORDER BY 1, 4 NULLS FIRST, 5",
        within(scope)
    );
    let query = super::query_as(&sql);
    Ok(match scope {
        Some(ids) => query.bind(ids),
        None => query,
    }
    .fetch_all(conn)
    .await?)
}

/// A group of a running execution, and where it stands.
#[derive(Debug, Clone, FromRow)]
pub(crate) struct GroupRow {
    pub group_id: GroupId,
    pub execution_id: ExecutionId,
    pub stage_index: i32,
}

/// Groups of running executions whose members are all terminal but that never fired (a
/// quorum group only if enough of them completed: one that failed its quorum fails its
/// execution instead).
pub(crate) async fn unfired_groups(
    conn: &mut PgConnection,
    scope: Scope<'_>,
) -> Result<Vec<GroupRow>> {
    let sql = format!(
        "SELECT g.id AS group_id, g.execution_id, g.stage_index
           FROM confluo.stage_group g JOIN confluo.execution e ON e.id = g.execution_id
          WHERE e.status = 'running' AND g.fired_at IS NULL AND {}
            AND NOT EXISTS (SELECT 1 FROM confluo.task t
                             WHERE t.group_id = g.id AND t.status IN ('pending', 'running'))
            AND (g.quorum IS NULL
                 OR (SELECT count(*) FROM confluo.task q
                      WHERE q.group_id = g.id AND q.status = 'completed') >= g.quorum)
          ORDER BY g.execution_id, g.stage_index",
        within(scope)
    );
    let query = super::query_as(&sql);
    Ok(match scope {
        Some(ids) => query.bind(ids),
        None => query,
    }
    .fetch_all(conn)
    .await?)
}

/// The condition of a stalled execution `e`: running, no open task, no unfired group.
/// Nothing will ever move it: every stage that runs has a task or a group waiting to fire.
const STALLED: &str = "e.status = 'running'
            AND NOT EXISTS (SELECT 1 FROM confluo.task t
                             WHERE t.execution_id = e.id AND t.status IN ('pending', 'running'))
            AND NOT EXISTS (SELECT 1 FROM confluo.stage_group u
                             WHERE u.execution_id = e.id AND u.fired_at IS NULL)";

/// Running executions with nothing left to run: no open task and every group fired, so
/// nothing will ever move them (in a graph, a stall may sit on any branch). Returns each
/// with its last group, to name it.
pub(crate) async fn stalled_executions(
    conn: &mut PgConnection,
    scope: Scope<'_>,
) -> Result<Vec<GroupRow>> {
    let sql = format!(
        "SELECT last.id AS group_id, e.id AS execution_id, last.stage_index
           FROM confluo.execution e
           JOIN LATERAL (SELECT g.id, g.stage_index FROM confluo.stage_group g
                          WHERE g.execution_id = e.id
                          ORDER BY g.stage_index DESC LIMIT 1) last ON true
          WHERE {STALLED} AND {}
          ORDER BY e.id",
        within(scope)
    );
    let query = super::query_as(&sql);
    Ok(match scope {
        Some(ids) => query.bind(ids),
        None => query,
    }
    .fetch_all(conn)
    .await?)
}

/// Whether the execution is stalled, from a snapshot taken now (its lock held by the
/// caller, via [`lock_if_stalled`]).
pub(crate) async fn is_stalled(conn: &mut PgConnection, execution_id: ExecutionId) -> Result<bool> {
    Ok(super::query_scalar(&format!(
        "SELECT EXISTS (SELECT 1 FROM confluo.execution e WHERE e.id = $1 AND {STALLED})"
    ))
    .bind(execution_id)
    .fetch_one(conn)
    .await?)
}

/// The fired groups of an execution whose transition a repair may drive again, in stage
/// order: every group but a branch's (a branch's group records its choice and fires as
/// it is entered, in the transaction that enters its arm; driving it again would take
/// the branch's own input on past the arm).
pub(crate) async fn redrivable_groups(
    conn: &mut PgConnection,
    execution_id: ExecutionId,
) -> Result<Vec<(GroupId, i32)>> {
    Ok(super::query_as(
        "SELECT id, stage_index FROM confluo.stage_group
          WHERE execution_id = $1 AND fired_at IS NOT NULL AND kind <> 'branch'
          ORDER BY stage_index",
    )
    .bind(execution_id)
    .fetch_all(conn)
    .await?)
}

/// Locks a group's stripes, then the group (the order completions take them), so that no
/// arrival is in flight on them; then, in a statement of its own (a snapshot taken after
/// the locks), sets every counter to the number of non-terminal members it stands for.
/// Returns the group's corrected counter.
pub(crate) async fn recount(conn: &mut PgConnection, group_id: GroupId) -> Result<Option<i32>> {
    super::locks::counters(conn, group_id).await?;
    super::query(
        "UPDATE confluo.group_stripe s
            SET remaining = (SELECT count(*) FROM confluo.task t
                              WHERE t.group_id = s.group_id AND t.status IN ('pending', 'running')
                                AND confluo.stripe_of(t.item_index, g.stripe_run, g.stripes) = s.stripe)
           FROM confluo.stage_group g
          WHERE s.group_id = $1 AND g.id = s.group_id",
    )
    .bind(group_id)
    .execute(&mut *conn)
    .await?;
    Ok(super::query_scalar(
        "UPDATE confluo.stage_group g
            SET remaining = CASE g.fan_in
                WHEN 'countdown' THEN (SELECT count(*) FROM confluo.task t
                                        WHERE t.group_id = g.id AND t.status IN ('pending', 'running'))
                WHEN 'striped' THEN (SELECT count(*) FROM confluo.group_stripe s
                                      WHERE s.group_id = g.id AND s.remaining > 0)
                ELSE g.remaining END,
                needed = g.quorum - (SELECT count(*) FROM confluo.task t
                                      WHERE t.group_id = g.id AND t.status = 'completed'),
                tolerable = g.width - g.quorum - (SELECT count(*) FROM confluo.task t
                                                   WHERE t.group_id = g.id AND t.status = 'dead')
          WHERE g.id = $1
      RETURNING g.remaining",
    )
    .bind(group_id)
    .fetch_optional(conn)
    .await?
    .flatten())
}

/// Locks a group (its stripes already locked by [`recount`], in the order completions
/// take them) and tells, from a snapshot taken after the lock, whether it still needs
/// firing: never fired, every member terminal, its execution running.
pub(crate) async fn lock_if_unfired(conn: &mut PgConnection, group_id: GroupId) -> Result<bool> {
    super::locks::group_row(conn, group_id).await?;
    Ok(super::query_scalar(
        "SELECT EXISTS (
            SELECT 1 FROM confluo.stage_group g JOIN confluo.execution e ON e.id = g.execution_id
             WHERE g.id = $1 AND g.fired_at IS NULL AND e.status = 'running'
               AND NOT EXISTS (SELECT 1 FROM confluo.task t
                                WHERE t.group_id = g.id AND t.status IN ('pending', 'running'))
            AND (g.quorum IS NULL
                 OR (SELECT count(*) FROM confluo.task q
                      WHERE q.group_id = g.id AND q.status = 'completed') >= g.quorum))",
    )
    .bind(group_id)
    .fetch_one(conn)
    .await?)
}

/// A stalled execution, as a repair moves it on.
#[derive(Debug, Clone, FromRow)]
pub(crate) struct StalledRow {
    pub workflow_name: String,
    pub workflow_version: i32,
    /// The default fan-in strategy recorded when the execution started.
    pub fan_in: String,
}

/// Locks an execution and, from a snapshot taken after the lock, returns it if it is
/// still stalled.
pub(crate) async fn lock_if_stalled(
    conn: &mut PgConnection,
    execution_id: ExecutionId,
) -> Result<Option<StalledRow>> {
    super::locks::execution(conn, execution_id).await?;
    Ok(super::query_as(&format!(
        "SELECT e.workflow_name, e.workflow_version, e.fan_in FROM confluo.execution e
          WHERE e.id = $1 AND {STALLED}"
    ))
    .bind(execution_id)
    .fetch_optional(conn)
    .await?)
}
