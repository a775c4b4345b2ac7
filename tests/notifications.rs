//! How a worker hears of new tasks between polls: `LISTEN` on a connection opened like the
//! pool's (the default), on a direct connection (behind PgBouncer), or not at all.
//! With `CONFLUO_TEST_PGBOUNCER`, the pools go through PgBouncer in transaction mode and
//! the direct connection does not.

mod common;

use std::time::{Duration, Instant};

use common::{eventually, TestDb, WAIT};
use confluo::{Notifications, TaskError, Workflow};
use sqlx::ConnectOptions;

/// Long enough that a task found within it was found by a notification, not a poll.
const POLL: Duration = Duration::from_secs(30);

async fn one_step(db: &TestDb, notifications: Notifications) -> confluo::Worker {
    db.register(&Workflow::new("ping", 1).step("pong")).await;
    db.engine
        .worker()
        .notifications(notifications)
        .poll_interval(POLL)
        .handler("ping", "pong", |_| async { Ok::<_, TaskError>(()) })
        .start()
        .await
        .expect("start the worker")
}

/// Sessions of this database whose last statement was the worker's `LISTEN`.
async fn listeners(db: &TestDb) -> i64 {
    let mut conn = db
        .direct_options()
        .connect()
        .await
        .expect("a direct connection");
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity
          WHERE datname = current_database() AND query LIKE 'LISTEN%'",
    )
    .fetch_one(&mut conn)
    .await
    .expect("read pg_stat_activity")
}

/// How long the worker took to finish an execution started while it was idle: a first
/// execution is run to the end (whether a claim or a notification found it), then, once
/// the worker has been idle a moment, a second one is started and timed. By then the
/// worker waits for a wake-up or its poll: its first claims are long over.
async fn time_to_pick_up(db: &TestDb) -> Duration {
    let first = db.engine.start("ping", &()).await.expect("start");
    db.engine
        .wait(first, WAIT)
        .await
        .expect("the first execution ends");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let started = Instant::now();
    let id = db.engine.start("ping", &()).await.expect("start");
    db.engine.wait(id, WAIT).await.expect("the execution ends");
    started.elapsed()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_direct_listener_wakes_the_worker_at_once() {
    let db = TestDb::new(6).await;
    let direct = Box::new(db.direct_options());
    let worker = one_step(&db, Notifications::Direct(direct)).await;
    assert!(
        eventually(WAIT, || async { listeners(&db).await == 1 }).await,
        "the worker's direct listener never showed up"
    );
    let took = time_to_pick_up(&db).await;
    assert!(
        took < POLL / 3,
        "a notification should wake the worker long before its {POLL:?} poll; took {took:?}"
    );
    worker.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_notifications_the_worker_opens_no_listener_and_polls() {
    let db = TestDb::new(6).await;
    db.register(&Workflow::new("ping", 1).step("pong")).await;
    let worker = db
        .engine
        .worker()
        .notifications(Notifications::Off)
        .poll_interval(Duration::from_millis(200))
        .handler("ping", "pong", |_| async { Ok::<_, TaskError>(()) })
        .start()
        .await
        .expect("start the worker");
    let took = time_to_pick_up(&db).await;
    assert_eq!(
        listeners(&db).await,
        0,
        "Notifications::Off opened a listener"
    );
    assert!(took < WAIT, "polling found the task in {took:?}");
    worker.shutdown().await;
}

/// The default listens on a connection opened like the pool's. Through PgBouncer in
/// transaction mode that `LISTEN` is not kept, which is why `Direct` exists: this test
/// only runs without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_listener_wakes_the_worker_at_once() {
    if TestDb::through_pgbouncer() {
        println!("skipped: the pools go through PgBouncer (CONFLUO_TEST_PGBOUNCER)");
        return;
    }
    let db = TestDb::new(6).await;
    let worker = one_step(&db, Notifications::default()).await;
    assert!(
        eventually(WAIT, || async { listeners(&db).await == 1 }).await,
        "the worker's listener never showed up"
    );
    let took = time_to_pick_up(&db).await;
    assert!(took < POLL / 3, "took {took:?}");
    worker.shutdown().await;
}
