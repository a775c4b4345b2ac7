//! What happened lately, read in one pass over each table: tasks by status, members
//! finished per minute, and how long fired groups took to hand over to the next stage.

use chrono::{DateTime, Utc};
use sqlx::PgConnection;

use crate::error::Result;

/// Tasks by status and, for those finished within `window_secs`, their minute (NULL
/// otherwise): one sequential pass over the task table.
pub(crate) async fn tasks_by_status_and_minute(
    conn: &mut PgConnection,
    window_secs: f64,
) -> Result<Vec<(String, Option<DateTime<Utc>>, i64)>> {
    Ok(super::query_as(
        "SELECT status,
                CASE WHEN finished_at >= now() - make_interval(secs => $1)
                     THEN date_trunc('minute', finished_at) END AS minute,
                count(*)
           FROM confluo.task_all
          GROUP BY 1, 2",
    )
    .bind(window_secs)
    .fetch_all(conn)
    .await?)
}

/// Of the groups fired within `window_secs` whose next stage (the one whose input they
/// are) was claimed: how many, how
/// many of those were claimed in the firing transaction itself (the same `now()`), and
/// the 50th and 95th percentiles and the maximum, in seconds, of the time from the
/// firing to the first claim of a member of the next stage.
pub(crate) async fn hand_over_seconds(
    conn: &mut PgConnection,
    window_secs: f64,
) -> Result<(i64, i64, Option<f64>, Option<f64>, Option<f64>)> {
    let sql = format!(
        "SELECT count(*), count(*) FILTER (WHERE seconds = 0),
                percentile_cont(0.5) WITHIN GROUP (ORDER BY seconds),
                percentile_cont(0.95) WITHIN GROUP (ORDER BY seconds),
                max(seconds)
           FROM (SELECT extract(epoch FROM
                          (SELECT min(t.started_at) FROM confluo.task_all t WHERE t.group_id = n.id)
                          - g.fired_at)::float8 AS seconds
                   FROM confluo.stage_group g
                   JOIN confluo.stage_group n
                     ON n.execution_id = g.execution_id AND {} = g.stage_index
                  WHERE g.fired_at >= now() - make_interval(secs => $1)) AS hand_overs
          WHERE seconds IS NOT NULL",
        super::groups::input_stage_of("n")
    );
    Ok(super::query_as(&sql)
        .bind(window_secs)
        .fetch_one(conn)
        .await?)
}
