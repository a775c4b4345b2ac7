//! The row-lock strategy, the classic engine's way and our baseline: after writing the
//! member's status, lock the execution row `FOR UPDATE` and re-count the group. The lock
//! serializes every completion of the execution until commit, so the last committer sees
//! every sibling terminal; the cost is a re-read of the whole group per completion.

use sqlx::PgConnection;

use crate::error::Result;
use crate::ids::{ExecutionId, GroupId};
use crate::store::tasks;

pub(super) async fn decide(
    conn: &mut PgConnection,
    execution_id: ExecutionId,
    group_id: GroupId,
) -> Result<bool> {
    tasks::lock_execution_for_update(conn, execution_id).await?;
    let (open, total) = tasks::count_open_members(conn, group_id).await?;
    Ok(open == 0 && total > 0)
}
