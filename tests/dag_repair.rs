//! The auditor's repair of stalled executions in a graph (`Engine::repair`): a stage whose
//! entry was lost (a defect, simulated by deleting its group) is entered once, wherever
//! it sits: on any branch of the graph, beside a dependent of the same stage that was
//! entered, as the first stage of a branch's arm, or as a stage the execution starts
//! with; and a repair that ends the execution on the way enters nothing more.

mod common;

use common::{claim_n, groups_of, TestDb};
use confluo::{ExecutionId, ExecutionStatus, Stage, Workflow};
use serde_json::json;

/// Deletes the group of stage `stage` of the execution, and its tasks with it: the entry
/// of that stage is lost.
async fn lose(db: &TestDb, id: ExecutionId, stage: &str) {
    let deleted =
        sqlx::query("DELETE FROM confluo.stage_group WHERE execution_id = $1 AND stage_name = $2")
            .bind(id)
            .bind(stage)
            .execute(&db.pool)
            .await
            .unwrap()
            .rows_affected();
    assert_eq!(deleted, 1, "stage {stage} had a group");
}

/// Repairs once (it must move the execution on), checks the database is healthy after,
/// and that a second repair finds nothing.
async fn repair_once(db: &TestDb) {
    let diagnosis = db.engine.doctor().await.unwrap();
    assert_eq!(diagnosis.stalled_executions.len(), 1, "{diagnosis:?}");
    let repairs = db.engine.repair().await.unwrap();
    assert_eq!(repairs.executions_advanced, 1, "{repairs:?}");
    assert!(db.engine.doctor().await.unwrap().is_healthy());
    assert_eq!(db.engine.repair().await.unwrap().found.len(), 0);
}

/// a; b and c after a; merge after b and c. b's entry is lost, c runs and arrives at the
/// join: re-driving a must enter b, though c (entered by the same fan-out) exists.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_auditor_enters_a_lost_dependent_beside_one_that_was_entered() {
    let db = TestDb::new(10).await;
    db.register(
        &Workflow::new("fan_out", 1)
            .step("a")
            .stage(Stage::step("b").after(["a"]))
            .stage(Stage::step("c").after(["a"]))
            .stage(Stage::step("merge").after(["b", "c"])),
    )
    .await;
    let id = db.engine.start("fan_out", &json!(null)).await.unwrap();
    let a = claim_n(&db.engine, 1).await.remove(0);
    db.engine.complete(&a, json!("from a")).await.unwrap();
    lose(&db, id, "b").await;
    let c = claim_n(&db.engine, 1).await.remove(0);
    assert_eq!(c.handler(), "c");
    db.engine.complete(&c, json!("c")).await.unwrap();
    repair_once(&db).await;
    assert_eq!(groups_of(&db, id, "c").await, (1, 1));
    let b = claim_n(&db.engine, 1).await.remove(0);
    assert_eq!(b.handler(), "b");
    assert_eq!(db.engine.task_input(&b).await.unwrap(), json!("from a"));
    db.engine.complete(&b, json!("b")).await.unwrap();
    let merge = claim_n(&db.engine, 1).await.remove(0);
    assert_eq!(
        db.engine.task_input(&merge).await.unwrap(),
        json!({"b": "b", "c": "c"})
    );
    db.engine.complete(&merge, json!("done")).await.unwrap();
    assert_eq!(
        db.engine.status(id).await.unwrap(),
        ExecutionStatus::Completed
    );
}

/// a; a branch on a's output whose arm "x" is x1 then x2. x1's entry is lost: re-driving
/// a finds the branch decided and goes on into the arm it took.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_auditor_enters_the_lost_first_stage_of_the_arm_a_branch_took() {
    let db = TestDb::new(10).await;
    db.register(
        &Workflow::new("arm", 1)
            .step("a")
            .stage(
                Stage::branch("route")
                    .on("x", [Stage::step("x1"), Stage::step("x2")])
                    .otherwise([Stage::step("other")]),
            )
            .step("after"),
    )
    .await;
    let id = db.engine.start("arm", &json!(null)).await.unwrap();
    let a = claim_n(&db.engine, 1).await.remove(0);
    db.engine.complete(&a, json!("x")).await.unwrap();
    lose(&db, id, "x1").await;
    repair_once(&db).await;
    assert_eq!(groups_of(&db, id, "route").await, (1, 1));
    assert_eq!(groups_of(&db, id, "other").await, (0, 0));
    for handler in ["x1", "x2", "after"] {
        let task = claim_n(&db.engine, 1).await.remove(0);
        assert_eq!(task.handler(), handler);
        db.engine.complete(&task, json!(handler)).await.unwrap();
    }
    assert_eq!(
        db.engine.status(id).await.unwrap(),
        ExecutionStatus::Completed
    );
}

/// a, and b from the start; merge after both. b's entry is lost when the execution
/// starts, and a arrives at the join: the repair enters b with the execution input.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_auditor_enters_a_lost_stage_the_execution_starts_with() {
    let db = TestDb::new(10).await;
    db.register(
        &Workflow::new("roots", 1)
            .step("a")
            .stage(Stage::step("b").at_start())
            .stage(Stage::step("merge").after(["a", "b"])),
    )
    .await;
    let id = db.engine.start("roots", &json!({"n": 1})).await.unwrap();
    lose(&db, id, "b").await;
    let a = claim_n(&db.engine, 1).await.remove(0);
    assert_eq!(a.handler(), "a");
    db.engine.complete(&a, json!("a")).await.unwrap();
    repair_once(&db).await;
    let b = claim_n(&db.engine, 1).await.remove(0);
    assert_eq!(b.handler(), "b");
    assert_eq!(db.engine.task_input(&b).await.unwrap(), json!({"n": 1}));
    db.engine.complete(&b, json!("b")).await.unwrap();
    let merge = claim_n(&db.engine, 1).await.remove(0);
    assert_eq!(
        db.engine.task_input(&merge).await.unwrap(),
        json!({"a": "a", "b": "b"})
    );
}

/// a then a sleep until the time a returns; b from the start, then c; end after the
/// sleep and c. The sleep's and c's
/// entries are lost, and a's output is no time any more: re-driving a fails the
/// execution, and the repair then stops, entering no c in a failed execution.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_repair_that_fails_the_execution_enters_nothing_after() {
    let db = TestDb::new(10).await;
    db.register(
        &Workflow::new("ends", 1)
            .step("a")
            .stage(Stage::sleep_until("nap", "/at"))
            .stage(Stage::step("b").at_start())
            .stage(Stage::step("c").after(["b"]))
            .stage(Stage::step("end").after(["nap", "c"])),
    )
    .await;
    let id = db.engine.start("ends", &json!(null)).await.unwrap();
    let mut tasks = claim_n(&db.engine, 2).await;
    tasks.sort_by_key(|t| t.handler().to_owned());
    db.engine
        .complete(&tasks[0], json!({"at": "2099-01-01T00:00:00Z"}))
        .await
        .unwrap();
    db.engine.complete(&tasks[1], json!("b")).await.unwrap();
    lose(&db, id, "nap").await;
    lose(&db, id, "c").await;
    sqlx::query("UPDATE confluo.task SET output = '{\"at\": \"soon\"}' WHERE execution_id = $1 AND handler = 'a'")
        .bind(id)
        .execute(&db.pool)
        .await
        .unwrap();
    let repairs = db.engine.repair().await.unwrap();
    assert_eq!(repairs.executions_advanced, 1, "{repairs:?}");
    assert_eq!(db.engine.status(id).await.unwrap(), ExecutionStatus::Failed);
    assert_eq!(
        groups_of(&db, id, "c").await,
        (0, 0),
        "c entered in a failed execution"
    );
    assert!(db.engine.doctor().await.unwrap().is_healthy());
}

/// a1 then a2, and b from the start; merge after a2 and b. a2's entry is lost (a defect)
/// after a1 fired, and b then arrives at the join: the stall is on the lower branch, not
/// after the last group.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_auditor_moves_a_stall_on_any_branch_of_the_graph_on() {
    let db = TestDb::new(10).await;
    db.register(
        &Workflow::new("two_branches", 1)
            .step("a1")
            .step("a2")
            .stage(Stage::step("b").at_start())
            .stage(Stage::step("merge").after(["a2", "b"])),
    )
    .await;
    let id = db.engine.start("two_branches", &json!(null)).await.unwrap();
    let mut tasks = claim_n(&db.engine, 2).await;
    tasks.sort_by_key(|t| t.handler().to_owned());
    db.engine.complete(&tasks[0], json!("a1")).await.unwrap();
    sqlx::query("DELETE FROM confluo.stage_group WHERE execution_id = $1 AND stage_name = 'a2'")
        .bind(id)
        .execute(&db.pool)
        .await
        .unwrap();
    db.engine.complete(&tasks[1], json!("b")).await.unwrap();
    let diagnosis = db.engine.doctor().await.unwrap();
    assert_eq!(diagnosis.stalled_executions.len(), 1, "{diagnosis:?}");
    let repairs = db.engine.repair().await.unwrap();
    assert_eq!(repairs.executions_advanced, 1, "{repairs:?}");
    assert!(db.engine.doctor().await.unwrap().is_healthy());
    // a2 runs again from a1's output; its arrival enters merge once, with both.
    let a2 = claim_n(&db.engine, 1).await.remove(0);
    assert_eq!(a2.handler(), "a2");
    assert_eq!(db.engine.task_input(&a2).await.unwrap(), json!("a1"));
    db.engine.complete(&a2, json!("a2")).await.unwrap();
    assert_eq!(groups_of(&db, id, "merge").await, (1, 0));
    let merge = claim_n(&db.engine, 1).await.remove(0);
    assert_eq!(
        db.engine.task_input(&merge).await.unwrap(),
        json!({"a2": "a2", "b": "b"})
    );
    // A second repair finds nothing to do.
    assert_eq!(db.engine.repair().await.unwrap().found.len(), 0);
}

/// A chain a → b → c whose c was lost after b fired: re-driving a finds b entered and
/// goes no further, and re-driving b enters c once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_auditor_steps_over_a_next_stage_entered_already_and_goes_on() {
    let db = TestDb::new(10).await;
    db.register(&Workflow::new("abc", 1).step("a").step("b").step("c"))
        .await;
    let id = db.engine.start("abc", &json!(null)).await.unwrap();
    for handler in ["a", "b"] {
        let task = claim_n(&db.engine, 1).await.remove(0);
        assert_eq!(task.handler(), handler);
        db.engine.complete(&task, json!(handler)).await.unwrap();
    }
    sqlx::query("DELETE FROM confluo.stage_group WHERE execution_id = $1 AND stage_name = 'c'")
        .bind(id)
        .execute(&db.pool)
        .await
        .unwrap();
    let repairs = db.engine.repair().await.unwrap();
    assert_eq!(repairs.executions_advanced, 1, "{repairs:?}");
    assert_eq!(groups_of(&db, id, "b").await, (1, 1));
    assert_eq!(groups_of(&db, id, "c").await, (1, 0));
    let c = claim_n(&db.engine, 1).await.remove(0);
    assert_eq!(c.handler(), "c");
    assert_eq!(db.engine.task_input(&c).await.unwrap(), json!("b"));
    db.engine.complete(&c, json!("done")).await.unwrap();
    assert_eq!(
        db.engine.status(id).await.unwrap(),
        ExecutionStatus::Completed
    );
    assert!(db.engine.doctor().await.unwrap().is_healthy());
}
