//! The naive re-count, kept only to demonstrate the stall it causes: write the member's
//! status, then count unfinished siblings with no lock. Two members committing together
//! each count the other as unfinished, and nobody fires.

use serde_json::Value;
use sqlx::PgConnection;

use super::Arrival;
use crate::error::Result;
use crate::ids::{GroupId, LeaseToken, TaskId};
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
    let last = decide(conn, row.group_id).await?;
    Ok(Some(Arrival {
        group_id: row.group_id,
        execution_id: row.execution_id,
        stage_index: row.stage_index,
        last,
    }))
}

pub(super) async fn decide(conn: &mut PgConnection, group_id: GroupId) -> Result<bool> {
    let (open, total) = tasks::count_open_members(conn, group_id).await?;
    Ok(open == 0 && total > 0)
}
