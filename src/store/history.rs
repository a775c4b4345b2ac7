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
/// oldest first), and have no attempt still running, into the history and marks them
/// archived, in one autocommitted statement (READ COMMITTED, as the session is pinned; a
/// locked execution is re-read at its latest version, so one resumed meanwhile is left
/// alone). Returns how many executions and tasks it moved.
pub(crate) async fn archive<'e, E>(executor: E, after_ms: i64, batch: i64) -> Result<(u64, u64)>
where
    E: super::Executor<'e>,
{
    let (executions, tasks): (i64, i64) = super::query_as(
        "WITH picked AS (
            SELECT id FROM confluo.execution
             WHERE archived_at IS NULL AND status <> 'running'
               AND finished_at < now() - make_interval(secs => $1::float8 / 1000)
               -- A stop leaves running attempts to end on their own: their
               -- acknowledgements, and the lease sweep, work on the hot table.
               AND NOT EXISTS (SELECT 1 FROM confluo.task t
                                WHERE t.execution_id = execution.id
                                  AND t.status IN ('pending', 'running'))
             ORDER BY finished_at
             LIMIT $2
               FOR NO KEY UPDATE SKIP LOCKED
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
    .bind(after_ms)
    .bind(batch)
    .fetch_one(executor)
    .await?;
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
