//! One lock order (`src/store/locks.rs`): paths that lock an execution and its groups
//! raced against each other with separate connections behind a barrier, counting the
//! deadlocks PostgreSQL detected in the test's database. Each deadlock used to cost
//! `deadlock_timeout` (1 s) and a retry; there must be none.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{TestDb, STRATEGIES};
use confluo::{Engine, ExecutionId, ExecutionStatus, FanInStrategy, Stage, TaskId, Workflow};
use tokio::sync::Barrier;

const ROUNDS: usize = 12;

/// Deadlocks detected in `db`'s database. Read after the racing pools are closed: a
/// backend reports its statistics when it exits, at the latest.
async fn deadlocks(db: &TestDb) -> i64 {
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut conn = db.connection().await;
    sqlx::query_scalar("SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()")
        .fetch_one(&mut conn)
        .await
        .unwrap()
}

/// An execution of a 4-wide map whose member 0 is dead-lettered and the others pending.
async fn one_dead_member(engine: &Engine) -> (ExecutionId, TaskId) {
    let id = engine.start("wide", &[0, 1, 2, 3]).await.unwrap();
    let task = engine
        .claim("test", 1, Duration::from_secs(60))
        .await
        .unwrap()
        .pop()
        .expect("a member");
    engine.fail(&task, "boom", true).await.unwrap();
    (id, task.id())
}

/// Races `reprocess(dead)` against `rival` over `ROUNDS` executions, for each strategy;
/// returns the deadlocks seen.
async fn race_reprocess<R, Fut>(rival: R, before: impl Fn(ExecutionId) -> String) -> i64
where
    R: Fn(Engine, ExecutionId) -> Fut + Copy + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let db = TestDb::new(2).await;
    let at_start = deadlocks(&db).await;
    for strategy in STRATEGIES {
        let (a, b) = (db.new_pool(2).await, db.new_pool(2).await);
        let (reprocessor, other) = (
            common::engine_builder(a.clone()).fan_in(strategy).build(),
            common::engine_builder(b.clone()).fan_in(strategy).build(),
        );
        reprocessor
            .register(
                &Workflow::new("wide", 1)
                    .stage(Stage::map("m"))
                    .step("after"),
            )
            .await
            .unwrap();
        for _ in 0..ROUNDS {
            let (execution, dead) = one_dead_member(&reprocessor).await;
            let setup = before(execution);
            if !setup.is_empty() {
                sqlx::query(&setup).execute(&a).await.unwrap();
            }
            let barrier = Arc::new(Barrier::new(2));
            let r = {
                let (engine, barrier) = (reprocessor.clone(), barrier.clone());
                tokio::spawn(async move {
                    drop(engine.pool().acquire().await.unwrap());
                    barrier.wait().await;
                    // Refused once the rival stopped the execution: that is fine.
                    let _ = engine.reprocess(dead).await;
                })
            };
            let o = {
                let (engine, barrier) = (other.clone(), barrier.clone());
                tokio::spawn(async move {
                    drop(engine.pool().acquire().await.unwrap());
                    barrier.wait().await;
                    rival(engine, execution).await;
                })
            };
            r.await.unwrap();
            o.await.unwrap();
            let status = reprocessor.execution(execution).await.unwrap().status;
            assert!(
                matches!(
                    status,
                    ExecutionStatus::Cancelled | ExecutionStatus::TimedOut
                ),
                "{strategy:?}: the rival stopped it: {status}"
            );
            let diagnosis = reprocessor.doctor().await.unwrap();
            assert!(
                diagnosis.counter_mismatches.is_empty(),
                "{strategy:?}: {diagnosis:?}"
            );
        }
        a.close().await;
        b.close().await;
    }
    deadlocks(&db).await - at_start
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reprocess_racing_a_cancel_never_deadlocks() {
    let seen = race_reprocess(
        |engine, execution| async move {
            engine.cancel(execution).await.unwrap();
        },
        |_| String::new(),
    )
    .await;
    assert_eq!(seen, 0, "deadlocks between reprocess and cancel");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reprocess_racing_a_deadline_never_deadlocks() {
    let seen = race_reprocess(
        |engine, execution| async move {
            // The sweep skips an execution another transaction holds: sweep until it is
            // timed out.
            for _ in 0..500 {
                if engine.time_out_expired(10).await.unwrap() == vec![execution] {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            panic!("{execution} was never timed out");
        },
        |execution| {
            format!(
                "UPDATE confluo.execution SET deadline_at = now() - interval '1 second' \
                  WHERE id = '{execution}'"
            )
        },
    )
    .await;
    assert_eq!(
        seen, 0,
        "deadlocks between reprocess and a deadline time-out"
    );
}

/// A reprocess racing the batch that completes the other members (singly, with
/// `complete`, and in one batch): the completion side drains the group while the
/// reprocess counts it back up. The next stage is entered at most once, and nothing
/// deadlocks: a batch that finds the execution's lock taken starts over taking it first.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reprocess_racing_the_last_completions_never_deadlocks() {
    let db = TestDb::new(2).await;
    let at_start = deadlocks(&db).await;
    for strategy in STRATEGIES {
        for batched in [true, false] {
            let pools: Vec<_> = racing_pools(&db, 4).await;
            let engines: Vec<Engine> = pools
                .iter()
                .map(|p| common::engine_builder(p.clone()).fan_in(strategy).build())
                .collect();
            // The map is the last stage (no next stage for a later round's claim to
            // pick up); its firing completes the execution.
            engines[0]
                .register(&Workflow::new("wide", 1).stage(Stage::map("m")))
                .await
                .unwrap();
            for _ in 0..ROUNDS {
                let (execution, dead) = one_dead_member(&engines[0]).await;
                let rest = engines[0]
                    .claim("test", 3, Duration::from_secs(60))
                    .await
                    .unwrap();
                assert_eq!(rest.len(), 3);
                let barrier = Arc::new(Barrier::new(if batched { 2 } else { 4 }));
                let mut racers = Vec::new();
                {
                    let (engine, barrier) = (engines[0].clone(), barrier.clone());
                    racers.push(tokio::spawn(async move {
                        drop(engine.pool().acquire().await.unwrap());
                        barrier.wait().await;
                        // Refused once the group fired and completed the execution.
                        match engine.reprocess(dead).await {
                            Ok(_) | Err(confluo::Error::ExecutionNotResumable { .. }) => {}
                            Err(e) => panic!("{e}"),
                        }
                    }));
                }
                if batched {
                    let (engine, barrier) = (engines[1].clone(), barrier.clone());
                    racers.push(tokio::spawn(async move {
                        drop(engine.pool().acquire().await.unwrap());
                        barrier.wait().await;
                        let items: Vec<_> =
                            rest.iter().map(|t| (t, serde_json::json!(1))).collect();
                        engine.complete_batch(&items).await.unwrap();
                    }));
                } else {
                    for (i, task) in rest.into_iter().enumerate() {
                        let (engine, barrier) = (engines[1 + i].clone(), barrier.clone());
                        racers.push(tokio::spawn(async move {
                            drop(engine.pool().acquire().await.unwrap());
                            barrier.wait().await;
                            engine.complete(&task, serde_json::json!(1)).await.unwrap();
                        }));
                    }
                }
                for racer in racers {
                    racer.await.unwrap();
                }
                // Reprocessed first, the member runs again and the group waits for it.
                let mut execution_now = engines[0].execution(execution).await.unwrap();
                if execution_now.status == ExecutionStatus::Running {
                    let again = engines[0]
                        .claim("test", 1, Duration::from_secs(60))
                        .await
                        .unwrap();
                    assert_eq!(again.len(), 1, "{strategy:?}: the requeued member");
                    engines[0]
                        .complete(&again[0], serde_json::json!(1))
                        .await
                        .unwrap();
                    execution_now = engines[0].execution(execution).await.unwrap();
                }
                assert_eq!(
                    execution_now.status,
                    ExecutionStatus::Completed,
                    "{strategy:?}: fired once, and the execution ended"
                );
                let diagnosis = engines[0].doctor().await.unwrap();
                assert!(
                    diagnosis.counter_mismatches.is_empty(),
                    "{strategy:?}: {diagnosis:?}"
                );
            }
            for pool in pools {
                pool.close().await;
            }
        }
    }
    assert_eq!(
        deadlocks(&db).await - at_start,
        0,
        "deadlocks between reprocess and the last completions"
    );
}

/// `n` pools of two connections on `db`'s database.
async fn racing_pools(db: &TestDb, n: usize) -> Vec<sqlx::PgPool> {
    let mut pools = Vec::new();
    for _ in 0..n {
        pools.push(db.new_pool(2).await);
    }
    pools
}

/// A batch that locks its executions first (row-lock members) takes a parent before its
/// child whatever their ids (`locks::executions`: depth, then id): while a parent is held
/// elsewhere, the batch waiting for it holds its child's execution unlocked. In plain id
/// order, a child whose id sorts first would be locked before the wait, the half of the
/// cycle a reprocess (parent, then children) closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_locks_a_parent_before_its_child_whatever_their_ids() {
    let db = TestDb::new(4).await;
    let engine = common::engine_builder(db.pool.clone())
        .fan_in(FanInStrategy::RowLock)
        .build();
    engine
        .register(&Workflow::new("kid", 1).step("work"))
        .await
        .unwrap();
    engine
        .register(
            &Workflow::new("parent", 1)
                .map_workflow("kids", "kid")
                .stage(Stage::step("side").at_start())
                .stage(Stage::step("end").after(["kids", "side"])),
        )
        .await
        .unwrap();
    // A parent whose child's id sorts before its own (even odds per try).
    let (parent, child) = loop {
        let parent = engine.start("parent", &[1]).await.unwrap();
        let child: ExecutionId =
            sqlx::query_scalar("SELECT id FROM confluo.execution WHERE parent_execution = $1")
                .bind(parent)
                .fetch_one(&db.pool)
                .await
                .unwrap();
        if child.to_string() < parent.to_string() {
            break (parent, child);
        }
        engine.cancel(parent).await.unwrap();
    };
    let tasks = common::claim_n(&engine, 2).await;
    assert!(tasks.iter().any(|t| t.execution_id() == child));
    assert!(tasks.iter().any(|t| t.execution_id() == parent));
    let mut holder = db.connection().await;
    sqlx::query("BEGIN").execute(&mut holder).await.unwrap();
    sqlx::query("SELECT 1 FROM confluo.execution WHERE id = $1 FOR NO KEY UPDATE")
        .bind(parent)
        .execute(&mut holder)
        .await
        .unwrap();
    let batch = {
        let engine = engine.clone();
        tokio::spawn(async move {
            let items: Vec<_> = tasks.iter().map(|t| (t, serde_json::json!(1))).collect();
            engine.complete_batch(&items).await.unwrap()
        })
    };
    // Until the batch waits for the parent's lock.
    let mut probe = db.connection().await;
    for _ in 0..200 {
        let waiting: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_stat_activity
                             WHERE datname = current_database() AND wait_event_type = 'Lock')",
        )
        .fetch_one(&mut probe)
        .await
        .unwrap();
        if waiting {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    sqlx::query("BEGIN").execute(&mut probe).await.unwrap();
    let free =
        sqlx::query("SELECT 1 FROM confluo.execution WHERE id = $1 FOR NO KEY UPDATE NOWAIT")
            .bind(child)
            .execute(&mut probe)
            .await;
    sqlx::query("ROLLBACK").execute(&mut probe).await.unwrap();
    sqlx::query("ROLLBACK").execute(&mut holder).await.unwrap();
    let outcomes = batch.await.unwrap();
    assert!(
        free.is_ok(),
        "the batch locked the child before its parent: {free:?}"
    );
    assert!(
        outcomes
            .iter()
            .all(|o| matches!(o, confluo::Outcome::Completed { .. })),
        "{outcomes:?}"
    );
}
