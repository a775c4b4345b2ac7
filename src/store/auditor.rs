//! The auditor's own row (`confluo.auditor`, migration 0019): which worker runs the next
//! round, where the last one stopped, and what the rounds found and could not repair.

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::types::Json;
use sqlx::{FromRow, PgConnection};

use crate::error::Result;
use crate::ids::ExecutionId;

/// Claims the next round if the last one was claimed at least `every_ms` ago, in one
/// autocommitted statement: of the workers that ask together, one gets it. Returns where
/// the last round stopped (`Some(None)`: start over), or `None` when the round is not
/// due.
pub(crate) async fn claim_round(
    conn: &mut PgConnection,
    every_ms: i64,
) -> Result<Option<Option<ExecutionId>>> {
    let cursor: Option<Option<ExecutionId>> = super::query_scalar(
        "UPDATE confluo.auditor SET round_at = now()
          WHERE round_at <= now() - make_interval(secs => $1::float8 / 1000)
      RETURNING cursor",
    )
    .bind(every_ms)
    .fetch_optional(conn)
    .await?;
    Ok(cursor)
}

/// The next `limit` running executions after `cursor`, in id order: a round's slice.
pub(crate) async fn slice(
    conn: &mut PgConnection,
    cursor: Option<ExecutionId>,
    limit: i64,
) -> Result<Vec<ExecutionId>> {
    Ok(super::query_scalar(
        "SELECT id FROM confluo.execution
          WHERE status = 'running' AND ($1::uuid IS NULL OR id > $1)
          ORDER BY id LIMIT $2",
    )
    .bind(cursor)
    .bind(limit)
    .fetch_all(conn)
    .await?)
}

/// Records a round: where the next starts (`None`: over), its counts, and what it left
/// unrepaired among the executions it audited (`slice`), in place of what an earlier
/// round had recorded for them (and dropping those of executions no longer running); at
/// most 100 entries are kept, the newest first.
pub(crate) async fn finish_round(
    conn: &mut PgConnection,
    cursor: Option<ExecutionId>,
    slice: &[ExecutionId],
    found: i64,
    repaired: i64,
    unrepaired: &Value,
) -> Result<()> {
    super::query(
        "UPDATE confluo.auditor a
            SET cursor = $1, rounds = a.rounds + 1, found = a.found + $3,
                repaired = a.repaired + $4,
                unrepaired = (
                    SELECT COALESCE(jsonb_agg(x ORDER BY x ->> 'at' DESC), '[]'::jsonb)
                      FROM (SELECT x FROM jsonb_array_elements($5::jsonb) x
                            UNION ALL
                            SELECT x FROM jsonb_array_elements(a.unrepaired) x
                             WHERE NOT ((x ->> 'execution_id')::uuid = ANY($2))
                               -- An execution that ended (a cancel, a repair) is done with.
                               AND EXISTS (SELECT 1 FROM confluo.execution e
                                            WHERE e.id = (x ->> 'execution_id')::uuid
                                              AND e.status = 'running')
                            LIMIT 100) kept)",
    )
    .bind(cursor)
    .bind(slice)
    .bind(found)
    .bind(repaired)
    .bind(Json(unrepaired))
    .execute(conn)
    .await?;
    Ok(())
}

/// The auditor's row.
#[derive(Debug, Clone, FromRow)]
pub(crate) struct AuditorRow {
    /// `None` before the first round.
    pub round_at: Option<DateTime<Utc>>,
    pub rounds: i64,
    pub found: i64,
    pub repaired: i64,
    pub unrepaired: Json<Value>,
}

/// Reads the auditor's row.
pub(crate) async fn get<'e, E>(executor: E) -> Result<AuditorRow>
where
    E: super::Executor<'e>,
{
    Ok(super::query_as(
        "SELECT CASE WHEN round_at = '-infinity' THEN NULL ELSE round_at END AS round_at,
                rounds, found, repaired, unrepaired
           FROM confluo.auditor",
    )
    .fetch_one(executor)
    .await?)
}
