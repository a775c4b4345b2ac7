//! The auditor that runs by itself: a worker's housekeeping finds a real stall and moves
//! it on with no one asking, and says so (`Engine::auditor`); a round audits a bounded
//! slice of the running executions and goes round them all; one worker at a time runs a
//! round, however many ask together.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{quick_worker, TestDb, WAIT};
use confluo::{ExecutionStatus, FanInStrategy, Stage, TaskError, Workflow};
use serde_json::json;
use tokio::sync::Barrier;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_finds_a_stall_by_itself_moves_it_on_and_says_so() {
    let db = TestDb::new(12).await;
    db.register(
        &Workflow::new("stalls", 1)
            .stage(Stage::map("member").fan_in(FanInStrategy::NaiveRecount))
            .step("after"),
    )
    .await;
    let stalled = common::naive_stall(&db, "stalls").await;
    assert!(!db.engine.doctor().await.unwrap().is_healthy());
    let before = db.engine.auditor().await.unwrap();
    assert_eq!((before.rounds, before.found), (0, 0), "{before:?}");
    assert!(before.last_round_at.is_none());

    // No one calls repair: the worker's housekeeping does.
    let worker = quick_worker(&db.engine, |w| {
        w.audit_every(Some(Duration::from_millis(200)))
            .partial(true)
            .lease(Duration::from_secs(2))
            .handler("stalls", "after", |_| async {
                Ok::<_, TaskError>(json!("moved on"))
            })
    })
    .await;
    let done = db.engine.wait(stalled, WAIT).await.unwrap();
    assert_eq!(done.status, ExecutionStatus::Completed, "{done:?}");
    assert_eq!(done.output, Some(json!("moved on")));
    worker.shutdown().await;

    let status = db.engine.auditor().await.unwrap();
    assert!(status.rounds >= 1, "{status:?}");
    assert!(status.found >= 1 && status.repaired >= 1, "{status:?}");
    assert!(status.unrepaired.is_empty(), "{status:?}");
    assert!(status.last_round_at.is_some(), "{status:?}");
    assert!(db.engine.doctor().await.unwrap().is_healthy());
}

#[tokio::test]
async fn a_round_audits_a_bounded_slice_and_goes_round_them_all() {
    let db = TestDb::new(6).await;
    db.register(
        &Workflow::new("slices", 1)
            .stage(Stage::map("member").fan_in(FanInStrategy::NaiveRecount))
            .step("after"),
    )
    .await;
    // Four running executions, one of them stalled.
    let stalled = common::naive_stall(&db, "slices").await;
    for _ in 0..3 {
        db.engine.start("slices", &[1]).await.unwrap();
    }
    let mut audited = Vec::new();
    let mut found = 0;
    for _ in 0..3 {
        let round = db
            .engine
            .audit_round(Duration::ZERO, 2)
            .await
            .unwrap()
            .expect("a round is due every time with an interval of zero");
        audited.push(round.audited);
        found += round.found;
        assert!(round.unrepaired.is_empty(), "{round:?}");
    }
    // Two, two, then the slice after the last: nothing left (or the repaired execution
    // gone from the running ones); every running execution was audited once.
    assert_eq!(&audited[..2], [2, 2], "{audited:?}");
    assert_eq!(found, 1, "{audited:?}");
    assert!(db.engine.doctor().await.unwrap().is_healthy());
    let moved: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM confluo.stage_group WHERE execution_id = $1 AND stage_index = 1",
    )
    .bind(stalled)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(moved, 1);
    let status = db.engine.auditor().await.unwrap();
    assert_eq!((status.rounds, status.found, status.repaired), (3, 1, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_worker_at_a_time_runs_a_round() {
    let db = TestDb::new(10).await;
    for attempt in 0..5 {
        let barrier = Arc::new(Barrier::new(4));
        let mut handles = Vec::new();
        for _ in 0..4 {
            let (engine, barrier) = (db.engine.clone(), barrier.clone());
            handles.push(tokio::spawn(async move {
                drop(engine.pool().acquire().await.unwrap());
                barrier.wait().await;
                engine
                    .audit_round(Duration::from_secs(3600), 100)
                    .await
                    .unwrap()
            }));
        }
        let mut ran = 0;
        for h in handles {
            ran += usize::from(h.await.unwrap().is_some());
        }
        // The first attempt finds the round due (never run); an hour has not passed since.
        assert_eq!(ran, usize::from(attempt == 0), "attempt {attempt}");
    }
    assert_eq!(db.engine.auditor().await.unwrap().rounds, 1);
}
