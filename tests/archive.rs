//! Finished tasks leave the hot table: `Engine::archive` and every worker's housekeeping
//! move an ended execution's tasks into `confluo.task_history`; every read of finished
//! work answers the same afterwards; a reprocess of an archived execution's dead letter
//! brings its tasks back and the execution finishes; purge deletes the history; racing
//! archivers move each execution once; the two tables keep the same columns.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{claim_n, TestDb, WAIT};
use confluo::{
    DeadLetterFilter, Engine, ExecutionId, ExecutionStatus, MemberFilter, RetryPolicy, Stage,
    TaskError, Workflow,
};
use serde_json::{json, Value};
use tokio::sync::Barrier;

/// (tasks in the hot table, tasks in the history) of one execution.
async fn where_tasks_are(db: &TestDb, id: ExecutionId) -> (i64, i64) {
    sqlx::query_as(
        "SELECT (SELECT count(*) FROM confluo.task WHERE execution_id = $1),
                (SELECT count(*) FROM confluo.task_history WHERE execution_id = $1)",
    )
    .bind(id)
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

/// Everything a reader sees of an ended execution, as JSON.
async fn everything_read(engine: &Engine, id: ExecutionId) -> Value {
    let mut execution = serde_json::to_value(engine.execution(id).await.unwrap()).unwrap();
    execution["updated_at"] = Value::Null;
    let members: Vec<Value> = {
        let mut all = Vec::new();
        for stage in 0..2 {
            all.push(serde_json::to_value(engine.members(id, stage, 1000).await.unwrap()).unwrap());
            let page = engine
                .member_page(id, stage, &MemberFilter::new().after(1).limit(2))
                .await
                .unwrap();
            all.push(serde_json::to_value(page.members).unwrap());
        }
        all
    };
    let dead = engine
        .dead_letters(&DeadLetterFilter::new().execution(id))
        .await
        .unwrap();
    let details: Vec<Value> = {
        let mut v = Vec::new();
        for d in &dead {
            v.push(serde_json::to_value(engine.dead_letter(d.task_id).await.unwrap()).unwrap());
            v.push(serde_json::to_value(engine.member(d.task_id).await.unwrap()).unwrap());
        }
        v
    };
    let outputs = engine.block_outputs(id, 0).await.unwrap();
    let page = outputs.page(None, 100).await.unwrap();
    let activity = engine.activity(Duration::from_secs(3600)).await.unwrap();
    json!({
        "execution": execution,
        "members": members,
        "dead_letters": serde_json::to_value(&dead).unwrap(),
        "details": details,
        "block_outputs": format!("{page:?}"),
        "task_counts": serde_json::to_value(activity.tasks).unwrap(),
    })
}

#[tokio::test]
async fn archiving_moves_ended_executions_tasks_and_every_read_answers_the_same() {
    let db = TestDb::new(4).await;
    db.register(
        &Workflow::new("wide", 1)
            .stage(Stage::map("member").retry(RetryPolicy::none()))
            .step("sum"),
    )
    .await;
    // One completes with a dead member (a partial map), one is still running.
    let ended = db.engine.start("wide", &[1, 2, 3, 4, 5]).await.unwrap();
    let mut tasks = claim_n(&db.engine, 5).await;
    let dead = tasks.remove(2);
    db.engine.fail(&dead, "boom", true).await.unwrap();
    for t in &tasks {
        let x: i64 = db.engine.task_input(t).await.unwrap().as_i64().unwrap();
        db.engine.complete(t, json!(x * 10)).await.unwrap();
    }
    let sum = claim_n(&db.engine, 1).await.remove(0);
    db.engine.complete(&sum, json!("summed")).await.unwrap();
    assert_eq!(
        db.engine.status(ended).await.unwrap(),
        ExecutionStatus::Completed
    );
    let running = db.engine.start("wide", &[7]).await.unwrap();

    let before = everything_read(&db.engine, ended).await;
    let waiting = db.engine.unarchived().await.unwrap();
    assert_eq!((waiting.executions, waiting.tasks), (1, 6));
    // Not yet: it ended less than an hour ago.
    let none = db
        .engine
        .archive(Duration::from_secs(3600), 10)
        .await
        .unwrap();
    assert_eq!((none.executions, none.tasks), (0, 0));
    let moved = db.engine.archive(Duration::ZERO, 10).await.unwrap();
    assert_eq!((moved.executions, moved.tasks), (1, 6));
    assert_eq!(where_tasks_are(&db, ended).await, (0, 6));
    assert_eq!(where_tasks_are(&db, running).await, (1, 0));
    assert_eq!(db.engine.unarchived().await.unwrap().executions, 0);
    let after = everything_read(&db.engine, ended).await;
    assert_eq!(before, after);
    assert_eq!(
        db.engine.execution(ended).await.unwrap().output,
        Some(json!("summed"))
    );
    // Nothing left to do: a second pass moves nothing.
    let again = db.engine.archive(Duration::ZERO, 10).await.unwrap();
    assert_eq!((again.executions, again.tasks), (0, 0));
}

#[tokio::test]
async fn a_stopped_execution_is_archived_once_its_running_attempts_end() {
    let db = TestDb::new(4).await;
    db.register(&Workflow::new("stop", 1).map("member")).await;
    let id = db.engine.start("stop", &[1, 2]).await.unwrap();
    let held = claim_n(&db.engine, 1).await.remove(0);
    assert!(db.engine.cancel(id).await.unwrap());
    // Its one attempt still runs: its acknowledgement goes to the hot table.
    let moved = db.engine.archive(Duration::ZERO, 10).await.unwrap();
    assert_eq!(moved.executions, 0);
    assert_eq!(where_tasks_are(&db, id).await, (2, 0));
    db.engine.complete(&held, json!(1)).await.unwrap();
    let moved = db.engine.archive(Duration::ZERO, 10).await.unwrap();
    assert_eq!((moved.executions, moved.tasks), (1, 2));
    // A late replay of the acknowledgement finds nothing to change, and says so.
    let replay = db.engine.complete(&held, json!(1)).await.unwrap();
    assert_eq!(replay, confluo::Outcome::AlreadyRecorded);
}

#[tokio::test]
async fn reprocessing_an_archived_dead_letter_brings_its_execution_back_and_it_finishes() {
    let db = TestDb::new(4).await;
    db.register(
        &Workflow::new("charge", 1)
            .stage(
                Stage::map("charge")
                    .retry(RetryPolicy::none())
                    .fail_execution_on_member_failure(),
            )
            .step("receipt"),
    )
    .await;
    let id = db.engine.start("charge", &[100, 200]).await.unwrap();
    let tasks = claim_n(&db.engine, 2).await;
    db.engine.complete(&tasks[0], json!("ok")).await.unwrap();
    db.engine
        .fail(&tasks[1], "gateway down", true)
        .await
        .unwrap();
    assert_eq!(db.engine.status(id).await.unwrap(), ExecutionStatus::Failed);
    db.engine.archive(Duration::ZERO, 10).await.unwrap();
    assert_eq!(where_tasks_are(&db, id).await, (0, 2));

    let listed = db
        .engine
        .dead_letters(&DeadLetterFilter::new())
        .await
        .unwrap();
    assert_eq!(listed.len(), 1, "an archived dead letter is still listed");
    let done = db.engine.reprocess(listed[0].task_id).await.unwrap();
    assert!(done.resumed);
    assert_eq!(where_tasks_are(&db, id).await, (2, 0));
    let retried = claim_n(&db.engine, 1).await.remove(0);
    assert_eq!(retried.id(), listed[0].task_id);
    db.engine.complete(&retried, json!("ok")).await.unwrap();
    let receipt = claim_n(&db.engine, 1).await.remove(0);
    db.engine.complete(&receipt, json!("sent")).await.unwrap();
    let finished = db.engine.execution(id).await.unwrap();
    assert_eq!(
        (finished.status, finished.output),
        (ExecutionStatus::Completed, Some(json!("sent")))
    );
    // Ended again: archived again, all three tasks.
    let moved = db.engine.archive(Duration::ZERO, 10).await.unwrap();
    assert_eq!((moved.executions, moved.tasks), (1, 3));
}

#[tokio::test]
async fn purge_deletes_the_history_of_what_it_deletes() {
    let db = TestDb::new(4).await;
    db.register(&Workflow::new("short", 1).map("member")).await;
    let id = db.engine.start("short", &[1, 2, 3]).await.unwrap();
    for t in claim_n(&db.engine, 3).await {
        db.engine.complete(&t, json!(null)).await.unwrap();
    }
    db.engine.archive(Duration::ZERO, 10).await.unwrap();
    assert_eq!(where_tasks_are(&db, id).await, (0, 3));
    let purged = db
        .engine
        .purge(chrono::Utc::now() + chrono::Duration::seconds(1), 10)
        .await
        .unwrap();
    assert_eq!(purged, 1);
    assert_eq!(where_tasks_are(&db, id).await, (0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn archivers_racing_each_other_and_a_reprocess_move_each_execution_once() {
    let db = TestDb::new(12).await;
    db.register(&Workflow::new("race", 1).map("member").step("after"))
        .await;
    db.register(
        &Workflow::new("race-charge", 1)
            .stage(
                Stage::step("charge")
                    .retry(RetryPolicy::none())
                    .fail_execution_on_member_failure(),
            )
            .step("after"),
    )
    .await;
    for round in 0..10 {
        // 19 completed executions and a failed one, moved by four archivers while the
        // failed one's dead letter is reprocessed, all released at once.
        let failed = db.engine.start("race-charge", &json!(1)).await.unwrap();
        let charge = claim_n(&db.engine, 1).await.remove(0);
        db.engine.fail(&charge, "declined", true).await.unwrap();
        assert_eq!(
            db.engine.status(failed).await.unwrap(),
            ExecutionStatus::Failed
        );
        let mut ids = vec![failed];
        for _ in 0..19 {
            ids.push(db.engine.start("race", &[1, 2, 3]).await.unwrap());
        }
        for t in claim_n(&db.engine, 57).await {
            db.engine.complete(&t, json!(null)).await.unwrap();
        }
        for t in claim_n(&db.engine, 19).await {
            db.engine.complete(&t, json!(null)).await.unwrap();
        }
        let barrier = Arc::new(Barrier::new(5));
        let mut racers = Vec::new();
        for _ in 0..4 {
            let (engine, barrier) = (db.engine.clone(), barrier.clone());
            racers.push(tokio::spawn(async move {
                barrier.wait().await;
                engine.archive(Duration::ZERO, 3).await.unwrap().executions
            }));
        }
        let (engine, b, dead) = (db.engine.clone(), barrier.clone(), charge.id());
        let reprocess = tokio::spawn(async move {
            b.wait().await;
            engine.reprocess(dead).await.unwrap()
        });
        let mut archived = 0;
        for r in racers {
            archived += r.await.unwrap();
        }
        assert!(reprocess.await.unwrap().resumed, "round {round}");
        // Each completed one is archived exactly once; the resumed one runs with its task
        // in the hot table (never archived, or archived first and brought back).
        let (hot, history): (i64, i64) = sqlx::query_as(
            "SELECT (SELECT count(*) FROM confluo.task WHERE execution_id = ANY($1)),
                    (SELECT count(*) FROM confluo.task_history WHERE execution_id = ANY($1))",
        )
        .bind(&ids)
        .fetch_one(&db.pool)
        .await
        .unwrap();
        assert!((19..=20).contains(&archived), "round {round}: {archived}");
        assert_eq!((hot, history), (1, 19 * 4), "round {round}");
        let retried = claim_n(&db.engine, 1).await.remove(0);
        assert_eq!(retried.id(), charge.id());
        db.engine.complete(&retried, json!(0)).await.unwrap();
        let after = claim_n(&db.engine, 1).await.remove(0);
        db.engine.complete(&after, json!(null)).await.unwrap();
        assert_eq!(
            db.engine.status(failed).await.unwrap(),
            ExecutionStatus::Completed
        );
        db.engine.archive(Duration::ZERO, 100).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn archivers_never_move_a_task_a_reprocess_claim_and_stop_left_running() {
    let db = TestDb::new(12).await;
    db.register(&Workflow::new("moved", 1).stage(Stage::step("charge").retry(RetryPolicy::none())))
        .await;
    for round in 0..20 {
        let id = db.engine.start("moved", &json!(1)).await.unwrap();
        let charge = claim_n(&db.engine, 1).await.remove(0);
        db.engine.fail(&charge, "declined", true).await.unwrap();
        // Archivers over and over, while the failed execution is resumed, its task claimed
        // and the execution cancelled with the attempt still running: at no point may the
        // running task leave the hot table.
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let barrier = Arc::new(Barrier::new(4));
        let mut archivers = Vec::new();
        for _ in 0..3 {
            let (engine, barrier, stop) = (db.engine.clone(), barrier.clone(), stop.clone());
            archivers.push(tokio::spawn(async move {
                barrier.wait().await;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    engine.archive(Duration::ZERO, 10).await.unwrap();
                }
            }));
        }
        barrier.wait().await;
        db.engine.reprocess(charge.id()).await.unwrap();
        let again = claim_n(&db.engine, 1).await.remove(0);
        assert!(db.engine.cancel(id).await.unwrap(), "round {round}");
        tokio::time::sleep(Duration::from_millis(20)).await;
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for a in archivers {
            a.await.unwrap();
        }
        let open_in_history: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM confluo.task_history WHERE status IN ('pending', 'running')",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap();
        assert_eq!(open_in_history, 0, "round {round}");
        assert_eq!(where_tasks_are(&db, id).await, (1, 0), "round {round}");
        // The attempt ends on the hot table, and then the execution is archived.
        db.engine.complete(&again, json!(0)).await.unwrap();
        db.engine.archive(Duration::ZERO, 10).await.unwrap();
        assert_eq!(where_tasks_are(&db, id).await, (0, 1), "round {round}");
    }
}

#[tokio::test]
async fn a_worker_archives_what_ended_as_part_of_its_housekeeping() {
    let db = TestDb::new(6).await;
    db.register(&Workflow::new("kept", 1).map("member").step("sum"))
        .await;
    let worker = common::quick_worker(&db.engine, |w| {
        w.lease(Duration::from_millis(400))
            .archive_after(Some(Duration::ZERO))
            .handler("kept", "member", |t| async move {
                let x: i64 = t.input_as()?;
                Ok::<_, TaskError>(x + 1)
            })
            .handler("kept", "sum", |_| async move { Ok::<_, TaskError>("done") })
    })
    .await;
    let id = db
        .engine
        .start("kept", &(0..50).collect::<Vec<_>>())
        .await
        .unwrap();
    let done = db.engine.wait(id, WAIT).await.unwrap();
    assert_eq!(done.output, Some(json!("done")));
    assert!(
        common::eventually(Duration::from_secs(10), || async {
            where_tasks_are(&db, id).await == (0, 51)
        })
        .await,
        "the worker did not archive the execution: {:?}",
        where_tasks_are(&db, id).await
    );
    worker.shutdown().await;
    // And one told not to archives nothing.
    let worker = common::quick_worker(&db.engine, |w| {
        w.lease(Duration::from_millis(400))
            .archive_after(None)
            .handler("kept", "member", |_| async move { Ok::<_, TaskError>(0) })
            .handler("kept", "sum", |_| async move { Ok::<_, TaskError>("done") })
    })
    .await;
    let id = db.engine.start("kept", &[1]).await.unwrap();
    db.engine.wait(id, WAIT).await.unwrap();
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(where_tasks_are(&db, id).await, (2, 0));
    worker.shutdown().await;
}

#[tokio::test]
async fn the_history_has_the_task_tables_columns_in_its_order() {
    let db = TestDb::new(2).await;
    let columns = |table: &'static str| {
        let pool = db.pool.clone();
        async move {
            sqlx::query_as::<_, (String, String, String)>(
                "SELECT column_name::text, data_type::text, is_nullable::text
                   FROM information_schema.columns
                  WHERE table_schema = 'confluo' AND table_name = $1
                  ORDER BY ordinal_position",
            )
            .bind(table)
            .fetch_all(&pool)
            .await
            .unwrap()
        }
    };
    let task = columns("task").await;
    assert!(task.len() > 20, "{task:?}");
    assert_eq!(columns("task_history").await, task);
    let view: Vec<String> = columns("task_all").await.into_iter().map(|c| c.0).collect();
    assert_eq!(view, task.into_iter().map(|c| c.0).collect::<Vec<_>>());
}
