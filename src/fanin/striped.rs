//! The striped countdown: the group's count is spread over stripe rows. A completion
//! counts down its stripe in the statement that writes its status; the one arrival that
//! drains a stripe counts down the group row (which counts undrained stripes), and the one
//! that takes the group row to zero fires. Both decrements are serialized by row locks, so
//! exactly one arrival sees zero, as with a single countdown row, but concurrent
//! finishers mostly lock different stripes.

use serde_json::Value;
use sqlx::PgConnection;

use super::{Arrival, Member};
use crate::error::Result;
use crate::ids::{LeaseToken, TaskId};
use crate::store::{completions, groups};

pub(super) async fn complete(
    conn: &mut PgConnection,
    id: TaskId,
    token: LeaseToken,
    output: &Value,
) -> Result<Option<Arrival>> {
    Ok(completions::complete_striping(conn, id, token, output)
        .await?
        .map(Arrival::from))
}

/// Counts a terminal member down on its stripe, and on the group when the stripe
/// drains; true if that took the group to zero.
pub(super) async fn count_down(conn: &mut PgConnection, member: Member) -> Result<bool> {
    let drained =
        groups::count_down_stripes(conn, &[member.group_id], &[member.item_index]).await?;
    if drained.iter().all(|(_, n)| *n == 0) {
        return Ok(false);
    }
    Ok(!groups::count_down(conn, &[member.group_id], &[1])
        .await?
        .is_empty())
}
