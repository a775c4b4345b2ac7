//! The naive re-count, kept only to demonstrate the stall it causes: write the member's
//! status, then count unfinished siblings with no lock. Two members committing together
//! each count the other as unfinished, and nobody fires.

use sqlx::PgConnection;

use crate::error::Result;
use crate::ids::GroupId;
use crate::store::tasks;

pub(super) async fn decide(conn: &mut PgConnection, group_id: GroupId) -> Result<bool> {
    let (open, total) = tasks::count_open_members(conn, group_id).await?;
    Ok(open == 0 && total > 0)
}
