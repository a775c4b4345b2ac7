//! The countdown strategy: `UPDATE stage_group SET remaining = remaining - 1 ... RETURNING`
//! fused with the guarded status transition into one statement, so the group row is held
//! only from that statement to the commit. Row locking serializes the decrements, so
//! exactly one transaction sees zero; the lease-token guard makes every replay decrement
//! nothing.

use serde_json::Value;
use sqlx::PgConnection;

use super::Arrival;
use crate::error::Result;
use crate::ids::{LeaseToken, TaskId};
use crate::store::completions;

pub(super) async fn complete(
    conn: &mut PgConnection,
    id: TaskId,
    token: LeaseToken,
    output: &Value,
) -> Result<Option<Arrival>> {
    Ok(completions::complete_counting_down(conn, id, token, output)
        .await?
        .map(Arrival::from))
}
