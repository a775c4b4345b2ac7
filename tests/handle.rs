//! The claimed handle: read-only (a `compile_fail` doc test on `ClaimedTask` keeps its
//! fields private), read back from a stored task id and lease token after a restart, and
//! claimed for given handlers only. And `start_with` says whether it created.

mod common;

use std::time::Duration;

use common::TestDb;
use confluo::{ExecutionStatus, Outcome, StartOptions, Workflow};
use serde_json::json;

const LEASE: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stored_lease_acknowledges_after_a_restart() {
    let db = TestDb::new(2).await;
    db.register(&Workflow::new("one", 1).step("a")).await;
    let execution = db.engine.start("one", &1).await.unwrap();
    let (task, lease) = {
        let claimed = db
            .engine
            .claim_for("service", &[("one", "a")], 1, LEASE)
            .await
            .unwrap();
        (claimed[0].id(), claimed[0].lease())
    }; // the service stores these two, and restarts
    let engine = common::engine(db.new_pool(2).await);
    let held = engine
        .claimed(task, lease)
        .await
        .unwrap()
        .expect("the attempt still holds its lease");
    assert_eq!(
        (
            held.execution_id(),
            held.workflow(),
            held.handler(),
            held.attempt()
        ),
        (execution, "one", "a", 1)
    );
    assert_eq!(
        engine.complete(&held, json!("done")).await.unwrap(),
        Outcome::Completed { fired: true }
    );
    assert!(
        engine.claimed(task, lease).await.unwrap().is_none(),
        "acknowledged: no longer held"
    );
    assert!(
        engine
            .claimed(task, confluo::LeaseToken::from(uuid::Uuid::new_v4()))
            .await
            .unwrap()
            .is_none(),
        "another token holds nothing"
    );
    assert_eq!(
        engine.status(execution).await.unwrap(),
        ExecutionStatus::Completed
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scoped_claims_take_only_their_handlers() {
    let db = TestDb::new(2).await;
    db.register(&Workflow::new("x", 1).step("a")).await;
    db.register(&Workflow::new("y", 1).step("b")).await;
    db.engine.start("x", &1).await.unwrap();
    let y = db.engine.start("y", &2).await.unwrap();
    assert!(db
        .engine
        .claim_for("s", &[("x", "b")], 10, LEASE)
        .await
        .unwrap()
        .is_empty());
    let claimed = db
        .engine
        .claim_for("s", &[("y", "b")], 10, LEASE)
        .await
        .unwrap();
    assert_eq!(
        claimed.iter().map(|t| t.execution_id()).collect::<Vec<_>>(),
        vec![y]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_with_says_whether_it_created() {
    let db = TestDb::new(2).await;
    db.register(&Workflow::new("once", 1).step("a")).await;
    let key = || StartOptions::new().idempotency_key("order-1");
    let first = db.engine.start_with("once", &1, key()).await.unwrap();
    let again = db.engine.start_with("once", &1, key()).await.unwrap();
    assert!(first.created, "the first start creates");
    assert!(!again.created, "the second finds it");
    assert_eq!(first.id, again.id);
}
