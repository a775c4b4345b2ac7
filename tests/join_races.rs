//! Join rules where they meet operators and racing workers, against real PostgreSQL:
//! a quorum met while its execution was failed fires when a reprocess resumes it; a
//! member that fails as its quorum fires is not run again; and the stage after a quorum
//! never sees a member still in flight. Races are released together by barriers, each
//! side on a connection of its own, for every strategy that counts a quorum.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{groups_of, TestDb};
use confluo::{
    ClaimedTask, ExecutionId, ExecutionStatus, FanInStrategy, Join, Outcome, Stage, Workflow,
};
use serde_json::{json, Value};

const ROUNDS: usize = 40;

/// The strategies that count a quorum.
const QUORUM_STRATEGIES: [FanInStrategy; 2] = [FanInStrategy::Countdown, FanInStrategy::RowLock];

/// Members of the execution's stage `stage` by item, with their status.
async fn statuses(db: &TestDb, id: ExecutionId, stage: &str) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT t.status FROM confluo.task t JOIN confluo.stage_group g ON g.id = t.group_id
          WHERE t.execution_id = $1 AND g.stage_name = $2 ORDER BY t.item_index",
    )
    .bind(id)
    .bind(stage)
    .fetch_all(&db.pool)
    .await
    .unwrap()
}

/// Claims the `n` tasks of `handler` of workflow `workflow`, in item order.
async fn claim_members(db: &TestDb, workflow: &str, handler: &str, n: usize) -> Vec<ClaimedTask> {
    let mut tasks = common::family::claim_of(&db.engine, workflow, handler, n).await;
    tasks.sort_by_key(ClaimedTask::item_index);
    tasks
}

/// Registers `name`: a map `m` joined `any`, retried up to five times, then a step `next`.
async fn any_map_with_retries(db: &TestDb, name: &str, strategy: FanInStrategy) {
    let wf = Workflow::new(name, 1)
        .stage(
            Stage::map("m")
                .join(Join::Any)
                .retry(common::fast_retry(5))
                .fan_in(strategy),
        )
        .stage(Stage::step("next").fan_in(strategy));
    db.register(&wf).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_quorum_met_while_its_execution_was_failed_fires_when_a_reprocess_resumes_it() {
    let db = TestDb::new(10).await;
    for strategy in QUORUM_STRATEGIES {
        let name = format!("resume_any_{strategy}");
        let wf = Workflow::new(&name, 1)
            .stage(
                Stage::map("m")
                    .join(Join::Any)
                    .fail_execution_on_member_failure()
                    .fan_in(strategy),
            )
            .stage(Stage::step("next").fan_in(strategy));
        db.register(&wf).await;
        let id = db.engine.start(&name, &json!([0, 1, 2])).await.unwrap();
        let m = claim_members(&db, &name, "m", 3).await;
        // m0 dead-letters and fails the execution; m1, still running, completes while it
        // is failed: its quorum is met, but nothing may fire in a failed execution; m2's
        // failure is cancelled.
        let dead = db.engine.fail(&m[0], "down", true).await.unwrap();
        assert_eq!(dead, Outcome::DeadLettered { fired: false }, "{strategy}");
        let while_failed = db.engine.complete(&m[1], json!("one")).await.unwrap();
        assert_eq!(
            while_failed,
            Outcome::Completed { fired: false },
            "{strategy}"
        );
        assert_eq!(
            db.engine.fail(&m[2], "late", false).await.unwrap(),
            Outcome::Cancelled,
            "{strategy}"
        );
        assert_eq!(
            db.engine.execution(id).await.unwrap().status,
            ExecutionStatus::Failed
        );

        // The resume fires the group its quorum was met in, in the reprocess's own
        // transaction: what was requeued of it is cancelled at once, nothing of it runs.
        let done = db.engine.reprocess(m[0].id()).await.unwrap();
        assert!(done.resumed, "{strategy}: {done:?}");
        assert!(done.group_fired, "{strategy}: {done:?}");
        assert!(done.requeued.is_empty(), "{strategy}: {done:?}");
        assert_eq!(groups_of(&db, id, "m").await, (1, 1), "{strategy}");
        assert_eq!(groups_of(&db, id, "next").await.0, 1, "{strategy}");
        assert_eq!(
            statuses(&db, id, "m").await,
            ["cancelled", "completed", "cancelled"],
            "{strategy}"
        );
        let next = claim_members(&db, &name, "next", 1).await;
        let input = db.engine.task_input(&next[0]).await.unwrap();
        assert_eq!(input["outputs"], json!(["one"]), "{strategy}: {input}");
        let failed: Vec<&str> = input["failed"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| f["status"].as_str().unwrap())
            .collect();
        assert_eq!(failed, ["cancelled", "cancelled"], "{strategy}: {input}");
        db.engine.complete(&next[0], json!("ok")).await.unwrap();
        let end = db.engine.execution(id).await.unwrap();
        assert_eq!(
            end.status,
            ExecutionStatus::Completed,
            "{strategy}: {end:?}"
        );
        let diagnosis = db.engine.doctor().await.unwrap();
        assert!(diagnosis.is_healthy(), "{strategy}: {diagnosis:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_quorum_met_while_a_sibling_failed_the_execution_fires_on_resume() {
    let db = TestDb::new(10).await;
    for strategy in QUORUM_STRATEGIES {
        let name = format!("resume_dag_{strategy}");
        // `quotes` (any of two) and `check` both start; `merge` waits for both.
        let wf = Workflow::new(&name, 1)
            .stage(
                Stage::parallel("quotes", [format!("{name}_a"), format!("{name}_b")])
                    .join(Join::Any)
                    .fan_in(strategy)
                    .at_start(),
            )
            .stage(Stage::step("check").fan_in(strategy).at_start())
            .stage(Stage::step("merge").after(["quotes", "check"]));
        db.register(&wf).await;
        let id = db.engine.start(&name, &json!(null)).await.unwrap();
        let a = claim_members(&db, &name, &format!("{name}_a"), 1).await;
        let check = claim_members(&db, &name, "check", 1).await;
        // The step fails the execution; b, still pending, is cancelled by the stop.
        db.engine.fail(&check[0], "refused", true).await.unwrap();
        assert_eq!(
            db.engine.execution(id).await.unwrap().status,
            ExecutionStatus::Failed
        );
        // a completes while it is failed: the quorum is met, nothing fires.
        let late = db.engine.complete(&a[0], json!(7)).await.unwrap();
        assert_eq!(late, Outcome::Completed { fired: false }, "{strategy}");

        let done = db.engine.reprocess(check[0].id()).await.unwrap();
        assert!(done.resumed, "{strategy}: {done:?}");
        assert_eq!(done.requeued, [check[0].id()], "{strategy}: {done:?}");
        assert_eq!(groups_of(&db, id, "quotes").await, (1, 1), "{strategy}");
        let check = claim_members(&db, &name, "check", 1).await;
        let fired = db.engine.complete(&check[0], json!(true)).await.unwrap();
        assert_eq!(fired, Outcome::Completed { fired: true }, "{strategy}");
        let merge = claim_members(&db, &name, "merge", 1).await;
        db.engine
            .complete(&merge[0], json!("merged"))
            .await
            .unwrap();
        let end = db.engine.execution(id).await.unwrap();
        assert_eq!(
            end.status,
            ExecutionStatus::Completed,
            "{strategy}: {end:?}"
        );
        let diagnosis = db.engine.doctor().await.unwrap();
        assert!(diagnosis.is_healthy(), "{strategy}: {diagnosis:?}");
    }
}

/// Runs `a` and `b` on connections of their own, released together.
async fn race<A, B>(db: &TestDb, a: A, b: B) -> (A::Output, B::Output)
where
    A: std::future::Future + Send + 'static,
    B: std::future::Future + Send + 'static,
    A::Output: Send + 'static,
    B::Output: Send + 'static,
{
    let barrier = Arc::new(tokio::sync::Barrier::new(2));
    let (pa, pb) = (db.engine.pool().clone(), db.engine.pool().clone());
    let (ba, bb) = (barrier.clone(), barrier);
    let ha = tokio::spawn(async move {
        drop(pa.acquire().await.unwrap());
        ba.wait().await;
        a.await
    });
    let hb = tokio::spawn(async move {
        drop(pb.acquire().await.unwrap());
        bb.wait().await;
        b.await
    });
    (ha.await.unwrap(), hb.await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_member_failing_as_its_quorum_fires_is_not_run_again() {
    let db = TestDb::new(10).await;
    for strategy in QUORUM_STRATEGIES {
        let name = format!("retry_any_{strategy}");
        any_map_with_retries(&db, &name, strategy).await;
        let mut retried = 0;
        for round in 0..ROUNDS {
            let context = format!("{strategy} round {round}");
            let id = db.engine.start(&name, &json!([0, 1])).await.unwrap();
            let m = claim_members(&db, &name, "m", 2).await;
            let (engine_a, engine_b) = (db.engine.clone(), db.engine.clone());
            let [a, b]: [ClaimedTask; 2] = m.try_into().unwrap();
            let (completed, failed) = race(
                &db,
                async move { engine_a.complete(&a, json!("a")).await.unwrap() },
                async move { engine_b.fail(&b, "flaky", false).await.unwrap() },
            )
            .await;
            assert_eq!(completed, Outcome::Completed { fired: true }, "{context}");
            retried += usize::from(matches!(failed, Outcome::RetryScheduled { .. }));
            // Whichever went first, b ends cancelled: never due again after the fire.
            assert_eq!(
                statuses(&db, id, "m").await,
                ["completed", "cancelled"],
                "{context}: {failed:?}"
            );
            let again = db
                .engine
                .claim_for("test", &[(&name, "m")], 10, Duration::from_secs(60))
                .await
                .unwrap();
            assert!(again.is_empty(), "{context}: {again:?}");
            db.engine.cancel(id).await.unwrap();
        }
        eprintln!(
            "{strategy}: the retry was recorded before the fire in {retried} of {ROUNDS} rounds"
        );
    }
    let diagnosis = db.engine.doctor().await.unwrap();
    assert!(diagnosis.is_healthy(), "{diagnosis:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn members_claimed_as_their_quorum_fires_end_cancelled_and_are_never_run_again() {
    let db = TestDb::new(10).await;
    for strategy in QUORUM_STRATEGIES {
        let name = format!("claim_any_{strategy}");
        any_map_with_retries(&db, &name, strategy).await;
        let mut in_flight = 0;
        for round in 0..ROUNDS {
            let context = format!("{strategy} round {round}");
            let id = db.engine.start(&name, &json!([0, 1, 2, 3])).await.unwrap();
            let first = claim_members(&db, &name, "m", 1).await;
            let [first]: [ClaimedTask; 1] = first.try_into().unwrap();
            let (engine_a, engine_b) = (db.engine.clone(), db.engine.clone());
            let claim_name = name.clone();
            let (completed, claimed) = race(
                &db,
                async move { engine_a.complete(&first, json!("first")).await.unwrap() },
                async move {
                    engine_b
                        .claim_for("test", &[(&claim_name, "m")], 3, Duration::from_secs(60))
                        .await
                        .unwrap()
                },
            )
            .await;
            assert_eq!(completed, Outcome::Completed { fired: true }, "{context}");
            in_flight += usize::from(!claimed.is_empty());
            // The next stage's input lists no member as still running: a member in flight
            // as the join fired is cancelled, whatever it does next.
            let next = claim_members(&db, &name, "next", 1).await;
            let input = db.engine.task_input(&next[0]).await.unwrap();
            assert_eq!(input["outputs"], json!(["first"]), "{context}: {input}");
            let failed: Vec<Value> = input["failed"].as_array().unwrap().clone();
            assert_eq!(failed.len(), 3, "{context}: {input}");
            for f in &failed {
                assert_eq!(f["status"], "cancelled", "{context}: {input}");
                assert!(f["error"].is_string(), "{context}: {input}");
            }
            // What the rival claimed fails retryably, or completes: cancelled either way,
            // and never claimed again.
            for (i, t) in claimed.iter().enumerate() {
                let outcome = if i % 2 == 0 {
                    db.engine.fail(t, "flaky", false).await.unwrap()
                } else {
                    db.engine.complete(t, json!("late")).await.unwrap()
                };
                // The row lock re-counts after its write: it cancels a late completion
                // it finds, and tells it `Completed { fired: false }`.
                let told_late = outcome == Outcome::Completed { fired: false }
                    && strategy == FanInStrategy::RowLock;
                assert!(
                    matches!(outcome, Outcome::Cancelled | Outcome::LeaseLost) || told_late,
                    "{context}: {outcome:?}"
                );
            }
            let again = db
                .engine
                .claim_for("test", &[(&name, "m")], 10, Duration::from_secs(60))
                .await
                .unwrap();
            assert!(again.is_empty(), "{context}: {again:?}");
            let mut ended = statuses(&db, id, "m").await;
            ended.sort();
            assert_eq!(
                ended,
                ["cancelled", "cancelled", "cancelled", "completed"],
                "{context}"
            );
            db.engine.complete(&next[0], json!(null)).await.unwrap();
            let end = db.engine.execution(id).await.unwrap();
            assert_eq!(end.status, ExecutionStatus::Completed, "{context}");
        }
        eprintln!(
            "{strategy}: the claim took members before the fire in {in_flight} of {ROUNDS} rounds"
        );
    }
    let diagnosis = db.engine.doctor().await.unwrap();
    assert!(diagnosis.is_healthy(), "{diagnosis:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_quorum_met_while_failed_on_the_last_stage_completes_the_execution_on_resume() {
    let db = TestDb::new(10).await;
    let wf = Workflow::new("resume_last", 1).stage(
        Stage::map("m")
            .join(Join::Any)
            .fail_execution_on_member_failure(),
    );
    db.register(&wf).await;
    let id = db
        .engine
        .start("resume_last", &json!([0, 1]))
        .await
        .unwrap();
    let m = claim_members(&db, "resume_last", "m", 2).await;
    db.engine.fail(&m[0], "down", true).await.unwrap();
    db.engine.complete(&m[1], json!("one")).await.unwrap();
    // The resume fires the last stage's group: the execution completes, in the
    // reprocess's own transaction.
    let done = db.engine.reprocess(m[0].id()).await.unwrap();
    assert!(done.resumed && done.group_fired, "{done:?}");
    let end = db.engine.execution(id).await.unwrap();
    assert_eq!(end.status, ExecutionStatus::Completed, "{end:?}");
    assert_eq!(end.output.unwrap()["outputs"], json!(["one"]));
}

#[tokio::test]
async fn a_resume_that_could_move_nothing_is_refused() {
    let db = TestDb::new(6).await;
    // `m` lets members fail; `q`, a map joined `any` over what `m` passed on, can never
    // fire when nothing was: the execution fails entering it, not on a task.
    let wf = Workflow::new("moves_nothing", 1)
        .stage(Stage::map("m"))
        .stage(Stage::map("q").join(Join::Any));
    db.register(&wf).await;
    let id = db.engine.start("moves_nothing", &json!([0])).await.unwrap();
    let m = claim_members(&db, "moves_nothing", "m", 1).await;
    db.engine.fail(&m[0], "down", true).await.unwrap();
    let failed = db.engine.execution(id).await.unwrap();
    assert_eq!(failed.status, ExecutionStatus::Failed, "{failed:?}");
    assert!(failed.error.as_deref().unwrap().contains("can never fire"));
    // Reprocessing m's dead member would run it again in a group that fired, and then
    // stall: refused, and nothing changes.
    match db.engine.reprocess(m[0].id()).await {
        Err(confluo::Error::ResumeMovesNothing { execution, error }) => {
            assert_eq!(execution, id);
            assert!(error.contains("can never fire"), "{error}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        db.engine.execution(id).await.unwrap().status,
        ExecutionStatus::Failed
    );
    assert_eq!(statuses(&db, id, "m").await, ["dead"]);
    let diagnosis = db.engine.doctor().await.unwrap();
    assert!(diagnosis.is_healthy(), "{diagnosis:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reprocessing_a_dead_member_of_a_fired_quorum_cancels_it_rather_than_run_it() {
    let db = TestDb::new(6).await;
    for strategy in QUORUM_STRATEGIES {
        let name = format!("fired_dead_{strategy}");
        let wf = Workflow::new(&name, 1)
            .stage(Stage::map("m").join(Join::AtLeast(2)).fan_in(strategy))
            .stage(Stage::step("next").fan_in(strategy));
        db.register(&wf).await;
        let id = db.engine.start(&name, &json!([0, 1, 2])).await.unwrap();
        let m = claim_members(&db, &name, "m", 3).await;
        db.engine.fail(&m[0], "down", true).await.unwrap();
        db.engine.complete(&m[1], json!(1)).await.unwrap();
        let fired = db.engine.complete(&m[2], json!(2)).await.unwrap();
        assert_eq!(fired, Outcome::Completed { fired: true }, "{strategy}");
        // The join went on without m0: reprocessing it would run it for nothing.
        let done = db.engine.reprocess(m[0].id()).await.unwrap();
        assert!(done.group_fired && !done.resumed, "{strategy}: {done:?}");
        assert!(done.requeued.is_empty(), "{strategy}: {done:?}");
        assert_eq!(
            statuses(&db, id, "m").await,
            ["cancelled", "completed", "completed"],
            "{strategy}"
        );
        let again = db
            .engine
            .claim_for("test", &[(&name, "m")], 10, Duration::from_secs(60))
            .await
            .unwrap();
        assert!(again.is_empty(), "{strategy}: {again:?}");
        let diagnosis = db.engine.doctor().await.unwrap();
        assert!(diagnosis.is_healthy(), "{strategy}: {diagnosis:?}");
        db.engine.cancel(id).await.unwrap();
    }
}
