//! The `worker` table: the registry of workers and their heartbeats.

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::types::Json;
use sqlx::{FromRow, PgConnection};

use crate::error::Result;

/// A worker as it registers.
pub(crate) struct Registration<'a> {
    pub id: &'a str,
    pub host: &'a str,
    pub pid: i32,
    pub version: &'a str,
    pub handlers: &'a Value,
    pub concurrency: i32,
    pub heartbeat_ms: i64,
}

/// Writes a starting worker's row (a restarted worker that keeps its id takes its row
/// over).
pub(crate) async fn register(conn: &mut PgConnection, w: &Registration<'_>) -> Result<()> {
    super::query(
        "INSERT INTO confluo.worker
                (id, host, pid, version, handlers, concurrency, heartbeat_ms)
         VALUES ($1, $2, $3, $4, $5, $6, $7)
         ON CONFLICT (id) DO UPDATE
            SET host = excluded.host, pid = excluded.pid, version = excluded.version,
                handlers = excluded.handlers, concurrency = excluded.concurrency,
                heartbeat_ms = excluded.heartbeat_ms, running = 0, held = 0,
                started_at = now(), last_seen = now(), stopped_at = NULL",
    )
    .bind(w.id)
    .bind(w.host)
    .bind(w.pid)
    .bind(w.version)
    .bind(Json(w.handlers))
    .bind(w.concurrency)
    .bind(w.heartbeat_ms)
    .execute(conn)
    .await?;
    Ok(())
}

/// A heartbeat: what the worker runs and holds now; the same statement deletes the rows
/// of workers stopped or silent for longer than `retention_ms`. False when the worker's
/// own row is gone (deleted by an operator, or aged out while the worker could not reach
/// the database).
pub(crate) async fn heartbeat(
    conn: &mut PgConnection,
    id: &str,
    running: i32,
    held: i32,
    retention_ms: i64,
) -> Result<bool> {
    let rows = super::query(
        "WITH aged_out AS (
            DELETE FROM confluo.worker
             WHERE last_seen < now() - $4 * interval '1 millisecond' AND id <> $1
         )
         UPDATE confluo.worker SET last_seen = now(), running = $2, held = $3
          WHERE id = $1 AND stopped_at IS NULL",
    )
    .bind(id)
    .bind(running)
    .bind(held)
    .bind(retention_ms)
    .execute(conn)
    .await?
    .rows_affected();
    Ok(rows == 1)
}

/// Marks a worker stopped.
pub(crate) async fn stopped(conn: &mut PgConnection, id: &str) -> Result<()> {
    super::query(
        "UPDATE confluo.worker SET stopped_at = now(), last_seen = now(), running = 0, held = 0
          WHERE id = $1",
    )
    .bind(id)
    .execute(conn)
    .await?;
    Ok(())
}

/// A row of the registry, with its state as the server's clock sees it.
#[derive(Debug, Clone, FromRow)]
pub(crate) struct WorkerRow {
    pub id: String,
    pub host: String,
    pub pid: i32,
    pub version: String,
    pub handlers: Json<Value>,
    pub concurrency: i32,
    pub running: i32,
    pub held: i32,
    pub started_at: DateTime<Utc>,
    pub last_seen: DateTime<Utc>,
    pub stopped_at: Option<DateTime<Utc>>,
    /// `alive`, `lost` (no heartbeat for three intervals) or `stopped`.
    pub state: String,
}

/// Every registered worker: alive first, then lost, then stopped; by id within each.
pub(crate) async fn list(conn: &mut PgConnection) -> Result<Vec<WorkerRow>> {
    Ok(super::query_as(
        "SELECT id, host, pid, version, handlers, concurrency, running, held, started_at,
                last_seen, stopped_at, state
           FROM confluo.worker w
          CROSS JOIN LATERAL (SELECT CASE
                    WHEN w.stopped_at IS NOT NULL THEN 'stopped'
                    WHEN w.last_seen < now() - 3 * w.heartbeat_ms * interval '1 millisecond'
                    THEN 'lost'
                    ELSE 'alive' END AS state) s
          ORDER BY array_position(ARRAY['alive', 'lost', 'stopped'], state), id",
    )
    .fetch_all(conn)
    .await?)
}
