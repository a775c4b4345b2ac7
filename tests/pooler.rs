//! An engine told that its pool goes through a transaction pooler
//! (`EngineBuilder::transaction_pooler`): unnamed statements, each inside a READ COMMITTED
//! transaction, no `LISTEN` and no migrations through it. With `CONFLUO_TEST_PGBOUNCER`
//! these engines go through PgBouncer in transaction mode; without, they use the same
//! statements on direct connections (which must be correct too: the mode is
//! process-wide).

mod common;

use std::time::Duration;

use common::{fired, TestDb, STRATEGIES, WAIT};
use confluo::{
    Engine, Error, ExecutionStatus, MapResults, Notifications, Stage, TaskError, Workflow,
};
use serde_json::json;
use sqlx::{ConnectOptions, Row};

/// An engine in pooler mode on `db` with a pool of `size`: through PgBouncer when the run
/// goes through it, else on direct connections.
async fn pooler_engine(db: &TestDb, size: u32) -> Engine {
    let pool = db.new_pool(size).await;
    if TestDb::through_pgbouncer() {
        common::engine(pool)
    } else {
        Engine::builder(pool).transaction_pooler().build()
    }
}

/// Transactions PgBouncer has passed to the server for `db`'s database so far, when the
/// run goes through it.
async fn transactions_through_pgbouncer(db: &TestDb) -> Option<i64> {
    let console = common::pgbouncer_console()?;
    let mut conn = console.connect().await.expect("PgBouncer's admin console");
    // The admin console speaks the simple query protocol only.
    let rows = sqlx::raw_sql("SHOW STATS")
        .fetch_all(&mut conn)
        .await
        .expect("SHOW STATS");
    let count = rows
        .iter()
        .find(|row| row.get::<String, _>("database") == db.name)
        // A NUMERIC in PgBouncer's text: read as it is sent.
        .map(|row| {
            row.try_get_unchecked::<&str, _>("total_xact_count")
                .expect("total_xact_count")
                .parse::<i64>()
                .expect("total_xact_count: a number")
        })
        .unwrap_or(0);
    Some(count)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_wide_map_runs_to_the_end_on_small_pools_and_no_statement_is_named() {
    let db = TestDb::new(4).await;
    let before = transactions_through_pgbouncer(&db).await;
    let engine = pooler_engine(&db, 2).await;
    assert!(engine.through_transaction_pooler());
    engine
        .register(
            &Workflow::new("wide", 1)
                .stage(Stage::map("square"))
                .step("sum"),
        )
        .await
        .unwrap();
    let mut workers = Vec::new();
    for _ in 0..3 {
        let engine = pooler_engine(&db, 2).await;
        workers.push(
            common::quick_worker(&engine, |w| {
                w.handler("wide", "square", |t| async move {
                    let n: u64 = t.input_as()?;
                    Ok::<_, TaskError>(n * n)
                })
                .handler("wide", "sum", |t| async move {
                    let squares: MapResults<u64> = t.input_as()?;
                    assert!(squares.failed.is_empty(), "{:?}", squares.failed);
                    Ok::<_, TaskError>(squares.outputs.iter().sum::<u64>())
                })
            })
            .await,
        );
    }
    let items: Vec<u64> = (0..500).collect();
    let id = engine.start("wide", &items).await.unwrap();
    let done = engine.wait(id, WAIT).await.unwrap();
    for worker in workers {
        worker.shutdown().await;
    }
    assert_eq!(done.status, ExecutionStatus::Completed);
    assert_eq!(
        done.output,
        Some(json!(items.iter().map(|n| n * n).sum::<u64>()))
    );
    let sums: i64 = sqlx::query_scalar("SELECT count(*) FROM confluo.task WHERE handler = 'sum'")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(sums, 1, "the next stage was dispatched exactly once");
    // No statement was prepared by name on the server connections the engines used (a
    // named one would collide behind PgBouncer 1.18). Asked in the simple protocol, which
    // prepares nothing itself; through PgBouncer, on one of the database's server
    // connections, which only these engines ever used.
    let mut conn = engine.pool().acquire().await.unwrap();
    let named: i64 = sqlx::raw_sql("SELECT count(*) FROM pg_prepared_statements")
        .fetch_one(&mut *conn)
        .await
        .unwrap()
        .get(0);
    assert_eq!(named, 0, "a statement was prepared by name");
    drop(conn);
    if let (Some(before), Some(after)) = (before, transactions_through_pgbouncer(&db).await) {
        assert!(
            after > before,
            "the engines' transactions did not go through PgBouncer ({before} then {after})"
        );
    }
}

/// Every statement pins READ COMMITTED itself: on a database whose sessions default to
/// SERIALIZABLE, simultaneous completions on an unpinned pool fire their group once, with
/// no serialization failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn simultaneous_finishes_fire_once_on_a_database_that_defaults_to_serializable() {
    const K: usize = 8;
    let db = TestDb::defaulting_to("serializable", 2).await;
    let pool = db.unpinned_pool(K as u32 + 1, "serializable").await;
    let engine = if TestDb::through_pgbouncer() {
        common::engine(pool)
    } else {
        Engine::builder(pool).transaction_pooler().build()
    };
    for strategy in STRATEGIES {
        let name = format!("pair-{strategy}");
        engine
            .register(
                &Workflow::new(&name, 1)
                    .stage(Stage::map("member").fan_in(strategy))
                    .step("after"),
            )
            .await
            .unwrap();
        let items: Vec<usize> = (0..K).collect();
        let execution = engine.start(&name, &items).await.unwrap();
        let tasks = engine
            .claim_for("test", &[(&name, "member")], K, Duration::from_secs(300))
            .await
            .unwrap();
        assert_eq!(tasks.len(), K);
        let (outcomes, ()) = common::race_completions(&engine, tasks, json!(1), |_| async {}).await;
        assert_eq!(fired(&outcomes), 1, "{strategy}: {outcomes:?}");
        let next: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM confluo.task WHERE execution_id = $1 AND stage_index = 1",
        )
        .bind(execution)
        .fetch_one(&db.pool)
        .await
        .unwrap();
        assert_eq!(next, 1, "{strategy}: the next stage was dispatched once");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrating_through_a_pooler_is_refused_with_the_way_out() {
    let db = TestDb::new(2).await;
    let engine = pooler_engine(&db, 1).await;
    let refused = engine.migrate().await.unwrap_err();
    assert!(
        matches!(refused, Error::NeedsDirectConnection { .. }),
        "{refused:?}"
    );
    let message = refused.to_string();
    assert!(
        message.contains("direct connection") && message.contains("confluo migrate"),
        "{message}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_behind_a_pooler_does_not_listen_through_it() {
    let db = TestDb::new(4).await;
    let engine = pooler_engine(&db, 2).await;
    engine
        .register(&Workflow::new("ping", 1).step("pong"))
        .await
        .unwrap();
    let refused = engine
        .worker()
        .notifications(Notifications::Pool)
        .handler("ping", "pong", |_| async { Ok::<_, TaskError>(()) })
        .start()
        .await
        .unwrap_err();
    assert!(
        matches!(refused, Error::NeedsDirectConnection { .. }),
        "{refused:?}"
    );
    assert!(
        refused.to_string().contains("Notifications::Direct"),
        "{refused}"
    );
    // By default it polls, and opens no listener.
    let worker = engine
        .worker()
        .poll_interval(Duration::from_millis(100))
        .handler("ping", "pong", |_| async { Ok::<_, TaskError>(()) })
        .start()
        .await
        .unwrap();
    let id = engine.start("ping", &()).await.unwrap();
    let done = engine.wait(id, WAIT).await.unwrap();
    assert_eq!(done.status, ExecutionStatus::Completed);
    let mut conn = db.direct_options().connect().await.unwrap();
    let listeners: i64 = sqlx::raw_sql(
        "SELECT count(*) FROM pg_stat_activity
          WHERE datname = current_database() AND query LIKE 'LISTEN%'",
    )
    .fetch_one(&mut conn)
    .await
    .unwrap()
    .get(0);
    assert_eq!(listeners, 0, "a worker behind a pooler opened a listener");
    worker.shutdown().await;
}
