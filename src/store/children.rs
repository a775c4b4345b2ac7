//! Child workflows' rows: the executions a [`Stage::map_workflow`](crate::Stage::map_workflow)
//! starts (`execution.parent_task`), the report of a child's end to its member, and the
//! `cascade` table of stopped parents whose children are still to be cancelled.
//!
//! # Locks
//! A child's end locks its own rows first (its execution, tasks, groups), then its
//! member's task in the parent, last: the one place a transaction takes a task after a
//! group. It cannot close a cycle: no transaction that holds a member of a child workflow
//! waits for a row of another execution (a parent's stop cancels its members and
//! leaves its children to [`cascade`](next_cascade); the member's own completion reads
//! the child without locking it).

use sqlx::PgConnection;

use crate::definition::Workflow;
use crate::error::Result;
use crate::fanin::FanInStrategy;
use crate::ids::{ExecutionId, GroupId, TaskId};

/// The CTE `woken` by which the executions of the CTE `ended` (with a `parent_task`
/// column) report their end: each one's member in its parent, if still pending, is due
/// now. Appended to a `WITH` list.
pub(crate) fn report_end_sql(ended: &str) -> String {
    format!(
        ", woken AS (
            UPDATE confluo.task t SET run_at = now()
              FROM {ended} e
             WHERE t.id = e.parent_task AND t.status = 'pending'
         RETURNING t.id
         )"
    )
}

/// A `FROM` item that wakes the workers (at commit) when `woken` woke a member: join it
/// `LEFT JOIN LATERAL ... ON true` in the statement's final `SELECT`, with `$channel` the
/// tasks channel's parameter.
pub(crate) fn notify_woken_sql(channel: &str) -> String {
    format!("(SELECT pg_notify({channel}, '') FROM (SELECT 1 FROM woken LIMIT 1) w) told")
}

/// Starts one execution of `child` per member of the group `group` (a map of child
/// workflows entered in the caller's transaction), or only of the members `only`, each
/// with its member's input, linked to the member (`parent_task`) and to the parent
/// execution, in one statement. Returns the new executions.
pub(crate) async fn start(
    conn: &mut PgConnection,
    group: GroupId,
    only: Option<&[TaskId]>,
    child: &Workflow,
    fan_in: FanInStrategy,
) -> Result<Vec<ExecutionId>> {
    Ok(super::query_scalar(
        "INSERT INTO confluo.execution
                (id, workflow_name, workflow_version, input, fan_in, callback_url,
                 parent_execution, parent_task)
         SELECT gen_random_uuid(), $2, $3, t.input, $4, $5, t.execution_id, t.id
           FROM confluo.task t
          WHERE t.group_id = $1 AND ($6::uuid[] IS NULL OR t.id = ANY($6))
          ORDER BY t.item_index
         RETURNING id",
    )
    .bind(group)
    .bind(child.name())
    .bind(child.version())
    .bind(fan_in.as_str())
    .bind(child.callback_url())
    .bind(only)
    .fetch_all(conn)
    .await?)
}

/// Locks, in id order, the children of the dead and cancelled members of the execution
/// `parent`, locked by the caller: those a reprocess of the parent requeues, and whose
/// child [`restart`] then reads. Locked, a running child cannot end between that read and
/// the reprocess's commit (its end would find its member not yet pending, and the member
/// would wait for nothing); one ending now is waited for, and read ended. The parent's
/// execution, then its children's, then tasks: executions before tasks, a parent before
/// its children (a child's end never waits for its parent's execution, so this cannot
/// close a cycle).
pub(crate) async fn lock_of_stopped_members(
    conn: &mut PgConnection,
    parent: ExecutionId,
) -> Result<()> {
    super::query(
        "SELECT c.id FROM confluo.execution c
          WHERE c.parent_execution = $1
            AND c.parent_task IN (SELECT t.id FROM confluo.task_all t
                                   WHERE t.execution_id = $1
                                     AND t.status IN ('dead', 'cancelled'))
          ORDER BY c.id
            FOR NO KEY UPDATE OF c",
    )
    .bind(parent)
    .execute(conn)
    .await?;
    Ok(())
}

/// A member whose child is to start again: the member, its group, and the workflow,
/// version and fan-in of the child it had.
#[derive(Debug, sqlx::FromRow)]
pub(crate) struct Restart {
    pub member: TaskId,
    pub group_id: GroupId,
    pub workflow_name: String,
    pub workflow_version: i32,
    pub fan_in: String,
}

/// For the members of child workflows among `requeued` (just put back in the queue by a
/// reprocess, in the caller's transaction): those whose child completed stay due (they
/// report its output); the others wait for a child's end (`run_at` infinity): the one
/// still running, or a new one for those whose child failed, was cancelled or timed out,
/// whose old child is unlinked from its member (it stays its parent's, for the record).
/// Returns the members that need a new child, by group. The ended children must be locked
/// first ([`lock_of_stopped_members`]).
pub(crate) async fn restart(conn: &mut PgConnection, requeued: &[TaskId]) -> Result<Vec<Restart>> {
    Ok(super::query_as(
        "WITH m AS (
            SELECT t.id AS member, t.group_id, c.id AS child, c.status, c.workflow_name,
                   c.workflow_version, c.fan_in
              FROM confluo.task t
              JOIN LATERAL (SELECT x.id, x.status, x.workflow_name, x.workflow_version, x.fan_in
                              FROM confluo.execution x WHERE x.parent_task = t.id
                             ORDER BY x.created_at DESC LIMIT 1) c ON true
             WHERE t.id = ANY($1) AND t.handler = $2
         ), waiting AS (
            UPDATE confluo.task t SET run_at = 'infinity'
              FROM m WHERE t.id = m.member AND m.status <> 'completed'
         ), unlinked AS (
            UPDATE confluo.execution c SET parent_task = NULL
              FROM m WHERE c.id = m.child AND m.status NOT IN ('running', 'completed')
         )
         SELECT member, group_id, workflow_name, workflow_version, fan_in FROM m
          WHERE status NOT IN ('running', 'completed')
          ORDER BY group_id, workflow_name, workflow_version, fan_in, member",
    )
    .bind(requeued)
    .bind(crate::definition::CHILD_HANDLER)
    .fetch_all(conn)
    .await?)
}

/// The first member of `group` whose input is not an array of at most `max` elements,
/// if any: its index and what the input is (a child whose first stage is a map needs
/// one).
pub(crate) async fn unfit_input(
    conn: &mut PgConnection,
    group: GroupId,
    max: i64,
) -> Result<Option<(i32, String)>> {
    Ok(super::query_as(
        "SELECT item_index,
                CASE jsonb_typeof(input) WHEN 'array'
                     THEN 'an array of ' || jsonb_array_length(input) || ' elements'
                     ELSE 'a JSON ' || jsonb_typeof(input) END
           FROM confluo.task
          WHERE group_id = $1
            AND (jsonb_typeof(input) <> 'array' OR jsonb_array_length(input) > $2)
          ORDER BY item_index
          LIMIT 1",
    )
    .bind(group)
    .bind(max)
    .fetch_optional(conn)
    .await?)
}

/// A member's child execution, as its member's handler reads it (unlocked).
#[derive(Debug, Clone, sqlx::FromRow)]
pub(crate) struct ChildRow {
    pub id: ExecutionId,
    pub workflow_name: String,
    pub workflow_version: i32,
    pub status: String,
    pub error: Option<String>,
    pub output_group: Option<GroupId>,
}

/// The child execution started for the member `task` (the latest, should there be
/// several).
pub(crate) async fn of_member<'e, E>(executor: E, task: TaskId) -> Result<Option<ChildRow>>
where
    E: super::Executor<'e>,
{
    Ok(super::query_as(
        "SELECT id, workflow_name, workflow_version, status, error, output_group
           FROM confluo.execution
          WHERE parent_task = $1
          ORDER BY created_at DESC
          LIMIT 1",
    )
    .bind(task)
    .fetch_optional(executor)
    .await?)
}

/// Takes the oldest stopped parent whose children are still to be cancelled, skipping
/// those another transaction holds: its id, and whether it runs again (a reprocess
/// resumed it: then its children are left alone).
///
/// The parent's execution is locked `FOR SHARE` (waiting for it) before its status is
/// read: a reprocess resuming it holds that row until it commits, so the cascade either
/// sees it running, or cancels children the reprocess, waiting behind it, then finds
/// cancelled (and starts again). Read without the lock, a resume committing between the
/// read and the cancel would lose the running child its resumed member waits for. A
/// parent that no longer exists (archived) counts as stopped: its cascade row is dropped
/// once no running child is left.
pub(crate) async fn next_cascade(conn: &mut PgConnection) -> Result<Option<(ExecutionId, bool)>> {
    let parent: Option<ExecutionId> = super::query_scalar(
        "SELECT execution_id FROM confluo.cascade
          ORDER BY stopped_at
          LIMIT 1
            FOR UPDATE SKIP LOCKED",
    )
    .fetch_optional(&mut *conn)
    .await?;
    let Some(parent) = parent else {
        return Ok(None);
    };
    let running: Option<bool> = super::query_scalar(
        "SELECT status = 'running' FROM confluo.execution WHERE id = $1 FOR SHARE",
    )
    .bind(parent)
    .fetch_optional(conn)
    .await?;
    Ok(Some((parent, running.unwrap_or(false))))
}

/// Locks up to `limit` running children of `parent`, in id order, skipping those another
/// transaction holds (a completion about to end one: the next pass takes it).
pub(crate) async fn lock_running(
    conn: &mut PgConnection,
    parent: ExecutionId,
    limit: i64,
) -> Result<Vec<ExecutionId>> {
    Ok(super::query_scalar(
        "SELECT id FROM confluo.execution
          WHERE parent_execution = $1 AND status = 'running'
          ORDER BY id
          LIMIT $2
            FOR NO KEY UPDATE SKIP LOCKED",
    )
    .bind(parent)
    .bind(limit)
    .fetch_all(conn)
    .await?)
}

/// Whether `parent` has a running child.
pub(crate) async fn any_running(conn: &mut PgConnection, parent: ExecutionId) -> Result<bool> {
    Ok(super::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM confluo.execution
                         WHERE parent_execution = $1 AND status = 'running')",
    )
    .bind(parent)
    .fetch_one(conn)
    .await?)
}

/// Forgets a parent whose children are all cancelled (or which runs again).
pub(crate) async fn done_cascading(conn: &mut PgConnection, parent: ExecutionId) -> Result<()> {
    super::query("DELETE FROM confluo.cascade WHERE execution_id = $1")
        .bind(parent)
        .execute(conn)
        .await?;
    Ok(())
}

/// Children whose end was never reported: ended, with their member still pending at
/// `infinity` in a running parent (the auditor's check; the end's own statement makes it
/// due, so any row here is a defect). Each as `(child, member)`.
pub(crate) async fn unreported<'e, E>(
    executor: E,
    limit: i64,
    scope: super::audit::Scope<'_>,
) -> Result<Vec<(ExecutionId, TaskId)>>
where
    E: super::Executor<'e>,
{
    Ok(super::query_as(
        "SELECT c.id, t.id
           FROM confluo.execution c
           JOIN confluo.task t ON t.id = c.parent_task
           JOIN confluo.execution p ON p.id = t.execution_id AND p.status = 'running'
          WHERE c.parent_task IS NOT NULL AND c.status <> 'running'
            AND t.status = 'pending' AND t.run_at = 'infinity'
            AND ($2::uuid[] IS NULL OR p.id = ANY($2))
          ORDER BY c.finished_at
          LIMIT $1",
    )
    .bind(limit)
    .bind(scope)
    .fetch_all(executor)
    .await?)
}

/// Running children of ended parents that nothing is cascading to (the auditor's check).
pub(crate) async fn orphans<'e, E>(
    executor: E,
    limit: i64,
    scope: super::audit::Scope<'_>,
) -> Result<Vec<ExecutionId>>
where
    E: super::Executor<'e>,
{
    Ok(super::query_scalar(
        "SELECT c.id
           FROM confluo.execution c
           JOIN confluo.execution p ON p.id = c.parent_execution AND p.status <> 'running'
          WHERE c.parent_execution IS NOT NULL AND c.status = 'running'
            AND NOT EXISTS (SELECT 1 FROM confluo.cascade k WHERE k.execution_id = p.id)
            AND ($2::uuid[] IS NULL OR c.id = ANY($2))
          ORDER BY c.created_at
          LIMIT $1",
    )
    .bind(limit)
    .bind(scope)
    .fetch_all(executor)
    .await?)
}

/// Makes the member `task` due now if it is pending (an auditor's repair of an
/// unreported end).
pub(crate) async fn wake_member(conn: &mut PgConnection, task: TaskId) -> Result<bool> {
    let woken =
        super::query("UPDATE confluo.task SET run_at = now() WHERE id = $1 AND status = 'pending'")
            .bind(task)
            .execute(conn)
            .await?
            .rows_affected();
    Ok(woken == 1)
}

/// Records the parents of `orphans` (running children of ended parents) for the cascade
/// (an auditor's repair).
pub(crate) async fn cascade_orphans(
    conn: &mut PgConnection,
    orphans: &[ExecutionId],
) -> Result<()> {
    super::query(
        "INSERT INTO confluo.cascade (execution_id)
         SELECT DISTINCT c.parent_execution FROM confluo.execution c
          WHERE c.id = ANY($1) AND c.parent_execution IS NOT NULL
         ON CONFLICT DO NOTHING",
    )
    .bind(orphans)
    .execute(conn)
    .await?;
    Ok(())
}
