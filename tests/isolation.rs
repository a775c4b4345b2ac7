//! READ COMMITTED, pinned: confluo's transactions set it whatever the database's default,
//! pools from `Engine::connect_with` and `confluo::read_committed` pin it on their
//! sessions, and a worker refuses a pool whose sessions default to another level, saying
//! how to fix it.
//!
//! The race tests run against a database defaulting to SERIALIZABLE too:
//! `CONFLUO_TEST_ISOLATION=serializable cargo test --test fan_in` (`.ci/run` does).

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{TestDb, WAIT};
use confluo::{Engine, Error, ExecutionStatus, FanInStrategy, Outcome, Stage, TaskError, Workflow};
use serde_json::json;
use sqlx::postgres::PgPoolOptions;
use tokio::sync::Barrier;

async fn serializable_database() -> TestDb {
    TestDb::defaulting_to("serializable", 2).await
}

/// The row-lock fan-in is all transactions: the last two finishers each complete their
/// member, lock the execution, and re-count. On a pool whose sessions default to
/// REPEATABLE READ, unpinned, each re-count read a snapshot from before the other's
/// commit and neither fired (a stall); pinned, exactly one fires, every round.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn row_lock_fan_in_fires_once_when_sessions_default_to_repeatable_read() {
    let db = TestDb::defaulting_to("repeatable read", 2).await;
    let pool = db.unpinned_pool(4, "repeatable read").await;
    let engine = common::engine(pool);
    engine
        .register(
            &Workflow::new("pair", 1)
                .stage(Stage::map("member").fan_in(FanInStrategy::RowLock))
                .step("after"),
        )
        .await
        .unwrap();
    for round in 0..30 {
        let id = engine.start("pair", &[1, 2]).await.unwrap();
        let mut tasks = engine
            .claim("test", 2, Duration::from_secs(60))
            .await
            .unwrap();
        assert_eq!(tasks.len(), 2);
        let barrier = Arc::new(Barrier::new(2));
        let finishers: Vec<_> = tasks
            .drain(..)
            .map(|task| {
                let (engine, barrier) = (engine.clone(), barrier.clone());
                tokio::spawn(async move {
                    drop(engine.pool().acquire().await.unwrap()); // connected before the barrier
                    barrier.wait().await;
                    engine.complete(&task, json!(null)).await.unwrap()
                })
            })
            .collect();
        let mut fired = 0;
        for finisher in finishers {
            if matches!(finisher.await.unwrap(), Outcome::Completed { fired: true }) {
                fired += 1;
            }
        }
        assert_eq!(fired, 1, "round {round}: exactly one finisher fires");
        let after = engine
            .claim("test", 1, Duration::from_secs(60))
            .await
            .unwrap();
        assert_eq!(after.len(), 1, "round {round}: the next stage was entered");
        engine.complete(&after[0], json!(null)).await.unwrap();
        assert_eq!(engine.status(id).await.unwrap(), ExecutionStatus::Completed);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_refuses_a_pool_that_defaults_to_another_isolation() {
    let db = serializable_database().await;
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .connect_with(db.unpinned_options())
        .await
        .unwrap();
    let engine = Engine::new(pool);
    engine
        .register(&Workflow::new("w", 1).step("s"))
        .await
        .unwrap();
    let refused = engine
        .worker()
        .handler("w", "s", |_| async { Ok::<_, TaskError>(()) })
        .start()
        .await
        .unwrap_err();
    assert!(
        matches!(&refused, Error::IsolationNotReadCommitted { found } if found == "serializable"),
        "{refused:?}"
    );
    let message = refused.to_string();
    assert!(
        message.contains("confluo::read_committed") && message.contains("Engine::connect"),
        "the message says what to do: {message}"
    );

    // Doing what it says: the same server, a pool of one's own, pinned.
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .connect_with(confluo::read_committed(db.unpinned_options()))
        .await
        .unwrap();
    let worker = Engine::new(pool)
        .worker()
        .handler("w", "s", |_| async { Ok::<_, TaskError>(()) })
        .start()
        .await
        .unwrap();
    worker.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_with_pins_read_committed_and_runs_workflows() {
    let db = serializable_database().await;
    let engine = Engine::connect_with(db.unpinned_options()).await.unwrap();
    let level: String = sqlx::query_scalar("SHOW transaction_isolation")
        .fetch_one(engine.pool())
        .await
        .unwrap();
    assert_eq!(level, "read committed");
    engine
        .register(&Workflow::new("w", 1).map("fan").step("join"))
        .await
        .unwrap();
    let worker = engine
        .worker()
        .concurrency(4)
        .handler("w", "fan", |_| async { Ok::<_, TaskError>(1) })
        .handler("w", "join", |_| async { Ok::<_, TaskError>(()) })
        .start()
        .await
        .unwrap();
    let items: Vec<u32> = (0..200).collect();
    let id = engine.start("w", &items).await.unwrap();
    let done = engine.wait(id, WAIT).await.unwrap();
    assert_eq!(done.status, ExecutionStatus::Completed);
    worker.shutdown().await;
    engine.pool().close().await;
}
