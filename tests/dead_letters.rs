//! Dead-letter reprocessing: a failed execution resumes and finishes; reprocessing a
//! member whose group already fired (or is firing at that very instant) never dispatches
//! the next stage a second time; what cannot be reprocessed is refused with a typed error.

mod common;

use std::time::Duration;

use common::{claim_n, TestDb, STRATEGIES};
use confluo::{
    DeadLetterFilter, Error, ExecutionStatus, FanInStrategy, MapResults, Outcome, RetryPolicy,
    Stage, Workflow,
};
use serde_json::{json, Value};

const LEASE: Duration = Duration::from_secs(60);

async fn groups_at(db: &TestDb, id: confluo::ExecutionId, stage: i32) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM confluo.stage_group WHERE execution_id = $1 AND stage_index = $2",
    )
    .bind(id)
    .bind(stage)
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reprocessing_racing_the_groups_last_completion_dispatches_the_next_stage_once() {
    for strategy in STRATEGIES {
        let db = TestDb::new(12).await;
        let name = format!("reprocess-{strategy}");
        db.register(
            &Workflow::new(&name, 1)
                .stage(
                    Stage::map("member")
                        .fan_in(strategy)
                        .retry(RetryPolicy::none()),
                )
                .step("after"),
        )
        .await;
        let (mut reprocess_first, mut fired_first) = (0, 0);
        for round in 0..15 {
            let id = db.engine.start(&name, &[0, 1, 2, 3]).await.unwrap();
            let mut tasks = claim_n(&db.engine, 4).await;
            tasks.sort_by_key(|t| t.item_index());
            let last = tasks.pop().unwrap();
            let dead = tasks.pop().unwrap();
            for t in &tasks {
                db.engine.complete(t, json!(t.item_index())).await.unwrap();
            }
            let outcome = db.engine.fail(&dead, "card declined", true).await.unwrap();
            assert_eq!(outcome, Outcome::DeadLettered { fired: false });

            // The group's last completion and the reprocess of its dead member, released
            // together on connections of their own.
            let dead_id = dead.id();
            let (outcomes, reprocessed) = common::race_completions(
                &db.engine,
                vec![last],
                json!(3),
                move |engine| async move { engine.reprocess(dead_id).await.unwrap() },
            )
            .await;
            let last_outcome = outcomes[0].clone();
            assert!(!reprocessed.resumed);
            assert_eq!(reprocessed.requeued, vec![dead.id()]);

            // The member runs again and succeeds.
            let again = loop {
                let claimed = claim_n(&db.engine, 1).await;
                if claimed[0].id() == dead.id() {
                    break claimed.into_iter().next().unwrap();
                }
                // The next stage, dispatched before the reprocess: leave it for later.
                db.engine.release(&claimed[0]).await.unwrap();
            };
            assert_eq!(again.attempt(), 1, "a fresh attempt budget");
            let again_outcome = db.engine.complete(&again, json!(2)).await.unwrap();

            let fired = [&last_outcome, &again_outcome]
                .iter()
                .filter(|o| ***o == Outcome::Completed { fired: true })
                .count();
            assert_eq!(
                fired, 1,
                "{strategy} round {round}: {last_outcome:?} {again_outcome:?}"
            );
            assert_eq!(groups_at(&db, id, 1).await, 1, "{strategy} round {round}");
            assert_eq!(
                reprocessed.group_fired,
                last_outcome == (Outcome::Completed { fired: true }),
                "{strategy} round {round}: the reprocess reports whether the group had fired"
            );

            // The next stage was dispatched once. It reads its input by reference when
            // claimed, so claimed now it sees the member's new output in either order.
            let after = claim_n(&db.engine, 1).await.remove(0);
            assert_eq!(after.stage_index(), 1);
            let input: MapResults<u32> =
                serde_json::from_value(db.engine.task_input(&after).await.unwrap()).unwrap();
            assert_eq!((input.outputs, input.failed.len()), (vec![0, 1, 2, 3], 0));
            if reprocessed.group_fired {
                fired_first += 1;
            } else {
                reprocess_first += 1;
            }
            db.engine.complete(&after, json!("done")).await.unwrap();
            let done = db.engine.execution(id).await.unwrap();
            assert_eq!(done.status, ExecutionStatus::Completed);
            assert_eq!(done.output, Some(json!("done")));
        }
        let diagnosis = db.engine.doctor().await.unwrap();
        assert!(diagnosis.is_healthy(), "{strategy}: {diagnosis:?}");
        eprintln!(
            "{strategy}: the group fired before the reprocess in {fired_first} rounds, \
             the reprocess came first in {reprocess_first}"
        );
    }
}

#[tokio::test]
async fn reprocessing_the_dead_step_resumes_the_failed_execution() {
    let db = TestDb::new(4).await;
    db.register(
        &Workflow::new("charge", 1)
            .stage(
                Stage::step("charge").retry(
                    RetryPolicy::exponential(2)
                        .backoff(Duration::from_millis(1), Duration::from_millis(1)),
                ),
            )
            .step("receipt"),
    )
    .await;
    let id = db
        .engine
        .start("charge", &json!({"cents": 500}))
        .await
        .unwrap();
    for attempt in 1..=2 {
        let task = claim_n(&db.engine, 1).await.remove(0);
        assert_eq!(task.attempt(), attempt);
        db.engine.fail(&task, "gateway down", false).await.unwrap();
    }
    let failed = db.engine.execution(id).await.unwrap();
    assert_eq!(failed.status, ExecutionStatus::Failed);

    let listed = db
        .engine
        .dead_letters(&DeadLetterFilter::new().execution(id))
        .await
        .unwrap();
    assert_eq!(listed.len(), 1);
    let dead = &listed[0];
    assert_eq!(
        (dead.stage.as_str(), dead.attempts, dead.execution_status),
        ("charge", 2, ExecutionStatus::Failed)
    );
    assert_eq!(dead.last_error.as_deref(), Some("gateway down"));
    let detail = db.engine.dead_letter(dead.task_id).await.unwrap();
    assert_eq!(detail.errors.len(), 2);

    let reprocessed = db.engine.reprocess(dead.task_id).await.unwrap();
    assert!(reprocessed.resumed && !reprocessed.group_fired);
    assert_eq!(reprocessed.requeued, vec![dead.task_id]);
    let resumed = db.engine.execution(id).await.unwrap();
    assert_eq!(
        (resumed.status, resumed.error),
        (ExecutionStatus::Running, None)
    );
    assert!(db
        .engine
        .dead_letters(&DeadLetterFilter::new())
        .await
        .unwrap()
        .is_empty());

    let task = claim_n(&db.engine, 1).await.remove(0);
    assert_eq!((task.id(), task.attempt()), (dead.task_id, 1));
    db.engine.complete(&task, json!("paid")).await.unwrap();
    let receipt = claim_n(&db.engine, 1).await.remove(0);
    assert_eq!(db.engine.task_input(&receipt).await.unwrap(), json!("paid"));
    db.engine.complete(&receipt, json!("sent")).await.unwrap();
    let done = db.engine.execution(id).await.unwrap();
    assert_eq!(
        (done.status, done.output),
        (ExecutionStatus::Completed, Some(json!("sent")))
    );
    // The history of the first round is kept.
    let errors: i32 =
        sqlx::query_scalar("SELECT jsonb_array_length(errors) FROM confluo.task WHERE id = $1")
            .bind(dead.task_id)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(errors, 2);
}

#[tokio::test]
async fn resuming_a_stage_that_fails_the_execution_requeues_what_the_failure_cancelled() {
    for strategy in [FanInStrategy::Countdown, FanInStrategy::Striped] {
        let db = TestDb::new(4).await;
        let name = format!("strict-{strategy}");
        db.register(
            &Workflow::new(&name, 1)
                .stage(
                    Stage::map("member")
                        .fan_in(strategy)
                        .retry(RetryPolicy::none())
                        .fail_execution_on_member_failure(),
                )
                .step("after"),
        )
        .await;
        let id = db
            .engine
            .start(&name, &(0..40).collect::<Vec<_>>())
            .await
            .unwrap();
        let mut claimed = claim_n(&db.engine, 3).await;
        let straggler = claimed.pop().unwrap();
        let dead = claimed.pop().unwrap();
        db.engine.complete(&claimed[0], json!(0)).await.unwrap();
        db.engine.fail(&dead, "bad row", true).await.unwrap();
        assert_eq!(db.engine.status(id).await.unwrap(), ExecutionStatus::Failed);
        // A member still running when the execution failed finishes anyway.
        assert_eq!(
            db.engine.complete(&straggler, json!(1)).await.unwrap(),
            Outcome::Completed { fired: false }
        );

        let reprocessed = db.engine.reprocess(dead.id()).await.unwrap();
        assert!(reprocessed.resumed, "{strategy}");
        // The dead member and the 37 that the failure cancelled.
        assert_eq!(reprocessed.requeued.len(), 38, "{strategy}");
        assert!(db.engine.doctor().await.unwrap().is_healthy(), "{strategy}");

        let mut fired = 0;
        let mut left = 38;
        while left > 0 {
            for task in db.engine.claim("test", left, LEASE).await.unwrap() {
                assert_eq!(task.stage_index(), 0);
                left -= 1;
                if db
                    .engine
                    .complete(&task, json!(task.item_index()))
                    .await
                    .unwrap()
                    == (Outcome::Completed { fired: true })
                {
                    fired += 1;
                }
            }
        }
        assert_eq!((fired, groups_at(&db, id, 1).await), (1, 1), "{strategy}");
        let after = claim_n(&db.engine, 1).await.remove(0);
        let input: MapResults<u32> =
            serde_json::from_value(db.engine.task_input(&after).await.unwrap()).unwrap();
        assert_eq!(input.outputs.len(), 40, "{strategy}");
        assert!(input.failed.is_empty(), "{strategy}");
        db.engine.complete(&after, Value::Null).await.unwrap();
        assert_eq!(
            db.engine.status(id).await.unwrap(),
            ExecutionStatus::Completed
        );
    }
}

#[tokio::test]
async fn what_cannot_be_reprocessed_is_refused_with_a_typed_error() {
    let db = TestDb::new(4).await;
    db.register(
        &Workflow::new("lenient", 1)
            .stage(Stage::map("member").retry(RetryPolicy::none()))
            .step("after"),
    )
    .await;
    let id = db.engine.start("lenient", &[1, 2]).await.unwrap();
    let tasks = claim_n(&db.engine, 2).await;
    db.engine.fail(&tasks[0], "boom", true).await.unwrap();

    // Twice in a row: the second finds it queued again.
    db.engine.reprocess(tasks[0].id()).await.unwrap();
    match db.engine.reprocess(tasks[0].id()).await {
        Err(Error::NotDeadLettered { status, .. }) => assert_eq!(status, "pending"),
        other => panic!("{other:?}"),
    }
    match db.engine.reprocess(confluo::TaskId::new()).await {
        Err(e) if e.is_not_found() => {}
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        db.engine.dead_letter(tasks[1].id()).await,
        Err(Error::NotDeadLettered { .. })
    ));

    // Dead again, then the execution completes with it listed as failed: nothing reads a
    // new result any more.
    let again = claim_n(&db.engine, 1).await.remove(0);
    db.engine.fail(&again, "boom", true).await.unwrap();
    db.engine.complete(&tasks[1], json!(2)).await.unwrap();
    let after = claim_n(&db.engine, 1).await.remove(0);
    db.engine.complete(&after, json!(null)).await.unwrap();
    assert_eq!(
        db.engine.status(id).await.unwrap(),
        ExecutionStatus::Completed
    );
    match db.engine.reprocess(again.id()).await {
        Err(Error::ExecutionNotResumable { execution, status }) => {
            assert_eq!((execution, status), (id, ExecutionStatus::Completed));
        }
        other => panic!("{other:?}"),
    }
    let listed = db
        .engine
        .dead_letters(&DeadLetterFilter::new())
        .await
        .unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!((listed[0].reprocessed, listed[0].group_fired), (1, true));
}

#[tokio::test]
async fn a_failed_execution_past_its_deadline_is_not_resumed() {
    let db = TestDb::new(4).await;
    db.register(&Workflow::new("late", 1).stage(Stage::step("charge").retry(RetryPolicy::none())))
        .await;
    let id = db
        .engine
        .start_with(
            "late",
            &json!({}),
            confluo::StartOptions::new().deadline(Duration::from_millis(300)),
        )
        .await
        .unwrap()
        .id;
    let task = claim_n(&db.engine, 1).await.remove(0);
    db.engine.fail(&task, "declined", true).await.unwrap();
    assert_eq!(db.engine.status(id).await.unwrap(), ExecutionStatus::Failed);
    tokio::time::sleep(Duration::from_millis(400)).await;
    match db.engine.reprocess(task.id()).await {
        Err(Error::DeadlinePassed { execution }) => assert_eq!(execution, id),
        other => panic!("{other:?}"),
    }
    // Nothing changed: still failed, still a dead letter.
    assert_eq!(db.engine.status(id).await.unwrap(), ExecutionStatus::Failed);
    assert_eq!(
        db.engine
            .dead_letter(task.id())
            .await
            .unwrap()
            .summary
            .attempts,
        1
    );
}
