//! Workflows end to end, run by real workers against real PostgreSQL.

mod common;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::TestDb;
use confluo::{
    Engine, ExecutionStatus, FanInStrategy, MapResults, ParallelResults, RetryPolicy, Stage,
    TaskError, Worker, Workflow,
};
use serde_json::{json, Value};

/// The strategies that must keep every invariant.
const STRATEGIES: [FanInStrategy; 3] = [
    FanInStrategy::Countdown,
    FanInStrategy::Striped,
    FanInStrategy::RowLock,
];

const WAIT: Duration = Duration::from_secs(120);

fn fast_retry(attempts: u32) -> RetryPolicy {
    RetryPolicy::exponential(attempts).backoff(Duration::from_millis(10), Duration::from_millis(50))
}

async fn quick_worker(
    engine: &Engine,
    build: impl FnOnce(confluo::WorkerBuilder) -> confluo::WorkerBuilder,
) -> Worker {
    build(
        engine
            .worker()
            .poll_interval(Duration::from_millis(50))
            .concurrency(8),
    )
    .start()
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_steps_pass_outputs_in_order() {
    let db = TestDb::new(10).await;
    db.register(&Workflow::new("chain", 1).step("a").step("b").step("c"))
        .await;
    let worker = quick_worker(&db.engine, |w| {
        w.handler("chain", "a", |t| async move {
            Ok::<_, TaskError>(t.input_as::<i64>()? + 1)
        })
        .handler("chain", "b", |t| async move {
            Ok::<_, TaskError>(t.input_as::<i64>()? * 10)
        })
        .handler("chain", "c", |t| async move {
            Ok::<_, TaskError>(json!({"result": t.input().clone()}))
        })
    })
    .await;
    let id = db.engine.start("chain", &4).await.unwrap();
    let done = db.engine.wait(id, WAIT).await.unwrap();
    worker.shutdown().await;
    assert_eq!(done.status, ExecutionStatus::Completed);
    assert_eq!(done.output, Some(json!({"result": 50})));
    assert_eq!(done.stages.len(), 3);
    assert!(done
        .stages
        .iter()
        .all(|s| s.completed == 1 && s.remaining == 0 && s.fired_at.is_some()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn map_of_width_zero_advances_at_once() {
    let db = TestDb::new(10).await;
    db.register(
        &Workflow::new("empty", 1)
            .step("list")
            .map("each")
            .step("total"),
    )
    .await;
    let seen = Arc::new(AtomicU32::new(0));
    let seen2 = seen.clone();
    let worker = quick_worker(&db.engine, move |w| {
        w.handler("empty", "list", |_| async {
            Ok::<_, TaskError>(Vec::<i32>::new())
        })
        .handler("empty", "each", move |_| {
            seen2.fetch_add(1, Ordering::SeqCst);
            async { Ok::<_, TaskError>(0) }
        })
        .handler("empty", "total", |t| async move {
            let r: MapResults<i64> = t.input_as()?;
            Ok::<_, TaskError>(json!({"n": r.outputs.len(), "failed": r.failed.len()}))
        })
    })
    .await;
    let id = db.engine.start("empty", &json!(null)).await.unwrap();
    let done = db.engine.wait(id, WAIT).await.unwrap();
    worker.shutdown().await;
    assert_eq!(done.status, ExecutionStatus::Completed);
    assert_eq!(done.output, Some(json!({"n": 0, "failed": 0})));
    assert_eq!(seen.load(Ordering::SeqCst), 0);
    let map = &done.stages[1];
    assert_eq!((map.width, map.remaining), (0, 0));
    assert!(map.fired_at.is_some());

    // A map over an empty execution input, as the last stage, completes at start.
    db.register(&Workflow::new("only-map", 1).map("m")).await;
    let id = db.engine.start("only-map", &json!([])).await.unwrap();
    let done = db.engine.execution(id).await.unwrap();
    assert_eq!(done.status, ExecutionStatus::Completed);
    assert_eq!(done.output, Some(json!({"outputs": [], "failed": []})));
}

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
async fn wide_map_of_10_000_end_to_end() {
    let db = TestDb::new(20).await;
    db.register(
        &Workflow::new("wide", 1)
            .step("split")
            .map("square")
            .step("sum"),
    )
    .await;
    let worker = quick_worker(&db.engine, |w| {
        w.batch_size(100)
            .concurrency(64)
            .handler("wide", "split", |t| async move {
                let n: u64 = t.input_as()?;
                Ok::<_, TaskError>((0..n).collect::<Vec<_>>())
            })
            .handler("wide", "square", |t| async move {
                let x: u64 = t.input_as()?;
                Ok::<_, TaskError>(x * x)
            })
            .handler("wide", "sum", |t| async move {
                let r: MapResults<u64> = t.input_as()?;
                Ok::<_, TaskError>(
                    json!({"n": r.outputs.len(), "sum": r.outputs.iter().sum::<u64>()}),
                )
            })
    })
    .await;
    let id = db.engine.start("wide", &10_000).await.unwrap();
    let done = db.engine.wait(id, Duration::from_secs(600)).await.unwrap();
    worker.shutdown().await;
    assert_eq!(done.status, ExecutionStatus::Completed);
    let expected: u64 = (0..10_000u64).map(|x| x * x).sum();
    assert_eq!(done.output, Some(json!({"n": 10_000, "sum": expected})));
    assert_eq!(done.stages[1].width, 10_000);
    assert_eq!(done.stages[1].completed, 10_000);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn several_workers_with_separate_pools_share_the_work() {
    let db = TestDb::new(5).await;
    db.register(&Workflow::new("shared", 1).map("work").step("join"))
        .await;
    let mut workers = Vec::new();
    for i in 0..3 {
        let engine = Engine::new(db.new_pool(5).await);
        workers.push(
            engine
                .worker()
                .id(format!("w{i}"))
                .poll_interval(Duration::from_millis(50))
                .concurrency(4)
                .batch_size(2)
                .handler("shared", "work", |t| async move {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    Ok::<_, TaskError>(t.item_index())
                })
                .handler("shared", "join", |t| async move {
                    let r: MapResults<u32> = t.input_as()?;
                    Ok::<_, TaskError>(r.outputs.len())
                })
                .start()
                .await
                .unwrap(),
        );
    }
    let input = vec![0; 60];
    let ids: Vec<_> =
        futures_util::future::join_all((0..5).map(|_| db.engine.start("shared", &input)))
            .await
            .into_iter()
            .map(Result::unwrap)
            .collect();
    for id in ids {
        let done = db.engine.wait(id, WAIT).await.unwrap();
        assert_eq!(done.status, ExecutionStatus::Completed);
        assert_eq!(done.output, Some(json!(60)));
    }
    for w in workers {
        w.shutdown().await;
    }
    let by_worker: i64 = sqlx::query_scalar("SELECT count(DISTINCT worker_id) FROM confluo.task")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(
        by_worker, 3,
        "every worker should have run some of the 305 tasks"
    );
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
async fn cancelling_stops_queued_work_and_dispatches_nothing() {
    for strategy in STRATEGIES {
        cancelling_stops_queued_work_and_dispatches_nothing_with(strategy).await;
    }
}

async fn cancelling_stops_queued_work_and_dispatches_nothing_with(strategy: FanInStrategy) {
    let db = TestDb::new(10).await;
    db.register(
        &Workflow::new("cancel", 1)
            .stage(Stage::map("item").fan_in(strategy))
            .step("after"),
    )
    .await;
    let id = db.engine.start("cancel", &[1, 2, 3]).await.unwrap();
    let running = db
        .engine
        .claim("t", 1, Duration::from_secs(60))
        .await
        .unwrap();
    assert!(db.engine.cancel(id).await.unwrap());
    assert!(
        !db.engine.cancel(id).await.unwrap(),
        "a second cancel changes nothing"
    );
    let exec = db.engine.execution(id).await.unwrap();
    assert_eq!(exec.status, ExecutionStatus::Cancelled);
    assert_eq!((exec.stages[0].cancelled, exec.stages[0].remaining), (2, 1));
    assert!(db
        .engine
        .claim("t", 10, Duration::from_secs(60))
        .await
        .unwrap()
        .is_empty());
    // The member that was running finishes: counted, but nothing is dispatched.
    db.engine.complete(&running[0], json!(1)).await.unwrap();
    let exec = db.engine.execution(id).await.unwrap();
    assert_eq!((exec.stages.len(), exec.stages[0].remaining), (1, 0));
    assert!(db
        .engine
        .cancel(confluo::ExecutionId::new())
        .await
        .unwrap_err()
        .is_not_found());
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
async fn notifications_wake_idle_workers_without_waiting_for_the_poll() {
    let db = TestDb::new(10).await;
    db.register(
        &Workflow::new("wake", 1)
            .step("a")
            .parallel("p", ["b", "c"])
            .step("d"),
    )
    .await;
    // Polling alone would take a minute per stage: only LISTEN/NOTIFY can finish in time.
    let worker = db
        .engine
        .worker()
        .poll_interval(Duration::from_secs(60))
        .handler("wake", "a", |_| async { Ok::<_, TaskError>(1) })
        .handler("wake", "b", |_| async { Ok::<_, TaskError>(2) })
        .handler("wake", "c", |_| async { Ok::<_, TaskError>(3) })
        .handler("wake", "d", |t| async move {
            Ok::<_, TaskError>(t.input().clone())
        })
        .start()
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await; // let it go idle, listening
    let id = db.engine.start("wake", &0).await.unwrap();
    let done = db.engine.wait(id, Duration::from_secs(30)).await.unwrap();
    worker.shutdown().await;
    assert_eq!(
        done.output,
        Some(json!({"outputs": {"b": 2, "c": 3}, "failed": []}))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn killed_connections_lose_no_task() {
    let db = TestDb::new(10).await;
    db.register(&Workflow::new("kill", 1).map("item").step("count"))
        .await;
    let worker_engine = Engine::new(db.new_pool(6).await);
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

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_engine_default_strategy_applies_to_every_group_and_is_stored_on_it() {
    let db = TestDb::new(10).await;
    // The engine's default is row-lock; one stage overrides it with the countdown.
    let engine = Engine::builder(db.pool.clone())
        .fan_in(FanInStrategy::RowLock)
        .build();
    engine
        .register(
            &Workflow::new("mixed", 1)
                .stage(Stage::map("item").retry(RetryPolicy::none()))
                .stage(Stage::parallel("p", ["x", "y"]).fan_in(FanInStrategy::Countdown))
                .step("end"),
        )
        .await
        .unwrap();
    // Workers on the default engine decide each group as its row says, not as they would.
    let worker = quick_worker(&db.engine, |w| {
        w.handler("mixed", "item", |t| async move {
            let n: i64 = t.input_as()?;
            if n % 10 == 0 {
                return Err(TaskError::permanent("multiple of ten"));
            }
            Ok(n)
        })
        .handler("mixed", "x", |t| async move {
            let r: MapResults<i64> = t.input_as()?;
            Ok::<_, TaskError>(r.outputs.iter().sum::<i64>())
        })
        .handler("mixed", "y", |t| async move {
            let r: MapResults<i64> = t.input_as()?;
            Ok::<_, TaskError>(r.failed.len())
        })
        .handler("mixed", "end", |t| async move {
            Ok::<_, TaskError>(t.input()["outputs"].clone())
        })
    })
    .await;
    let input: Vec<i64> = (1..=100).collect();
    let id = engine.start("mixed", &input).await.unwrap();
    let done = db.engine.wait(id, WAIT).await.unwrap();
    worker.shutdown().await;
    assert_eq!(done.status, ExecutionStatus::Completed, "{:?}", done.error);
    let expected: i64 = (1..=100).filter(|n| n % 10 != 0).sum();
    assert_eq!(done.output, Some(json!({"x": expected, "y": 10})));
    let strategies: Vec<_> = done.stages.iter().map(|s| s.fan_in).collect();
    assert_eq!(
        strategies,
        [
            Some(FanInStrategy::RowLock),
            Some(FanInStrategy::Countdown),
            Some(FanInStrategy::RowLock)
        ]
    );
    assert!(done
        .stages
        .iter()
        .all(|s| s.remaining == 0 && s.fired_at.is_some()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cancelling_a_wide_striped_group_counts_every_stripe_down() {
    let db = TestDb::new(10).await;
    db.register(
        &Workflow::new("striped", 1)
            .stage(Stage::map("item").fan_in(FanInStrategy::Striped))
            .step("after"),
    )
    .await;
    let id = db.engine.start("striped", &vec![0; 100]).await.unwrap();
    let stripes: i32 =
        sqlx::query_scalar("SELECT stripes FROM confluo.stage_group WHERE execution_id = $1")
            .bind(id)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(stripes, 6, "one stripe per 16 members");
    let running = db
        .engine
        .claim("t", 10, Duration::from_secs(60))
        .await
        .unwrap();
    assert!(db.engine.cancel(id).await.unwrap());
    let exec = db.engine.execution(id).await.unwrap();
    assert_eq!(
        (exec.stages[0].cancelled, exec.stages[0].remaining),
        (90, 10)
    );
    for task in &running {
        db.engine.complete(task, json!(1)).await.unwrap();
    }
    let (row, stripe_sum): (i32, i64) = sqlx::query_as(
        "SELECT g.remaining, (SELECT sum(remaining) FROM confluo.group_stripe s WHERE s.group_id = g.id)
           FROM confluo.stage_group g WHERE g.execution_id = $1",
    )
    .bind(id)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        (row, stripe_sum),
        (0, 0),
        "every stripe drained, the group row at zero"
    );
    let exec = db.engine.execution(id).await.unwrap();
    assert_eq!((exec.stages.len(), exec.stages[0].fired_at), (1, None));
}
