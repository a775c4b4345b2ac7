//! Cancellation against fan-in: a cancel racing the last completions of a group fires the
//! group at most once and dispatches nothing after it commits; running handlers see the
//! cancellation, and what they send afterwards changes nothing.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{TestDb, STRATEGIES};
use confluo::{ExecutionStatus, FanInStrategy, Outcome, Stage, TaskError, Workflow};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cancel_racing_the_last_completions_fires_at_most_once_and_dispatches_nothing_after() {
    for strategy in STRATEGIES {
        let db = TestDb::new(12).await;
        let name = format!("race-{strategy}");
        db.register(
            &Workflow::new(&name, 1)
                .stage(Stage::map("member").fan_in(strategy))
                .step("after"),
        )
        .await;
        let (mut dispatched_before_cancel, mut cancelled_first) = (0, 0);
        for round in 0..20u64 {
            let input: Vec<u32> = (0..6).collect();
            let id = db.engine.start(&name, &input).await.unwrap();
            let mut tasks = db
                .engine
                .claim("racer", 6, Duration::from_secs(60))
                .await
                .unwrap();
            assert_eq!(tasks.len(), 6);
            // Four finish before the race; the last two race the cancel.
            for task in tasks.drain(..4) {
                db.engine.complete(&task, json!(1)).await.unwrap();
            }
            let (outcomes, cancelled) =
                common::race_completions(&db.engine, tasks, json!(2), move |engine| async move {
                    // Varying how late the cancel comes lets either side win some rounds.
                    tokio::time::sleep(Duration::from_micros(round * 300)).await;
                    engine.cancel(id).await.unwrap()
                })
                .await;
            for o in &outcomes {
                assert!(
                    matches!(o, Outcome::Completed { .. }),
                    "{strategy} round {round}: {o:?}"
                );
            }
            let fired = common::fired(&outcomes) as i64;
            assert!(cancelled, "the execution was running");

            let (groups, open_next, done_next): (i64, i64, i64) = sqlx::query_as(
                "SELECT (SELECT count(*) FROM confluo.stage_group
                          WHERE execution_id = $1 AND stage_index = 1),
                        (SELECT count(*) FROM confluo.task WHERE execution_id = $1
                          AND stage_index = 1 AND status IN ('pending', 'running')),
                        (SELECT count(*) FROM confluo.task WHERE execution_id = $1
                          AND stage_index = 1 AND status = 'completed')",
            )
            .bind(id)
            .fetch_one(&db.pool)
            .await
            .unwrap();
            assert!(
                fired <= 1 && groups == fired,
                "{strategy}: fired {fired}, {groups} groups"
            );
            // Whatever was dispatched before the cancel was cancelled with it: nothing of
            // the next stage can run.
            assert_eq!((open_next, done_next), (0, 0), "{strategy} round {round}");
            assert_eq!(
                db.engine.status(id).await.unwrap(),
                ExecutionStatus::Cancelled
            );
            if groups == 1 {
                dispatched_before_cancel += 1;
            } else {
                cancelled_first += 1;
            }
        }
        eprintln!(
            "{strategy}: the group fired before the cancel in {dispatched_before_cancel} rounds, \
             the cancel came first in {cancelled_first}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn running_handlers_see_the_cancellation_and_their_late_completions_change_nothing() {
    let db = TestDb::new(8).await;
    db.register(
        &Workflow::new("slow", 1)
            .stage(Stage::map("wait"))
            .step("after"),
    )
    .await;
    let saw_cancel = Arc::new(AtomicBool::new(false));
    let seen = saw_cancel.clone();
    let worker = common::engine(db.new_pool(4).await)
        .worker()
        .lease(Duration::from_millis(600))
        .handler("slow", "wait", move |t| {
            let seen = seen.clone();
            async move {
                tokio::select! {
                    _ = t.cancellation().cancelled() => seen.store(true, Ordering::SeqCst),
                    _ = tokio::time::sleep(Duration::from_secs(30)) => {}
                }
                // Returns a result anyway: it must change nothing.
                Ok::<_, TaskError>(json!("late"))
            }
        })
        .handler("slow", "after", |_| async {
            Ok::<_, TaskError>(json!(null))
        })
        .start()
        .await
        .unwrap();
    let id = db.engine.start("slow", &[1, 2, 3]).await.unwrap();
    let running = common::eventually(Duration::from_secs(10), || async {
        db.engine.execution(id).await.unwrap().stages[0].running == 3
    })
    .await;
    assert!(running, "the handlers started");
    assert!(db.engine.cancel(id).await.unwrap());
    let noticed = common::eventually(Duration::from_secs(5), || async {
        saw_cancel.load(Ordering::SeqCst)
    })
    .await;
    assert!(
        noticed,
        "a running handler saw the cancellation (at its next lease renewal)"
    );
    // Their late completions are recorded as the members' ends but dispatch nothing.
    let settled = common::eventually(Duration::from_secs(10), || async {
        db.engine.execution(id).await.unwrap().stages[0].running == 0
    })
    .await;
    assert!(settled);
    worker.shutdown().await;
    let execution = db.engine.execution(id).await.unwrap();
    assert_eq!(execution.status, ExecutionStatus::Cancelled);
    assert_eq!(
        execution.stages.len(),
        1,
        "nothing was dispatched after the cancel"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cancelling_stops_queued_work_and_dispatches_nothing() {
    for strategy in STRATEGIES {
        cancelling_stops_queued_work_and_dispatches_nothing_with(strategy).await;
    }
}

async fn cancelling_stops_queued_work_and_dispatches_nothing_with(strategy: FanInStrategy) {
    let db = TestDb::new(10).await;
    db.register(
        &Workflow::new("cancel", 1)
            .stage(Stage::map("item").fan_in(strategy))
            .step("after"),
    )
    .await;
    let id = db.engine.start("cancel", &[1, 2, 3]).await.unwrap();
    let running = db
        .engine
        .claim("t", 1, Duration::from_secs(60))
        .await
        .unwrap();
    assert!(db.engine.cancel(id).await.unwrap());
    assert!(
        !db.engine.cancel(id).await.unwrap(),
        "a second cancel changes nothing"
    );
    let exec = db.engine.execution(id).await.unwrap();
    assert_eq!(exec.status, ExecutionStatus::Cancelled);
    assert_eq!((exec.stages[0].cancelled, exec.stages[0].remaining), (2, 1));
    assert!(db
        .engine
        .claim("t", 10, Duration::from_secs(60))
        .await
        .unwrap()
        .is_empty());
    // The member that was running finishes: counted, but nothing is dispatched.
    db.engine.complete(&running[0], json!(1)).await.unwrap();
    let exec = db.engine.execution(id).await.unwrap();
    assert_eq!((exec.stages.len(), exec.stages[0].remaining), (1, 0));
    assert!(db
        .engine
        .cancel(confluo::ExecutionId::new())
        .await
        .unwrap_err()
        .is_not_found());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cancelling_a_wide_striped_group_counts_every_stripe_down() {
    let db = TestDb::new(10).await;
    db.register(
        &Workflow::new("striped", 1)
            .stage(Stage::map("item").fan_in(FanInStrategy::Striped))
            .step("after"),
    )
    .await;
    let id = db.engine.start("striped", &vec![0; 100]).await.unwrap();
    let stripes: i32 =
        sqlx::query_scalar("SELECT stripes FROM confluo.stage_group WHERE execution_id = $1")
            .bind(id)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(stripes, 6, "one stripe per 16 members");
    let running = db
        .engine
        .claim("t", 10, Duration::from_secs(60))
        .await
        .unwrap();
    assert!(db.engine.cancel(id).await.unwrap());
    let exec = db.engine.execution(id).await.unwrap();
    assert_eq!(
        (exec.stages[0].cancelled, exec.stages[0].remaining),
        (90, 10)
    );
    for task in &running {
        db.engine.complete(task, json!(1)).await.unwrap();
    }
    let (row, stripe_sum): (i32, i64) = sqlx::query_as(
        "SELECT g.remaining, (SELECT sum(remaining) FROM confluo.group_stripe s WHERE s.group_id = g.id)
           FROM confluo.stage_group g WHERE g.execution_id = $1",
    )
    .bind(id)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        (row, stripe_sum),
        (0, 0),
        "every stripe drained, the group row at zero"
    );
    let exec = db.engine.execution(id).await.unwrap();
    assert_eq!((exec.stages.len(), exec.stages[0].fired_at), (1, None));
}
