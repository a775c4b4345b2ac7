//! The worker registry: workers register, send heartbeats with what they run and hold,
//! say when they stop, are seen lost when they die without stopping, and age out.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{eventually, TestDb, WAIT};
use confluo::{Engine, TaskError, WorkerInfo, WorkerState, Workflow};
use tokio::sync::Semaphore;

async fn find(engine: &Engine, id: &str) -> Option<WorkerInfo> {
    engine
        .workers()
        .await
        .unwrap()
        .into_iter()
        .find(|w| w.id == id)
}

/// A worker registers with what it is, its heartbeats carry what it runs and holds, and
/// its shutdown marks it stopped.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_registers_beats_and_stops() {
    let db = TestDb::new(8).await;
    db.register(&Workflow::new("slow", 1).map("item").step("after"))
        .await;
    let items: Vec<u32> = (0..20).collect();
    db.engine.start("slow", &items).await.unwrap();
    // Handlers that block until the test lets them go.
    let gate = Arc::new(Semaphore::new(0));
    let g = gate.clone();
    let worker = db
        .engine
        .worker()
        .id("registry-test-worker")
        .concurrency(3)
        .local_queue(4)
        .lease(Duration::from_millis(400)) // a heartbeat every 200 ms
        .handler("slow", "item", move |_| {
            let g = g.clone();
            async move {
                let _permit = g.acquire().await.expect("gate open");
                Ok::<_, TaskError>(())
            }
        })
        .handler("slow", "after", |_| async { Ok::<_, TaskError>(()) })
        .start()
        .await
        .unwrap();
    assert_eq!(worker.id(), "registry-test-worker");

    let registered = find(&db.engine, "registry-test-worker")
        .await
        .expect("registered at start");
    assert_eq!(registered.state, WorkerState::Alive);
    assert_eq!(registered.pid, std::process::id());
    assert_eq!(registered.version, env!("CARGO_PKG_VERSION"));
    assert!(!registered.host.is_empty());
    assert_eq!(registered.concurrency, 3);
    assert_eq!(
        registered.handlers,
        vec![
            ("slow".to_owned(), "after".to_owned()),
            ("slow".to_owned(), "item".to_owned())
        ]
    );
    assert_eq!(registered.stopped_at, None);

    // Three handlers blocked, and the local queue full behind them.
    assert!(
        eventually(WAIT, || async {
            find(&db.engine, "registry-test-worker")
                .await
                .is_some_and(|w| w.running == 3 && w.held == 7)
        })
        .await,
        "a heartbeat reports 3 running and 7 held: {:?}",
        find(&db.engine, "registry-test-worker").await
    );
    let first = find(&db.engine, "registry-test-worker").await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let later = find(&db.engine, "registry-test-worker").await.unwrap();
    assert!(later.last_seen > first.last_seen, "heartbeats keep coming");
    assert_eq!(later.state, WorkerState::Alive);

    gate.add_permits(1_000);
    worker.shutdown().await;
    let stopped = find(&db.engine, "registry-test-worker").await.unwrap();
    assert_eq!(stopped.state, WorkerState::Stopped);
    assert!(stopped.stopped_at.is_some());
    assert_eq!((stopped.running, stopped.held), (0, 0));
}

/// A worker that dies without stopping (its runtime dropped: no shutdown, no last word)
/// is seen lost once three heartbeats are missing; a restart under the same id takes its
/// row over; and rows gone for longer than the retention are deleted by any worker's
/// housekeeping.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_worker_is_lost_then_ages_out() {
    let db = TestDb::new(8).await;
    db.register(&Workflow::new("idle", 1).step("one")).await;
    let options = db.options();
    // A worker on a runtime of its own, dropped as a SIGKILL would end it.
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        runtime.block_on(async move {
            let engine = common::engine(
                sqlx::postgres::PgPoolOptions::new()
                    .max_connections(2)
                    .connect_with(options)
                    .await
                    .unwrap(),
            );
            let worker = engine
                .worker()
                .id("registry-doomed")
                .lease(Duration::from_millis(200))
                .handler("idle", "one", |_| async { Ok::<_, TaskError>(()) })
                .start()
                .await
                .unwrap();
            std::mem::forget(worker);
            tokio::time::sleep(Duration::from_millis(300)).await;
        });
        runtime.shutdown_background();
    })
    .join()
    .unwrap();

    let doomed = find(&db.engine, "registry-doomed")
        .await
        .expect("it registered");
    assert_ne!(
        doomed.state,
        WorkerState::Stopped,
        "it never said it stopped"
    );
    assert!(
        eventually(WAIT, || async {
            find(&db.engine, "registry-doomed")
                .await
                .is_some_and(|w| w.state == WorkerState::Lost)
        })
        .await,
        "no heartbeat for three intervals: lost"
    );

    // Gone for longer than the retention (the clock moved by SQL): the next heartbeat of a
    // live worker deletes the row; its own row stays.
    sqlx::query(
        "UPDATE confluo.worker SET last_seen = now() - interval '2 hours'
          WHERE id = 'registry-doomed'",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let live = db
        .engine
        .worker()
        .id("registry-live")
        .lease(Duration::from_millis(200))
        .handler("idle", "one", |_| async { Ok::<_, TaskError>(()) })
        .start()
        .await
        .unwrap();
    assert!(
        eventually(WAIT, || async {
            find(&db.engine, "registry-doomed").await.is_none()
        })
        .await,
        "aged out"
    );
    assert_eq!(
        find(&db.engine, "registry-live").await.map(|w| w.state),
        Some(WorkerState::Alive)
    );
    live.shutdown().await;

    // A restart under a stopped worker's id takes its row over, alive again.
    let again = db
        .engine
        .worker()
        .id("registry-live")
        .handler("idle", "one", |_| async { Ok::<_, TaskError>(()) })
        .start()
        .await
        .unwrap();
    let row = find(&db.engine, "registry-live").await.unwrap();
    assert_eq!(row.state, WorkerState::Alive);
    assert_eq!(row.stopped_at, None);
    again.shutdown().await;
}
