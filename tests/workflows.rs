//! Workflows end to end, run by real workers against real PostgreSQL: shapes, scale,
//! several workers, wake-ups, the strategy each group records.

mod common;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{quick_worker, TestDb, WAIT};
use confluo::{
    ExecutionStatus, FanInStrategy, MapResults, RetryPolicy, Stage, TaskError, Workflow,
};
use serde_json::json;

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
        let engine = common::engine(db.new_pool(5).await);
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
        .notifications(db.listening())
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
async fn an_engine_default_strategy_applies_to_every_group_and_is_stored_on_it() {
    let db = TestDb::new(10).await;
    // The engine's default is row-lock; one stage overrides it with the countdown.
    let engine = common::engine_builder(db.pool.clone())
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
