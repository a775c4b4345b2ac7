//! Claiming, leases, registration, idempotent starts and migrations.

mod common;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use common::TestDb;
use confluo::{
    Engine, Error, ExecutionStatus, Outcome, RetryPolicy, Stage, StartOptions, Workflow,
};
use serde_json::json;
use tokio::sync::Barrier;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_claims_never_hand_out_a_task_twice() {
    let db = TestDb::new(12).await;
    db.register(&Workflow::new("m", 1).map("x")).await;
    db.engine.start("m", &vec![0; 400]).await.unwrap();
    let barrier = Arc::new(Barrier::new(8));
    let mut handles = Vec::new();
    for i in 0..8 {
        let (engine, barrier) = (db.engine.clone(), barrier.clone());
        handles.push(tokio::spawn(async move {
            barrier.wait().await;
            let mut mine = Vec::new();
            loop {
                let batch = engine
                    .claim(&format!("c{i}"), 7, Duration::from_secs(60))
                    .await
                    .unwrap();
                if batch.is_empty() {
                    return mine;
                }
                mine.extend(batch.into_iter().map(|t| t.id()));
            }
        }));
    }
    let mut all = Vec::new();
    for h in handles {
        all.extend(h.await.unwrap());
    }
    let unique: HashSet<_> = all.iter().collect();
    assert_eq!(all.len(), 400);
    assert_eq!(unique.len(), 400);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_by_priority_then_due_time_and_skips_tasks_in_backoff() {
    let db = TestDb::new(5).await;
    db.register(&Workflow::new("low", 1).stage(Stage::step("low").retry(
        RetryPolicy::exponential(3).backoff(Duration::from_secs(60), Duration::from_secs(60)),
    )))
    .await;
    db.register(&Workflow::new("high", 1).stage(Stage::step("high").priority(10)))
        .await;
    db.engine.start("low", &1).await.unwrap();
    db.engine.start("high", &2).await.unwrap();
    let first = db
        .engine
        .claim("t", 1, Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(first[0].handler(), "high");
    let second = db
        .engine
        .claim("t", 1, Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(second[0].handler(), "low");
    // A failed attempt waits out its backoff (60 s): not claimable now.
    assert!(matches!(
        db.engine.fail(&second[0], "later", false).await.unwrap(),
        Outcome::RetryScheduled { .. }
    ));
    assert!(db
        .engine
        .claim("t", 10, Duration::from_secs(60))
        .await
        .unwrap()
        .is_empty());

    // The claim reads the partial claim index, with the due time as an index condition.
    let mut conn = db.connection().await;
    sqlx::query("SET enable_seqscan = off")
        .execute(&mut conn)
        .await
        .unwrap();
    let plan: Vec<String> = sqlx::query_scalar(
        "EXPLAIN SELECT id FROM confluo.task WHERE status = 'pending' AND run_at <= now()
          ORDER BY priority DESC, run_at LIMIT 10 FOR UPDATE SKIP LOCKED",
    )
    .fetch_all(&mut conn)
    .await
    .unwrap();
    let plan = plan.join("\n");
    assert!(plan.contains("task_claim_idx"), "{plan}");
    assert!(plan.contains("Index Cond: (run_at <= now())"), "{plan}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_that_keeps_killing_its_worker_ends_dead_lettered() {
    let db = TestDb::new(5).await;
    db.register(
        &Workflow::new("killer", 1).stage(
            Stage::step("crash")
                .retry(RetryPolicy::exponential(3).backoff(Duration::ZERO, Duration::ZERO)),
        ),
    )
    .await;
    let id = db.engine.start("killer", &json!({})).await.unwrap();
    for attempt in 1..=3 {
        // The worker claims it and dies: nobody renews the lease.
        let claimed = db
            .engine
            .claim("doomed", 1, Duration::from_millis(50))
            .await
            .unwrap();
        assert_eq!(claimed.len(), 1, "attempt {attempt} should be claimable");
        assert_eq!(claimed[0].attempt(), attempt);
        tokio::time::sleep(Duration::from_millis(80)).await;
        assert_eq!(db.engine.reclaim_expired(10).await.unwrap(), 1);
    }
    assert!(db
        .engine
        .claim("doomed", 1, Duration::from_secs(1))
        .await
        .unwrap()
        .is_empty());
    let exec = db.engine.execution(id).await.unwrap();
    assert_eq!(exec.status, ExecutionStatus::Failed);
    assert_eq!(exec.dead_letters[0].errors.len(), 3);
    assert!(exec.dead_letters[0].errors[2]
        .error
        .contains("lease expired"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewed_lease_is_not_reclaimed() {
    let db = TestDb::new(5).await;
    db.register(&Workflow::new("r", 1).step("s")).await;
    db.engine.start("r", &1).await.unwrap();
    let task = db
        .engine
        .claim("w", 1, Duration::from_millis(300))
        .await
        .unwrap()
        .remove(0);
    for _ in 0..4 {
        tokio::time::sleep(Duration::from_millis(150)).await;
        assert_eq!(
            db.engine
                .renew_lease(&task, Duration::from_millis(300))
                .await
                .unwrap(),
            Some(ExecutionStatus::Running)
        );
        assert_eq!(db.engine.reclaim_expired(10).await.unwrap(), 0);
    }
    assert_eq!(
        db.engine.complete(&task, json!(1)).await.unwrap(),
        Outcome::Completed { fired: true }
    );
    assert_eq!(
        db.engine
            .renew_lease(&task, Duration::from_secs(1))
            .await
            .unwrap(),
        None
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn racing_starts_with_one_idempotency_key_start_one_execution() {
    let db = TestDb::new(12).await;
    db.register(&Workflow::new("once", 1).step("s")).await;
    let barrier = Arc::new(Barrier::new(10));
    let mut handles = Vec::new();
    for _ in 0..10 {
        let (engine, barrier) = (db.engine.clone(), barrier.clone());
        handles.push(tokio::spawn(async move {
            barrier.wait().await;
            engine
                .start_with(
                    "once",
                    &json!({"order": 7}),
                    StartOptions::new().idempotency_key("order-7"),
                )
                .await
                .unwrap()
                .id
        }));
    }
    let mut ids = HashSet::new();
    for h in handles {
        ids.insert(h.await.unwrap());
    }
    assert_eq!(ids.len(), 1);
    let (executions, tasks): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM confluo.execution), (SELECT count(*) FROM confluo.task)",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!((executions, tasks), (1, 1));
    // Another key starts another execution; no key always does.
    let other = db
        .engine
        .start_with("once", &1, StartOptions::new().idempotency_key("order-8"))
        .await
        .unwrap()
        .id;
    assert!(!ids.contains(&other));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registration_rejects_bad_definitions_and_conflicts_and_pins_versions() {
    let db = TestDb::new(5).await;
    let err = db
        .engine
        .register(&Workflow::new("bad", 1).parallel("p", Vec::<String>::new()))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::InvalidDefinition(_)), "{err}");
    assert!(err.is_invalid_definition());
    let err = db
        .engine
        .register(&Workflow::new("bad", 1).step("a").step("a"))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("used twice"), "{err}");

    let v1 = Workflow::new("pinned", 1).step("a");
    db.register(&v1).await;
    db.register(&v1).await; // identical: a no-op
    let err = db
        .engine
        .register(&Workflow::new("pinned", 1).step("b"))
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::DefinitionConflict { version: 1, .. }),
        "{err}"
    );

    let old = db.engine.start("pinned", &0).await.unwrap();
    db.register(&Workflow::new("pinned", 2).step("a").step("b"))
        .await;
    let new = db.engine.start("pinned", &0).await.unwrap();
    assert_eq!(db.engine.execution(old).await.unwrap().version, 1);
    assert_eq!(db.engine.execution(new).await.unwrap().version, 2);
    let explicit = db
        .engine
        .start_with("pinned", &0, StartOptions::new().version(1))
        .await
        .unwrap()
        .id;
    assert_eq!(db.engine.execution(explicit).await.unwrap().version, 1);

    let err = db.engine.start("nope", &0).await.unwrap_err();
    assert!(err.is_not_found(), "{err}");
    db.register(&Workflow::new("mapfirst", 1).map("m")).await;
    let err = db
        .engine
        .start("mapfirst", &json!({"not": "array"}))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::InvalidInput { .. }), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_without_every_handler_refuses_to_start() {
    let db = TestDb::new(5).await;
    db.register(
        &Workflow::new("orders", 1)
            .step("a")
            .parallel("p", ["b", "c"]),
    )
    .await;
    let err = db
        .engine
        .worker()
        .handler("orders", "a", |_| async { Ok::<_, confluo::TaskError>(()) })
        .handler("orders", "b", |_| async { Ok::<_, confluo::TaskError>(()) })
        .start()
        .await
        .unwrap_err();
    assert!(
        matches!(&err, Error::MissingHandler { handler, .. } if handler == "c"),
        "{err}"
    );
    let err = db.engine.worker().start().await.unwrap_err();
    assert!(matches!(err, Error::NoHandlers), "{err}");
    let err = db
        .engine
        .worker()
        .handler("unknown", "a", |_| async {
            Ok::<_, confluo::TaskError>(())
        })
        .start()
        .await
        .unwrap_err();
    assert!(err.is_not_found(), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn migrations_are_idempotent_and_safe_to_run_concurrently() {
    let db = TestDb::new(10).await;
    // The template was migrated already; run it again from four "processes" at once.
    let mut handles = Vec::new();
    for _ in 0..4 {
        let engine = Engine::new(db.new_pool(2).await);
        handles.push(tokio::spawn(async move { engine.migrate().await }));
    }
    for h in handles {
        h.await.unwrap().unwrap();
    }
    let bookkeeping: Option<String> =
        sqlx::query_scalar("SELECT to_regclass('confluo._sqlx_migrations')::text")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert!(
        bookkeeping.is_some(),
        "sqlx's bookkeeping lives in the confluo schema"
    );
    let public: Option<String> =
        sqlx::query_scalar("SELECT to_regclass('public._sqlx_migrations')::text")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert!(public.is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrating_a_fresh_database_from_several_processes_at_once() {
    let db = TestDb::new(2).await;
    // A database with no confluo schema at all.
    let mut conn = db.connection().await;
    sqlx::query("DROP SCHEMA confluo CASCADE")
        .execute(&mut conn)
        .await
        .unwrap();
    let mut handles = Vec::new();
    for _ in 0..4 {
        let engine = Engine::new(db.new_pool(2).await);
        handles.push(tokio::spawn(async move { engine.migrate().await }));
    }
    for h in handles {
        h.await.unwrap().unwrap();
    }
    db.register(&Workflow::new("after", 1).step("s")).await;
    db.engine.start("after", &1).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permanent_error_skips_the_remaining_attempts() {
    let db = TestDb::new(5).await;
    db.register(
        &Workflow::new("perm", 1)
            .stage(Stage::map("m").retry(RetryPolicy::exponential(5)))
            .step("after"),
    )
    .await;
    let id = db.engine.start("perm", &[1]).await.unwrap();
    let task = db
        .engine
        .claim("w", 1, Duration::from_secs(60))
        .await
        .unwrap()
        .remove(0);
    assert_eq!(task.attempt(), 1);
    assert_eq!(
        db.engine
            .fail(&task, "malformed order", true)
            .await
            .unwrap(),
        Outcome::DeadLettered { fired: true }
    );
    let exec = db.engine.execution(id).await.unwrap();
    assert_eq!((exec.stages[0].dead, exec.stages.len()), (1, 2));
    assert_eq!(exec.dead_letters[0].attempts, 1);
}
