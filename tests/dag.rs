//! Dependency fan-in (a DAG) against real PostgreSQL: stages that wait for several earlier
//! stages (`Stage::after`), entered once all have finished, by the one transaction whose
//! arrival brings the stage's countdown of unfinished dependencies to zero. Raced behind a
//! barrier for each strategy: two dependencies finishing together, on connections of
//! their own, and together in one batch.

mod common;

use std::time::Duration;

use common::{claim_n, groups_of, quick_worker, race_completions, TestDb, STRATEGIES, WAIT};
use confluo::{
    DefinitionError, Error, ExecutionId, ExecutionStatus, FanInStrategy, Outcome, Stage, TaskError,
    Workflow,
};
use serde_json::{json, Value};

const ROUNDS: usize = 12;

/// fetch_a and fetch_b from the start; checks (a parallel block) after fetch_a; merge after
/// fetch_b and checks.
fn report(name: &str, strategy: FanInStrategy) -> Workflow {
    Workflow::new(name, 1)
        .stage(Stage::step("fetch_a").fan_in(strategy))
        .stage(Stage::step("fetch_b").at_start().fan_in(strategy))
        .stage(
            Stage::parallel("checks", ["check_x", "check_y"])
                .after(["fetch_a"])
                .fan_in(strategy),
        )
        .stage(
            Stage::step("merge")
                .after(["fetch_b", "checks"])
                .fan_in(strategy),
        )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stage_waiting_for_several_runs_once_with_their_outputs_through_workers() {
    let db = TestDb::new(10).await;
    let diamond = Workflow::new("diamond", 1)
        .step("split")
        .stage(Stage::map("each").after(["split"]))
        .stage(Stage::step("side").after(["split"]))
        .stage(Stage::step("total").after(["each", "side"]));
    db.register(&diamond).await;
    for strategy in STRATEGIES {
        db.register(&report(&format!("report_{strategy}"), strategy))
            .await;
    }
    let worker = quick_worker(&db.engine, |mut w| {
        for strategy in STRATEGIES {
            let name = format!("report_{strategy}");
            w = w
                .handler(&name, "fetch_a", |t| async move {
                    Ok::<_, TaskError>(json!(t.input().as_i64().unwrap() * 2))
                })
                .handler(&name, "fetch_b", |_| async {
                    Ok::<_, TaskError>(json!("b"))
                })
                .handler(&name, "check_x", |t| async move {
                    Ok::<_, TaskError>(t.input().clone())
                })
                .handler(&name, "check_y", |t| async move {
                    Ok::<_, TaskError>(t.input().clone())
                })
                .handler(&name, "merge", |t| async move {
                    Ok::<_, TaskError>(t.input().clone())
                });
        }
        w.handler("diamond", "split", |t| async move {
            let n = t.input().as_i64().unwrap();
            Ok::<_, TaskError>(json!((0..n).collect::<Vec<_>>()))
        })
        .handler("diamond", "each", |t| async move {
            Ok::<_, TaskError>(json!(t.input().as_i64().unwrap() * 10))
        })
        .handler("diamond", "side", |t| async move {
            Ok::<_, TaskError>(json!(t.input().as_array().unwrap().len()))
        })
        .handler("diamond", "total", |t| async move {
            let sum: i64 = t.input()["each"]["outputs"]
                .as_array()
                .unwrap()
                .iter()
                .filter_map(Value::as_i64)
                .sum();
            Ok::<_, TaskError>(json!({"sum": sum, "count": t.input()["side"]}))
        })
    })
    .await;
    for strategy in STRATEGIES {
        let id = db
            .engine
            .start(&format!("report_{strategy}"), &json!(3))
            .await
            .unwrap();
        let done = db.engine.wait(id, WAIT).await.unwrap();
        assert_eq!(done.status, ExecutionStatus::Completed, "{done:?}");
        assert_eq!(
            done.output.unwrap(),
            json!({
                "fetch_b": "b",
                "checks": {"outputs": {"check_x": 6, "check_y": 6}, "failed": []}
            }),
            "{strategy}"
        );
        for stage in ["fetch_a", "fetch_b", "checks", "merge"] {
            assert_eq!(
                groups_of(&db, id, stage).await,
                (1, 1),
                "{strategy} {stage}"
            );
        }
    }
    let id = db.engine.start("diamond", &json!(20)).await.unwrap();
    let done = db.engine.wait(id, WAIT).await.unwrap();
    assert_eq!(done.status, ExecutionStatus::Completed, "{done:?}");
    assert_eq!(done.output.unwrap(), json!({"sum": 1900, "count": 20}));
    worker.shutdown().await;
    let diagnosis = db.engine.doctor().await.unwrap();
    assert!(diagnosis.is_healthy(), "{diagnosis:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failed_dependency_fails_the_execution_and_the_other_branch_enters_nothing() {
    let db = TestDb::new(10).await;
    db.register(&pair("pair", FanInStrategy::Countdown)).await;
    let id = db.engine.start("pair", &json!(null)).await.unwrap();
    let tasks = claim_n(&db.engine, 2).await;
    let a = tasks.iter().find(|t| t.handler() == "fetch_a").unwrap();
    assert_eq!(
        db.engine.fail(a, "refused", true).await.unwrap(),
        Outcome::DeadLettered { fired: false }
    );
    assert_eq!(db.engine.status(id).await.unwrap(), ExecutionStatus::Failed);
    let b = tasks.iter().find(|t| t.handler() == "fetch_b").unwrap();
    // fetch_b was running: its late completion is recorded and dispatches nothing.
    assert_eq!(
        db.engine.complete(b, json!("late")).await.unwrap(),
        Outcome::Completed { fired: false }
    );
    assert_eq!(groups_of(&db, id, "merge").await, (0, 0));
    assert_eq!(db.engine.status(id).await.unwrap(), ExecutionStatus::Failed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn registration_refuses_unknown_backward_cyclic_and_unjoined_dependencies() {
    let db = TestDb::new(4).await;
    let refused = |wf: Workflow| {
        let engine = db.engine.clone();
        async move {
            match engine.register(&wf).await {
                Err(Error::InvalidDefinition(e)) => e,
                other => panic!("{} registered: {other:?}", wf.name()),
            }
        }
    };
    let e = refused(
        Workflow::new("w1", 1)
            .step("a")
            .stage(Stage::step("b").after(["z"])),
    )
    .await;
    assert!(
        matches!(e, DefinitionError::UnknownDependency { .. }),
        "{e}"
    );
    assert!(e.to_string().contains("\"z\""), "{e}");
    let e = refused(
        Workflow::new("w2", 1)
            .stage(Stage::step("a").after(["b"]))
            .stage(Stage::step("b").after(["a"])),
    )
    .await;
    assert!(
        matches!(e, DefinitionError::DependencyCycle(ref c) if c == &["a", "b", "a"]),
        "{e}"
    );
    let e = refused(
        Workflow::new("w3", 1)
            .stage(Stage::step("a").after(["b"]))
            .stage(Stage::step("b").at_start())
            .step("c"),
    )
    .await;
    assert!(matches!(e, DefinitionError::DependencyOrder { .. }), "{e}");
    let e = refused(
        Workflow::new("w4", 1)
            .step("a")
            .stage(Stage::step("b").at_start())
            .stage(Stage::step("c").after(["a"])),
    )
    .await;
    assert!(
        matches!(e, DefinitionError::UnjoinedStage { ref stage, ref last } if stage == "b" && last == "c"),
        "{e}"
    );
    let e = refused(
        Workflow::new("w5", 1)
            .step("a")
            .stage(Stage::step("b").at_start())
            .stage(Stage::map("c").after(["a", "b"])),
    )
    .await;
    assert!(matches!(e, DefinitionError::InvalidJoin { .. }), "{e}");
    let e = refused(
        Workflow::new("w6", 1)
            .step("a")
            .stage(Stage::branch("route").on("x", [Stage::step("inner").after(["a"])])),
    )
    .await;
    assert!(matches!(e, DefinitionError::DependencyInArm { .. }), "{e}");
    // A definition read as data may name a dependency twice (the builder keeps one): the
    // join would wait for an arrival that never comes, so it is refused.
    let mut data = serde_json::to_value(
        Workflow::new("w7", 1)
            .step("a")
            .stage(Stage::step("b").at_start())
            .stage(Stage::step("c").after(["a", "b"])),
    )
    .unwrap();
    data["stages"][2]["after"] = json!(["a", "b", "a"]);
    let twice: Workflow = serde_json::from_value(data).expect("a workflow as data");
    let e = refused(twice).await;
    assert!(
        matches!(e, DefinitionError::DuplicateDependency { ref stage, ref dependency } if stage == "c" && dependency == "a"),
        "{e}"
    );
    // The list form is the chain: it registers as before.
    db.register(&Workflow::new("chain", 1).step("a").step("b").step("c"))
        .await;
}

/// fetch_a and fetch_b from the start, merge after both.
fn pair(name: &str, strategy: FanInStrategy) -> Workflow {
    Workflow::new(name, 1)
        .stage(Stage::step("fetch_a").fan_in(strategy))
        .stage(Stage::step("fetch_b").at_start().fan_in(strategy))
        .stage(
            Stage::step("merge")
                .after(["fetch_a", "fetch_b"])
                .fan_in(strategy),
        )
}

/// Starts `name` (a [`pair`]) and claims its two fetches.
async fn two_fetches(db: &TestDb, name: &str) -> (ExecutionId, Vec<confluo::ClaimedTask>) {
    let id = db.engine.start(name, &json!(null)).await.unwrap();
    let mut tasks = claim_n(&db.engine, 2).await;
    tasks.sort_by_key(|t| t.handler().to_owned());
    assert!(tasks.iter().all(|t| t.execution_id() == id));
    (id, tasks)
}

/// The merge stage was entered once, with both fetches' outputs; its countdown is at zero.
async fn merged_once(db: &TestDb, id: ExecutionId, context: &str) {
    assert_eq!(groups_of(db, id, "merge").await, (1, 0), "{context}");
    let input: Value = sqlx::query_scalar(
        "SELECT input FROM confluo.task WHERE execution_id = $1 AND handler = 'merge'",
    )
    .bind(id)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(input, json!({"fetch_a": "a", "fetch_b": "b"}), "{context}");
    let remaining: i32 =
        sqlx::query_scalar("SELECT remaining FROM confluo.stage_join WHERE execution_id = $1")
            .bind(id)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(remaining, 0, "{context}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_dependencies_finishing_together_enter_their_stage_once() {
    let db = TestDb::new(20).await;
    for strategy in STRATEGIES {
        let name = format!("pair_{strategy}");
        db.register(&pair(&name, strategy)).await;
        for round in 0..ROUNDS {
            let context = format!("{strategy} round {round}");
            // On connections of their own, released together.
            let (id, mut tasks) = two_fetches(&db, &name).await;
            let b = tasks.pop().unwrap();
            let a = tasks.pop().unwrap();
            let (outcomes, second) =
                race_completions(&db.engine, vec![a], json!("a"), |e| async move {
                    e.complete(&b, json!("b")).await.unwrap()
                })
                .await;
            for outcome in [outcomes[0].clone(), second] {
                assert_eq!(outcome, Outcome::Completed { fired: true }, "{context}");
            }
            merged_once(&db, id, &context).await;
            db.engine.cancel(id).await.unwrap();

            // In one batch: both arrivals in one transaction.
            let (id, tasks) = two_fetches(&db, &name).await;
            let outcomes = db
                .engine
                .complete_batch(&[(&tasks[0], json!("a")), (&tasks[1], json!("b"))])
                .await
                .unwrap();
            let fired = Outcome::Completed { fired: true };
            assert_eq!(outcomes, [fired.clone(), fired], "{context}");
            merged_once(&db, id, &format!("{context}, batched")).await;
            db.engine.cancel(id).await.unwrap();
        }
    }
    let diagnosis = db.engine.doctor().await.unwrap();
    assert!(diagnosis.is_healthy(), "{diagnosis:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_auditor_enters_a_join_whose_dependencies_all_arrived() {
    let db = TestDb::new(10).await;
    db.register(&pair("pair", FanInStrategy::Countdown)).await;
    let (id, tasks) = two_fetches(&db, "pair").await;
    db.engine.complete(&tasks[0], json!("a")).await.unwrap();
    db.engine.complete(&tasks[1], json!("b")).await.unwrap();
    // A defect: the merge stage's group (and task) lost after both arrived.
    sqlx::query("DELETE FROM confluo.stage_group WHERE execution_id = $1 AND stage_name = 'merge'")
        .bind(id)
        .execute(&db.pool)
        .await
        .unwrap();
    let diagnosis = db.engine.doctor().await.unwrap();
    assert_eq!(diagnosis.stalled_executions.len(), 1, "{diagnosis:?}");
    db.engine.repair().await.unwrap();
    merged_once(&db, id, "repaired").await;
    assert!(db.engine.doctor().await.unwrap().is_healthy());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dependency_that_finished_while_the_execution_was_failed_counts_once_it_resumes() {
    let db = TestDb::new(10).await;
    db.register(&pair("pair", FanInStrategy::Countdown)).await;
    let (id, tasks) = two_fetches(&db, "pair").await;
    db.engine.fail(&tasks[0], "refused", true).await.unwrap();
    // fetch_b ends while the execution is failed: recorded, firing nothing.
    assert_eq!(
        db.engine.complete(&tasks[1], json!("b")).await.unwrap(),
        Outcome::Completed { fired: false }
    );
    let reprocessed = db.engine.reprocess(tasks[0].id()).await.unwrap();
    assert!(reprocessed.resumed);
    let again = claim_n(&db.engine, 1).await.remove(0);
    assert_eq!(again.handler(), "fetch_a");
    db.engine.complete(&again, json!("a")).await.unwrap();
    merged_once(&db, id, "resumed").await;
    let merge = claim_n(&db.engine, 1).await.remove(0);
    db.engine.complete(&merge, json!("merged")).await.unwrap();
    assert_eq!(
        db.engine.status(id).await.unwrap(),
        ExecutionStatus::Completed
    );
    assert!(db.engine.doctor().await.unwrap().is_healthy());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_resume_gives_a_sleep_and_a_timed_wait_beside_the_failed_stage_their_due_times_back() {
    let db = TestDb::new(10).await;
    db.register(
        &Workflow::new("beside", 1)
            .step("fetch")
            .stage(Stage::sleep("nap", Duration::from_secs(3600)).at_start())
            .stage(
                Stage::from(Stage::signal("approve").within(Duration::from_secs(3600))).at_start(),
            )
            .stage(Stage::step("merge").after(["fetch", "nap", "approve"])),
    )
    .await;
    let id = db.engine.start("beside", &json!(null)).await.unwrap();
    let due_times = || async {
        let rows: Vec<(String, String, bool)> = sqlx::query_as(
            "SELECT handler, status, run_at > now() + interval '50 minutes'
               FROM confluo.task WHERE execution_id = $1 AND handler LIKE 'confluo:%'
              ORDER BY handler",
        )
        .bind(id)
        .fetch_all(&db.pool)
        .await
        .unwrap();
        rows
    };
    let before: Vec<(String, String, bool)> = due_times().await;
    assert_eq!(
        before,
        [
            ("confluo:signal".into(), "pending".into(), true),
            ("confluo:sleep".into(), "pending".into(), true)
        ]
    );
    let fetch = claim_n(&db.engine, 1).await.remove(0);
    assert_eq!(fetch.handler(), "fetch");
    db.engine.fail(&fetch, "refused", true).await.unwrap();
    assert_eq!(db.engine.status(id).await.unwrap(), ExecutionStatus::Failed);
    assert!(due_times().await.iter().all(|(_, s, _)| s == "cancelled"));

    let reprocessed = db.engine.reprocess(fetch.id()).await.unwrap();
    assert!(reprocessed.resumed);
    assert_eq!(
        due_times().await,
        before,
        "the sleep or the wait became due at the resume"
    );
    // The wait still receives its signal, and the join still needs all three.
    assert_eq!(
        db.engine.signal(id, "approve", json!("yes")).await.unwrap(),
        confluo::SignalOutcome::Received
    );
    let again = claim_n(&db.engine, 1).await.remove(0);
    assert_eq!(again.handler(), "fetch");
    db.engine.complete(&again, json!("a")).await.unwrap();
    assert_eq!(
        groups_of(&db, id, "merge").await,
        (0, 0),
        "merge entered early"
    );
    assert!(db.engine.doctor().await.unwrap().is_healthy());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_resume_that_would_fail_the_execution_at_once_is_refused_and_leaves_the_dead_letter() {
    let db = TestDb::new(10).await;
    db.register(
        &Workflow::new("route_b", 1)
            .step("fetch_a")
            .stage(Stage::step("fetch_b").at_start())
            .stage(
                Stage::from(Stage::branch("route").on("x", [Stage::step("on_x")]))
                    .after(["fetch_b"]),
            )
            .stage(Stage::step("merge").after(["fetch_a", "route"])),
    )
    .await;
    let id = db.engine.start("route_b", &json!(null)).await.unwrap();
    let mut tasks = claim_n(&db.engine, 2).await;
    tasks.sort_by_key(|t| t.handler().to_owned());
    db.engine.fail(&tasks[0], "refused", true).await.unwrap();
    // fetch_b ends while the execution is failed, with an output no arm of route takes.
    db.engine.complete(&tasks[1], json!("y")).await.unwrap();
    let e = db.engine.reprocess(tasks[0].id()).await.unwrap_err();
    assert!(
        matches!(e, Error::ResumeFailsAtOnce { execution, ref reason } if execution == id && reason.contains("route")),
        "{e}"
    );
    assert!(e.to_string().contains("the dead letter stays"), "{e}");
    // Nothing moved: the execution is failed, the dead letter dead, fetch_b unfired.
    assert_eq!(db.engine.status(id).await.unwrap(), ExecutionStatus::Failed);
    db.engine
        .dead_letter(tasks[0].id())
        .await
        .expect("still dead");
    assert_eq!(groups_of(&db, id, "fetch_b").await, (1, 0));
    assert_eq!(groups_of(&db, id, "route").await, (0, 0));
}
