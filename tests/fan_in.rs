//! Exactly-once fan-in under simultaneous finish, replays, duplicates and zombies, with
//! real concurrent transactions on separate connections.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::TestDb;
use confluo::{ClaimedTask, Engine, FanInStrategy, Outcome, RetryPolicy, Stage, Workflow};
use serde_json::json;
use tokio::sync::Barrier;

/// Every strategy that must keep the invariants; each test runs against all of them.
const STRATEGIES: [FanInStrategy; 3] = [
    FanInStrategy::Countdown,
    FanInStrategy::Striped,
    FanInStrategy::RowLock,
];

/// Registers a map (decided by `strategy`) followed by one step; returns its name.
async fn wide(db: &TestDb, retry: RetryPolicy, strategy: FanInStrategy) -> String {
    let name = format!("wide-{strategy}");
    let wf = Workflow::new(&name, 1)
        .stage(Stage::map("member").retry(retry).fan_in(strategy))
        .step("after");
    db.register(&wf).await;
    name
}

async fn claim_all(engine: &Engine, n: usize) -> Vec<ClaimedTask> {
    let mut claimed = Vec::new();
    while claimed.len() < n {
        let batch = engine
            .claim("test", 200, Duration::from_secs(300))
            .await
            .unwrap();
        assert!(
            !batch.is_empty(),
            "only {} of {n} tasks were claimable",
            claimed.len()
        );
        claimed.extend(batch);
    }
    // A claim returns its batch in no particular order.
    claimed.sort_by_key(|t| (t.stage_index(), t.item_index()));
    claimed
}

/// Counts what the database says happened after a group: groups of the next stage, its
/// tasks, the group's members not yet terminal, and its fired marker. Checks on the way
/// that a counting group's counter equals its open members (invariant I2).
async fn after_state(db: &TestDb, execution: confluo::ExecutionId) -> (i64, i64, i32, bool) {
    let (groups, next_tasks, counter, open, marked): (i64, i64, Option<i32>, i32, bool) =
        sqlx::query_as(
            "SELECT (SELECT count(*) FROM confluo.stage_group WHERE execution_id = $1 AND stage_index = 1),
                    (SELECT count(*) FROM confluo.task WHERE execution_id = $1 AND stage_index = 1),
                    CASE g.fan_in
                        WHEN 'striped' THEN (SELECT sum(s.remaining)::int FROM confluo.group_stripe s
                                              WHERE s.group_id = g.id)
                        ELSE g.remaining END,
                    (SELECT count(*)::int FROM confluo.task
                      WHERE group_id = g.id AND status IN ('pending', 'running')),
                    g.fired_at IS NOT NULL
               FROM confluo.stage_group g WHERE g.execution_id = $1 AND g.stage_index = 0",
        )
        .bind(execution)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    if let Some(counter) = counter {
        assert_eq!(counter, open, "the countdown disagrees with the members");
    }
    // A striped group's row counts its stripes that are not drained.
    let (row, undrained): (Option<i32>, i64) = sqlx::query_as(
        "SELECT g.remaining, (SELECT count(*) FROM confluo.group_stripe s
                               WHERE s.group_id = g.id AND s.remaining > 0)
           FROM confluo.stage_group g
          WHERE g.execution_id = $1 AND g.stage_index = 0 AND g.fan_in = 'striped'",
    )
    .bind(execution)
    .fetch_optional(&db.pool)
    .await
    .unwrap()
    .unwrap_or((Some(0), 0));
    assert_eq!(
        row,
        Some(undrained as i32),
        "a striped group's row disagrees with its stripes"
    );
    (groups, next_tasks, open, marked)
}

/// Completes every claimed task from `finishers` concurrent connections released together
/// by a barrier; returns each completion's outcome.
async fn finish_together(
    engine: &Engine,
    tasks: Vec<ClaimedTask>,
    finishers: usize,
) -> Vec<Outcome> {
    let barrier = Arc::new(Barrier::new(finishers));
    let tasks = Arc::new(tasks);
    let mut handles = Vec::new();
    for f in 0..finishers {
        let (engine, barrier, tasks) = (engine.clone(), barrier.clone(), tasks.clone());
        handles.push(tokio::spawn(async move {
            // Hold a connection of its own before the barrier, so all start at once.
            let warm = engine.pool().acquire().await.unwrap();
            drop(warm);
            barrier.wait().await;
            let mut outcomes = Vec::new();
            for task in tasks.iter().skip(f).step_by(finishers) {
                outcomes.push(
                    engine
                        .complete(task, json!({"i": task.item_index()}))
                        .await
                        .unwrap(),
                );
            }
            outcomes
        }));
    }
    let mut all = Vec::new();
    for h in handles {
        all.extend(h.await.unwrap());
    }
    all
}

async fn simultaneous_finish(width: usize, rounds: usize) {
    for strategy in STRATEGIES {
        simultaneous_finish_with(width, rounds, strategy).await;
    }
}

async fn simultaneous_finish_with(width: usize, rounds: usize, strategy: FanInStrategy) {
    let finishers = width.min(40);
    let db = TestDb::new(finishers as u32 + 2).await;
    let wf = wide(&db, RetryPolicy::default(), strategy).await;
    for round in 0..rounds {
        let input: Vec<usize> = (0..width).collect();
        let id = db.engine.start(&wf, &input).await.unwrap();
        let tasks = claim_all(&db.engine, width).await;
        assert_eq!(tasks.len(), width);
        let outcomes = finish_together(&db.engine, tasks, finishers).await;
        let fired = outcomes
            .iter()
            .filter(|o| matches!(o, Outcome::Completed { fired: true }))
            .count();
        assert_eq!(
            fired, 1,
            "round {round}: {fired} completions fired, outcomes {outcomes:?}"
        );
        assert!(outcomes
            .iter()
            .all(|o| matches!(o, Outcome::Completed { .. })));
        let (groups, next_tasks, remaining, marked) = after_state(&db, id).await;
        assert_eq!(
            (groups, next_tasks, remaining, marked),
            (1, 1, 0, true),
            "round {round}"
        );
        // Drain the next stage so the following round claims only its own members.
        let after = claim_all(&db.engine, 1).await;
        assert_eq!(after[0].handler(), "after");
        let input = db.engine.task_input(&after[0]).await.unwrap();
        assert_eq!(input["outputs"].as_array().unwrap().len(), width);
        assert_eq!(input["outputs"][width - 1], json!({"i": width - 1}));
        db.engine.complete(&after[0], json!("done")).await.unwrap();
        assert_eq!(
            db.engine.status(id).await.unwrap(),
            confluo::ExecutionStatus::Completed
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn simultaneous_finish_width_2_fires_exactly_once() {
    simultaneous_finish(2, 40).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn simultaneous_finish_width_50_fires_exactly_once() {
    simultaneous_finish(50, 12).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn simultaneous_finish_width_500_fires_exactly_once() {
    simultaneous_finish(500, 3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replays_and_duplicates_decrement_nothing() {
    for strategy in STRATEGIES {
        replays_and_duplicates_decrement_nothing_with(strategy).await;
    }
}

async fn replays_and_duplicates_decrement_nothing_with(strategy: FanInStrategy) {
    let db = TestDb::new(20).await;
    let wf = wide(&db, RetryPolicy::default(), strategy).await;
    let id = db.engine.start(&wf, &[1, 2, 3]).await.unwrap();
    let tasks = claim_all(&db.engine, 3).await;

    // The first member's acknowledgement is delivered three times, concurrently.
    let first = tasks[0].clone();
    let barrier = Arc::new(Barrier::new(3));
    let mut handles = Vec::new();
    for _ in 0..3 {
        let (engine, barrier, task) = (db.engine.clone(), barrier.clone(), first.clone());
        handles.push(tokio::spawn(async move {
            barrier.wait().await;
            engine.complete(&task, json!("first")).await.unwrap()
        }));
    }
    let mut outcomes = Vec::new();
    for h in handles {
        outcomes.push(h.await.unwrap());
    }
    outcomes.sort_by_key(|o| format!("{o:?}"));
    assert_eq!(
        outcomes,
        [
            Outcome::AlreadyRecorded,
            Outcome::AlreadyRecorded,
            Outcome::Completed { fired: false }
        ]
    );
    let (_, _, remaining, _) = after_state(&db, id).await;
    assert_eq!(remaining, 2, "a duplicate decremented the countdown");

    // A replayed failure for a completed attempt changes nothing either.
    assert_eq!(
        db.engine.fail(&first, "late", false).await.unwrap(),
        Outcome::AlreadyRecorded
    );

    assert_eq!(
        db.engine.complete(&tasks[1], json!(2)).await.unwrap(),
        Outcome::Completed { fired: false }
    );
    assert_eq!(
        db.engine.complete(&tasks[2], json!(3)).await.unwrap(),
        Outcome::Completed { fired: true }
    );
    // Replaying the firing completion does not fire again.
    assert_eq!(
        db.engine.complete(&tasks[2], json!(3)).await.unwrap(),
        Outcome::AlreadyRecorded
    );
    let (groups, next_tasks, remaining, _) = after_state(&db, id).await;
    assert_eq!((groups, next_tasks, remaining), (1, 1, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn zombie_after_reclaimed_lease_changes_nothing() {
    for strategy in STRATEGIES {
        zombie_after_reclaimed_lease_changes_nothing_with(strategy).await;
    }
}

async fn zombie_after_reclaimed_lease_changes_nothing_with(strategy: FanInStrategy) {
    let db = TestDb::new(10).await;
    let wf = wide(
        &db,
        RetryPolicy::exponential(3).backoff(Duration::ZERO, Duration::ZERO),
        strategy,
    )
    .await;
    let id = db.engine.start(&wf, &[1, 2]).await.unwrap();
    let short = db
        .engine
        .claim("zombie", 2, Duration::from_millis(200))
        .await
        .unwrap();
    assert_eq!(short.len(), 2);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(db.engine.reclaim_expired(10).await.unwrap(), 2);
    // Reclaimed and not claimed again yet: a zombie is fenced out all the same (it is not
    // a replay: the reclaimed attempt acknowledged nothing). Found by `confluo stress`.
    assert_eq!(
        db.engine.complete(&short[0], json!("early")).await.unwrap(),
        Outcome::LeaseLost
    );
    // Reclaiming counted the attempt; the tasks are claimable again.
    let fresh = claim_all(&db.engine, 2).await;
    assert!(fresh.iter().all(|t| t.attempt() == 2));
    assert_eq!(
        db.engine.complete(&fresh[0], json!("new")).await.unwrap(),
        Outcome::Completed { fired: false }
    );

    // The zombie attempts finish now: one after its successor completed, one while its
    // successor still runs. Both are fenced out.
    for zombie in &short {
        assert_eq!(
            db.engine.complete(zombie, json!("zombie")).await.unwrap(),
            Outcome::LeaseLost
        );
        assert_eq!(
            db.engine.fail(zombie, "zombie", true).await.unwrap(),
            Outcome::LeaseLost
        );
    }
    let (_, _, remaining, _) = after_state(&db, id).await;
    assert_eq!(remaining, 1);
    assert_eq!(
        db.engine.complete(&fresh[1], json!("new")).await.unwrap(),
        Outcome::Completed { fired: true }
    );
    let stored: Vec<serde_json::Value> = sqlx::query_scalar(
        "SELECT output FROM confluo.task WHERE execution_id = $1 AND stage_index = 0 ORDER BY item_index",
    )
    .bind(id)
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(stored, [json!("new"), json!("new")]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dead_letter_racing_a_sibling_completion_fires_once() {
    for strategy in STRATEGIES {
        dead_letter_racing_a_sibling_completion_fires_once_with(strategy).await;
    }
}

async fn dead_letter_racing_a_sibling_completion_fires_once_with(strategy: FanInStrategy) {
    let db = TestDb::new(10).await;
    let wf = wide(&db, RetryPolicy::none(), strategy).await;
    for round in 0..20 {
        let id = db.engine.start(&wf, &[1, 2]).await.unwrap();
        let tasks = claim_all(&db.engine, 2).await;
        let barrier = Arc::new(Barrier::new(2));
        let (e1, b1, t1) = (db.engine.clone(), barrier.clone(), tasks[0].clone());
        let (e2, b2, t2) = (db.engine.clone(), barrier.clone(), tasks[1].clone());
        let dead = tokio::spawn(async move {
            b1.wait().await;
            e1.fail(&t1, "boom", false).await.unwrap()
        });
        let done = tokio::spawn(async move {
            b2.wait().await;
            e2.complete(&t2, json!("ok")).await.unwrap()
        });
        let (dead, done) = (dead.await.unwrap(), done.await.unwrap());
        let fired = [&dead, &done]
            .iter()
            .filter(|o| {
                matches!(
                    o,
                    Outcome::DeadLettered { fired: true } | Outcome::Completed { fired: true }
                )
            })
            .count();
        assert_eq!(fired, 1, "round {round}: {dead:?} / {done:?}");
        let (groups, next_tasks, remaining, marked) = after_state(&db, id).await;
        assert_eq!((groups, next_tasks, remaining, marked), (1, 1, 0, true));
        // The next stage sees the success and the failure.
        let after = claim_all(&db.engine, 1).await;
        let input = db.engine.task_input(&after[0]).await.unwrap();
        assert_eq!(input["outputs"], json!(["ok"]));
        assert_eq!(input["failed"][0]["index"], json!(0));
        assert_eq!(input["failed"][0]["error"], json!("boom"));
        db.engine.complete(&after[0], json!(null)).await.unwrap();
    }
}

/// The bug made visible: the unlocked re-count leaves groups with every member completed
/// and nothing dispatched, when members finish together.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn naive_recount_stalls_under_simultaneous_finish() {
    let db = TestDb::new(10).await;
    let wf = wide(&db, RetryPolicy::default(), FanInStrategy::NaiveRecount).await;
    let (mut stalls, mut rounds) = (0, 0);
    while stalls == 0 && rounds < 200 {
        rounds += 1;
        let id = db.engine.start(&wf, &[1, 2]).await.unwrap();
        let tasks = claim_all(&db.engine, 2).await;
        let outcomes = finish_together(&db.engine, tasks, 2).await;
        let fired = outcomes
            .iter()
            .filter(|o| matches!(o, Outcome::Completed { fired: true }))
            .count();
        assert!(
            fired <= 1,
            "naive never double-fires while write and check share a transaction"
        );
        let (groups, next_tasks, open, marked) = after_state(&db, id).await;
        if fired == 0 {
            // Every member completed, nothing dispatched, nothing will ever look again.
            assert_eq!((groups, next_tasks, open, marked), (0, 0, 0, false));
            assert_eq!(
                db.engine.status(id).await.unwrap(),
                confluo::ExecutionStatus::Running
            );
            stalls += 1;
        } else {
            let after = claim_all(&db.engine, 1).await;
            db.engine.complete(&after[0], json!(null)).await.unwrap();
        }
    }
    eprintln!("naive re-count: first stall after {rounds} round(s)");
    assert!(
        stalls > 0,
        "no stall in {rounds} rounds of simultaneous finish"
    );
}

/// Batches of consecutive members (sharing stripes and the group) acknowledged by
/// concurrent connections: still exactly one fire, and the counter matches the members.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn batched_acknowledgements_fire_exactly_once() {
    for strategy in STRATEGIES {
        let db = TestDb::new(12).await;
        let wf = wide(&db, RetryPolicy::default(), strategy).await;
        for round in 0..5 {
            let input: Vec<usize> = (0..300).collect();
            let id = db.engine.start(&wf, &input).await.unwrap();
            let tasks = Arc::new(claim_all(&db.engine, 300).await);
            let barrier = Arc::new(Barrier::new(8));
            let mut handles = Vec::new();
            for f in 0..8 {
                let (engine, barrier, tasks) = (db.engine.clone(), barrier.clone(), tasks.clone());
                handles.push(tokio::spawn(async move {
                    barrier.wait().await;
                    let mut outcomes = Vec::new();
                    // Finisher f takes batches f, f + 8, f + 16, ... of 8 consecutive members.
                    for batch in tasks.chunks(8).skip(f).step_by(8) {
                        let items: Vec<_> =
                            batch.iter().map(|t| (t, json!(t.item_index()))).collect();
                        outcomes.extend(engine.complete_batch(&items).await.unwrap());
                    }
                    outcomes
                }));
            }
            let mut outcomes = Vec::new();
            for h in handles {
                outcomes.extend(h.await.unwrap());
            }
            assert_eq!(outcomes.len(), 300);
            let fired = outcomes
                .iter()
                .filter(|o| matches!(o, Outcome::Completed { fired: true }))
                .count();
            assert_eq!(fired, 1, "{strategy} round {round}");
            let (groups, next_tasks, open, marked) = after_state(&db, id).await;
            assert_eq!(
                (groups, next_tasks, open, marked),
                (1, 1, 0, true),
                "{strategy} round {round}"
            );
            let after = claim_all(&db.engine, 1).await;
            let input = db.engine.task_input(&after[0]).await.unwrap();
            assert_eq!(input["outputs"][299], json!(299));
            db.engine.complete(&after[0], json!(null)).await.unwrap();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_records_what_it_holds_and_changes_nothing_else() {
    for strategy in STRATEGIES {
        let db = TestDb::new(8).await;
        let wf = wide(
            &db,
            RetryPolicy::exponential(3).backoff(Duration::ZERO, Duration::ZERO),
            strategy,
        )
        .await;
        let id = db.engine.start(&wf, &[1, 2, 3, 4]).await.unwrap();
        let stale = db
            .engine
            .claim("z", 1, Duration::from_millis(50))
            .await
            .unwrap()
            .remove(0);
        tokio::time::sleep(Duration::from_millis(80)).await;
        assert_eq!(db.engine.reclaim_expired(10).await.unwrap(), 1);
        let tasks = claim_all(&db.engine, 4).await;
        let first = db.engine.complete(&tasks[0], json!("a")).await.unwrap();
        assert_eq!(first, Outcome::Completed { fired: false });
        // A replay, a zombie, the same member twice, and one fresh completion.
        let items = [
            (&tasks[0], json!("a")),
            (&stale, json!("zombie")),
            (&tasks[1], json!("b")),
            (&tasks[1], json!("b")),
        ];
        let outcomes = db.engine.complete_batch(&items).await.unwrap();
        assert_eq!(
            outcomes,
            [
                Outcome::AlreadyRecorded,
                Outcome::LeaseLost, // its attempt was reclaimed
                Outcome::Completed { fired: false },
                Outcome::AlreadyRecorded
            ],
            "{strategy}"
        );
        let (_, _, open, _) = after_state(&db, id).await;
        assert_eq!(open, 2, "{strategy}");
        let rest = [(&tasks[2], json!("c")), (&tasks[3], json!("d"))];
        assert_eq!(
            db.engine.complete_batch(&rest).await.unwrap(),
            [
                Outcome::Completed { fired: false },
                Outcome::Completed { fired: true }
            ],
            "{strategy}"
        );
        let (groups, next_tasks, open, marked) = after_state(&db, id).await;
        assert_eq!(
            (groups, next_tasks, open, marked),
            (1, 1, 0, true),
            "{strategy}"
        );
    }
}
