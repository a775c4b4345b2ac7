//! The one lock order. Every transaction that locks rows of several kinds takes them in
//! this order, each kind in id order:
//!
//! 1. **executions** (`FOR NO KEY UPDATE`, or `FOR UPDATE` for the row-lock fan-in),
//!    by depth first: a parent before its children (child workflows), then in id order;
//! 2. **tasks**;
//! 3. **stripes** of striped groups;
//! 4. **groups** (the countdown rows).
//!
//! A transaction may skip a kind, never go back to an earlier one and wait. So every path
//! that may fire a group, stop an execution or count a group back up takes the
//! execution's lock first: a signal (which also serialises it with the entry of its wait),
//! a cancel, a deadline time-out, a fail-fast dead letter, a
//! reprocess (and the move of an archived execution's tasks back that it starts with), a
//! single completion that may be its group's last, a repair. An archive locks the ended
//! executions it moves before it deletes their tasks, oldest first rather than in id
//! order, but it skips those another transaction holds: it never waits for one, so it
//! cannot close a cycle. Completions that
//! cannot be the last (one autocommitted statement: the task, then its stripe or group)
//! never touch the execution. A batch of completions takes no execution lock up front
//! (held by every busy batch, it would keep the deadline sweep, which skips locked
//! executions, from timing one out); when its statement drains a group, it asks for the
//! execution's lock without waiting (`NOWAIT`), and if someone holds it (a cancel, a
//! reprocess), the batch rolls back and starts over with the executions locked first. No
//! path waits for a lock of an earlier kind while holding a later one, so none can
//! deadlock another.
//!
//! Two exceptions, by design. A child workflow's end (its completion or stop) locks its
//! own rows in this order, then its member's task in the parent, last, to make it due
//! ([`children`](super::children)). No transaction that holds such a member waits for a
//! row of another execution: a parent's stop cancels its members and leaves its children
//! to the cascade, which runs after it commits and skips locked children; the member's
//! completion reads its child without locking it. So it closes no cycle.
//!
//! Parents come before their children among executions because two paths lock a parent
//! and then its children: a reprocess (its execution, then the children of its dead and
//! cancelled members) and the cascade (a stopped parent `FOR SHARE`, then its running
//! children, skipping those held). A batch of completions that locks its executions
//! first takes them in the same order ([`executions`]): in plain id order, a batch
//! holding a child's task and its parent's could take the child first and wait for the
//! parent a reprocess holds while the reprocess waits for the child.
//!
//! A quorum group that fires ([`Join`](crate::Join)) cancels its members still pending or
//! running in the firing transaction, which holds the group: tasks after a group. It
//! asks for them `SKIP LOCKED`, so it never waits for one, and closes no cycle; the
//! members it skips finish on their own ([`fan_in::cancel_unjoined`](super::fan_in)).
//!
//! Join rows (`confluo.stage_join`, dependency fan-in) are written only by a transaction
//! that holds their execution's lock, as it finishes a dependency: they need no place of
//! their own in the order.
//!
//! The re-counting strategies (row-lock, and the naive
//! demonstration) write the task's status and then lock the execution. They hold no
//! stripe or group then, and the one task they hold is running. One path that holds an
//! execution does wait for a running task: the failure (or the reclaim of an expired
//! lease) of a member of a fail-fast or quorum stage, which takes the execution first.
//! Racing a row-lock completion of the same attempt (a late acknowledgement against the
//! lease sweep), the two can deadlock; PostgreSQL detects it (40P01) and the loser is
//! retried (`retry_conflicts`), about a second later. Countdown stages never do this: their
//! completions that may fire take the execution first.

use sqlx::PgConnection;

use crate::error::{Error, Result};
use crate::ids::{ExecutionId, GroupId};

/// Locks an execution.
pub(crate) async fn execution(conn: &mut PgConnection, id: ExecutionId) -> Result<()> {
    super::query("SELECT 1 FROM confluo.execution WHERE id = $1 FOR NO KEY UPDATE")
        .bind(id)
        .execute(conn)
        .await?;
    Ok(())
}

/// Locks executions in the order above: by depth (how many parents each has), then id.
/// Most executions have no parent: the walk up stops at once. Depth counts the ancestors
/// still stored (`parent_execution` has no foreign key, and a purged ancestor ends the
/// walk), which keeps the order that matters: a stored parent's depth is always one less
/// than its child's.
pub(crate) async fn executions(conn: &mut PgConnection, ids: &[ExecutionId]) -> Result<()> {
    super::query(
        "WITH RECURSIVE up (id, ancestor, depth) AS (
             SELECT id, parent_execution, 0 FROM confluo.execution WHERE id = ANY($1)
             UNION ALL
             SELECT up.id, e.parent_execution, up.depth + 1
               FROM up JOIN confluo.execution e ON e.id = up.ancestor
         ), depths AS (
             SELECT id, max(depth) AS depth FROM up GROUP BY id
         )
         SELECT 1 FROM confluo.execution x JOIN depths d ON d.id = x.id
          ORDER BY d.depth, x.id
            FOR NO KEY UPDATE OF x",
    )
    .bind(ids)
    .execute(conn)
    .await?;
    Ok(())
}

/// Locks an execution as the row-lock fan-in does (`FOR UPDATE`), after writing the
/// task's status: the exception above.
pub(crate) async fn execution_for_update(conn: &mut PgConnection, id: ExecutionId) -> Result<()> {
    super::query("SELECT 1 FROM confluo.execution WHERE id = $1 FOR UPDATE")
        .bind(id)
        .execute(conn)
        .await?;
    Ok(())
}

/// Locks a group's counters, its stripes then its row, as every statement that counts
/// takes them: no arrival is in flight on them until the transaction ends.
pub(crate) async fn counters(conn: &mut PgConnection, group: GroupId) -> Result<()> {
    super::query(
        "SELECT 1 FROM confluo.group_stripe WHERE group_id = $1 ORDER BY stripe
            FOR NO KEY UPDATE",
    )
    .bind(group)
    .execute(&mut *conn)
    .await?;
    group_row(conn, group).await
}

/// Locks a group's row (its stripes, if any, already locked).
pub(crate) async fn group_row(conn: &mut PgConnection, group: GroupId) -> Result<()> {
    super::query("SELECT 1 FROM confluo.stage_group WHERE id = $1 FOR NO KEY UPDATE")
        .bind(group)
        .execute(conn)
        .await?;
    Ok(())
}

/// Whether `error` is a `NOWAIT` lock request that found the row taken (55P03).
pub(crate) fn is_taken(error: &Error) -> bool {
    matches!(error, Error::Database(sqlx::Error::Database(db)) if db.code().as_deref() == Some("55P03"))
}
