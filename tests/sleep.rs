//! Durable sleep against real PostgreSQL: a sleep is a task due at its wake time, run by
//! the workers' own handler; nothing after it starts before it is due, it survives the
//! restart of every worker, and the stage after it receives what it received.

mod common;

use std::time::{Duration, Instant};

use common::{claim_n, quick_worker, TestDb, WAIT};
use confluo::{ExecutionStatus, MapResults, Outcome, Stage, TaskError, Workflow};
use serde_json::json;

const NAP: Duration = Duration::from_millis(1500);

/// When the stage after the sleep was first claimed, and when the sleep was entered.
async fn slept(db: &TestDb, id: confluo::ExecutionId, after: &str) -> Duration {
    let seconds: f64 = sqlx::query_scalar(
        "SELECT extract(epoch FROM t.started_at - g.created_at)::float8
           FROM confluo.task_all t, confluo.stage_group g
          WHERE t.execution_id = $1 AND t.handler = $2
            AND g.execution_id = $1 AND g.kind = 'sleep'",
    )
    .bind(id)
    .bind(after)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    Duration::from_secs_f64(seconds)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn nothing_after_a_sleep_starts_before_it_is_due_and_it_passes_its_input_on() {
    let db = TestDb::new(10).await;
    db.register(
        &Workflow::new("nap", 1)
            .step("a")
            .stage(Stage::sleep("nap", NAP))
            .step("b")
            .map("each")
            .stage(Stage::sleep("settle", Duration::from_millis(10))),
    )
    .await;
    // No handler for the sleeps: the worker runs them itself.
    let worker = quick_worker(&db.engine, |w| {
        w.handler("nap", "a", |_| async {
            Ok::<_, TaskError>(json!([1, 2, 3]))
        })
        .handler("nap", "b", |t| async move {
            Ok::<_, TaskError>(t.input().clone())
        })
        .handler("nap", "each", |t| async move {
            Ok::<_, TaskError>(t.input_as::<i64>()? * 10)
        })
    })
    .await;
    let started = Instant::now();
    let id = db.engine.start("nap", &json!(null)).await.unwrap();
    let done = db.engine.wait(id, WAIT).await.unwrap();
    worker.shutdown().await;
    assert_eq!(done.status, ExecutionStatus::Completed, "{done:?}");
    assert!(started.elapsed() >= NAP);
    assert!(
        slept(&db, id, "b").await >= NAP,
        "b started before the sleep was due"
    );
    // `b` received what the sleep received (a's output); the last sleep passes the map's
    // block on as the execution's output.
    let output: MapResults<i64> = serde_json::from_value(done.output.unwrap()).unwrap();
    assert_eq!(output.outputs, [10, 20, 30]);
    let nap = &done.stages[1];
    assert_eq!(
        (nap.kind.as_str(), nap.width, nap.completed),
        ("sleep", 1, 1)
    );
    assert_eq!(nap.wakes_at, None, "a sleep that woke says nothing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_sleep_survives_the_restart_of_every_worker() {
    let db = TestDb::new(12).await;
    let wf = Workflow::new("restart", 1)
        .step("a")
        .stage(Stage::sleep("nap", Duration::from_secs(2)))
        .step("b");
    db.register(&wf).await;
    let handlers = |w: confluo::WorkerBuilder| {
        w.handler("restart", "a", |_| async { Ok::<_, TaskError>(json!("a")) })
            .handler("restart", "b", |t| async move {
                Ok::<_, TaskError>(json!({"b": t.input().clone()}))
            })
    };
    let first = quick_worker(&db.engine, handlers).await;
    let id = db.engine.start("restart", &json!(null)).await.unwrap();
    assert!(
        common::eventually(WAIT, || async {
            db.engine.execution(id).await.unwrap().stages.len() == 2
        })
        .await,
        "the execution never reached its sleep"
    );
    first.shutdown().await;
    let asleep = db.engine.execution(id).await.unwrap();
    assert_eq!(asleep.stages.len(), 2, "{asleep:?}");
    assert_eq!(
        (asleep.stages[1].kind.as_str(), asleep.stages[1].pending),
        ("sleep", 1)
    );
    let wakes = asleep.stages[1]
        .wakes_at
        .expect("a sleeping stage says when it wakes");
    let entered = asleep.stages[1].entered_at;
    assert_eq!(
        (wakes - entered).num_milliseconds(),
        2000,
        "{wakes} {entered}"
    );
    // Nobody runs while it sleeps; then a new worker, on a new pool, wakes it.
    tokio::time::sleep(Duration::from_millis(2200)).await;
    let engine = common::engine(db.new_pool(4).await);
    let second = quick_worker(&engine, handlers).await;
    let done = engine.wait(id, WAIT).await.unwrap();
    second.shutdown().await;
    assert_eq!(done.status, ExecutionStatus::Completed, "{done:?}");
    assert_eq!(done.output, Some(json!({"b": "a"})));
    assert!(slept(&db, id, "b").await >= Duration::from_secs(2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sleep_until_reads_the_wake_time_from_the_previous_output() {
    let db = TestDb::new(10).await;
    db.register(
        &Workflow::new("until", 1)
            .step("plan")
            .stage(Stage::sleep_until("wait", "/at"))
            .step("go"),
    )
    .await;
    let claim_one = || async { claim_n(&db.engine, 1).await.remove(0) };

    // A time in the past: the sleep is due at once, and `go` receives plan's output.
    let past = json!({"at": "2020-01-01T00:00:00Z"});
    let id = db.engine.start("until", &json!(null)).await.unwrap();
    let plan = claim_one().await;
    db.engine.complete(&plan, past.clone()).await.unwrap();
    let nap = claim_one().await;
    assert_eq!(nap.handler(), "confluo:sleep");
    assert_eq!(
        db.engine.complete(&nap, json!(null)).await.unwrap(),
        Outcome::Completed { fired: true }
    );
    let go = claim_one().await;
    assert_eq!(go.handler(), "go");
    assert_eq!(db.engine.task_input(&go).await.unwrap(), past);
    db.engine.complete(&go, json!("went")).await.unwrap();
    assert_eq!(
        db.engine.execution(id).await.unwrap().output,
        Some(json!("went"))
    );

    // A time a second away: not claimable before it.
    let soon = chrono::Utc::now() + chrono::Duration::seconds(1);
    let id = db.engine.start("until", &json!(null)).await.unwrap();
    let plan = claim_one().await;
    db.engine
        .complete(&plan, json!({"at": soon.to_rfc3339()}))
        .await
        .unwrap();
    assert!(db
        .engine
        .claim("test", 10, Duration::from_secs(10))
        .await
        .unwrap()
        .is_empty());
    let nap = claim_one().await;
    assert!(chrono::Utc::now() >= soon);
    db.engine.complete(&nap, json!(null)).await.unwrap();
    assert_eq!(claim_one().await.handler(), "go");

    // Not a time: the execution fails, saying what it found.
    let id2 = db.engine.start("until", &json!(null)).await.unwrap();
    let plan = claim_one().await;
    db.engine
        .complete(&plan, json!({"at": "next tuesday"}))
        .await
        .unwrap();
    let failed = db.engine.execution(id2).await.unwrap();
    assert_eq!(failed.status, ExecutionStatus::Failed);
    let error = failed.error.unwrap();
    assert!(
        error.contains("\"next tuesday\" at \"/at\"") && error.contains("RFC 3339"),
        "{error}"
    );
    assert_ne!(id, id2);
}

#[test]
fn a_sleep_needs_a_wake_time_and_reserved_names_are_refused() {
    let bad = Workflow::new("w", 1).stage(Stage::sleep_until("s", "at"));
    assert!(matches!(
        bad.validate(),
        Err(confluo::DefinitionError::InvalidSleep { .. })
    ));
    // Ten million years: milliseconds that fit an i64, a time PostgreSQL cannot reach.
    let eons = Duration::from_secs(10_000_000 * 365 * 24 * 3_600);
    let forever = Workflow::new("w", 1).stage(Stage::sleep("s", eons));
    assert!(matches!(
        forever.validate(),
        Err(confluo::DefinitionError::InvalidSleep { .. })
    ));
    let millennium = Duration::from_secs(1_000 * 365 * 24 * 3_600);
    let long = Workflow::new("w", 1).stage(Stage::sleep("s", millennium));
    assert!(long.validate().is_ok());
    let reserved = Workflow::new("w", 1).step("confluo:sleep");
    assert!(matches!(
        reserved.validate(),
        Err(confluo::DefinitionError::InvalidStageName { .. })
    ));
    let two = Workflow::new("w", 1)
        .stage(Stage::sleep("one", Duration::from_secs(1)))
        .stage(Stage::sleep("two", Duration::from_secs(1)));
    assert!(
        two.validate().is_ok(),
        "two sleeps share the workers' handler"
    );
    assert!(two.handler_names().is_empty());
}

/// A workflow that is only a sleep ends with its input, whether its task is acknowledged
/// on its own (the single completion's path) or in a worker's batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lone_sleep_passes_the_execution_input_on() {
    let db = TestDb::new(10).await;
    db.register(&Workflow::new("lone", 1).stage(Stage::sleep("only", Duration::ZERO)))
        .await;
    let id = db.engine.start("lone", &json!({"k": 1})).await.unwrap();
    let nap = claim_n(&db.engine, 1).await.remove(0);
    assert_eq!(
        db.engine.complete(&nap, json!(null)).await.unwrap(),
        Outcome::Completed { fired: true }
    );
    let done = db.engine.execution(id).await.unwrap();
    assert_eq!(done.status, ExecutionStatus::Completed);
    assert_eq!(done.output, Some(json!({"k": 1})));

    // A worker serves the workflows it has handlers for: give it one the workflow lacks.
    let worker = quick_worker(&db.engine, |w| {
        w.handler("lone", "unused", |_| async {
            Ok::<_, TaskError>(json!(null))
        })
        .partial(true)
    })
    .await;
    let id = db.engine.start("lone", &json!({"k": 2})).await.unwrap();
    let done = db.engine.wait(id, WAIT).await.unwrap();
    worker.shutdown().await;
    assert_eq!(done.output, Some(json!({"k": 2})), "{done:?}");
}
