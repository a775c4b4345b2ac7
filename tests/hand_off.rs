//! A batch of acknowledgements that fires a group claims the next stage for its worker in
//! the same transaction (no notification, no claim round trip), within the worker's room
//! and only for the handlers it serves.

mod common;

use common::{TestDb, WAIT};
use confluo::{ExecutionStatus, TaskError, Workflow};

/// One worker serving both stages: every second stage was claimed by it in the
/// transaction that created it (the claim's `started_at` is that transaction's `now()`).
/// One execution at a time, so that no claim of the worker's own fetchers holds its room
/// when the group fires (then the next stage is left to them: see the README).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_firing_batch_claims_the_next_stage_for_its_worker() {
    let db = TestDb::new(8).await;
    db.register(&Workflow::new("relay", 1).map("fan").step("join"))
        .await;
    let worker = db
        .engine
        .worker()
        .concurrency(4)
        // Woken by notifications only: no poll's claim can hold the room at a fire.
        .notifications(db.listening())
        .poll_interval(std::time::Duration::from_secs(60))
        .handler("relay", "fan", |_| async { Ok::<_, TaskError>(1) })
        .handler("relay", "join", |_| async { Ok::<_, TaskError>(()) })
        .start()
        .await
        .unwrap();
    for width in [1usize, 10, 100] {
        let items: Vec<usize> = (0..width).collect();
        let id = db.engine.start("relay", &items).await.unwrap();
        let done = db.engine.wait(id, WAIT).await.unwrap();
        assert_eq!(done.status, ExecutionStatus::Completed);
    }
    let joins: Vec<(String, bool)> = sqlx::query_as(
        "SELECT worker_id, started_at = created_at FROM confluo.task WHERE handler = 'join'",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(joins.len(), 3);
    for (worker_id, in_firing_transaction) in joins {
        assert_eq!(worker_id, worker.id());
        assert!(
            in_firing_transaction,
            "claimed by the transaction that fired"
        );
    }
    worker.shutdown().await;
}

/// A worker that does not serve the next stage does not claim it: the worker that does
/// runs it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_next_stage_goes_only_to_a_worker_that_serves_it() {
    let db = TestDb::new(8).await;
    db.register(&Workflow::new("relay", 1).map("fan").step("join"))
        .await;
    let fan = db
        .engine
        .worker()
        .partial(true)
        .concurrency(4)
        .handler("relay", "fan", |_| async { Ok::<_, TaskError>(1) })
        .start()
        .await
        .unwrap();
    let join = db
        .engine
        .worker()
        .partial(true)
        .poll_interval(std::time::Duration::from_millis(50))
        .handler("relay", "join", |_| async { Ok::<_, TaskError>(()) })
        .start()
        .await
        .unwrap();
    let items: Vec<usize> = (0..20).collect();
    let id = db.engine.start("relay", &items).await.unwrap();
    let done = db.engine.wait(id, WAIT).await.unwrap();
    assert_eq!(done.status, ExecutionStatus::Completed);
    let (fan_by, join_by): (Vec<String>, String) = sqlx::query_as(
        "SELECT (SELECT array_agg(DISTINCT worker_id) FROM confluo.task WHERE handler = 'fan'),
                (SELECT worker_id FROM confluo.task WHERE handler = 'join')",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(fan_by, vec![fan.id().to_owned()]);
    assert_eq!(join_by, join.id());
    fan.shutdown().await;
    join.shutdown().await;
}
