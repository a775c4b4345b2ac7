//! Join rules (`Stage::join`) against real PostgreSQL: `any` and `at_least(k)` fire their
//! group once, on the arrival that meets the quorum, cancel the members still open, and
//! fail the execution as soon as the quorum is out of reach. Raced behind barriers for
//! each strategy that can count a quorum (a countdown, and the row-lock baseline), on
//! connections of their own and in one batch; a member held by another transaction as
//! the group fires finishes late and changes nothing.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{claim_n, fired, groups_of, quick_worker, race_completions, TestDb, WAIT};
use confluo::{
    DefinitionError, Engine, Error, ExecutionId, ExecutionStatus, FanInStrategy, Join, Outcome,
    Stage, TaskError, Workflow,
};
use serde_json::{json, Value};

const ROUNDS: usize = 10;

/// The strategies that count a quorum (striping cannot: a stage is refused, a default
/// gives way to a countdown).
const QUORUM_STRATEGIES: [FanInStrategy; 2] = [FanInStrategy::Countdown, FanInStrategy::RowLock];

/// A parallel block of `width` members `m0..` joined by `join`, then a step `next`.
fn block(name: &str, width: usize, join: Join, strategy: FanInStrategy) -> Workflow {
    let members: Vec<String> = (0..width).map(|i| format!("{name}_m{i}")).collect();
    Workflow::new(name, 1)
        .stage(
            Stage::parallel("block", members)
                .join(join)
                .fan_in(strategy),
        )
        .stage(Stage::step(format!("{name}_next")).fan_in(strategy))
}

/// Starts `name` (a [`block`] of `width`) and claims its members, in member order.
async fn claimed(
    db: &TestDb,
    name: &str,
    width: usize,
) -> (ExecutionId, Vec<confluo::ClaimedTask>) {
    let id = db.engine.start(name, &json!(null)).await.unwrap();
    let mut tasks = claim_n(&db.engine, width).await;
    tasks.sort_by_key(|t| t.handler().to_owned());
    assert!(tasks.iter().all(|t| t.execution_id() == id));
    (id, tasks)
}

/// Members of the execution's block by status.
async fn statuses(db: &TestDb, id: ExecutionId) -> Vec<(String, String)> {
    sqlx::query_as(
        "SELECT handler, status FROM confluo.task
          WHERE execution_id = $1 AND stage_index = 0 ORDER BY handler",
    )
    .bind(id)
    .fetch_all(&db.pool)
    .await
    .unwrap()
}

/// The block's output as the next stage receives it.
async fn block_output(db: &TestDb, id: ExecutionId) -> Value {
    let block = db.engine.block_outputs(id, 0).await.unwrap();
    let members = block.page(None, 100).await.unwrap();
    let outputs: serde_json::Map<String, Value> = members
        .iter()
        .filter(|m| m.status == "completed")
        .map(|m| (m.handler.clone(), m.output.clone().unwrap()))
        .collect();
    Value::Object(outputs)
}

/// The block fired once, the next stage was entered once, every member is terminal, and
/// exactly the completed members are what the next stage receives.
async fn fired_once(db: &TestDb, id: ExecutionId, k: usize, context: &str) {
    assert_eq!(groups_of(db, id, "block").await, (1, 1), "{context}");
    let next = format!("{}_next", db.engine.execution(id).await.unwrap().workflow);
    assert_eq!(groups_of(db, id, &next).await.0, 1, "{context}");
    let members = statuses(db, id).await;
    let completed = members.iter().filter(|(_, s)| s == "completed").count();
    assert!(completed >= k, "{context}: {members:?}");
    assert!(
        members
            .iter()
            .all(|(_, s)| s == "completed" || s == "cancelled"),
        "{context}: {members:?}"
    );
    let passed = block_output(db, id).await;
    assert_eq!(passed.as_object().unwrap().len(), completed, "{context}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn members_finishing_together_fire_a_quorum_once() {
    let db = TestDb::new(30).await;
    for strategy in QUORUM_STRATEGIES {
        let name = format!("quorum_{strategy}");
        db.register(&block(&name, 4, Join::AtLeast(2), strategy))
            .await;
        for round in 0..ROUNDS {
            let context = format!("{strategy} round {round}");
            // Four completions on connections of their own, released together.
            let (id, mut tasks) = claimed(&db, &name, 4).await;
            let last = tasks.pop().unwrap();
            let (mut outcomes, rival) =
                race_completions(&db.engine, tasks, json!(1), |e| async move {
                    e.complete(&last, json!(1)).await.unwrap()
                })
                .await;
            outcomes.push(rival);
            assert_eq!(fired(&outcomes), 1, "{context}: {outcomes:?}");
            fired_once(&db, id, 2, &context).await;
            db.engine.cancel(id).await.unwrap();

            // In one batch: every arrival in one transaction.
            let (id, tasks) = claimed(&db, &name, 4).await;
            let items: Vec<(&confluo::ClaimedTask, Value)> =
                tasks.iter().map(|t| (t, json!(2))).collect();
            let outcomes = db.engine.complete_batch(&items).await.unwrap();
            assert_eq!(fired(&outcomes), 1, "{context}, batched: {outcomes:?}");
            fired_once(&db, id, 2, &format!("{context}, batched")).await;
            db.engine.cancel(id).await.unwrap();
        }
    }
    let diagnosis = db.engine.doctor().await.unwrap();
    assert!(diagnosis.is_healthy(), "{diagnosis:?}");
}

/// Fails `tasks` permanently on connections of their own, released together.
async fn race_failures(engine: &Engine, tasks: Vec<confluo::ClaimedTask>) -> Vec<Outcome> {
    let barrier = Arc::new(tokio::sync::Barrier::new(tasks.len()));
    let mut handles = Vec::new();
    for task in tasks {
        let (engine, barrier) = (engine.clone(), barrier.clone());
        handles.push(tokio::spawn(async move {
            drop(engine.pool().acquire().await.unwrap());
            barrier.wait().await;
            engine.fail(&task, "refused", true).await.unwrap()
        }));
    }
    let mut outcomes = Vec::new();
    for h in handles {
        outcomes.push(h.await.unwrap());
    }
    outcomes
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn failures_together_fail_a_quorum_once_it_is_out_of_reach() {
    let db = TestDb::new(30).await;
    for strategy in QUORUM_STRATEGIES {
        let name = format!("reach_{strategy}");
        // Two of four: it tolerates two dead members, not three.
        db.register(&block(&name, 4, Join::AtLeast(2), strategy))
            .await;
        for round in 0..ROUNDS {
            let context = format!("{strategy} round {round}");
            let (id, mut tasks) = claimed(&db, &name, 4).await;
            let survivor = tasks.pop().unwrap();
            let outcomes = race_failures(&db.engine, tasks).await;
            assert!(
                outcomes.iter().all(|o| matches!(
                    o,
                    Outcome::DeadLettered { fired: false } | Outcome::Cancelled
                )),
                "{context}: {outcomes:?}"
            );
            let done = db.engine.execution(id).await.unwrap();
            assert_eq!(done.status, ExecutionStatus::Failed, "{context}");
            let error = done.error.unwrap();
            assert!(
                error.contains("at_least(2)") && error.contains("can no longer fire"),
                "{context}: {error}"
            );
            assert_eq!(groups_of(&db, id, "block").await, (1, 0), "{context}");
            let next = format!("{name}_next");
            assert_eq!(groups_of(&db, id, &next).await, (0, 0), "{context}");
            // The survivor's late completion enters nothing.
            let late = db.engine.complete(&survivor, json!(1)).await.unwrap();
            assert!(
                !matches!(late, Outcome::Completed { fired: true }),
                "{context}"
            );
            assert_eq!(groups_of(&db, id, &next).await, (0, 0), "{context}");
        }
    }
    let diagnosis = db.engine.doctor().await.unwrap();
    assert!(diagnosis.is_healthy(), "{diagnosis:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dead_members_within_the_tolerance_still_let_the_quorum_fire() {
    let db = TestDb::new(10).await;
    for strategy in QUORUM_STRATEGIES {
        let name = format!("tolerant_{strategy}");
        db.register(&block(&name, 4, Join::AtLeast(2), strategy))
            .await;
        let (id, tasks) = claimed(&db, &name, 4).await;
        for t in &tasks[..2] {
            let outcome = db.engine.fail(t, "refused", true).await.unwrap();
            assert_eq!(
                outcome,
                Outcome::DeadLettered { fired: false },
                "{strategy}"
            );
        }
        assert_eq!(
            db.engine.complete(&tasks[2], json!("two")).await.unwrap(),
            Outcome::Completed { fired: false },
            "{strategy}"
        );
        assert_eq!(
            db.engine.complete(&tasks[3], json!("three")).await.unwrap(),
            Outcome::Completed { fired: true },
            "{strategy}"
        );
        let members = statuses(&db, id).await;
        let s: Vec<&str> = members.iter().map(|(_, s)| s.as_str()).collect();
        assert_eq!(s, ["dead", "dead", "completed", "completed"], "{strategy}");
        assert_eq!(
            block_output(&db, id).await,
            json!({format!("{name}_m2"): "two", format!("{name}_m3"): "three"})
        );
        db.engine.cancel(id).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_member_held_as_the_group_fires_finishes_late_and_changes_nothing() {
    let db = TestDb::new(10).await;
    for strategy in QUORUM_STRATEGIES {
        let name = format!("late_{strategy}");
        db.register(&block(&name, 3, Join::Any, strategy)).await;
        let (id, tasks) = claimed(&db, &name, 3).await;
        // Another transaction holds m1's row as m0 fires the group (as a completion of
        // m1 in flight would): the group's cancel skips it rather than wait.
        let mut holder = db.pool.begin().await.unwrap();
        sqlx::query("SELECT 1 FROM confluo.task WHERE id = $1 FOR NO KEY UPDATE")
            .bind(tasks[1].id())
            .execute(&mut *holder)
            .await
            .unwrap();
        assert_eq!(
            db.engine.complete(&tasks[0], json!("first")).await.unwrap(),
            Outcome::Completed { fired: true },
            "{strategy}"
        );
        holder.rollback().await.unwrap();
        let members = statuses(&db, id).await;
        let s: Vec<&str> = members.iter().map(|(_, s)| s.as_str()).collect();
        assert_eq!(s, ["completed", "running", "cancelled"], "{strategy}");
        // m2 was cancelled while it ran: its lease is gone, its acknowledgement changes
        // nothing.
        let m2 = db.engine.complete(&tasks[2], json!("third")).await.unwrap();
        assert_eq!(m2, Outcome::LeaseLost, "{strategy}");
        // m1 completes late: cancelled, its output not passed on.
        let m1 = db
            .engine
            .complete(&tasks[1], json!("second"))
            .await
            .unwrap();
        assert!(
            matches!(m1, Outcome::Cancelled | Outcome::Completed { fired: false }),
            "{strategy}: {m1:?}"
        );
        let members = statuses(&db, id).await;
        let s: Vec<&str> = members.iter().map(|(_, s)| s.as_str()).collect();
        assert_eq!(s, ["completed", "cancelled", "cancelled"], "{strategy}");
        assert_eq!(
            block_output(&db, id).await,
            json!({format!("{name}_m0"): "first"})
        );
        let next = format!("{name}_next");
        assert_eq!(groups_of(&db, id, &next).await.0, 1, "{strategy}");
        let diagnosis = db.engine.doctor().await.unwrap();
        assert!(diagnosis.is_healthy(), "{strategy}: {diagnosis:?}");
        db.engine.cancel(id).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn any_and_at_least_run_end_to_end_through_workers() {
    let db = TestDb::new(10).await;
    let quotes = Workflow::new("quotes", 1)
        .stage(Stage::parallel("ask", ["fast", "slow", "broken"]).join(Join::Any))
        .step("buy");
    let replicas = Workflow::new("replicas", 1)
        .stage(
            Stage::map("write")
                .join(Join::AtLeast(2))
                .retry(common::fast_retry(1)),
        )
        .step("ack");
    db.register(&quotes).await;
    db.register(&replicas).await;
    let worker = quick_worker(&db.engine, |w| {
        w.handler("quotes", "fast", |_| async {
            Ok::<_, TaskError>(json!(10))
        })
        .handler("quotes", "slow", |_| async {
            tokio::time::sleep(Duration::from_secs(2)).await;
            Ok::<_, TaskError>(json!(20))
        })
        .handler("quotes", "broken", |_| async {
            tokio::time::sleep(Duration::from_secs(2)).await;
            Err::<Value, _>(TaskError::permanent("no quote"))
        })
        .handler("quotes", "buy", |t| async move {
            Ok::<_, TaskError>(t.input().clone())
        })
        .handler("replicas", "write", |t| async move {
            match t.input().as_i64().unwrap() {
                n if n < 0 => Err(TaskError::permanent(format!("replica {n} is down"))),
                n => Ok(json!(n)),
            }
        })
        .handler("replicas", "ack", |t| async move {
            Ok::<_, TaskError>(json!(t.input()["outputs"].as_array().unwrap().len()))
        })
    })
    .await;

    let id = db.engine.start("quotes", &json!(null)).await.unwrap();
    let done = db.engine.wait(id, WAIT).await.unwrap();
    assert_eq!(done.status, ExecutionStatus::Completed, "{done:?}");
    let output = done.output.unwrap();
    assert_eq!(output["outputs"], json!({"fast": 10}), "{output}");
    let failed: Vec<&str> = output["failed"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["status"].as_str().unwrap())
        .collect();
    assert_eq!(failed, ["cancelled", "cancelled"], "{output}");

    // Two of three replicas down: at_least(2) is out of reach.
    let id = db
        .engine
        .start("replicas", &json!([1, -2, -3]))
        .await
        .unwrap();
    let done = db.engine.wait(id, WAIT).await.unwrap();
    assert_eq!(done.status, ExecutionStatus::Failed, "{done:?}");
    assert!(
        done.error.as_deref().unwrap().contains("at_least(2)"),
        "{done:?}"
    );
    // One down: the quorum holds.
    let id = db
        .engine
        .start("replicas", &json!([1, -2, 3]))
        .await
        .unwrap();
    let done = db.engine.wait(id, WAIT).await.unwrap();
    assert_eq!(done.status, ExecutionStatus::Completed, "{done:?}");
    assert_eq!(done.output.as_ref(), Some(&json!(2)));
    // The join rule reads back on the stages: at_least(2) needs two, a join of all `None`.
    let quorums: Vec<Option<u32>> = done.stages.iter().map(|s| s.quorum).collect();
    assert_eq!(quorums, [Some(2), None], "{done:?}");
    // Fewer members than the quorum: it could never fire.
    let id = db.engine.start("replicas", &json!([1])).await.unwrap();
    let done = db.engine.wait(id, WAIT).await.unwrap();
    assert_eq!(done.status, ExecutionStatus::Failed, "{done:?}");
    assert!(
        done.error.as_deref().unwrap().contains("can never fire"),
        "{done:?}"
    );
    worker.shutdown().await;
    let diagnosis = db.engine.doctor().await.unwrap();
    assert!(diagnosis.is_healthy(), "{diagnosis:?}");
}

#[tokio::test]
async fn registration_refuses_join_rules_a_stage_cannot_have() {
    let db = TestDb::new(4).await;
    let refused = [
        Workflow::new("j1", 1).stage(Stage::step("s").join(Join::Any)),
        Workflow::new("j2", 1).stage(Stage::parallel("p", ["a", "b"]).join(Join::AtLeast(0))),
        Workflow::new("j3", 1).stage(Stage::parallel("p", ["a", "b"]).join(Join::AtLeast(3))),
        Workflow::new("j4", 1).stage(
            Stage::map("m")
                .join(Join::Any)
                .fan_in(FanInStrategy::Striped),
        ),
    ];
    for wf in refused {
        match db.engine.register(&wf).await {
            Err(Error::InvalidDefinition(DefinitionError::InvalidJoinRule {
                stage,
                reason,
                ..
            })) => {
                assert!(!reason.is_empty(), "{stage}");
            }
            other => panic!("{wf:?}: {other:?}"),
        }
    }
    // A join rule is data: it round-trips and is pinned with the definition.
    let wf = Workflow::new("j5", 1).stage(Stage::map("m").join(Join::AtLeast(3)));
    let text = serde_json::to_string(&wf).unwrap();
    assert!(text.contains(r#""join":{"at_least":3}"#), "{text}");
    assert_eq!(serde_json::from_str::<Workflow>(&text).unwrap(), wf);
    db.register(&wf).await;
}
