//! Join rows of dependency fan-in (`confluo.stage_join`): the countdown of a stage that
//! waits for several, read here; counted down by [`join_arrival`](super::fan_in::join_arrival)
//! in the fan-in's module, only under the execution's lock (by the transaction that
//! finishes a dependency), so arrivals at one join never interleave.

use sqlx::PgConnection;

use crate::error::Result;
use crate::ids::{ExecutionId, GroupId};

/// The dependencies still to come at the join of stage `stage` (`None`: none arrived).
pub(crate) async fn remaining(
    conn: &mut PgConnection,
    execution_id: ExecutionId,
    stage: usize,
) -> Result<Option<i32>> {
    Ok(super::query_scalar(
        "SELECT remaining FROM confluo.stage_join WHERE execution_id = $1 AND stage_index = $2",
    )
    .bind(execution_id)
    .bind(stage as i32)
    .fetch_optional(conn)
    .await?)
}

/// The dependencies that arrived at the join of stage `stage`, by name, each with the
/// group whose output it passes on (`None`: the execution input).
pub(crate) async fn arrived(
    conn: &mut PgConnection,
    execution_id: ExecutionId,
    stage: usize,
) -> Result<Vec<(String, Option<GroupId>)>> {
    Ok(super::query_as(
        "SELECT a.key, (a.value #>> '{}')::uuid
           FROM confluo.stage_join j, jsonb_each(j.arrived) a
          WHERE j.execution_id = $1 AND j.stage_index = $2
          ORDER BY a.key",
    )
    .bind(execution_id)
    .bind(stage as i32)
    .fetch_all(conn)
    .await?)
}
