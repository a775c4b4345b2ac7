//! Reprocessing members of a map of child workflows, against real PostgreSQL: a dead
//! member (and its cancelled siblings, when its fail-fast parent resumes) gets a new child
//! where its child failed or was cancelled, reports the output of a child that completed,
//! and waits for one still running, whose end may race the reprocess: raced behind a
//! barrier for each strategy.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::family::{children, claim_of, members};
use common::{quick_worker, race_completions, TestDb, STRATEGIES, WAIT};
use confluo::{ExecutionId, ExecutionStatus, Outcome, Stage, TaskError, TaskId, Workflow};
use serde_json::json;

const ROUNDS: usize = 12;

/// The dead or cancelled members of `parent`, by index, with their child's status.
async fn stopped_members(db: &TestDb, parent: ExecutionId) -> Vec<(TaskId, String, String)> {
    sqlx::query_as(
        "SELECT t.id, t.status, c.status FROM confluo.task_all t
           JOIN confluo.execution c ON c.parent_task = t.id
          WHERE t.execution_id = $1 AND t.handler = 'confluo:child'
            AND t.status IN ('dead', 'cancelled')
          ORDER BY t.item_index",
    )
    .bind(parent)
    .fetch_all(&db.pool)
    .await
    .unwrap()
}

/// The children of `parent` no longer linked to a member (replaced by a reprocess).
async fn unlinked_children(db: &TestDb, parent: ExecutionId) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT status FROM confluo.execution
          WHERE parent_execution = $1 AND parent_task IS NULL ORDER BY created_at",
    )
    .bind(parent)
    .fetch_all(&db.pool)
    .await
    .unwrap()
}

/// Whether the member `task` is due now (not waiting for a child's end).
async fn due(db: &TestDb, task: TaskId) -> bool {
    sqlx::query_scalar("SELECT run_at <= now() FROM confluo.task WHERE id = $1")
        .bind(task)
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reprocessing_a_dead_member_starts_new_children_where_they_failed_or_were_cancelled() {
    let db = TestDb::new(10).await;
    db.register(&Workflow::new("chk", 1).step("check")).await;
    db.register(
        &Workflow::new("strict", 1)
            .stage(Stage::map_workflow("each", "chk").fail_execution_on_member_failure())
            .step("after"),
    )
    .await;
    // While `refuse`, two is refused; while `hold`, three waits (so a fail-fast parent
    // stops before it ends, and its child is cancelled).
    let refuse = Arc::new(AtomicBool::new(true));
    let hold = Arc::new(AtomicBool::new(true));
    let (r, h) = (refuse.clone(), hold.clone());
    let worker = quick_worker(&db.engine, move |w| {
        w.handler("chk", "check", move |t| {
            let (refuse, hold) = (r.clone(), h.clone());
            async move {
                match t.input().as_i64() {
                    Some(2) if refuse.load(Ordering::SeqCst) => {
                        Err(TaskError::permanent("two is refused"))
                    }
                    Some(3) => {
                        for _ in 0..3_000 {
                            if !hold.load(Ordering::SeqCst) {
                                break;
                            }
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                        Ok(json!(3))
                    }
                    _ => Ok(t.input().clone()),
                }
            }
        })
        .handler("strict", "after", |t| async move {
            Ok::<_, TaskError>(t.input().clone())
        })
    })
    .await;
    let id = db.engine.start("strict", &json!([1, 2, 3])).await.unwrap();
    let done = db.engine.wait(id, WAIT).await.unwrap();
    assert_eq!(done.status, ExecutionStatus::Failed, "{done:?}");
    // The failure's cascade (workers' housekeeping) cancels the held child.
    assert!(
        common::eventually(WAIT, || async {
            children(&db, id).await[2].1 == "cancelled"
        })
        .await,
        "the held child was never cancelled: {:?}",
        children(&db, id).await
    );
    let stopped = stopped_members(&db, id).await;
    let dead: Vec<TaskId> = stopped
        .iter()
        .filter(|(_, status, _)| status == "dead")
        .map(|(t, _, _)| *t)
        .collect();
    assert_eq!(dead.len(), 1, "{stopped:?}");
    // Member 1's child may have completed before the parent failed, or not: either way
    // only the members whose child did not complete get a new one.
    let to_restart = stopped.iter().filter(|(_, _, c)| c != "completed").count();
    assert!(to_restart >= 2, "{stopped:?}");

    refuse.store(false, Ordering::SeqCst);
    hold.store(false, Ordering::SeqCst);
    let reprocessed = db.engine.reprocess(dead[0]).await.unwrap();
    assert!(reprocessed.resumed);
    assert_eq!(reprocessed.requeued.len(), stopped.len(), "{reprocessed:?}");
    assert_eq!(
        reprocessed.restarted_children.len(),
        to_restart,
        "{reprocessed:?}"
    );
    let done = db.engine.wait(id, WAIT).await.unwrap();
    assert_eq!(done.status, ExecutionStatus::Completed, "{done:?}");
    assert_eq!(
        done.output.unwrap(),
        json!({"outputs": [1, 2, 3], "failed": []})
    );
    // Each member has one linked child, the new one where there is one, completed; the
    // replaced ones stay listed under the parent, as they ended.
    let linked = children(&db, id).await;
    assert_eq!(linked.len(), 3);
    assert!(linked.iter().all(|(_, s)| s == "completed"), "{linked:?}");
    for child in &reprocessed.restarted_children {
        assert!(linked.iter().any(|(c, _)| c == child), "{linked:?}");
    }
    let mut replaced = unlinked_children(&db, id).await;
    replaced.sort();
    assert_eq!(replaced.len(), to_restart);
    assert!(replaced.contains(&"failed".to_owned()) && replaced.contains(&"cancelled".to_owned()));
    assert_eq!(members(&db, id).await, ["completed"; 3]);
    worker.shutdown().await;
    let diagnosis = db.engine.doctor().await.unwrap();
    assert!(diagnosis.is_healthy(), "{diagnosis:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_childs_end_raced_against_its_members_reprocess_leaves_the_member_due_once() {
    let db = TestDb::new(20).await;
    let mut rounds = 0;
    for strategy in STRATEGIES {
        let child = format!("work_{strategy}");
        let name = format!("strict_{strategy}");
        db.register(&Workflow::new(&child, 1).stage(Stage::step("work").fan_in(strategy)))
            .await;
        db.register(
            &Workflow::new(&name, 1)
                .stage(
                    Stage::map_workflow("each", &child)
                        .fan_in(strategy)
                        .fail_execution_on_member_failure(),
                )
                .stage(Stage::step("after").fan_in(strategy)),
        )
        .await;
        for round in 0..ROUNDS {
            let id = db.engine.start(&name, &json!([0, 1])).await.unwrap();
            let mut work = claim_of(&db.engine, &child, "work", 2).await;
            let kids = children(&db, id).await;
            work.sort_by_key(|t| usize::from(t.execution_id() != kids[0].0));
            let (work_a, work_b) = (work.remove(0), work.remove(0));
            // Child A fails, and its member with it; the fail-fast parent fails, member B
            // is cancelled, and child B, left to a cascade that does not run here, goes on.
            db.engine.fail(&work_a, "refused", true).await.unwrap();
            let member_a = claim_of(&db.engine, &name, "confluo:child", 1)
                .await
                .remove(0);
            db.engine.run_builtin(&member_a).await.unwrap();
            assert_eq!(db.engine.status(id).await.unwrap(), ExecutionStatus::Failed);
            assert_eq!(members(&db, id).await, ["dead", "cancelled"]);

            // Child B's end against the reprocess of member A (which requeues member B).
            let member_a_id = member_a.id();
            let (ends, reprocessed) =
                race_completions(&db.engine, vec![work_b], json!("b"), |e| async move {
                    e.reprocess(member_a_id).await.unwrap()
                })
                .await;
            assert!(
                matches!(ends[0], Outcome::Completed { fired: true }),
                "{strategy} round {round}: {ends:?}"
            );
            assert_eq!(reprocessed.restarted_children.len(), 1, "{reprocessed:?}");
            // Member B is due (its child completed), whichever came first; member A waits
            // for its new child.
            let member_b: TaskId = sqlx::query_scalar(
                "SELECT id FROM confluo.task WHERE execution_id = $1 AND item_index = 1
                    AND handler = 'confluo:child'",
            )
            .bind(id)
            .fetch_one(&db.pool)
            .await
            .unwrap();
            assert!(
                due(&db, member_b).await,
                "{strategy} round {round}: member B waits for a child that has ended"
            );
            assert!(!due(&db, member_a_id).await, "{strategy} round {round}");

            // The new child runs; both members report; the parent's group fires once.
            let new_work = claim_of(&db.engine, &child, "work", 1).await.remove(0);
            assert_eq!(new_work.execution_id(), reprocessed.restarted_children[0]);
            db.engine.complete(&new_work, json!("a")).await.unwrap();
            for member in claim_of(&db.engine, &name, "confluo:child", 2).await {
                db.engine.run_builtin(&member).await.unwrap();
            }
            let after = claim_of(&db.engine, &name, "after", 1).await.remove(0);
            let input = db.engine.task_input(&after).await.unwrap();
            assert_eq!(input, json!({"outputs": ["a", "b"], "failed": []}));
            db.engine.complete(&after, json!("done")).await.unwrap();
            assert_eq!(
                db.engine.status(id).await.unwrap(),
                ExecutionStatus::Completed
            );
            let groups: (i64, i64) = sqlx::query_as(
                "SELECT count(*), count(*) FILTER (WHERE fired_at IS NOT NULL)
                   FROM confluo.stage_group WHERE execution_id = $1 AND stage_name = 'each'",
            )
            .bind(id)
            .fetch_one(&db.pool)
            .await
            .unwrap();
            assert_eq!(groups, (1, 1), "{strategy} round {round}");
            rounds += 1;
        }
    }
    assert_eq!(rounds, ROUNDS * STRATEGIES.len());
    let diagnosis = db.engine.doctor().await.unwrap();
    assert!(diagnosis.is_healthy(), "{diagnosis:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_cascade_decides_on_a_parent_only_once_a_resume_holding_it_has_committed() {
    let db = TestDb::new(10).await;
    db.register(&Workflow::new("work", 1).step("work")).await;
    db.register(
        &Workflow::new("strict", 1)
            .stage(Stage::map_workflow("each", "work").fail_execution_on_member_failure())
            .step("after"),
    )
    .await;
    let id = db.engine.start("strict", &json!([0, 1])).await.unwrap();
    let mut work = claim_of(&db.engine, "work", "work", 2).await;
    let kids = children(&db, id).await;
    work.sort_by_key(|t| usize::from(t.execution_id() != kids[0].0));
    // Child A fails and its fail-fast parent with it; child B runs on, left to the
    // cascade (which does not run here).
    db.engine.fail(&work[0], "refused", true).await.unwrap();
    let member_a = claim_of(&db.engine, "strict", "confluo:child", 1)
        .await
        .remove(0);
    db.engine.run_builtin(&member_a).await.unwrap();
    assert_eq!(db.engine.status(id).await.unwrap(), ExecutionStatus::Failed);
    assert_eq!(children(&db, id).await[1].1, "running");

    // A resume's first write, held open: the parent locked and running again.
    let mut resume = db.connection().await;
    sqlx::query("BEGIN").execute(&mut resume).await.unwrap();
    sqlx::query(
        "UPDATE confluo.execution SET status = 'running', finished_at = NULL WHERE id = $1",
    )
    .bind(id)
    .execute(&mut resume)
    .await
    .unwrap();
    let engine = db.engine.clone();
    let cascade = tokio::spawn(async move { engine.cancel_orphans(100).await.unwrap() });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !cascade.is_finished(),
        "the cascade decided on a parent another transaction holds"
    );
    sqlx::query("COMMIT").execute(&mut resume).await.unwrap();
    assert_eq!(
        cascade.await.unwrap(),
        0,
        "the cascade cancelled a child of a resumed parent"
    );
    assert_eq!(children(&db, id).await[1].1, "running");
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM confluo.cascade")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(left, 0, "a resumed parent stays in the cascade");

    // Stopped again, its running child goes with it.
    assert!(db.engine.cancel(id).await.unwrap());
    assert_eq!(children(&db, id).await[1].1, "cancelled");
}
