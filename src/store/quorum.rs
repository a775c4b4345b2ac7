//! The statements of quorum joins ([`Join::Any`](crate::Join), [`Join::AtLeast`]
//! (crate::Join)) that move no countdown: the re-count by which the re-counting strategies
//! decide one, the cancel of a completion that came after its group fired, and what a
//! failed quorum reports. The countdown's own moves (`needed`, `tolerable`) are in
//! [`fan_in`](super::fan_in), with every other counter.

use sqlx::{FromRow, PgConnection};

use crate::error::Result;
use crate::ids::{GroupId, TaskId};

/// Cancels completions of a quorum group that had fired already, in the transaction that
/// completed them (it holds their rows and their group's): they pass nothing on, and
/// their error says why. Terminal either way, so `remaining` does not move; `needed`
/// (which counts completed members) takes them back.
pub(crate) async fn cancel_late(conn: &mut PgConnection, ids: &[TaskId]) -> Result<()> {
    super::query(&format!(
        "WITH late AS (
            UPDATE confluo.task t SET status = 'cancelled', {LATE_ERROR}
             WHERE t.id = ANY($1) AND t.status = 'completed'
         RETURNING t.group_id
         ), per_group AS (
            SELECT group_id, count(*)::int AS n FROM late GROUP BY 1
         )
         UPDATE confluo.stage_group g SET needed = g.needed + p.n
           FROM per_group p WHERE g.id = p.group_id AND g.needed IS NOT NULL"
    ))
    .bind(ids)
    .execute(conn)
    .await?;
    Ok(())
}

/// The error recorded on a member that completed after its group's quorum fired.
const LATE_ERROR: &str = "errors = t.errors || jsonb_build_array(jsonb_build_object(
        'attempt', t.attempt, 'at', now(),
        'error', 'completed after its stage''s join had fired: cancelled, its output not passed on'))";

/// Decides a quorum group by re-counting its members (the re-counting strategies; the
/// caller holds the execution's lock for the row-lock one): fires once `k` completed,
/// unless it fired already, in which case the arrivals `completed` are late and are
/// cancelled here; fails once more than `width - k` are dead. Returns whether it fires,
/// and whether its quorum is unreachable.
pub(crate) async fn recount(
    conn: &mut PgConnection,
    group_id: GroupId,
    completed: &[TaskId],
) -> Result<(bool, bool)> {
    let (fired, reached, unreachable): (bool, bool, bool) = super::query_as(
        "SELECT g.fired_at IS NOT NULL,
                count(*) FILTER (WHERE t.status = 'completed') >= g.quorum,
                count(*) FILTER (WHERE t.status = 'dead') > g.width - g.quorum
           FROM confluo.stage_group g JOIN confluo.task t ON t.group_id = g.id
          WHERE g.id = $1
          GROUP BY g.id",
    )
    .bind(group_id)
    .fetch_one(&mut *conn)
    .await?;
    if fired {
        if !completed.is_empty() {
            super::query(&format!(
                "UPDATE confluo.task t SET status = 'cancelled', {LATE_ERROR}
                  WHERE t.id = ANY($1) AND t.status = 'completed'"
            ))
            .bind(completed)
            .execute(conn)
            .await?;
        }
        return Ok((false, false));
    }
    Ok((reached, unreachable))
}

/// Where a quorum group stands, to say why it failed.
#[derive(Debug, Clone, FromRow)]
pub(crate) struct QuorumRow {
    pub width: i32,
    pub quorum: i32,
    pub dead: i64,
}

/// [`QuorumRow`] of a group.
pub(crate) async fn state(conn: &mut PgConnection, group_id: GroupId) -> Result<QuorumRow> {
    Ok(super::query_as(
        "SELECT g.width, g.quorum,
                (SELECT count(*) FROM confluo.task t
                  WHERE t.group_id = g.id AND t.status = 'dead') AS dead
           FROM confluo.stage_group g WHERE g.id = $1 AND g.quorum IS NOT NULL",
    )
    .bind(group_id)
    .fetch_one(conn)
    .await?)
}
