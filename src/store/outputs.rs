//! Reading a block's outputs: bounded (the input of the stage after it, refused past a
//! size) or page by page (any width, bounded memory).

use serde_json::Value;
use sqlx::types::Json;
use sqlx::{FromRow, PgConnection};

use super::groups;
use crate::error::Result;
use crate::ids::ExecutionId;

/// What [`stage_output_within`] found.
pub(crate) enum Bounded {
    /// The stage's output, as the next stage sees it.
    Output(Value),
    /// The stage is a block whose members' outputs take `stored` bytes as stored, more
    /// than the limit: nothing was aggregated.
    TooLarge { stored: i64 },
    /// The stage was not entered.
    Missing,
}

/// The output of an execution's stage, as [`groups::stage_output`] builds it, unless the
/// stage is a block whose members' outputs take more than `limit` bytes as stored
/// (`pg_column_size`, after PostgreSQL's compression); then nothing is aggregated. One
/// statement: the aggregate is evaluated only when the size allows it.
pub(crate) async fn stage_output_within(
    conn: &mut PgConnection,
    execution_id: ExecutionId,
    stage_index: i32,
    limit: i64,
) -> Result<Bounded> {
    let sql = format!(
        "WITH g AS (
            SELECT id, kind, execution_id FROM confluo.stage_group
             WHERE execution_id = $1 AND stage_index = $2
         ), size AS (
            -- Per group (a subquery on its id), so that both tables are read by their
            -- (group_id, item_index) index whatever their statistics.
            SELECT CASE WHEN g.kind IN ('step', 'signal') THEN 0
                        ELSE COALESCE((SELECT sum(pg_column_size(t.output))
                                         FROM confluo.task_all t WHERE t.group_id = g.id), 0)
                   END::int8 AS stored
              FROM g
         )
         SELECT size.stored,
                CASE WHEN size.stored > $3 THEN NULL
                     ELSE ({aggregate}) END AS output
           FROM g, size",
        aggregate = groups::output_expression()
    );
    let row: Option<(i64, Option<Value>)> = super::query_as(&sql)
        .bind(execution_id)
        .bind(stage_index)
        .bind(limit)
        .fetch_optional(conn)
        .await?;
    Ok(match row {
        None => Bounded::Missing,
        Some((stored, None)) if stored > limit => Bounded::TooLarge { stored },
        Some((_, output)) => Bounded::Output(output.unwrap_or(Value::Null)),
    })
}

/// One member of a block, as [`page`] reads it.
#[derive(Debug, FromRow)]
pub(crate) struct MemberOutputRow {
    pub item_index: i32,
    pub handler: String,
    pub status: String,
    pub attempt: i32,
    pub output: Option<Json<Value>>,
    pub error: Option<String>,
}

/// Up to `limit` members of an execution's stage with an item index above `after`, in
/// item order, with their outputs: a range of the `(group_id, item_index)` index, so each
/// page costs the same however wide the group.
pub(crate) async fn page(
    conn: &mut PgConnection,
    execution_id: ExecutionId,
    stage_index: i32,
    after: i32,
    limit: i64,
) -> Result<Vec<MemberOutputRow>> {
    Ok(super::query_as(
        "SELECT t.item_index, t.handler, t.status, t.attempt, t.output,
                t.errors -> -1 ->> 'error' AS error
           FROM confluo.task_all t
          WHERE t.group_id = (SELECT g.id FROM confluo.stage_group g
                               WHERE g.execution_id = $1 AND g.stage_index = $2)
            AND t.item_index > $3
          ORDER BY t.item_index
          LIMIT $4",
    )
    .bind(execution_id)
    .bind(stage_index)
    .bind(after)
    .bind(limit)
    .fetch_all(conn)
    .await?)
}

/// Whether an execution entered its stage `stage_index`.
pub(crate) async fn stage_entered(
    conn: &mut PgConnection,
    execution_id: ExecutionId,
    stage_index: i32,
) -> Result<bool> {
    Ok(super::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM confluo.stage_group
                         WHERE execution_id = $1 AND stage_index = $2)",
    )
    .bind(execution_id)
    .bind(stage_index)
    .fetch_one(conn)
    .await?)
}
