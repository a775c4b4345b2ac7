//! A stage's members, as listed: the most urgent first, or page by page in item order.

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::types::Json;
use sqlx::{FromRow, PgConnection};

use crate::error::Result;
use crate::ids::{ExecutionId, TaskId};

/// One member with its execution, stage, input, output and every attempt's error.
#[derive(Debug, Clone, FromRow)]
pub(crate) struct MemberDetailRow {
    #[sqlx(flatten)]
    pub member: MemberListRow,
    pub execution_id: ExecutionId,
    pub stage_index: i32,
    pub input: Option<Json<Value>>,
    pub output: Option<Json<Value>>,
    pub errors: Json<Value>,
}

/// One member of a stage, as listed.
#[derive(Debug, Clone, FromRow)]
pub(crate) struct MemberListRow {
    pub id: TaskId,
    pub item_index: i32,
    pub handler: String,
    pub status: String,
    pub attempt: i32,
    pub reprocessed: i32,
    pub started_at: Option<DateTime<Utc>>,
    pub finished_at: Option<DateTime<Utc>>,
    pub last_error: Option<String>,
}

const COLUMNS: &str = "id, item_index, handler, status, attempt, reprocessed, started_at, \
                       finished_at, errors -> -1 ->> 'error' AS last_error";

/// Up to `limit` members of one stage of an execution: those not completed first, then
/// in item order.
pub(crate) async fn urgent_first(
    conn: &mut PgConnection,
    execution: ExecutionId,
    stage_index: i32,
    limit: i64,
) -> Result<Vec<MemberListRow>> {
    Ok(super::query_as(&format!(
        "SELECT {COLUMNS} FROM confluo.task_all
          WHERE execution_id = $1 AND stage_index = $2
          ORDER BY status = 'completed', item_index
          LIMIT $3"
    ))
    .bind(execution)
    .bind(stage_index)
    .bind(limit)
    .fetch_all(conn)
    .await?)
}

/// Up to `limit` members of one stage after item `after` (all when `None`), in item
/// order, optionally only those in `status`. It walks the group's `(group_id,
/// item_index)` index from `after`: a page costs what it returns (and the rows it skips
/// for a status filter), however wide the group.
pub(crate) async fn page(
    conn: &mut PgConnection,
    execution: ExecutionId,
    stage_index: i32,
    after: Option<i32>,
    status: Option<&str>,
    limit: i64,
) -> Result<Vec<MemberListRow>> {
    Ok(super::query_as(&format!(
        "SELECT {COLUMNS} FROM confluo.task_all
          WHERE group_id = (SELECT id FROM confluo.stage_group
                             WHERE execution_id = $1 AND stage_index = $2)
            AND item_index > $3
            AND ($4::text IS NULL OR status = $4)
          ORDER BY item_index
          LIMIT $5"
    ))
    .bind(execution)
    .bind(stage_index)
    .bind(after.unwrap_or(-1))
    .bind(status)
    .bind(limit)
    .fetch_all(conn)
    .await?)
}

/// One member by its task id, with what [`MemberDetailRow`] holds.
pub(crate) async fn detail(
    conn: &mut PgConnection,
    task: TaskId,
) -> Result<Option<MemberDetailRow>> {
    Ok(super::query_as(&format!(
        "SELECT {COLUMNS}, execution_id, stage_index, input, output, errors
           FROM confluo.task_all WHERE id = $1"
    ))
    .bind(task)
    .fetch_optional(conn)
    .await?)
}
