//! The task history: where the tasks of ended executions go, so that the hot table
//! (`confluo.task`) holds the work in flight (migration 0012 says why). Rows move in one
//! statement each way, so in any snapshot a task is in exactly one of the two tables;
//! readers of finished work read both through the `confluo.task_all` view.
//!
//! # Locks
//! Both moves lock the execution first, then its tasks (the order of
//! [`locks`](super::locks)): an archive skips executions another transaction holds (a
//! reprocess, a purge, another worker's archive), and a restore runs in a reprocess's
//! transaction, which holds the execution's lock.

use sqlx::PgConnection;

use crate::error::Result;
use crate::ids::ExecutionId;

/// Moves the tasks of up to `batch` executions that ended at least `after_ms` ago (the
/// oldest first), and have no task still pending or running, into the history and marks
/// them archived, in one READ COMMITTED transaction of two statements. Returns how many
/// executions and tasks it moved.
///
/// The first statement locks the candidates, skipping those another transaction holds
/// (a reprocess, a purge, another worker's archive). The second, whose snapshot is taken
/// once the locks are held, checks each again and moves it. Checked in the first
/// statement's snapshot alone, a reprocess (resuming the execution), a claim of what it
/// requeued and a stop, all committed between that snapshot and the lock, would leave
/// a running task behind the check, and the move would take it out of the hot table
/// where nothing reclaims it. Under the lock, an ended execution with no open task gets
/// none: only a reprocess (which needs the lock) puts a task back in the queue.
///
/// # Cancel safety
/// Dropped before its commit, nothing is moved.
pub(crate) async fn archive(pool: &sqlx::PgPool, after_ms: i64, batch: i64) -> Result<(u64, u64)> {
    let mut tx = super::begin(pool).await?;
    let locked: Vec<ExecutionId> = super::query_scalar(
        "SELECT id FROM confluo.execution
          WHERE archived_at IS NULL AND status <> 'running'
            AND finished_at < now() - make_interval(secs => $1::float8 / 1000)
            -- A stop leaves running attempts to end on their own: their
            -- acknowledgements, and the lease sweep, work on the hot table.
            AND NOT EXISTS (SELECT 1 FROM confluo.task t
                             WHERE t.execution_id = execution.id
                               AND t.status IN ('pending', 'running'))
          ORDER BY finished_at
          LIMIT $2
            FOR NO KEY UPDATE SKIP LOCKED",
    )
    .bind(after_ms)
    .bind(batch)
    .fetch_all(&mut *tx)
    .await?;
    if locked.is_empty() {
        return Ok((0, 0));
    }
    let (executions, tasks): (i64, i64) = super::query_as(
        "WITH picked AS (
            SELECT id FROM confluo.execution
             WHERE id = ANY($1) AND archived_at IS NULL AND status <> 'running'
               AND NOT EXISTS (SELECT 1 FROM confluo.task t
                                WHERE t.execution_id = execution.id
                                  AND t.status IN ('pending', 'running'))
         ), marked AS (
            UPDATE confluo.execution e SET archived_at = now()
              FROM picked p WHERE e.id = p.id
            RETURNING e.id
         ), moved AS (
            DELETE FROM confluo.task t USING marked m
             WHERE t.execution_id = m.id
            RETURNING t.*
         ), kept AS (
            INSERT INTO confluo.task_history SELECT * FROM moved RETURNING 1
         )
         SELECT (SELECT count(*) FROM marked), (SELECT count(*) FROM kept)",
    )
    .bind(&locked)
    .fetch_one(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok((executions.max(0) as u64, tasks.max(0) as u64))
}

/// Moves an archived execution's tasks back into the hot table and clears its mark, in
/// the caller's transaction, which holds the execution's lock (a reprocess). Does nothing
/// if it was not archived.
pub(crate) async fn restore(conn: &mut PgConnection, execution: ExecutionId) -> Result<()> {
    super::query(
        "WITH unmarked AS (
            UPDATE confluo.execution SET archived_at = NULL
             WHERE id = $1 AND archived_at IS NOT NULL
            RETURNING id
         ), moved AS (
            DELETE FROM confluo.task_history h USING unmarked u
             WHERE h.execution_id = u.id
            RETURNING h.*
         )
         INSERT INTO confluo.task SELECT * FROM moved",
    )
    .bind(execution)
    .execute(conn)
    .await?;
    Ok(())
}

/// How many ended executions still have their tasks in the hot table, and how many tasks
/// those are: what [`archive`] has left to do.
pub(crate) async fn unarchived<'e, E>(executor: E) -> Result<(u64, u64)>
where
    E: super::Executor<'e>,
{
    let (executions, tasks): (i64, i64) = super::query_as(
        "SELECT count(*),
                coalesce(sum((SELECT count(*) FROM confluo.task t
                               WHERE t.execution_id = e.id)), 0)::int8
           FROM confluo.execution e
          WHERE e.archived_at IS NULL AND e.status <> 'running'",
    )
    .fetch_one(executor)
    .await?;
    Ok((executions.max(0) as u64, tasks.max(0) as u64))
}
