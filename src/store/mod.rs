//! Every SQL statement confluo runs lives under this module, grouped by table.
//!
//! All statements name the `confluo` schema, so the caller's `search_path` never matters.
//! Queries are checked at run time (no compile-time database), so the crate builds
//! anywhere.

use sqlx::{Connection, PgConnection, PgPool};

use crate::error::Result;

pub(crate) mod audit;
pub(crate) mod completions;
pub(crate) mod dead_letters;
pub(crate) mod executions;
pub(crate) mod groups;
pub(crate) mod tasks;
pub(crate) mod workflows;

/// The schema that holds confluo's tables, and sqlx's migration bookkeeping.
pub(crate) const SCHEMA: &str = "confluo";

/// Channel notified (at commit) whenever tasks become claimable.
pub(crate) const TASKS_CHANNEL: &str = "confluo_tasks";

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

/// Applies the embedded migrations. Idempotent, and safe when several processes run it at
/// once: a session advisory lock serializes them, and sqlx's bookkeeping table lives in
/// the `confluo` schema rather than the application's.
pub(crate) async fn migrate(pool: &PgPool) -> Result<()> {
    // A dedicated connection: its search_path is changed, and must not return to the pool.
    let mut conn = PgConnection::connect_with(&pool.connect_options()).await?;
    let result = migrate_on(&mut conn).await;
    let _ = conn.close().await;
    result
}

async fn migrate_on(conn: &mut PgConnection) -> Result<()> {
    // Any constant key will do: it only has to be the same in every process.
    sqlx::query("SELECT pg_advisory_lock(hashtext('confluo.migrate'))")
        .execute(&mut *conn)
        .await?;
    let result = async {
        sqlx::query(&format!("CREATE SCHEMA IF NOT EXISTS {SCHEMA}"))
            .execute(&mut *conn)
            .await?;
        sqlx::query(&format!("SET search_path TO {SCHEMA}"))
            .execute(&mut *conn)
            .await?;
        // `run_direct` is `run` without its `Acquire` bound, whose future is not `Send`
        // (sqlx#1396): with it, `migrate()` could not be spawned.
        MIGRATOR.run_direct(&mut *conn).await?;
        Ok(())
    }
    .await;
    sqlx::query("SELECT pg_advisory_unlock(hashtext('confluo.migrate'))")
        .execute(&mut *conn)
        .await?;
    result
}
