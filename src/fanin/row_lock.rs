//! The row-lock strategy, the classic engine's way and our baseline: after writing the
//! member's status, lock the execution row `FOR UPDATE` and re-count the group. The lock
//! serializes every completion of the execution until commit, so the last committer sees
//! every sibling terminal; the cost is a re-read of the whole group per completion.

use serde_json::Value;
use sqlx::PgConnection;

use super::Arrival;
use crate::error::Result;
use crate::ids::{ExecutionId, GroupId, LeaseToken, TaskId};
use crate::store::tasks;

pub(super) async fn complete(
    conn: &mut PgConnection,
    id: TaskId,
    token: LeaseToken,
    output: &Value,
) -> Result<Option<Arrival>> {
    let Some(row) = tasks::complete_plain(conn, id, token, output).await? else {
        return Ok(None);
    };
    let last = decide(conn, row.execution_id, row.group_id).await?;
    Ok(Some(Arrival {
        group_id: row.group_id,
        execution_id: row.execution_id,
        stage_index: row.stage_index,
        last,
    }))
}

pub(super) async fn decide(
    conn: &mut PgConnection,
    execution_id: ExecutionId,
    group_id: GroupId,
) -> Result<bool> {
    tasks::lock_execution_for_update(conn, execution_id).await?;
    let (open, total) = tasks::count_open_members(conn, group_id).await?;
    Ok(open == 0 && total > 0)
}
