//! Execution deadlines: past its deadline an execution moves to `timed_out` and what is
//! pending is cancelled in the same transaction, also when that races a group's last
//! completions; running handlers see their cancellation.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{TestDb, STRATEGIES};
use confluo::{ExecutionStatus, Outcome, Stage, StartOptions, TaskError, Workflow};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn timing_out_racing_the_last_completions_fires_at_most_once_and_dispatches_nothing_after() {
    for strategy in STRATEGIES {
        let db = TestDb::new(12).await;
        let name = format!("deadline-{strategy}");
        db.register(
            &Workflow::new(&name, 1)
                .stage(Stage::map("member").fan_in(strategy))
                .step("after"),
        )
        .await;
        let (mut fired_first, mut timed_out_first) = (0, 0);
        for round in 0..15u64 {
            let options = StartOptions::new().deadline(Duration::from_millis(30));
            let id = db
                .engine
                .start_with(&name, &(0..6).collect::<Vec<_>>(), options)
                .await
                .unwrap()
                .id;
            let mut tasks = db
                .engine
                .claim("racer", 6, Duration::from_secs(60))
                .await
                .unwrap();
            assert_eq!(tasks.len(), 6);
            for task in tasks.drain(..4) {
                db.engine.complete(&task, json!(1)).await.unwrap();
            }
            tokio::time::sleep(Duration::from_millis(40)).await;
            let (outcomes, timed_out) =
                common::race_completions(&db.engine, tasks, json!(2), move |engine| async move {
                    // Varying how late the sweep comes lets either side win some rounds.
                    tokio::time::sleep(Duration::from_micros(round * 200)).await;
                    // An execution whose row a firing completion holds is skipped (SKIP
                    // LOCKED) and timed out by the next sweep.
                    loop {
                        let timed_out = engine.time_out_expired(10).await.unwrap();
                        if !timed_out.is_empty() {
                            return timed_out;
                        }
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                })
                .await;
            for o in &outcomes {
                assert!(
                    matches!(o, Outcome::Completed { .. }),
                    "{strategy} round {round}: {o:?}"
                );
            }
            let fired = common::fired(&outcomes) as i64;
            assert_eq!(timed_out, vec![id], "{strategy} round {round}");
            let (groups, open_next): (i64, i64) = sqlx::query_as(
                "SELECT (SELECT count(*) FROM confluo.stage_group
                          WHERE execution_id = $1 AND stage_index = 1),
                        (SELECT count(*) FROM confluo.task WHERE execution_id = $1
                          AND status IN ('pending', 'running', 'completed') AND stage_index = 1)",
            )
            .bind(id)
            .fetch_one(&db.pool)
            .await
            .unwrap();
            assert!(
                fired <= 1 && groups == fired,
                "{strategy}: fired {fired}, {groups} groups"
            );
            assert_eq!(
                open_next, 0,
                "{strategy} round {round}: the next stage was cancelled"
            );
            let execution = db.engine.execution(id).await.unwrap();
            assert_eq!(execution.status, ExecutionStatus::TimedOut);
            assert!(execution.error.unwrap().contains("deadline"));
            if groups == 1 {
                fired_first += 1;
            } else {
                timed_out_first += 1;
            }
        }
        assert!(db.engine.doctor().await.unwrap().is_healthy());
        eprintln!(
            "{strategy}: the group fired before the time-out in {fired_first} rounds, \
             the time-out came first in {timed_out_first}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_times_out_an_execution_past_its_deadline_and_its_handlers_see_it() {
    let db = TestDb::new(8).await;
    db.register(
        &Workflow::new("slow", 1)
            .stage(Stage::map("wait"))
            .step("after"),
    )
    .await;
    let (started, cancelled) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let (s, c) = (started.clone(), cancelled.clone());
    let worker = common::engine(db.new_pool(4).await)
        .worker()
        .concurrency(2)
        .lease(Duration::from_millis(400))
        // Claims within the 300 ms deadline also without notifications (behind a pooler).
        .poll_interval(Duration::from_millis(50))
        .handler("slow", "wait", move |t| {
            let (s, c) = (s.clone(), c.clone());
            async move {
                s.fetch_add(1, Ordering::SeqCst);
                tokio::select! {
                    _ = t.cancellation().cancelled() => { c.fetch_add(1, Ordering::SeqCst); }
                    _ = tokio::time::sleep(Duration::from_secs(30)) => {}
                }
                Ok::<_, TaskError>(json!("late"))
            }
        })
        .handler("slow", "after", |_| async {
            Ok::<_, TaskError>(json!(null))
        })
        .start()
        .await
        .unwrap();
    let never = db.engine.start("slow", &[1]).await.unwrap();
    let id = db
        .engine
        .start_with(
            "slow",
            &(0..10).collect::<Vec<_>>(),
            StartOptions::new().deadline(Duration::from_millis(300)),
        )
        .await
        .unwrap()
        .id;
    let done = db.engine.wait(id, Duration::from_secs(20)).await.unwrap();
    assert_eq!(done.status, ExecutionStatus::TimedOut);
    // Wait for the running handlers to notice at their next lease renewal.
    for _ in 0..100 {
        if cancelled.load(Ordering::SeqCst) >= 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    worker.shutdown().await;
    assert!(
        cancelled.load(Ordering::SeqCst) >= 1,
        "a running handler saw the time-out"
    );
    let open: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM confluo.task WHERE execution_id = $1
            AND (status IN ('pending', 'running') OR stage_index > 0)",
    )
    .bind(id)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    // Nothing is left to run, and the next stage was never dispatched (a handler that
    // returned after the time-out had its result recorded, and nothing more).
    assert_eq!(open, 0);
    // An execution without a deadline is untouched.
    assert_eq!(
        db.engine.status(never).await.unwrap(),
        ExecutionStatus::Running
    );
    assert!(started.load(Ordering::SeqCst) >= 1);
}
