//! Failures end to end, run by real workers: retries, exhausted attempts (a failed
//! execution, or partial results), fail-fast stages, panics, garbage and hung handlers,
//! graceful shutdown, killed connections.

mod common;

use std::time::Duration;

use common::{fast_retry, quick_worker, TestDb, STRATEGIES, WAIT};
use confluo::{
    ExecutionStatus, FanInStrategy, MapResults, ParallelResults, RetryPolicy, Stage, TaskError,
    Workflow,
};
use serde_json::{json, Value};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn retry_then_success() {
    let db = TestDb::new(10).await;
    db.register(&Workflow::new("flaky", 1).stage(Stage::step("try").retry(fast_retry(5))))
        .await;
    let worker = quick_worker(&db.engine, |w| {
        w.handler("flaky", "try", |t| async move {
            if t.attempt() < 3 {
                Err(TaskError::retryable(format!(
                    "transient failure {}",
                    t.attempt()
                )))
            } else {
                Ok(json!({"attempt": t.attempt()}))
            }
        })
    })
    .await;
    let id = db.engine.start("flaky", &json!({})).await.unwrap();
    let done = db.engine.wait(id, WAIT).await.unwrap();
    worker.shutdown().await;
    assert_eq!(done.status, ExecutionStatus::Completed);
    assert_eq!(done.output, Some(json!({"attempt": 3})));
    let errors: Value =
        sqlx::query_scalar("SELECT errors FROM confluo.task WHERE execution_id = $1")
            .bind(id)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(errors.as_array().unwrap().len(), 2);
    assert_eq!(errors[1]["error"], json!("transient failure 2"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn exhausted_step_fails_the_execution_with_every_error() {
    let db = TestDb::new(10).await;
    db.register(
        &Workflow::new("doomed", 1)
            .stage(Stage::step("charge").retry(fast_retry(3)))
            .step("never"),
    )
    .await;
    let worker = quick_worker(&db.engine, |w| {
        w.handler("doomed", "charge", |t| async move {
            Err::<Value, _>(TaskError::retryable(format!(
                "card declined #{}",
                t.attempt()
            )))
        })
        .handler("doomed", "never", |_| async {
            Ok::<_, TaskError>(json!(null))
        })
    })
    .await;
    let id = db.engine.start("doomed", &json!({})).await.unwrap();
    let done = db.engine.wait(id, WAIT).await.unwrap();
    worker.shutdown().await;
    assert_eq!(done.status, ExecutionStatus::Failed);
    assert!(
        done.error.as_deref().unwrap().contains("card declined #3"),
        "{:?}",
        done.error
    );
    assert_eq!(
        done.stages.len(),
        1,
        "nothing may be dispatched after a failed step"
    );
    assert_eq!(done.dead_letters.len(), 1);
    let errors: Vec<&str> = done.dead_letters[0]
        .errors
        .iter()
        .map(|e| e.error.as_str())
        .collect();
    assert_eq!(
        errors,
        ["card declined #1", "card declined #2", "card declined #3"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn exhausted_parallel_member_passes_partial_results_on() {
    let db = TestDb::new(10).await;
    db.register(
        &Workflow::new("checks", 1)
            .stage(Stage::parallel("verify", ["fraud", "stock", "address"]).retry(fast_retry(2)))
            .step("decide"),
    )
    .await;
    let worker = quick_worker(&db.engine, |w| {
        w.handler("checks", "fraud", |_| async { Ok::<_, TaskError>(json!("clean")) })
            .handler("checks", "stock", |_| async { Err::<Value, _>(TaskError::retryable("warehouse down")) })
            .handler("checks", "address", |t| async move { Ok::<_, TaskError>(t.input()["city"].clone()) })
            .handler("checks", "decide", |t| async move {
                let r: ParallelResults = t.input_as()?;
                Ok::<_, TaskError>(json!({
                    "ok": r.outputs.keys().collect::<Vec<_>>(),
                    "failed": r.failed.iter().map(|f| (f.branch.clone(), f.error.clone(), f.attempts)).collect::<Vec<_>>(),
                }))
            })
    })
    .await;
    let id = db
        .engine
        .start("checks", &json!({"city": "Lyon"}))
        .await
        .unwrap();
    let done = db.engine.wait(id, WAIT).await.unwrap();
    worker.shutdown().await;
    assert_eq!(done.status, ExecutionStatus::Completed);
    assert_eq!(
        done.output,
        Some(json!({"ok": ["address", "fraud"], "failed": [["stock", "warehouse down", 2]]}))
    );
    assert_eq!((done.stages[0].completed, done.stages[0].dead), (2, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn failing_member_can_fail_the_execution_and_cancel_pending_siblings() {
    for strategy in STRATEGIES {
        failing_member_can_fail_the_execution_and_cancel_pending_siblings_with(strategy).await;
    }
}

async fn failing_member_can_fail_the_execution_and_cancel_pending_siblings_with(
    strategy: FanInStrategy,
) {
    let db = TestDb::new(10).await;
    db.register(
        &Workflow::new("strict", 1)
            .stage(
                Stage::map("item")
                    .retry(RetryPolicy::none())
                    .fail_execution_on_member_failure()
                    .fan_in(strategy),
            )
            .step("after"),
    )
    .await;
    let id = db.engine.start("strict", &[1, 2, 3, 4]).await.unwrap();
    let first = db
        .engine
        .claim("t", 2, Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(
        db.engine.fail(&first[0], "bad item", false).await.unwrap(),
        confluo::Outcome::DeadLettered { fired: false }
    );
    let exec = db.engine.execution(id).await.unwrap();
    assert_eq!(exec.status, ExecutionStatus::Failed);
    let stage = &exec.stages[0];
    // Two pending siblings cancelled in the same transaction; the running one may finish.
    assert_eq!(
        (stage.dead, stage.cancelled, stage.running, stage.remaining),
        (1, 2, 1, 1)
    );
    assert_eq!(
        db.engine.complete(&first[1], json!("late")).await.unwrap(),
        confluo::Outcome::Completed { fired: false }
    );
    let exec = db.engine.execution(id).await.unwrap();
    assert_eq!(
        exec.stages.len(),
        1,
        "a failed execution dispatches nothing"
    );
    assert_eq!(exec.stages[0].remaining, 0);
    assert!(db
        .engine
        .claim("t", 10, Duration::from_secs(60))
        .await
        .unwrap()
        .is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn panics_garbage_and_timeouts_are_failed_attempts_not_dead_workers() {
    let db = TestDb::new(10).await;
    db.register(
        &Workflow::new("rough", 1)
            .stage(Stage::step("produce").retry(fast_retry(4)))
            .stage(
                Stage::map("consume")
                    .retry(fast_retry(3))
                    .timeout(Duration::from_millis(200)),
            ),
    )
    .await;
    let worker = quick_worker(&db.engine, |w| {
        w.handler("rough", "produce", |t| async move {
            match t.attempt() {
                1 => panic!("handler bug"),
                2 => Ok(json!({"not": "an array"})), // the next stage is a map
                _ => Ok(json!([1, 2])),
            }
        })
        .handler("rough", "consume", |t| async move {
            if t.attempt() == 1 {
                tokio::time::sleep(Duration::from_secs(3600)).await; // hangs
            }
            Ok::<_, TaskError>(t.input().clone())
        })
    })
    .await;
    let id = db.engine.start("rough", &json!({})).await.unwrap();
    let done = db.engine.wait(id, WAIT).await.unwrap();
    worker.shutdown().await;
    assert_eq!(done.status, ExecutionStatus::Completed, "{:?}", done.error);
    assert_eq!(done.output, Some(json!({"outputs": [1, 2], "failed": []})));
    let errors: Vec<Value> = sqlx::query_scalar(
        "SELECT errors FROM confluo.task WHERE execution_id = $1 ORDER BY stage_index, item_index",
    )
    .bind(id)
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert!(errors[0][0]["error"]
        .as_str()
        .unwrap()
        .contains("panicked: handler bug"));
    assert!(errors[0][1]["error"]
        .as_str()
        .unwrap()
        .contains("must return a JSON array"));
    assert!(errors[1][0]["error"]
        .as_str()
        .unwrap()
        .contains("timed out"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn graceful_shutdown_releases_what_outlives_the_grace_period() {
    let db = TestDb::new(10).await;
    db.register(&Workflow::new("slow", 1).step("sleep")).await;
    let worker = quick_worker(&db.engine, |w| {
        w.shutdown_grace(Duration::from_millis(200))
            .handler("slow", "sleep", |_| async {
                tokio::time::sleep(Duration::from_secs(3600)).await;
                Ok::<_, TaskError>(())
            })
    })
    .await;
    let id = db.engine.start("slow", &json!(null)).await.unwrap();
    assert!(
        common::eventually(WAIT, || async {
            db.engine.execution(id).await.unwrap().stages[0].running == 1
        })
        .await
    );
    worker.shutdown().await;
    let (status, attempt): (String, i32) =
        sqlx::query_as("SELECT status, attempt FROM confluo.task WHERE execution_id = $1")
            .bind(id)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        (status.as_str(), attempt),
        ("pending", 0),
        "released, attempt not counted"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn killed_connections_lose_no_task() {
    let db = TestDb::new(10).await;
    db.register(&Workflow::new("kill", 1).map("item").step("count"))
        .await;
    let worker_engine = common::engine(db.new_pool(6).await);
    let worker = quick_worker(&worker_engine, |w| {
        w.lease(Duration::from_secs(2))
            .handler("kill", "item", |t| async move {
                tokio::time::sleep(Duration::from_millis(2)).await;
                Ok::<_, TaskError>(t.item_index())
            })
            .handler("kill", "count", |t| async move {
                let r: MapResults<u32> = t.input_as()?;
                Ok::<_, TaskError>(r.outputs.len())
            })
    })
    .await;
    let id = db.engine.start("kill", &vec![0; 1500]).await.unwrap();
    // Terminate every backend of the worker's pool and listener, repeatedly, mid-run.
    let mut killer = db.connection().await;
    let mut killed = 0;
    for _ in 0..6 {
        tokio::time::sleep(Duration::from_millis(150)).await;
        killed += sqlx::query(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
              WHERE datname = current_database() AND pid <> pg_backend_pid()
                AND backend_type = 'client backend'",
        )
        .fetch_all(&mut killer)
        .await
        .unwrap()
        .len();
    }
    assert!(killed >= 6, "only {killed} backends were terminated");
    let done = db.engine.wait(id, WAIT).await.unwrap();
    worker.shutdown().await;
    assert_eq!(done.status, ExecutionStatus::Completed, "{:?}", done.error);
    assert_eq!(done.output, Some(json!(1500)));
    assert_eq!(done.stages[0].completed, 1500);
}

/// A handler whose lease is lost (here: another attempt took the task, as a reclaim
/// would) is told through `TaskContext::cancellation()` before it is aborted, and what it
/// returns afterwards changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lost_lease_is_told_to_the_handler_before_it_is_aborted() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let db = TestDb::new(6).await;
    db.register(&Workflow::new("long", 1).step("wait")).await;
    let (started, told) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicBool::new(false)),
    );
    let (s, t) = (started.clone(), told.clone());
    let worker = quick_worker(&db.engine, move |w| {
        w.lease(Duration::from_millis(300))
            .handler("long", "wait", move |ctx| {
                let (s, t) = (s.clone(), t.clone());
                async move {
                    s.store(true, Ordering::SeqCst);
                    ctx.cancellation().cancelled().await;
                    t.store(true, Ordering::SeqCst);
                    Ok::<_, TaskError>(json!("late"))
                }
            })
    })
    .await;
    let id = db.engine.start("long", &json!(null)).await.unwrap();
    assert!(
        common::eventually(WAIT, || async { started.load(Ordering::SeqCst) }).await,
        "the handler started"
    );
    // Someone else's attempt now: the worker's next renewal finds its lease gone.
    sqlx::query("UPDATE confluo.task SET lease_token = gen_random_uuid() WHERE execution_id = $1")
        .bind(id)
        .execute(&db.pool)
        .await
        .unwrap();
    assert!(
        common::eventually(Duration::from_secs(10), || async {
            told.load(Ordering::SeqCst)
        })
        .await,
        "the handler saw its cancellation"
    );
    worker.shutdown().await;
    let (status, output): (String, Option<Value>) =
        sqlx::query_as("SELECT status, output FROM confluo.task WHERE execution_id = $1")
            .bind(id)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        (status.as_str(), output),
        ("running", None),
        "its late result changed nothing"
    );
}
