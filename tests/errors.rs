//! Errors a person can act on: an unreachable server is named at once with the reason, an
//! unmigrated database says to migrate, a bad URL is refused without repeating its
//! password, and each message is said once.

mod common;

use std::time::{Duration, Instant};

use common::TestDb;
use confluo::{ConnectBuilder, Engine, Error, ListFilter};

/// The whole chain, as `anyhow` prints it with `{:#}`.
fn chain(error: Error) -> String {
    format!("{:#}", anyhow::Error::from(error))
}

#[tokio::test]
async fn an_unreachable_server_is_named_at_once_with_the_reason() {
    let started = Instant::now();
    let error = Engine::connect("postgres://postgres@127.0.0.1:1/postgres")
        .await
        .expect_err("nothing listens on port 1");
    // sqlx alone retried until its 30 s acquire time-out and said `PoolTimedOut`.
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "took {:?}",
        started.elapsed()
    );
    assert!(matches!(error, Error::Connect(_)), "{error:?}");
    let text = chain(error);
    assert!(
        text.starts_with(
            "cannot connect to PostgreSQL at 127.0.0.1:1/postgres: connection refused"
        ),
        "{text}"
    );
}

#[tokio::test]
async fn a_missing_database_and_a_bad_url_say_what_to_fix() {
    let db = TestDb::new(1).await;
    let missing = Engine::connect_with(db.options().database("confluo_no_such_database"))
        .await
        .expect_err("no such database");
    let text = chain(missing);
    assert!(
        text.contains("database \"confluo_no_such_database\" does not exist")
            && text.contains("CREATE DATABASE"),
        "{text}"
    );
    let bad = Engine::connect("postgres://app:hunter2@db.example.com:not-a-port/app")
        .await
        .expect_err("not a URL");
    assert!(matches!(bad, Error::InvalidDatabaseUrl { .. }), "{bad:?}");
    let text = chain(bad);
    assert!(
        !text.contains("hunter2"),
        "the password is not repeated: {text}"
    );
    assert!(
        text.contains("postgres://user:password@host:port/database"),
        "{text}"
    );
}

#[tokio::test]
async fn an_unmigrated_database_says_to_migrate_once() {
    let db = TestDb::new(1).await;
    sqlx::query("DROP SCHEMA confluo CASCADE")
        .execute(&db.pool)
        .await
        .unwrap();
    let engine = Engine::connect_with(db.options()).await.unwrap();
    let error = engine
        .list(&ListFilter::default())
        .await
        .expect_err("no schema");
    assert!(matches!(error, Error::NotMigrated { .. }), "{error:?}");
    let text = chain(error);
    assert!(text.contains("run `confluo migrate`"), "{text}");
    assert_eq!(
        text.matches("does not exist").count(),
        1,
        "said once: {text}"
    );
    engine.migrate().await.unwrap();
    engine.list(&ListFilter::default()).await.expect("migrated");
}

#[tokio::test]
async fn connect_builder_sets_pool_size_and_application_name() {
    let db = TestDb::new(1).await;
    let engine = ConnectBuilder::from_options(db.options())
        .max_connections(3)
        .application_name("billing-worker")
        .connect()
        .await
        .unwrap();
    assert_eq!(engine.pool().options().get_max_connections(), 3);
    let name: String = sqlx::query_scalar("SELECT current_setting('application_name')")
        .fetch_one(engine.pool())
        .await
        .unwrap();
    assert_eq!(name, "billing-worker");
    let level: String = sqlx::query_scalar("SHOW default_transaction_isolation")
        .fetch_one(engine.pool())
        .await
        .unwrap();
    assert_eq!(level, "read committed", "pinned, as Engine::connect does");
}
