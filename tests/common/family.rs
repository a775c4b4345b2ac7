//! Helpers for tests of child workflows: a parent's children and members, and claims of
//! one handler's tasks.

use std::time::Duration;

use confluo::{Engine, ExecutionId};

use super::TestDb;

/// The children of `parent`, by member index: `(id, status)`.
pub async fn children(db: &TestDb, parent: ExecutionId) -> Vec<(ExecutionId, String)> {
    sqlx::query_as(
        "SELECT c.id, c.status FROM confluo.execution c
           JOIN confluo.task_all t ON t.id = c.parent_task
          WHERE c.parent_execution = $1 ORDER BY t.item_index",
    )
    .bind(parent)
    .fetch_all(&db.pool)
    .await
    .unwrap()
}

/// The statuses of `parent`'s members (its map of children), by index.
pub async fn members(db: &TestDb, parent: ExecutionId) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT status FROM confluo.task_all
          WHERE execution_id = $1 AND handler = 'confluo:child' ORDER BY item_index",
    )
    .bind(parent)
    .fetch_all(&db.pool)
    .await
    .unwrap()
}

/// Claims the tasks of `handler` of the workflow `workflow` until `n` are in hand.
pub async fn claim_of(
    engine: &Engine,
    workflow: &str,
    handler: &str,
    n: usize,
) -> Vec<confluo::ClaimedTask> {
    let mut tasks = Vec::new();
    for _ in 0..200 {
        tasks.extend(
            engine
                .claim_for(
                    "test",
                    &[(workflow, handler)],
                    n - tasks.len(),
                    Duration::from_secs(60),
                )
                .await
                .unwrap(),
        );
        if tasks.len() == n {
            return tasks;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("claimed {} of {n} {handler} tasks", tasks.len());
}
