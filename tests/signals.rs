//! Signal waits against real PostgreSQL: a signal completes its wait through the ordinary
//! guarded completion, whether it comes before the stage is reached (kept) or after;
//! timeouts fail the execution or give the timeout output; and every place where two
//! arrivals can decide the same wait (the signal against the entry, against the
//! timeout, against another signal) is raced behind a barrier, for each strategy.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{claim_n, quick_worker, TestDb, STRATEGIES, WAIT};
use confluo::{
    Engine, Error, ExecutionId, ExecutionStatus, FanInStrategy, Outcome, SignalOutcome, Stage,
    TaskError, Workflow,
};
use serde_json::{json, Value};
use tokio::sync::Barrier;

/// `a`, a wait for `approval`, and `b`, which returns what it received.
fn approval(name: &str, strategy: FanInStrategy) -> Workflow {
    Workflow::new(name, 1)
        .stage(Stage::step("a").fan_in(strategy))
        .stage(Stage::from(Stage::signal("approval")).fan_in(strategy))
        .stage(Stage::step("b").fan_in(strategy))
}

/// The wait's tasks of an execution: `(status, attempt, worker, output)`.
async fn wait_tasks(db: &TestDb, id: ExecutionId) -> Vec<(String, i32, Option<String>, Value)> {
    sqlx::query_as(
        "SELECT t.status, t.attempt, t.worker_id, COALESCE(t.output, 'null')
           FROM confluo.task_all t JOIN confluo.stage_group g ON g.id = t.group_id
          WHERE t.execution_id = $1 AND g.kind = 'signal'",
    )
    .bind(id)
    .fetch_all(&db.pool)
    .await
    .unwrap()
}

/// How many tasks of `handler` the execution has.
async fn tasks_of(db: &TestDb, id: ExecutionId, handler: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM confluo.task_all WHERE execution_id = $1 AND handler = $2",
    )
    .bind(id)
    .bind(handler)
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

/// Claims `b`, checks it received `payload`, and completes the execution with it.
async fn finish_with_b(db: &TestDb, id: ExecutionId, payload: &Value) {
    let b = claim_n(&db.engine, 1).await.remove(0);
    assert_eq!((b.handler(), b.execution_id()), ("b", id));
    assert_eq!(&db.engine.task_input(&b).await.unwrap(), payload);
    db.engine.complete(&b, payload.clone()).await.unwrap();
    let done = db.engine.execution(id).await.unwrap();
    assert_eq!(done.status, ExecutionStatus::Completed, "{done:?}");
    assert_eq!(done.output.as_ref(), Some(payload));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_signal_completes_its_wait_and_its_payload_is_what_the_next_stage_receives() {
    let db = TestDb::new(10).await;
    db.register(&approval("expense", FanInStrategy::Countdown))
        .await;
    // No handler for the wait: nothing runs it but the signal.
    let worker = quick_worker(&db.engine, |w| {
        w.handler("expense", "a", |_| async {
            Ok::<_, TaskError>(json!({"amount": 12}))
        })
        .handler("expense", "b", |t| async move {
            Ok::<_, TaskError>(json!({"b": t.input().clone()}))
        })
    })
    .await;
    let id = db.engine.start("expense", &json!(null)).await.unwrap();
    assert!(
        common::eventually(WAIT, || async {
            db.engine.execution(id).await.unwrap().stages.len() == 2
        })
        .await,
        "the execution never reached its wait"
    );
    let waiting = db.engine.execution(id).await.unwrap();
    let wait = &waiting.stages[1];
    assert_eq!(
        (wait.kind.as_str(), wait.pending, wait.wakes_at),
        ("signal", 1, None)
    );
    // The wait is not claimable: a worker that polls leaves it alone.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(wait_tasks(&db, id).await[0].0, "pending");

    let outcome = db
        .engine
        .signal(id, "approval", json!({"approved": true}))
        .await
        .unwrap();
    assert_eq!(outcome, SignalOutcome::Received);
    let done = db.engine.wait(id, WAIT).await.unwrap();
    worker.shutdown().await;
    assert_eq!(done.status, ExecutionStatus::Completed, "{done:?}");
    assert_eq!(done.output, Some(json!({"b": {"approved": true}})));
    assert_eq!(
        wait_tasks(&db, id).await,
        [(
            "completed".to_owned(),
            1,
            Some("confluo:signal".to_owned()),
            json!({"approved": true})
        )]
    );
    // Once per name; and an ended execution keeps nothing.
    assert_eq!(
        db.engine
            .signal(id, "approval", json!("again"))
            .await
            .unwrap(),
        SignalOutcome::Ended(ExecutionStatus::Completed)
    );
    let kept: i64 =
        sqlx::query_scalar("SELECT count(*) FROM confluo.signal WHERE execution_id = $1")
            .bind(id)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(kept, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_signal_sent_before_its_wait_is_kept_and_received_when_the_wait_is_entered() {
    let db = TestDb::new(6).await;
    db.register(&approval("early", FanInStrategy::Countdown))
        .await;
    let id = db.engine.start("early", &json!(null)).await.unwrap();
    assert_eq!(
        db.engine
            .signal(id, "approval", json!("yes"))
            .await
            .unwrap(),
        SignalOutcome::Kept
    );
    // A second one, before or after, changes nothing: the first payload stands.
    assert_eq!(
        db.engine.signal(id, "approval", json!("no")).await.unwrap(),
        SignalOutcome::AlreadyReceived
    );
    let a = claim_n(&db.engine, 1).await.remove(0);
    assert_eq!(
        db.engine.complete(&a, json!("a")).await.unwrap(),
        Outcome::Completed { fired: true }
    );
    // Entered and received in a's transaction: b is already claimable.
    let after = db.engine.execution(id).await.unwrap();
    assert_eq!(after.stages.len(), 3, "{after:?}");
    assert!(after.stages[1].fired_at.is_some());
    finish_with_b(&db, id, &json!("yes")).await;

    // A first-stage wait: entered by `start`, received at once if the signal came first
    // (it cannot: it is entered with the execution), else by the signal.
    db.register(
        &Workflow::new("first", 1)
            .stage(Stage::signal("approval"))
            .step("b"),
    )
    .await;
    let id = db.engine.start("first", &json!("input")).await.unwrap();
    assert_eq!(
        db.engine
            .signal(id, "approval", json!([1, 2]))
            .await
            .unwrap(),
        SignalOutcome::Received
    );
    finish_with_b(&db, id, &json!([1, 2])).await;
    assert!(db.engine.doctor().await.unwrap().is_healthy());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_signals_get_typed_errors_and_keep_nothing() {
    let db = TestDb::new(6).await;
    db.register(&approval("typed", FanInStrategy::Countdown))
        .await;
    db.register(
        &Workflow::new("to_map", 1)
            .stage(Stage::signal("items"))
            .map("each"),
    )
    .await;
    let id = db.engine.start("typed", &json!(null)).await.unwrap();
    let error = db
        .engine
        .signal(id, "aproval", json!(true))
        .await
        .unwrap_err();
    assert!(matches!(error, Error::UnknownSignal { .. }), "{error:?}");
    let text = error.to_string();
    assert!(
        text.contains("\"aproval\"") && text.contains("it waits for \"approval\""),
        "{text}"
    );
    let unknown = ExecutionId::from(uuid::Uuid::new_v4());
    assert!(matches!(
        db.engine.signal(unknown, "approval", json!(1)).await,
        Err(Error::ExecutionNotFound(_))
    ));
    // A map after the wait needs an array: refused before anything is kept.
    let to_map = db.engine.start("to_map", &json!(null)).await.unwrap();
    let error = db
        .engine
        .signal(to_map, "items", json!({"not": "an array"}))
        .await
        .unwrap_err();
    assert!(matches!(error, Error::InvalidSignal { .. }), "{error:?}");
    assert!(
        error.to_string().contains("must be a JSON array"),
        "{error}"
    );
    let kept: i64 = sqlx::query_scalar("SELECT count(*) FROM confluo.signal")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(kept, 0);
    assert_eq!(
        db.engine
            .signal(to_map, "items", json!([1, 2, 3]))
            .await
            .unwrap(),
        SignalOutcome::Received
    );
    assert_eq!(claim_n(&db.engine, 3).await.len(), 3);
    // A cancelled execution keeps nothing.
    assert!(db.engine.cancel(id).await.unwrap());
    assert_eq!(
        db.engine.signal(id, "approval", json!(1)).await.unwrap(),
        SignalOutcome::Ended(ExecutionStatus::Cancelled)
    );
}

#[test]
fn signal_waits_are_validated_at_registration() {
    let invalid = |stage: Stage| {
        let wf = Workflow::new("w", 1).stage(stage).map("m");
        matches!(
            wf.validate(),
            Err(confluo::DefinitionError::InvalidSignal { .. })
        )
    };
    assert!(invalid(Stage::signal("s").on_timeout(json!([])).into()));
    assert!(invalid(
        Stage::signal("s")
            .within(Duration::from_secs(1))
            .on_timeout(json!("not an array"))
            .into()
    ));
    assert!(invalid(
        Stage::signal("s")
            .within(Duration::from_secs(400_000 * 86_400 * 365))
            .into()
    ));
    assert!(!invalid(
        Stage::signal("s")
            .within(Duration::from_secs(1))
            .on_timeout(json!([]))
            .into()
    ));
    // The stage name is the signal's: two waits for one name are two stages of one name.
    let twice = Workflow::new("w", 1)
        .stage(Stage::signal("s"))
        .stage(Stage::signal("s"));
    assert!(matches!(
        twice.validate(),
        Err(confluo::DefinitionError::DuplicateStage(_))
    ));
    // Definitions stay data.
    let wf = Workflow::new("w", 1).stage(
        Stage::signal("s")
            .within(Duration::from_millis(1500))
            .on_timeout(json!({"late": true})),
    );
    let back: Workflow = serde_json::from_value(serde_json::to_value(&wf).unwrap()).unwrap();
    assert_eq!(back, wf);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_wait_times_out_by_failing_or_with_its_timeout_output() {
    let db = TestDb::new(10).await;
    db.register(
        &Workflow::new("strict", 1)
            .step("a")
            .stage(Stage::signal("approval").within(Duration::from_millis(300))),
    )
    .await;
    db.register(
        &Workflow::new("lenient", 1)
            .step("a")
            .stage(
                Stage::signal("approval")
                    .within(Duration::from_millis(300))
                    .on_timeout(json!({"approved": false})),
            )
            .stage(
                Stage::branch("decide")
                    .by("/approved")
                    .on("true", [Stage::step("pay")])
                    .otherwise([Stage::step("reject")]),
            ),
    )
    .await;
    let strict = db.engine.start("strict", &json!(null)).await.unwrap();
    let lenient = db.engine.start("lenient", &json!(null)).await.unwrap();
    let approved = db.engine.start("lenient", &json!(null)).await.unwrap();
    // A signal kept before the wait wins against a timeout that never starts.
    assert_eq!(
        db.engine
            .signal(approved, "approval", json!({"approved": true}))
            .await
            .unwrap(),
        SignalOutcome::Kept
    );
    let worker = quick_worker(&db.engine, |w| {
        w.handler("strict", "a", |_| async { Ok::<_, TaskError>(()) })
            .handler("lenient", "a", |_| async { Ok::<_, TaskError>(()) })
            .handler("lenient", "pay", |_| async { Ok::<_, TaskError>("paid") })
            .handler("lenient", "reject", |t| async move {
                Ok::<_, TaskError>(json!({"rejected": t.input().clone()}))
            })
    })
    .await;
    let failed = db.engine.wait(strict, WAIT).await.unwrap();
    let defaulted = db.engine.wait(lenient, WAIT).await.unwrap();
    let paid = db.engine.wait(approved, WAIT).await.unwrap();
    worker.shutdown().await;
    assert_eq!(failed.status, ExecutionStatus::Failed, "{failed:?}");
    let reason = failed.error.unwrap();
    assert!(
        reason.contains("no signal \"approval\" arrived within 300 ms"),
        "{reason}"
    );
    assert_eq!(failed.dead_letters.len(), 1);
    assert_eq!(
        defaulted.status,
        ExecutionStatus::Completed,
        "{defaulted:?}"
    );
    assert_eq!(
        defaulted.output,
        Some(json!({"rejected": {"approved": false}}))
    );
    assert_eq!(paid.output, Some(json!("paid")));
    // Too late: the wait is over, and nothing is kept.
    let late = db.engine.start("strict", &json!(null)).await.unwrap();
    let a = claim_n(&db.engine, 1).await.remove(0);
    db.engine.complete(&a, json!(null)).await.unwrap();
    tokio::time::sleep(Duration::from_millis(350)).await;
    let wait = claim_n(&db.engine, 1).await.remove(0);
    assert_eq!(wait.handler(), "confluo:signal");
    assert_eq!(
        db.engine.signal(late, "approval", json!(1)).await.unwrap(),
        SignalOutcome::TooLate,
        "a worker is timing it out"
    );
    db.engine.fail(&wait, "timed out", true).await.unwrap();
    assert_eq!(
        db.engine.signal(late, "approval", json!(1)).await.unwrap(),
        SignalOutcome::Ended(ExecutionStatus::Failed)
    );
}

/// Runs `a` and `b` at the same instant, released together by a barrier, each with a
/// connection of the pool ready for it.
async fn together<A, B>(engine: &Engine, a: A, b: B) -> (A::Output, B::Output)
where
    A: std::future::Future + Send + 'static,
    A::Output: Send + 'static,
    B: std::future::Future + Send + 'static,
    B::Output: Send + 'static,
{
    let barrier = Arc::new(Barrier::new(2));
    let (pool, gate) = (engine.pool().clone(), barrier.clone());
    let first = tokio::spawn(async move {
        drop(pool.acquire().await.unwrap());
        gate.wait().await;
        a.await
    });
    let (pool, gate) = (engine.pool().clone(), barrier);
    let second = tokio::spawn(async move {
        drop(pool.acquire().await.unwrap());
        gate.wait().await;
        b.await
    });
    (first.await.unwrap(), second.await.unwrap())
}

const ROUNDS: usize = 12;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_signal_racing_the_entry_of_its_wait_is_received_exactly_once() {
    for strategy in STRATEGIES {
        let db = TestDb::new(8).await;
        let wf = format!("entry_{}", strategy.as_str());
        db.register(&approval(&wf, strategy)).await;
        let mut seen = std::collections::BTreeSet::new();
        for round in 0..ROUNDS {
            let id = db.engine.start(&wf, &json!(null)).await.unwrap();
            let a = claim_n(&db.engine, 1).await.remove(0);
            let (engine, other) = (db.engine.clone(), db.engine.clone());
            let payload = json!({"round": round});
            let sent = payload.clone();
            let (completed, signalled) = together(
                &db.engine,
                async move { engine.complete(&a, json!("a")).await.unwrap() },
                async move { other.signal(id, "approval", sent).await.unwrap() },
            )
            .await;
            assert_eq!(
                completed,
                Outcome::Completed { fired: true },
                "{strategy} {round}"
            );
            assert!(
                matches!(signalled, SignalOutcome::Kept | SignalOutcome::Received),
                "{strategy} {round}: {signalled:?}"
            );
            seen.insert(format!("{signalled:?}"));
            let waits = wait_tasks(&db, id).await;
            assert_eq!(waits.len(), 1, "{strategy} {round}");
            assert_eq!(
                (waits[0].0.as_str(), waits[0].1, &waits[0].3),
                ("completed", 1, &payload),
                "{strategy} {round}"
            );
            assert_eq!(tasks_of(&db, id, "b").await, 1, "{strategy} {round}");
            finish_with_b(&db, id, &payload).await;
        }
        eprintln!("{strategy}: outcomes seen {seen:?}");
        assert!(db.engine.doctor().await.unwrap().is_healthy(), "{strategy}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_signal_racing_its_timeout_loses_or_wins_whole() {
    for strategy in STRATEGIES {
        let db = TestDb::new(8).await;
        let wf = format!("timeout_{}", strategy.as_str());
        db.register(
            &Workflow::new(&wf, 1)
                .stage(
                    Stage::from(
                        Stage::signal("approval")
                            .within(Duration::from_millis(1))
                            .on_timeout(json!("timed out")),
                    )
                    .fan_in(strategy),
                )
                .stage(Stage::step("b").fan_in(strategy)),
        )
        .await;
        let mut seen = std::collections::BTreeSet::new();
        for round in 0..ROUNDS {
            let id = db.engine.start(&wf, &json!(null)).await.unwrap();
            tokio::time::sleep(Duration::from_millis(5)).await;
            let (engine, other) = (db.engine.clone(), db.engine.clone());
            let name = wf.clone();
            // A worker's timeout (claim, then complete with the timeout output) against
            // the signal. It claims only the wait's timeouts (a plain claim would take
            // `b` once the signal entered it).
            let (timed_out, signalled) = together(
                &db.engine,
                async move {
                    let timeouts = [(name.as_str(), "confluo:signal")];
                    let claimed = engine
                        .claim_for("timer", &timeouts, 1, Duration::from_secs(60))
                        .await
                        .unwrap();
                    match claimed.first() {
                        Some(task) => {
                            Some(engine.complete(task, json!("timed out")).await.unwrap())
                        }
                        None => None,
                    }
                },
                async move {
                    other
                        .signal(id, "approval", json!("signalled"))
                        .await
                        .unwrap()
                },
            )
            .await;
            let winner = match (&timed_out, signalled) {
                (Some(Outcome::Completed { fired: true }), SignalOutcome::TooLate) => "timed out",
                (None, SignalOutcome::Received) => "signalled",
                other => panic!("{strategy} {round}: {other:?}"),
            };
            seen.insert(winner);
            let waits = wait_tasks(&db, id).await;
            assert_eq!(
                (waits.len(), waits[0].0.as_str(), waits[0].1, &waits[0].3),
                (1, "completed", 1, &json!(winner)),
                "{strategy} {round}"
            );
            assert_eq!(tasks_of(&db, id, "b").await, 1, "{strategy} {round}");
            finish_with_b(&db, id, &json!(winner)).await;
        }
        eprintln!("{strategy}: winners seen {seen:?}");
        assert!(db.engine.doctor().await.unwrap().is_healthy(), "{strategy}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_signals_of_one_name_at_once_are_received_once() {
    for strategy in STRATEGIES {
        let db = TestDb::new(8).await;
        let wf = format!("twice_{}", strategy.as_str());
        db.register(&approval(&wf, strategy)).await;
        for round in 0..ROUNDS {
            let id = db.engine.start(&wf, &json!(null)).await.unwrap();
            // Half the rounds with the wait entered, half before.
            if round % 2 == 0 {
                let a = claim_n(&db.engine, 1).await.remove(0);
                db.engine.complete(&a, json!("a")).await.unwrap();
            }
            let (one, two) = (db.engine.clone(), db.engine.clone());
            let (first, second) = together(
                &db.engine,
                async move { one.signal(id, "approval", json!("one")).await.unwrap() },
                async move { two.signal(id, "approval", json!("two")).await.unwrap() },
            )
            .await;
            let expected = if round % 2 == 0 {
                SignalOutcome::Received
            } else {
                SignalOutcome::Kept
            };
            let winner = match (first, second) {
                (f, SignalOutcome::AlreadyReceived) if f == expected => "one",
                (SignalOutcome::AlreadyReceived, s) if s == expected => "two",
                other => panic!("{strategy} {round}: {other:?}"),
            };
            if round % 2 == 1 {
                let a = claim_n(&db.engine, 1).await.remove(0);
                db.engine.complete(&a, json!("a")).await.unwrap();
            }
            assert_eq!(wait_tasks(&db, id).await[0].3, json!(winner));
            finish_with_b(&db, id, &json!(winner)).await;
        }
        assert!(db.engine.doctor().await.unwrap().is_healthy(), "{strategy}");
    }
}

/// A signal kept while its wait is pending (rows written around the engine, as a broken
/// engine would leave them) is an auditor's finding; the repair hands it over once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_auditor_hands_over_a_signal_its_wait_never_received() {
    let db = TestDb::new(6).await;
    db.register(&approval("lost", FanInStrategy::Countdown))
        .await;
    let id = db.engine.start("lost", &json!(null)).await.unwrap();
    let a = claim_n(&db.engine, 1).await.remove(0);
    db.engine.complete(&a, json!("a")).await.unwrap();
    sqlx::query("INSERT INTO confluo.signal (execution_id, name, payload) VALUES ($1, 'approval', '\"lost\"')")
        .bind(id)
        .execute(&db.pool)
        .await
        .unwrap();
    let found = db.engine.doctor().await.unwrap();
    assert_eq!(found.unreceived_signals.len(), 1, "{found:?}");
    assert_eq!(found.unreceived_signals[0].execution_id, id);
    let repairs = db.engine.repair().await.unwrap();
    assert_eq!(repairs.signals_received, 1);
    assert!(db.engine.doctor().await.unwrap().is_healthy());
    assert_eq!(db.engine.repair().await.unwrap().signals_received, 0);
    finish_with_b(&db, id, &json!("lost")).await;
}
