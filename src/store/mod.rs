//! Every SQL statement confluo runs lives under this module, grouped by table.
//!
//! All statements name the `confluo` schema, so the caller's `search_path` never matters.
//! Queries are checked at run time (no compile-time database), so the crate builds
//! anywhere.
//!
//! # Isolation
//! Every transaction runs at READ COMMITTED ([`begin`], [`begin_on`]), whatever the
//! server's, database's or role's `default_transaction_isolation`; autocommitted
//! statements run at the session's level, which [`Engine::connect`](crate::Engine::connect)
//! pins and a worker checks at start ([`check_isolation`]). The design relies on READ
//! COMMITTED: a statement that waits for a row another transaction holds re-reads the
//! row's latest version when it gets it, and each statement of a transaction sees what
//! committed before it began (the row-lock fan-in re-counts members after taking the
//! execution's lock; under REPEATABLE READ its snapshot would predate that lock and the
//! last two finishers could each miss the other's commit, and neither fire).

use sqlx::{Connection, PgConnection, PgPool, Postgres, Transaction};

use crate::error::{Error, Result};

pub(crate) use statement::{query, query_as, query_scalar, use_unnamed_statements, Executor};

pub(crate) mod activity;
pub(crate) mod audit;
pub(crate) mod auditor;
pub(crate) mod children;
pub(crate) mod dead_letters;
pub(crate) mod executions;
pub(crate) mod fan_in;
pub(crate) mod groups;
pub(crate) mod history;
pub(crate) mod joins;
pub(crate) mod locks;
pub(crate) mod members;
pub(crate) mod notifications;
pub(crate) mod outputs;
pub(crate) mod plans;
pub(crate) mod quorum;
pub(crate) mod signals;
mod statement;
pub(crate) mod tasks;
pub(crate) mod workers;
pub(crate) mod workflows;

/// The schema that holds confluo's tables, and sqlx's migration bookkeeping.
pub(crate) const SCHEMA: &str = "confluo";

/// Channel notified (at commit) whenever tasks become claimable.
pub(crate) const TASKS_CHANNEL: &str = "confluo_tasks";

/// A duration as the milliseconds SQL parameters take, saturating.
pub(crate) fn millis(d: std::time::Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// How every confluo transaction begins.
const BEGIN: &str = "BEGIN ISOLATION LEVEL READ COMMITTED";

/// Begins a READ COMMITTED transaction on a connection of `pool`.
///
/// # Cancel safety
/// Dropped before it returns, no transaction is left open (sqlx rolls back a transaction
/// it began when its guard is dropped).
pub(crate) async fn begin(pool: &PgPool) -> Result<Transaction<'static, Postgres>> {
    Ok(pool.begin_with(BEGIN).await?)
}

/// Begins a READ COMMITTED transaction on `conn`.
///
/// # Cancel safety
/// As [`begin`].
pub(crate) async fn begin_on(conn: &mut PgConnection) -> Result<Transaction<'_, Postgres>> {
    Ok(conn.begin_with(BEGIN).await?)
}

/// The session setting that pins READ COMMITTED for autocommitted statements, as a
/// connection startup option (whose spaces separate arguments unless escaped).
pub(crate) const READ_COMMITTED_OPTION: (&str, &str) =
    ("default_transaction_isolation", "read\\ committed");

/// Refuses a pool whose connections default to another isolation level than READ
/// COMMITTED (they share the server's, database's and role's defaults, so one tells).
pub(crate) async fn check_isolation(pool: &PgPool) -> Result<()> {
    let found: String = query_scalar("SELECT current_setting('default_transaction_isolation')")
        .fetch_one(pool)
        .await?;
    if found == "read committed" {
        Ok(())
    } else {
        Err(Error::IsolationNotReadCommitted { found })
    }
}

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

/// Applies the embedded migrations. Idempotent, and safe when several processes run it at
/// once: a session advisory lock serializes them, and sqlx's bookkeeping table lives in
/// the `confluo` schema rather than the application's.
/// Whether the server answers with this build's schema: a statement that names the
/// newest migration's column and reads no row (an older schema fails it, and the caller
/// gets [`Error::NotMigrated`]).
pub(crate) async fn probe(pool: &PgPool) -> Result<()> {
    query("SELECT claim FROM confluo.notification LIMIT 0")
        .execute(pool)
        .await?;
    Ok(())
}

pub(crate) async fn migrate(pool: &PgPool) -> Result<()> {
    // A dedicated connection: its search_path is changed, and must not return to the pool.
    let mut conn = PgConnection::connect_with(&pool.connect_options()).await?;
    let result = migrate_on(&mut conn).await;
    let _ = conn.close().await;
    result
}

async fn migrate_on(conn: &mut PgConnection) -> Result<()> {
    // Any constant key will do: it only has to be the same in every process.
    query("SELECT pg_advisory_lock(hashtext('confluo.migrate'))")
        .execute(&mut *conn)
        .await?;
    let result = async {
        query(&format!("CREATE SCHEMA IF NOT EXISTS {SCHEMA}"))
            .execute(&mut *conn)
            .await?;
        query(&format!("SET search_path TO {SCHEMA}"))
            .execute(&mut *conn)
            .await?;
        // `run_direct` is `run` without its `Acquire` bound, whose future is not `Send`
        // (sqlx#1396): with it, `migrate()` could not be spawned.
        MIGRATOR.run_direct(&mut *conn).await?;
        Ok(())
    }
    .await;
    query("SELECT pg_advisory_unlock(hashtext('confluo.migrate'))")
        .execute(&mut *conn)
        .await?;
    result
}
