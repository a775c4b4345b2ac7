//! Child workflows against real PostgreSQL: a map whose members are executions of another
//! workflow. A child's end makes its member due in the transaction that ends the child;
//! the member then completes (or fails) through the ordinary guarded completion, so the
//! parent's group fires once. Every place where two arrivals can decide the same thing is
//! raced behind a barrier, for each strategy: two children's members completing last
//! together, a child's end against its parent's cancel, and against its parent's deadline.

mod common;

use std::time::Duration;

use common::family::{children, claim_of, members};
use common::{claim_n, quick_worker, race_completions, TestDb, STRATEGIES, WAIT};
use confluo::{
    Error, ExecutionId, ExecutionStatus, FanInStrategy, Outcome, Stage, StartOptions, TaskError,
    Workflow,
};
use serde_json::json;

const ROUNDS: usize = 12;

/// `work`: one step, the child of every parent here.
fn child(strategy: FanInStrategy) -> Workflow {
    Workflow::new("work", 1).stage(Stage::step("work").fan_in(strategy))
}

/// A map of `work` children over the input, then `after`.
fn parent(name: &str, strategy: FanInStrategy) -> Workflow {
    Workflow::new(name, 1)
        .stage(Stage::map_workflow("each", "work").fan_in(strategy))
        .stage(Stage::step("after").fan_in(strategy))
}

/// How many groups of `stage` the execution fired, and how many tasks `handler` it has.
async fn fired_and_tasks(db: &TestDb, id: ExecutionId, stage: &str, handler: &str) -> (i64, i64) {
    sqlx::query_as(
        "SELECT (SELECT count(*) FROM confluo.stage_group
                  WHERE execution_id = $1 AND stage_name = $2 AND fired_at IS NOT NULL),
                (SELECT count(*) FROM confluo.task_all WHERE execution_id = $1 AND handler = $3)",
    )
    .bind(id)
    .bind(stage)
    .bind(handler)
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

/// Writes an execution's status behind the engine's back (a defect the auditor must find).
async fn set_status(db: &TestDb, id: ExecutionId, status: &str) {
    sqlx::query("UPDATE confluo.execution SET status = $2 WHERE id = $1")
        .bind(id)
        .bind(status)
        .execute(&db.pool)
        .await
        .unwrap();
}

async fn assert_healthy(db: &TestDb) {
    let diagnosis = db.engine.doctor().await.unwrap();
    assert!(diagnosis.is_healthy(), "{diagnosis:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn children_run_through_workers_and_their_outputs_are_the_stage_output() {
    let db = TestDb::new(10).await;
    for strategy in STRATEGIES {
        let name = format!("billing_{strategy}");
        let charge = Workflow::new(format!("charge_{strategy}"), 1)
            .stage(Stage::step("authorize").fan_in(strategy))
            .stage(Stage::step("capture").fan_in(strategy));
        db.register(&charge).await;
        let billing = Workflow::new(&name, 1)
            .stage(Stage::step("select").fan_in(strategy))
            .stage(Stage::map_workflow("charge_each", charge.name()).fan_in(strategy))
            .stage(Stage::step("report").fan_in(strategy));
        db.register(&billing).await;
        let (c, b) = (charge.name().to_owned(), name.clone());
        let worker = quick_worker(&db.engine, |w| {
            w.handler(&b, "select", |t| async move {
                Ok::<_, TaskError>(t.input().clone())
            })
            .handler(&c, "authorize", |t| async move {
                let cents = t.input()["cents"].as_i64().unwrap();
                Ok::<_, TaskError>(json!({"cents": cents, "auth": format!("A{cents}")}))
            })
            .handler(&c, "capture", |t| async move {
                Ok::<_, TaskError>(
                    json!({"captured": t.input()["cents"], "auth": t.input()["auth"]}),
                )
            })
            .handler(&b, "report", |t| async move {
                Ok::<_, TaskError>(t.input().clone())
            })
        })
        .await;
        let accounts = json!([{"cents": 100}, {"cents": 250}, {"cents": 7}]);
        let id = db.engine.start(&name, &accounts).await.unwrap();
        let done = db.engine.wait(id, WAIT).await.unwrap();
        let empty = db.engine.start(&name, &json!([])).await.unwrap();
        let none = db.engine.wait(empty, WAIT).await.unwrap();
        worker.shutdown().await;
        assert_eq!(
            done.status,
            ExecutionStatus::Completed,
            "{strategy}: {done:?}"
        );
        assert_eq!(
            done.output.as_ref().unwrap()["outputs"],
            json!([
                {"captured": 100, "auth": "A100"},
                {"captured": 250, "auth": "A250"},
                {"captured": 7, "auth": "A7"}
            ]),
            "{strategy}"
        );
        assert_eq!(done.output.as_ref().unwrap()["failed"], json!([]));
        assert_eq!(done.stages[1].kind, "map_workflow");
        assert_eq!(done.stages[1].completed, 3);
        let kids = children(&db, id).await;
        assert_eq!(kids.len(), 3, "{strategy}");
        for (kid, status) in &kids {
            assert_eq!(status, "completed");
            let kid = db.engine.execution(*kid).await.unwrap();
            assert_eq!((kid.parent, kid.workflow.as_str()), (Some(id), c.as_str()));
        }
        // An empty array starts no child and goes on at once.
        assert_eq!(none.status, ExecutionStatus::Completed, "{none:?}");
        assert_eq!(none.output.unwrap()["outputs"], json!([]));
        assert!(children(&db, empty).await.is_empty());
    }
    assert_healthy(&db).await;
}

/// A loop of its own on `claim`, with `run_builtin` for the engine's own tasks: a user
/// handler's task is left alone (`None`, nothing recorded); a member is acknowledged with
/// its child's output, or failed for good with its child's error.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_claim_loop_runs_child_members_with_run_builtin() {
    let db = TestDb::new(6).await;
    db.register(&child(FanInStrategy::Countdown)).await;
    db.register(&parent("own_loop", FanInStrategy::Countdown))
        .await;
    let id = db.engine.start("own_loop", &json!([5, 6])).await.unwrap();
    let works = claim_of(&db.engine, "work", "work", 2).await;
    for task in &works {
        assert_eq!(db.engine.run_builtin(task).await.unwrap(), None);
        let (status, lease): (String, Option<confluo::LeaseToken>) =
            sqlx::query_as("SELECT status, lease_token FROM confluo.task WHERE id = $1")
                .bind(task.id())
                .fetch_one(&db.pool)
                .await
                .unwrap();
        assert_eq!((status.as_str(), lease), ("running", Some(task.lease())));
    }
    db.engine.complete(&works[0], json!(50)).await.unwrap();
    db.engine
        .fail(&works[1], "six is refused", true)
        .await
        .unwrap();
    let mut members = claim_of(&db.engine, "own_loop", "confluo:child", 2).await;
    members.sort_by_key(|t| t.item_index());
    assert_eq!(
        db.engine.run_builtin(&members[0]).await.unwrap(),
        Some(Outcome::Completed { fired: false })
    );
    assert_eq!(
        db.engine.run_builtin(&members[1]).await.unwrap(),
        Some(Outcome::DeadLettered { fired: true })
    );
    // A replay changes nothing.
    assert_eq!(
        db.engine.run_builtin(&members[0]).await.unwrap(),
        Some(Outcome::AlreadyRecorded)
    );
    let after = claim_of(&db.engine, "own_loop", "after", 1).await.remove(0);
    let input = db.engine.task_input(&after).await.unwrap();
    assert_eq!(input["outputs"], json!([50]), "{input}");
    let error = input["failed"][0]["error"].as_str().unwrap().to_owned();
    assert!(error.contains("six is refused"), "{error}");
    db.engine.complete(&after, json!("done")).await.unwrap();
    let done = db.engine.wait(id, WAIT).await.unwrap();
    assert_eq!(done.status, ExecutionStatus::Completed, "{done:?}");
    assert_healthy(&db).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failed_child_is_a_dead_member_and_a_fail_fast_parent_cancels_the_rest() {
    let db = TestDb::new(10).await;
    db.register(&Workflow::new("picky", 1).step("check")).await;
    db.register(
        &Workflow::new("lenient", 1)
            .map_workflow("each", "picky")
            .step("after"),
    )
    .await;
    db.register(
        &Workflow::new("strict", 1)
            .stage(Stage::map_workflow("each", "picky").fail_execution_on_member_failure())
            .step("after"),
    )
    .await;
    let worker = quick_worker(&db.engine, |w| {
        w.handler("picky", "check", |t| async move {
            match t.input().as_i64() {
                Some(2) => Err(TaskError::permanent("two is refused")),
                // Slow enough that a fail-fast parent stops before they end.
                Some(n) if n >= 10 => {
                    tokio::time::sleep(Duration::from_secs(600)).await;
                    Ok(json!(n))
                }
                _ => Ok(t.input().clone()),
            }
        })
        .handler("lenient", "after", |t| async move {
            Ok::<_, TaskError>(t.input().clone())
        })
        .handler("strict", "after", |t| async move {
            Ok::<_, TaskError>(t.input().clone())
        })
    })
    .await;
    let lenient = db.engine.start("lenient", &json!([1, 2, 3])).await.unwrap();
    let done = db.engine.wait(lenient, WAIT).await.unwrap();
    assert_eq!(done.status, ExecutionStatus::Completed, "{done:?}");
    let output = done.output.unwrap();
    assert_eq!(output["outputs"], json!([1, 3]));
    let failed = &output["failed"][0];
    assert_eq!(failed["index"], 1);
    let error = failed["error"].as_str().unwrap();
    let failed_child = children(&db, lenient).await[1].0;
    assert!(
        error.contains(&failed_child.to_string()) && error.contains("two is refused"),
        "the member's error names the child and its error: {error}"
    );

    // Fail fast: the parent fails at the first dead member, and its slow children are
    // cancelled (by the workers' housekeeping: the failure's own transaction leaves them).
    let strict = db
        .engine
        .start("strict", &json!([2, 10, 11]))
        .await
        .unwrap();
    let done = db.engine.wait(strict, WAIT).await.unwrap();
    assert_eq!(done.status, ExecutionStatus::Failed, "{done:?}");
    assert!(done.error.unwrap().contains("two is refused"));
    assert!(
        common::eventually(WAIT, || async {
            children(&db, strict)
                .await
                .iter()
                .filter(|(_, s)| s == "cancelled")
                .count()
                == 2
        })
        .await,
        "the running children of a failed parent were never cancelled: {:?}",
        children(&db, strict).await
    );
    worker.shutdown().await;
    assert_healthy(&db).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cancelling_a_parent_cancels_its_children_and_theirs_and_late_ends_change_nothing() {
    let db = TestDb::new(10).await;
    db.register(&child(FanInStrategy::Countdown)).await;
    db.register(&Workflow::new("middle", 1).map_workflow("each", "work"))
        .await;
    db.register(
        &Workflow::new("top", 1)
            .map_workflow("each", "middle")
            .step("after"),
    )
    .await;
    // Two middles of two works each.
    let id = db
        .engine
        .start("top", &json!([[1, 2], [3, 4]]))
        .await
        .unwrap();
    let middles = children(&db, id).await;
    assert_eq!(middles.len(), 2);
    let mut works = Vec::new();
    for (m, _) in &middles {
        works.extend(children(&db, *m).await);
    }
    assert_eq!(works.len(), 4);
    // One grandchild is running when the cancel comes.
    let running = claim_of(&db.engine, "work", "work", 1).await.remove(0);

    assert!(db.engine.cancel(id).await.unwrap());
    for (m, status) in children(&db, id).await {
        assert_eq!(status, "cancelled", "middle {m}");
        for (w, status) in children(&db, m).await {
            assert_eq!(status, "cancelled", "work {w}");
        }
    }
    assert_eq!(members(&db, id).await, ["cancelled", "cancelled"]);
    // The running grandchild's late completion is recorded, and dispatches nothing.
    let late = db.engine.complete(&running, json!("late")).await.unwrap();
    assert_eq!(late, Outcome::Completed { fired: false });
    assert_eq!(fired_and_tasks(&db, id, "each", "after").await, (0, 0));
    assert!(db
        .engine
        .claim("test", 10, Duration::from_secs(60))
        .await
        .unwrap()
        .is_empty());
    assert_healthy(&db).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn registration_needs_the_child_workflow_and_bad_child_inputs_fail_the_parent() {
    let db = TestDb::new(10).await;
    let orphan = Workflow::new("orphan", 1).map_workflow("each", "nowhere");
    match db.engine.register(&orphan).await {
        Err(e @ Error::UnknownChildWorkflow { .. }) => {
            assert!(
                e.to_string().contains("register the child workflow first"),
                "{e}"
            )
        }
        other => panic!("expected UnknownChildWorkflow, got {other:?}"),
    }
    db.register(&child(FanInStrategy::Countdown)).await;
    let pinned = Workflow::new("pinned", 1).stage(Stage::map_workflow_version("each", "work", 2));
    assert!(matches!(
        db.engine.register(&pinned).await,
        Err(Error::UnknownChildWorkflow {
            version: Some(2),
            ..
        })
    ));
    let bad = Workflow::new("bad", 1).stage(Stage::map_workflow_version("each", "work", 0));
    assert!(matches!(
        db.engine.register(&bad).await,
        Err(Error::InvalidDefinition(
            confluo::DefinitionError::InvalidChildWorkflow { .. }
        ))
    ));
    // A workflow may map over itself: a tree walk that ends at the empty arrays.
    let tree = Workflow::new("tree", 1)
        .step("children")
        .map_workflow("each", "tree");
    db.register(&tree).await;
    let worker = quick_worker(&db.engine, |w| {
        w.handler("tree", "children", |t| async move {
            // A node is the list of its children.
            Ok::<_, TaskError>(t.input().clone())
        })
    })
    .await;
    let id = db.engine.start("tree", &json!([[[]], []])).await.unwrap();
    let done = db.engine.wait(id, WAIT).await.unwrap();
    assert_eq!(done.status, ExecutionStatus::Completed, "{done:?}");
    let all: i64 =
        sqlx::query_scalar("SELECT count(*) FROM confluo.execution WHERE workflow_name = 'tree'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(all, 4, "the root, its two children and one grandchild");

    // A child whose first stage is a map needs arrays: the parent fails, saying which.
    db.register(&Workflow::new("fan", 1).map("leaf")).await;
    db.register(&Workflow::new("fans", 1).map_workflow("each", "fan"))
        .await;
    let id = db.engine.start("fans", &json!([[1], 5])).await.unwrap();
    let failed = db.engine.execution(id).await.unwrap();
    worker.shutdown().await;
    assert_eq!(failed.status, ExecutionStatus::Failed);
    let error = failed.error.unwrap();
    assert!(
        error.contains("item 1") && error.contains("a JSON number"),
        "{error}"
    );
    assert!(children(&db, id).await.is_empty(), "nothing was started");
}

/// Ends the two children of a fresh `parent` execution over `[1, 2]` together, then
/// completes their two members together: returns the execution and the members'
/// outcomes.
async fn two_children_then_members(db: &TestDb, name: &str) -> (ExecutionId, Vec<Outcome>) {
    let id = db.engine.start(name, &json!([1, 2])).await.unwrap();
    let works = claim_of(&db.engine, "work", "work", 2).await;
    let (ends, ()) = race_completions(&db.engine, works, json!("worked"), |_| async {}).await;
    // Each is its own child's last arrival.
    assert_eq!(common::fired(&ends), 2, "{ends:?}");
    assert_eq!(members(db, id).await, ["pending", "pending"]);
    let members = claim_of(&db.engine, name, "confluo:child", 2).await;
    let (outcomes, ()) = race_completions(&db.engine, members, json!("worked"), |_| async {}).await;
    (id, outcomes)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_childrens_members_completing_together_fire_their_parent_once() {
    let db = TestDb::new(20).await;
    db.register(&child(FanInStrategy::Countdown)).await;
    for strategy in STRATEGIES {
        let name = format!("pair_{strategy}");
        db.register(&parent(&name, strategy)).await;
        for round in 0..ROUNDS {
            let (id, outcomes) = two_children_then_members(&db, &name).await;
            assert_eq!(
                common::fired(&outcomes),
                1,
                "{strategy} round {round}: {outcomes:?}"
            );
            assert_eq!(fired_and_tasks(&db, id, "each", "after").await, (1, 1));
            let after = claim_n(&db.engine, 1).await.remove(0);
            assert_eq!(
                db.engine.task_input(&after).await.unwrap()["outputs"],
                json!(["worked", "worked"])
            );
            db.engine.complete(&after, json!(null)).await.unwrap();
        }
    }
    assert_healthy(&db).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_childs_end_raced_against_its_parents_cancel_or_deadline_changes_nothing() {
    let db = TestDb::new(20).await;
    db.register(&child(FanInStrategy::Countdown)).await;
    // [child completed first, child cancelled first]; [member woken then cancelled,
    // member cancelled first (the child's report then woke nothing)].
    let mut orders = [0usize; 2];
    let mut member_orders = [0usize; 2];
    for strategy in STRATEGIES {
        let name = format!("stop_{strategy}");
        db.register(&parent(&name, strategy)).await;
        for round in 0..ROUNDS {
            let deadline = round % 2 == 1;
            let options = if deadline {
                StartOptions::new().deadline(Duration::from_millis(200))
            } else {
                StartOptions::new()
            };
            let id = db
                .engine
                .start_with(&name, &json!([1]), options)
                .await
                .unwrap()
                .id;
            let work = claim_of(&db.engine, "work", "work", 1).await;
            if deadline {
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            let (ends, stopped) =
                race_completions(&db.engine, work, json!("worked"), |e| async move {
                    if deadline {
                        e.time_out_expired(10).await.unwrap().contains(&id)
                    } else {
                        e.cancel(id).await.unwrap()
                    }
                })
                .await;
            assert!(
                stopped,
                "{strategy} round {round}: the parent was not stopped"
            );
            // The child completed (its end came first, or the cascade found it held) or
            // was cancelled with its parent; either way the parent's member is cancelled
            // and nothing after it runs.
            let child_status = &children(&db, id).await[0].1;
            match (&ends[0], child_status.as_str()) {
                (Outcome::Completed { fired: true }, "completed") => orders[0] += 1,
                (Outcome::Completed { fired: false } | Outcome::Cancelled, "cancelled") => {
                    orders[1] += 1
                }
                other => panic!("{strategy} round {round}: {other:?}"),
            }
            db.engine.cancel_orphans(100).await.unwrap();
            assert_eq!(
                members(&db, id).await,
                ["cancelled"],
                "{strategy} round {round}"
            );
            let never_woken: bool = sqlx::query_scalar(
                "SELECT run_at = 'infinity' FROM confluo.task_all
                  WHERE execution_id = $1 AND handler = 'confluo:child'",
            )
            .bind(id)
            .fetch_one(&db.pool)
            .await
            .unwrap();
            member_orders[usize::from(never_woken)] += 1;
            assert_eq!(fired_and_tasks(&db, id, "each", "after").await, (0, 0));
            let status = db.engine.status(id).await.unwrap();
            let expected = if deadline {
                ExecutionStatus::TimedOut
            } else {
                ExecutionStatus::Cancelled
            };
            assert_eq!(status, expected);
            assert!(
                db.engine
                    .claim("test", 10, Duration::from_secs(60))
                    .await
                    .unwrap()
                    .is_empty(),
                "{strategy} round {round}: a member became claimable"
            );
        }
    }
    assert_healthy(&db).await;
    eprintln!(
        "child completed: {}, child cancelled: {}; member woken then cancelled: {}, member \
         cancelled first: {}",
        orders[0], orders[1], member_orders[0], member_orders[1]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_auditor_finds_and_repairs_an_unreported_end_and_orphans() {
    let db = TestDb::new(10).await;
    db.register(&child(FanInStrategy::Countdown)).await;
    db.register(&parent("audited", FanInStrategy::Countdown))
        .await;
    let id = db.engine.start("audited", &json!([1, 2])).await.unwrap();
    let works = claim_of(&db.engine, "work", "work", 2).await;
    db.engine.complete(&works[0], json!("one")).await.unwrap();
    assert_healthy(&db).await;
    // Undo the report of the first child's end, as a missing statement would.
    sqlx::query(
        "UPDATE confluo.task SET run_at = 'infinity'
          WHERE execution_id = $1 AND handler = 'confluo:child' AND item_index = 0",
    )
    .bind(id)
    .execute(&db.pool)
    .await
    .unwrap();
    let found = db.engine.doctor().await.unwrap();
    let first = children(&db, id).await[0].0;
    assert_eq!(found.unreported_children.len(), 1, "{found:?}");
    assert_eq!(found.unreported_children[0].execution_id, first);
    // And a child left running by a stopped parent that nothing cascades from.
    set_status(&db, id, "cancelled").await;
    let found = db.engine.doctor().await.unwrap();
    assert_eq!(
        found.orphaned_children,
        [children(&db, id).await[1].0],
        "{found:?}"
    );
    // Put the parent back to running for the first repair, then stop it again.
    set_status(&db, id, "running").await;
    let repairs = db.engine.repair().await.unwrap();
    assert_eq!(repairs.children_reported, 1, "{repairs:?}");
    let member = claim_of(&db.engine, "audited", "confluo:child", 1)
        .await
        .remove(0);
    assert_eq!(member.item_index(), 0);
    db.engine.release(&member).await.unwrap();
    set_status(&db, id, "cancelled").await;
    let repairs = db.engine.repair().await.unwrap();
    assert_eq!(repairs.orphans_cancelled, 1, "{repairs:?}");
    assert_eq!(children(&db, id).await[1].1, "cancelled");
    // The late completion of the cancelled child's task dispatches nothing.
    assert_eq!(
        db.engine.complete(&works[1], json!("two")).await.unwrap(),
        Outcome::Completed { fired: false }
    );
}
