//! The auditor: it finds what should never exist (a real naive stall, counters that
//! disagree, a stalled execution), repairs it exactly once, is idempotent, and finds
//! nothing on a healthy database even while workers run.

mod common;

use std::time::Duration;

use common::TestDb;
use confluo::{
    ClaimedTask, Engine, ExecutionStatus, FanInStrategy, Outcome, Stage, TaskError, Workflow,
};
use serde_json::json;

async fn wide(db: &TestDb, strategy: FanInStrategy) -> String {
    let name = format!("audit-{strategy}");
    db.register(
        &Workflow::new(&name, 1)
            .stage(Stage::map("member").fan_in(strategy))
            .step("after"),
    )
    .await;
    name
}

async fn claim(engine: &Engine, n: usize) -> Vec<ClaimedTask> {
    let mut tasks = engine
        .claim("test", n, Duration::from_secs(300))
        .await
        .unwrap();
    assert_eq!(tasks.len(), n);
    tasks.sort_by_key(|t| t.item_index());
    tasks
}

async fn next_stage_groups(db: &TestDb, id: confluo::ExecutionId) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM confluo.stage_group WHERE execution_id = $1 AND stage_index = 1",
    )
    .bind(id)
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

/// A real stall, made by the naive re-count under simultaneous finish, is found and
/// repaired: the next stage is dispatched once, and repairing again changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn finds_and_repairs_a_real_naive_stall_exactly_once() {
    let db = TestDb::new(10).await;
    let wf = wide(&db, FanInStrategy::NaiveRecount).await;
    let stalled = common::naive_stall(&db, &wf).await;
    assert_eq!(next_stage_groups(&db, stalled).await, 0);

    let diagnosis = db.engine.doctor().await.unwrap();
    assert_eq!(diagnosis.unfired_groups.len(), 1, "{diagnosis:?}");
    assert_eq!(diagnosis.unfired_groups[0].execution_id, stalled);
    assert!(diagnosis.counter_mismatches.is_empty() && diagnosis.stalled_executions.is_empty());

    let repairs = db.engine.repair().await.unwrap();
    assert_eq!(repairs.groups_fired, 1);
    assert_eq!(next_stage_groups(&db, stalled).await, 1);
    let again = db.engine.repair().await.unwrap();
    assert_eq!((again.groups_fired, again.found.len()), (0, 0));
    assert_eq!(next_stage_groups(&db, stalled).await, 1);

    // The repaired execution runs to the end.
    let after = claim(&db.engine, 1).await;
    db.engine.complete(&after[0], json!("done")).await.unwrap();
    assert_eq!(
        db.engine.status(stalled).await.unwrap(),
        ExecutionStatus::Completed
    );
}

/// Counters that disagree with their members (a countdown row, a stripe) are found, and
/// re-counted; the group then fires normally when its members finish.
#[tokio::test]
async fn finds_and_recounts_counters_that_disagree() {
    for strategy in [FanInStrategy::Countdown, FanInStrategy::Striped] {
        let db = TestDb::new(4).await;
        let wf = wide(&db, strategy).await;
        let input: Vec<usize> = (0..40).collect();
        let id = db.engine.start(&wf, &input).await.unwrap();
        let tasks = claim(&db.engine, 40).await;
        for task in &tasks[..10] {
            db.engine.complete(task, json!(1)).await.unwrap();
        }
        // Corrupt: the group's row (countdown) or its first stripe (striped) gains one.
        let corrupted = match strategy {
            FanInStrategy::Striped => {
                "UPDATE confluo.group_stripe s SET remaining = s.remaining + 1
                   FROM confluo.stage_group g
                  WHERE g.id = s.group_id AND g.execution_id = $1 AND s.stripe = 0"
            }
            _ => {
                "UPDATE confluo.stage_group SET remaining = remaining + 1
                  WHERE execution_id = $1 AND stage_index = 0"
            }
        };
        sqlx::query(corrupted)
            .bind(id)
            .execute(&db.pool)
            .await
            .unwrap();

        let diagnosis = db.engine.doctor().await.unwrap();
        assert_eq!(
            diagnosis.counter_mismatches.len(),
            1,
            "{strategy}: {diagnosis:?}"
        );
        let m = &diagnosis.counter_mismatches[0];
        assert_eq!(m.counter, m.expected + 1);
        assert_eq!(m.stripe.is_some(), strategy == FanInStrategy::Striped);

        let repairs = db.engine.repair().await.unwrap();
        assert_eq!((repairs.counters_fixed, repairs.groups_fired), (1, 0));
        assert!(db.engine.doctor().await.unwrap().is_healthy());

        let mut fired = 0;
        for task in &tasks[10..] {
            let outcome = db.engine.complete(task, json!(1)).await.unwrap();
            fired += usize::from(matches!(outcome, Outcome::Completed { fired: true }));
        }
        assert_eq!(fired, 1, "{strategy}: the re-counted group fires once");
        assert_eq!(next_stage_groups(&db, id).await, 1);
        assert!(db.engine.doctor().await.unwrap().is_healthy());
    }
}

/// A group that fired without its next stage (as a crash between two transactions would
/// leave it, in engines that split them) is a stalled execution; repair enters the next
/// stage once.
#[tokio::test]
async fn moves_a_stalled_execution_on() {
    let db = TestDb::new(4).await;
    let wf = wide(&db, FanInStrategy::Countdown).await;
    let id = db.engine.start(&wf, &[1, 2, 3]).await.unwrap();
    for task in claim(&db.engine, 3).await {
        db.engine.complete(&task, json!(1)).await.unwrap();
    }
    sqlx::query("DELETE FROM confluo.stage_group WHERE execution_id = $1 AND stage_index = 1")
        .bind(id)
        .execute(&db.pool)
        .await
        .unwrap();

    let diagnosis = db.engine.doctor().await.unwrap();
    assert_eq!(diagnosis.stalled_executions.len(), 1, "{diagnosis:?}");
    assert!(diagnosis.unfired_groups.is_empty());
    let repairs = db.engine.repair().await.unwrap();
    assert_eq!(repairs.executions_advanced, 1);
    assert_eq!(next_stage_groups(&db, id).await, 1);
    assert_eq!(db.engine.repair().await.unwrap().found.len(), 0);
}

/// On a healthy database the auditor finds nothing, even while workers are in the middle
/// of wide blocks; repairing all along changes nothing and breaks nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn finds_nothing_and_repairs_nothing_while_workers_run() {
    let db = TestDb::new(12).await;
    let wf = Workflow::new("busy", 1)
        .stage(Stage::map("member").fan_in(FanInStrategy::Striped))
        .stage(Stage::map("again"))
        .step("sum");
    db.register(&wf).await;
    let worker = common::engine(db.new_pool(6).await)
        .worker()
        .concurrency(16)
        .handler("busy", "member", |t| async move {
            Ok::<_, TaskError>(t.input().clone())
        })
        .handler("busy", "again", |t| async move {
            Ok::<_, TaskError>(t.input().clone())
        })
        .handler("busy", "sum", |t| async move {
            let outputs = t.input()["outputs"].as_array().map_or(0, |a| a.len());
            Ok::<_, TaskError>(json!(outputs))
        })
        .start()
        .await
        .unwrap();
    let mut ids = Vec::new();
    for _ in 0..4 {
        let input: Vec<usize> = (0..300).collect();
        ids.push(db.engine.start("busy", &input).await.unwrap());
    }
    let mut audits = 0;
    loop {
        let repairs = db.engine.repair().await.unwrap();
        assert!(
            repairs.found.is_healthy(),
            "false finding while running: {:?}",
            repairs.found
        );
        audits += 1;
        let mut done = true;
        for id in &ids {
            done &= db.engine.status(*id).await.unwrap() == ExecutionStatus::Completed;
        }
        if done {
            break;
        }
    }
    worker.shutdown().await;
    for id in ids {
        let execution = db.engine.execution(id).await.unwrap();
        assert_eq!(execution.output, Some(json!(300)));
    }
    assert!(audits > 1, "the audit ran while the workers ran");
}
