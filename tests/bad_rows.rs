//! One row this build cannot act on stops nothing else: a reclaim pass skips it (and
//! later passes skip it too) and reclaims the other expired leases; a claim gives it back,
//! uncounted and due later, and returns the others.

mod common;

use std::time::Duration;

use common::TestDb;
use confluo::{ExecutionId, Workflow};

/// Lifts the CHECK on `stage_group.fan_in`, as a newer confluo with a strategy of its own
/// would have, and gives `execution`'s group that strategy.
async fn from_a_newer_version(db: &TestDb, execution: ExecutionId) {
    sqlx::query(
        "DO $$ DECLARE c text; BEGIN
           FOR c IN SELECT conname FROM pg_constraint
                     WHERE conrelid = 'confluo.stage_group'::regclass AND contype = 'c'
                       AND pg_get_constraintdef(oid) LIKE '%fan_in%'
           LOOP EXECUTE format('ALTER TABLE confluo.stage_group DROP CONSTRAINT %I', c); END LOOP;
         END $$",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query(
        "UPDATE confluo.stage_group SET fan_in = 'from_the_future' WHERE execution_id = $1",
    )
    .bind(execution)
    .execute(&db.pool)
    .await
    .unwrap();
}

/// Gives `execution`'s tasks a stage its workflow does not have.
async fn beyond_its_stages(db: &TestDb, execution: ExecutionId) {
    sqlx::query("UPDATE confluo.task SET stage_index = 7 WHERE execution_id = $1")
        .bind(execution)
        .execute(&db.pool)
        .await
        .unwrap();
}

async fn task_of(db: &TestDb, execution: ExecutionId) -> (String, i32, bool) {
    sqlx::query_as(
        "SELECT status, attempt, run_at > now() + interval '30 seconds'
           FROM confluo.task WHERE execution_id = $1",
    )
    .bind(execution)
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_it_cannot_read_does_not_stop_the_reclaim_pass() {
    let db = TestDb::new(4).await;
    db.register(&Workflow::new("one", 1).step("s")).await;
    let mut ids = Vec::new();
    for i in 0..3 {
        ids.push(db.engine.start("one", &i).await.unwrap());
    }
    let claimed = db
        .engine
        .claim("dying", 3, Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(claimed.len(), 3);
    let (future, beyond, good) = (ids[0], ids[1], ids[2]);
    from_a_newer_version(&db, future).await;
    beyond_its_stages(&db, beyond).await;
    // The unreadable ones expired first: a pass of 2 meets only them.
    for (execution, ago) in [
        (future, "10 minutes"),
        (beyond, "9 minutes"),
        (good, "1 minute"),
    ] {
        sqlx::query(&format!(
            "UPDATE confluo.task SET lease_expires_at = now() - interval '{ago}'
              WHERE execution_id = $1"
        ))
        .bind(execution)
        .execute(&db.pool)
        .await
        .unwrap();
    }
    assert_eq!(
        db.engine
            .reclaim_expired(2)
            .await
            .expect("the pass goes on"),
        0,
        "neither unreadable row is reclaimed"
    );
    assert_eq!(
        db.engine.reclaim_expired(2).await.unwrap(),
        1,
        "the next pass skips them and reclaims the readable one"
    );
    assert_eq!(task_of(&db, good).await.0, "pending", "retried");
    assert_eq!(task_of(&db, future).await.0, "running", "left as it was");
    assert_eq!(task_of(&db, beyond).await.0, "running", "left as it was");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_gives_back_what_it_cannot_read() {
    let db = TestDb::new(4).await;
    db.register(&Workflow::new("one", 1).step("s")).await;
    let mut ids = Vec::new();
    for i in 0..3 {
        ids.push(db.engine.start("one", &i).await.unwrap());
    }
    let (future, beyond, good) = (ids[0], ids[1], ids[2]);
    from_a_newer_version(&db, future).await;
    beyond_its_stages(&db, beyond).await;
    let claimed = db
        .engine
        .claim("worker", 10, Duration::from_secs(60))
        .await
        .expect("the claim returns what it can read");
    assert_eq!(
        claimed.iter().map(|t| t.execution_id()).collect::<Vec<_>>(),
        vec![good]
    );
    for execution in [future, beyond] {
        assert_eq!(
            task_of(&db, execution).await,
            ("pending".to_owned(), 0, true),
            "given back uncounted, due again later"
        );
    }
    // Not claimed again at once.
    assert!(db
        .engine
        .claim("worker", 10, Duration::from_secs(60))
        .await
        .unwrap()
        .is_empty());
}
