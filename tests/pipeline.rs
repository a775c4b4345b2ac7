//! The worker's pipeline: claims whose plan does not depend on statistics, a bounded local
//! queue that is renewed and given back, and batched acknowledgements.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{eventually, TestDb, WAIT};
use confluo::{ExecutionStatus, Stage, StartOptions, TaskError, Workflow};
use serde_json::json;
use sqlx::postgres::PgPoolOptions;
use tokio::sync::Notify;

/// The claim statement reads one index range per handler, in index order, on a task table
/// that was never analyzed and holds 100 000 pending tasks just inserted, with the custom
/// plan and with the generic plan a prepared statement switches to.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_claim_is_an_index_scan_on_a_fresh_unanalyzed_table() {
    let db = TestDb::new(4).await;
    // Keep autovacuum from analyzing the table behind the test's back.
    sqlx::query("ALTER TABLE confluo.task SET (autovacuum_enabled = false)")
        .execute(&db.pool)
        .await
        .unwrap();
    db.register(&Workflow::new("wide", 1).map("item").step("after"))
        .await;
    db.register(&Workflow::new("other", 1).step("one")).await;
    let items: Vec<u32> = (0..100_000).collect();
    db.engine.start("wide", &items).await.unwrap();
    for i in 0..50 {
        db.engine.start("other", &i).await.unwrap();
    }
    let analyzed: Option<chrono::DateTime<chrono::Utc>> = sqlx::query_scalar(
        "SELECT greatest(last_analyze, last_autoanalyze) FROM pg_stat_user_tables
          WHERE schemaname = 'confluo' AND relname = 'task'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(analyzed, None, "the table must not have statistics");

    let handlers = [("wide", "item"), ("other", "one"), ("wide", "after")];
    let plans = db.engine.claim_plan(&handlers, 256).await.unwrap();
    println!("{plans}");
    let (custom, generic) = custom_and_generic(&plans, "k", handlers.len());
    assert_index_plan(custom);
    assert_index_plan(generic);
}

/// The two plans [`Engine::claim_plan`] and [`Engine::completion_plan`] print for a
/// statement, custom first.
fn plans_of(plans: &str) -> (&str, &str) {
    let custom = plans.split_once("custom plan:\n").expect("a custom plan").1;
    custom
        .split_once("generic plan:\n")
        .expect("a generic plan")
}

/// [`plans_of`], told apart by the planner's estimate of the array parameter that
/// `unnest` reads as `alias`: its length in the custom plan, PostgreSQL's guess of 10 in
/// the generic one.
fn custom_and_generic<'a>(plans: &'a str, alias: &str, length: usize) -> (&'a str, &'a str) {
    let (custom, generic) = plans_of(plans);
    assert_eq!(
        unnest_estimate(custom, alias),
        length,
        "custom plan:\n{custom}"
    );
    assert_eq!(
        unnest_estimate(generic, alias),
        10,
        "generic plan:\n{generic}"
    );
    (custom, generic)
}

/// The rows the planner expects from `Function Scan on <alias>`.
fn unnest_estimate(plan: &str, alias: &str) -> usize {
    let line = plan
        .lines()
        .find(|l| l.contains(&format!("Function Scan on {alias} ")))
        .unwrap_or_else(|| panic!("no scan of {alias}:\n{plan}"));
    let rows = line.split("rows=").nth(1).expect("an estimate");
    rows.split(' ').next().unwrap().parse().unwrap()
}

/// Acknowledgements look each attempt up by primary key, whatever the statistics say:
/// here the task table was analyzed while none of its tasks ran, so the planner believes
/// that none runs. (On that table, the first form of the completion statements walked
/// every running task for each attempt of a batch: a batch of 512 compared 300 000 rows.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledgements_look_attempts_up_by_key_whatever_the_statistics() {
    let db = TestDb::new(4).await;
    sqlx::query("ALTER TABLE confluo.task SET (autovacuum_enabled = false)")
        .execute(&db.pool)
        .await
        .unwrap();
    db.register(&Workflow::new("wide", 1).map("item")).await;
    let items: Vec<u32> = (0..20_000).collect();
    db.engine.start("wide", &items).await.unwrap();
    // The table as a worker finds it near the end of a wide map: most members finished,
    // statistics from a moment when none ran, and then 600 running.
    sqlx::query("UPDATE confluo.task SET status = 'completed', finished_at = now() WHERE item_index < 19000")
        .execute(&db.pool)
        .await
        .unwrap();
    sqlx::query("ANALYZE confluo.task")
        .execute(&db.pool)
        .await
        .unwrap();
    sqlx::query(
        "UPDATE confluo.task SET status = 'running', lease_token = gen_random_uuid(),
                lease_expires_at = now() + interval '1 minute'
          WHERE status = 'pending' AND item_index < 19600",
    )
    .execute(&db.pool)
    .await
    .unwrap();

    for batch in [1, 3, 512] {
        let plans = db.engine.completion_plan(batch).await.unwrap();
        println!("batch of {batch}:\n{plans}");
        let (unless_last, may_fire) = plans
            .split_once("-- a batch that may fire")
            .expect("both statements");
        for statement in [unless_last, may_fire] {
            // One attempt takes scalar parameters: there is no array to unnest.
            let (custom, generic) = if batch == 1 {
                assert!(!statement.contains("Function Scan"), "{statement}");
                plans_of(statement)
            } else {
                custom_and_generic(statement, "u", batch)
            };
            assert_lookups_by_key(custom, batch);
            assert_lookups_by_key(generic, batch);
        }
    }
}

/// Every read of the task table in a completion plan is a lookup by primary key (the
/// lateral probe per attempt, then the write of the rows it locked), never a scan joined
/// against the batch.
fn assert_lookups_by_key(plan: &str, batch: usize) {
    assert!(
        plan.contains("Index Scan using task_pkey on task y"),
        "batch of {batch}: each attempt must be found through task_pkey:\n{plan}"
    );
    let lines: Vec<&str> = plan.lines().collect();
    for (i, line) in lines.iter().enumerate() {
        if !line.contains(" on task ") || line.contains("Update on task") {
            continue;
        }
        // A bitmap heap scan reads what the bitmap index scan under it found.
        let by_key = line.contains("using task_pkey")
            || (line.contains("Bitmap Heap Scan")
                && lines[i + 1..]
                    .iter()
                    .find(|l| l.contains("Bitmap Index Scan"))
                    .is_some_and(|l| l.contains("on task_pkey")));
        assert!(
            by_key,
            "batch of {batch}: a read of the task table other than by key: {line}\n{plan}"
        );
    }
    assert!(
        !plan
            .lines()
            .any(|l| l.contains("Join Filter") && l.contains("lease_token")),
        "batch of {batch}: attempts matched by a join filter:\n{plan}"
    );
}

/// The part of the plan that picks the tasks (the `picked` CTE) walks the handler index,
/// with no sequential or bitmap scan of the task table: a sort there would sort the whole
/// backlog. (The merge of the handlers' ranges sorts at most `limit` rows per handler;
/// inputs read by reference, after the pick, are lookups by key.)
fn assert_index_plan(plan: &str) {
    let picked: Vec<&str> = plan
        .lines()
        .skip_while(|l| !l.contains("CTE picked"))
        .skip(1)
        .take_while(|l| l.starts_with("    "))
        .collect();
    let picked = picked.join("\n");
    assert!(
        picked.contains("Index Scan using task_claim_handler_idx on task"),
        "the claim must walk task_claim_handler_idx:\n{plan}"
    );
    for bad in ["Seq Scan", "Bitmap"] {
        assert!(!picked.contains(bad), "the pick has a {bad}:\n{plan}");
    }
}

/// Handlers that block until released, counting how many run.
#[derive(Clone, Default)]
struct Gate {
    running: Arc<AtomicUsize>,
    release: Arc<Notify>,
}

/// A worker holds at most `concurrency + local_queue` tasks, and at shutdown gives back
/// those that waited in its local queue, their attempts uncounted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_local_queue_is_bounded_and_given_back_at_shutdown() {
    let db = TestDb::new(8).await;
    db.register(&Workflow::new("slow", 1).map("item")).await;
    let items: Vec<u32> = (0..50).collect();
    let id = db.engine.start("slow", &items).await.unwrap();
    let gate = Gate::default();
    let g = gate.clone();
    let worker = db
        .engine
        .worker()
        .concurrency(2)
        .local_queue(4)
        .poll_interval(Duration::from_millis(50))
        .shutdown_grace(Duration::from_millis(200))
        .handler("slow", "item", move |_| {
            let g = g.clone();
            async move {
                g.running.fetch_add(1, Ordering::SeqCst);
                g.release.notified().await;
                Ok::<_, TaskError>(())
            }
        })
        .start()
        .await
        .unwrap();
    assert!(
        eventually(WAIT, || async { gate.running.load(Ordering::SeqCst) == 2 }).await,
        "two handlers should run"
    );
    let held = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM confluo.task WHERE status = 'running'")
            .fetch_one(&db.pool)
            .await
            .unwrap()
    };
    assert!(eventually(WAIT, || async { held().await == 6 }).await);
    tokio::time::sleep(Duration::from_millis(300)).await; // polls come and go
    assert_eq!(held().await, 6, "2 running + 4 waiting, no more");
    assert_eq!(gate.running.load(Ordering::SeqCst), 2);

    worker.shutdown().await; // the 2 blocked handlers are stopped after the grace period
    let (pending, attempted): (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE status = 'pending'), count(*) FILTER (WHERE attempt > 0)
           FROM confluo.task WHERE execution_id = $1",
    )
    .bind(id)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(pending, 50, "every task is back in the queue");
    assert_eq!(attempted, 0, "no attempt was counted");
}

/// Tasks that wait in the local queue longer than the lease keep it: the worker renews
/// their leases, so none is reclaimed (no attempt counted twice, no lease-expired error).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn waiting_tasks_keep_their_leases() {
    let db = TestDb::new(8).await;
    db.register(&Workflow::new("queue", 1).map("item")).await;
    let items: Vec<u32> = (0..12).collect();
    let id = db.engine.start("queue", &items).await.unwrap();
    let worker = db
        .engine
        .worker()
        .concurrency(1)
        .local_queue(16)
        .lease(Duration::from_millis(300))
        .poll_interval(Duration::from_millis(50))
        .handler("queue", "item", |_| async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            Ok::<_, TaskError>(())
        })
        .start()
        .await
        .unwrap();
    let done = db.engine.wait(id, WAIT).await.unwrap();
    worker.shutdown().await;
    assert_eq!(done.status, ExecutionStatus::Completed);
    let (attempts, errors): (i64, i64) = sqlx::query_as(
        "SELECT sum(attempt)::int8, sum(jsonb_array_length(errors))::int8
           FROM confluo.task WHERE execution_id = $1",
    )
    .bind(id)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        (attempts, errors),
        (12, 0),
        "the last task waited ~1.1 s with a 300 ms lease"
    );
}

/// With an acknowledgement window, completions are written in batches (members of one
/// batch share the statement's `now()`), the group fires once, and the next stage sees
/// every output; with no window, each completion is its own statement.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn completions_are_acknowledged_in_batches() {
    for (window, batched) in [(Duration::from_millis(20), true), (Duration::ZERO, false)] {
        let db = TestDb::new(8).await;
        db.register(
            &Workflow::new("fan", 1)
                .stage(Stage::map("item"))
                .step("total"),
        )
        .await;
        let items: Vec<u32> = (0..400).collect();
        let id = db.engine.start("fan", &items).await.unwrap();
        let worker = db
            .engine
            .worker()
            .concurrency(8)
            .ack_window(window)
            .poll_interval(Duration::from_millis(50))
            .handler("fan", "item", |t| async move {
                Ok::<_, TaskError>(t.input_as::<u32>()? * 2)
            })
            .handler("fan", "total", |t| async move {
                let r: confluo::MapResults<u32> = t.input_as()?;
                Ok::<_, TaskError>(
                    json!({"n": r.outputs.len(), "sum": r.outputs.iter().sum::<u32>()}),
                )
            })
            .start()
            .await
            .unwrap();
        let done = db.engine.wait(id, WAIT).await.unwrap();
        worker.shutdown().await;
        assert_eq!(done.status, ExecutionStatus::Completed);
        assert_eq!(done.output, Some(json!({"n": 400, "sum": 399 * 400})));
        let statements: i64 = sqlx::query_scalar(
            "SELECT count(DISTINCT finished_at) FROM confluo.task
              WHERE execution_id = $1 AND stage_index = 0",
        )
        .bind(id)
        .fetch_one(&db.pool)
        .await
        .unwrap();
        let groups: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM confluo.stage_group WHERE execution_id = $1 AND fired_at IS NOT NULL",
        )
        .bind(id)
        .fetch_one(&db.pool)
        .await
        .unwrap();
        assert_eq!(groups, 2, "both groups fired, once each");
        if batched {
            assert!(
                statements <= 100,
                "400 completions in {statements} statements: not batched"
            );
        } else {
            assert!(
                statements > 300,
                "400 completions in only {statements} statements with no window"
            );
        }
    }
}

/// `start_many` starts every item in order, honours idempotency keys within the call and
/// across calls, and its executions run as those of `start` do.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn start_many_starts_in_order_and_honours_idempotency_keys() {
    let db = TestDb::new(8).await;
    db.register(&Workflow::new("one", 1).step("double")).await;
    let key = |k: &str| confluo::StartOptions::new().idempotency_key(k);
    let first = db
        .engine
        .start_many(
            "one",
            [
                (1, key("a")),
                (2, key("b")),
                (3, key("a")),
                (4, StartOptions::new()),
            ],
        )
        .await
        .unwrap();
    assert_eq!(first.len(), 4);
    assert_eq!(first[0], first[2], "the same key twice in one call");
    assert_ne!(first[0], first[1]);
    let second = db
        .engine
        .start_many("one", [(5, key("b")), (6, key("c"))])
        .await
        .unwrap();
    assert_eq!(second[0], first[1], "a key of an earlier call");
    let worker = common::quick_worker(&db.engine, |w| {
        w.handler("one", "double", |t| async move {
            Ok::<_, TaskError>(t.input_as::<i64>()? * 2)
        })
    })
    .await;
    let mut outputs = Vec::new();
    for id in [first[0], first[1], first[3], second[1]] {
        outputs.push(db.engine.wait(id, WAIT).await.unwrap().output);
    }
    worker.shutdown().await;
    // The first item of each key is the one that ran.
    assert_eq!(
        outputs,
        vec![
            Some(json!(2)),
            Some(json!(4)),
            Some(json!(8)),
            Some(json!(12))
        ]
    );
    let executions: i64 = sqlx::query_scalar("SELECT count(*) FROM confluo.execution")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(executions, 4);
}

/// Two `start_many` calls racing on overlapping keys, from separate connections released
/// together, agree on one execution per key.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn start_many_racing_on_the_same_keys_starts_each_once() {
    let db = TestDb::new(8).await;
    db.register(&Workflow::new("one", 1).step("s")).await;
    let barrier = Arc::new(tokio::sync::Barrier::new(2));
    let mut racers = Vec::new();
    for offset in [0, 25] {
        let engine = common::engine(db.new_pool(2).await);
        let barrier = barrier.clone();
        racers.push(tokio::spawn(async move {
            let mut items: Vec<_> = (offset..offset + 50)
                .map(|k| (k, StartOptions::new().idempotency_key(format!("k{k:02}"))))
                .collect();
            if offset > 0 {
                items.reverse(); // the shared keys in the other order: no deadlock either
            }
            barrier.wait().await;
            engine.start_many("one", items).await.unwrap()
        }));
    }
    let a = racers.remove(0).await.unwrap();
    let b = racers.remove(0).await.unwrap();
    let mut shared_in_b = b[25..].to_vec(); // b holds k74..k25
    shared_in_b.reverse();
    assert_eq!(
        &a[25..],
        &shared_in_b[..],
        "the shared keys k25..k49 got the same executions"
    );
    let (executions, tasks): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM confluo.execution), (SELECT count(*) FROM confluo.task)",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!((executions, tasks), (75, 75));
}

/// An input the first stage cannot take is refused with the item named, and nothing of
/// the call is started.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_many_refuses_a_bad_item_and_starts_nothing() {
    let db = TestDb::new(4).await;
    db.register(&Workflow::new("fan", 1).map("each")).await;
    let items = [json!([1, 2]), json!([3]), json!("not an array")];
    let err = db
        .engine
        .start_many("fan", items.iter().map(|i| (i, StartOptions::new())))
        .await
        .unwrap_err();
    assert!(
        matches!(err, confluo::Error::InvalidInput { .. }) && err.to_string().contains("item 2"),
        "{err}"
    );
    let executions: i64 = sqlx::query_scalar("SELECT count(*) FROM confluo.execution")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(executions, 0);
    // Maps as first stage are entered per execution, empty ones included.
    let ids = db
        .engine
        .start_many(
            "fan",
            [json!([1, 2, 3]), json!([])]
                .iter()
                .map(|i| (i, StartOptions::new())),
        )
        .await
        .unwrap();
    let widths: Vec<i64> = sqlx::query_scalar(
        "SELECT width::int8 FROM confluo.stage_group WHERE execution_id = ANY ($1) ORDER BY width DESC",
    )
    .bind(ids.iter().map(|i| i.as_uuid()).collect::<Vec<_>>())
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(widths, vec![3, 0]);
    assert_eq!(
        db.engine.status(ids[1]).await.unwrap(),
        ExecutionStatus::Completed,
        "an empty map completes at once"
    );
}

/// Renewing the local queue's leases while acknowledgement batches complete the tasks
/// that just left it never deadlocks (a renewal skips rows a batch holds): a short lease
/// makes the worker renew every 100 ms through a run of 4 000 tasks, and the database
/// counts no deadlock.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn renewals_and_acknowledgement_batches_never_deadlock() {
    let db = TestDb::new(12).await;
    db.register(&Workflow::new("busy", 1).map("item")).await;
    let items: Vec<u32> = (0..4_000).collect();
    let id = db.engine.start("busy", &items).await.unwrap();
    let worker = db
        .engine
        .worker()
        .concurrency(8)
        .lease(Duration::from_millis(300))
        .poll_interval(Duration::from_millis(50))
        .handler("busy", "item", |_| async { Ok::<_, TaskError>(()) })
        .start()
        .await
        .unwrap();
    let done = db.engine.wait(id, WAIT).await.unwrap();
    worker.shutdown().await;
    assert_eq!(done.status, ExecutionStatus::Completed);
    // The statistics reach pg_stat_database within a second or so.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let deadlocks: i64 = sqlx::query_scalar(
        "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(deadlocks, 0, "deadlocks detected in the test database");
}

/// A worker that dies (its runtime dropped: no give-back, no acknowledgement, its
/// connections gone) leaves its tasks leased. Once the leases expire, the attempts whose
/// handlers had started (reported by the worker's renewal) are charged; the tasks that
/// only waited in its local queue go back uncounted, except those that already used
/// their budget of uncounted expiries (a task that kills its worker before its start can
/// be reported must still run out of attempts).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_charges_only_the_attempts_that_started() {
    let db = TestDb::new(4).await;
    db.register(&Workflow::new("crash", 1).map("item")).await;
    let items: Vec<u32> = (0..20).collect();
    let id = db.engine.start("crash", &items).await.unwrap();
    // Even members have used up their uncounted expiries.
    sqlx::query("UPDATE confluo.task SET held_expiries = 3 WHERE item_index % 2 = 0")
        .execute(&db.pool)
        .await
        .unwrap();

    let started_items = Arc::new(std::sync::Mutex::new(Vec::<usize>::new()));
    let (crash_tx, crash_rx) = std::sync::mpsc::channel::<()>();
    let options = db.options();
    let seen = started_items.clone();
    let process = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let worker = runtime.block_on(async move {
            let pool = PgPoolOptions::new()
                .max_connections(4)
                .connect_with(options)
                .await
                .unwrap();
            common::engine(pool)
                .worker()
                .concurrency(2)
                .local_queue(8)
                .lease(Duration::from_millis(600))
                .poll_interval(Duration::from_millis(50))
                .handler("crash", "item", move |task| {
                    seen.lock().unwrap().push(task.item_index() as usize);
                    std::future::pending::<Result<(), TaskError>>()
                })
                .start()
                .await
                .unwrap()
        });
        crash_rx.recv().unwrap();
        // No shutdown: the worker's tasks are dropped where they stand, as in a SIGKILL.
        std::mem::forget(worker);
        runtime.shutdown_background();
    });

    let started_in_db = || async {
        sqlx::query_scalar::<_, Vec<i32>>(
            "SELECT coalesce(array_agg(item_index ORDER BY item_index), '{}') FROM confluo.task
              WHERE status = 'running' AND started",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap()
    };
    assert!(
        eventually(WAIT, || async { started_in_db().await.len() == 2 }).await,
        "the renewal reports the two started handlers"
    );
    let mut started: Vec<i32> = started_items
        .lock()
        .unwrap()
        .iter()
        .map(|i| *i as i32)
        .collect();
    started.sort_unstable();
    assert_eq!(started_in_db().await, started);
    let held: Vec<i32> = sqlx::query_scalar(
        "SELECT item_index FROM confluo.task WHERE status = 'running' ORDER BY item_index",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(held.len(), 10, "2 running and 8 waiting: {held:?}");

    crash_tx.send(()).unwrap();
    process.join().unwrap();
    tokio::time::sleep(Duration::from_millis(700)).await;
    let mut reclaimed = 0;
    let deadline = tokio::time::Instant::now() + WAIT;
    while reclaimed < 10 && tokio::time::Instant::now() < deadline {
        let n = db.engine.reclaim_expired(100).await.unwrap();
        if n == 0 {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        reclaimed += n;
    }
    assert_eq!(
        reclaimed, 10,
        "every task the dead worker held is reclaimed"
    );

    let rows: Vec<(i32, String, i32, i32, i32)> = sqlx::query_as(
        "SELECT item_index, status, attempt, held_expiries, jsonb_array_length(errors)
           FROM confluo.task WHERE execution_id = $1 ORDER BY item_index",
    )
    .bind(id)
    .fetch_all(&db.pool)
    .await
    .unwrap();
    for (item, status, attempt, held_expiries, errors) in rows {
        assert_eq!(status, "pending", "item {item}: every task is due again");
        let budget_used = if item % 2 == 0 { 3 } else { 0 };
        let expected = if started.contains(&item) || (held.contains(&item) && item % 2 == 0) {
            (1, budget_used, 1) // charged, as any failed attempt
        } else if held.contains(&item) {
            (0, 1, 0) // waited in the local queue: given back uncounted
        } else {
            (0, budget_used, 0) // never claimed
        };
        assert_eq!(
            (attempt, held_expiries, errors),
            expected,
            "item {item} (started: {started:?}, held: {held:?})"
        );
    }
}
