//! Conditional branches end to end against real PostgreSQL: only the chosen arm's tasks
//! are created, the stage after the branch receives the arm's output, an unmatched value
//! fails the execution with the reason on it, and members that finish together take the
//! branch once.

mod common;

use std::collections::BTreeMap;

use common::{claim_n, quick_worker, race_completions, TestDb, STRATEGIES, WAIT};
use confluo::{
    Execution, ExecutionId, ExecutionStatus, FanInStrategy, Outcome, Stage, TaskError, Workflow,
};
use serde_json::{json, Value};

/// `payments`: classify, then a branch on `/method` with a two-stage arm, a one-stage
/// arm, an empty arm and an otherwise, then receipt.
fn payments() -> Workflow {
    Workflow::new("payments", 1)
        .step("classify")
        .stage(
            Stage::branch("route")
                .by("/method")
                .on("card", [Stage::step("charge")])
                .on("invoice", [Stage::step("bill"), Stage::step("remind")])
                .on("free", Vec::<Stage>::new())
                .otherwise([Stage::step("review")]),
        )
        .step("receipt")
}

/// How many tasks of each handler an execution has, archived or not.
async fn tasks_by_handler(db: &TestDb, id: ExecutionId) -> BTreeMap<String, i64> {
    sqlx::query_as::<_, (String, i64)>(
        "SELECT handler, count(*) FROM confluo.task_all WHERE execution_id = $1 GROUP BY 1",
    )
    .bind(id)
    .fetch_all(&db.pool)
    .await
    .unwrap()
    .into_iter()
    .collect()
}

fn counts(handlers: &[&str]) -> BTreeMap<String, i64> {
    handlers.iter().map(|h| (h.to_string(), 1)).collect()
}

/// Registers `workflow`, starts it, and completes its first stage (a step) with
/// `output`, which fires it; returns the execution as it stands then.
async fn first_step_returns(db: &TestDb, workflow: &Workflow, output: Value) -> Execution {
    db.register(workflow).await;
    let id = db
        .engine
        .start(workflow.name(), &json!(null))
        .await
        .unwrap();
    let task = claim_n(&db.engine, 1).await.remove(0);
    let outcome = db.engine.complete(&task, output).await.unwrap();
    assert_eq!(outcome, Outcome::Completed { fired: true });
    db.engine.execution(id).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn each_value_runs_only_its_arm_and_the_next_stage_gets_the_arms_output() {
    let db = TestDb::new(12).await;
    db.register(&payments()).await;
    let worker = quick_worker(&db.engine, |w| {
        w.handler("payments", "classify", |t| async move {
            Ok::<_, TaskError>(t.input().clone())
        })
        .handler("payments", "charge", |t| async move {
            Ok::<_, TaskError>(json!({"charged": t.input()["amount"]}))
        })
        .handler("payments", "bill", |t| async move {
            Ok::<_, TaskError>(json!({"billed": t.input()["amount"]}))
        })
        .handler("payments", "remind", |t| async move {
            Ok::<_, TaskError>(json!({"reminded": t.input().clone()}))
        })
        .handler("payments", "review", |_| async move {
            Ok::<_, TaskError>(json!("reviewed"))
        })
        .handler("payments", "receipt", |t| async move {
            Ok::<_, TaskError>(json!({"receipt": t.input().clone()}))
        })
    })
    .await;
    let cases = [
        (
            "card",
            json!({"charged": 5}),
            vec!["classify", "charge", "receipt"],
        ),
        (
            "invoice",
            json!({"reminded": {"billed": 5}}),
            vec!["classify", "bill", "remind", "receipt"],
        ),
        (
            "free",
            json!({"method": "free", "amount": 5}),
            vec!["classify", "receipt"],
        ),
        (
            "cash",
            json!("reviewed"),
            vec!["classify", "review", "receipt"],
        ),
    ];
    let mut started = Vec::new();
    for (method, _, _) in &cases {
        let input = json!({"method": method, "amount": 5});
        started.push(db.engine.start("payments", &input).await.unwrap());
    }
    for ((method, expected, handlers), id) in cases.iter().zip(started) {
        let done = db.engine.wait(id, WAIT).await.unwrap();
        assert_eq!(
            done.status,
            ExecutionStatus::Completed,
            "{method}: {done:?}"
        );
        assert_eq!(done.output, Some(json!({"receipt": expected})), "{method}");
        assert_eq!(
            tasks_by_handler(&db, id).await,
            counts(handlers),
            "{method}"
        );
        let branch = done
            .stages
            .iter()
            .find(|s| s.kind == "branch")
            .expect("the branch is a stage of the execution");
        assert_eq!((branch.index, branch.name.as_str()), (1, "route"));
        assert_eq!((branch.width, branch.remaining), (0, 0));
        assert!(branch.fired_at.is_some());
        let choice = branch
            .branch
            .as_ref()
            .expect("the branch records its choice");
        let arm = (*method != "cash").then(|| method.to_string());
        assert_eq!(choice.arm, arm, "{method}");
        assert_eq!(choice.value, json!(method));
        let receipt = done.stages.last().unwrap();
        assert_eq!((receipt.index, receipt.name.as_str()), (6, "receipt"));
        assert_eq!(done.current_stage, 7);
    }
    worker.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_unmatched_value_without_otherwise_fails_the_execution_and_says_why() {
    let db = TestDb::new(10).await;
    let strict = Workflow::new("strict", 1).step("classify").stage(
        Stage::branch("route")
            .by("/method")
            .on("card", [Stage::step("charge")]),
    );
    let failed = first_step_returns(&db, &strict, json!({"method": "cash"})).await;
    let id = failed.id;
    assert_eq!(failed.status, ExecutionStatus::Failed);
    let error = failed.error.expect("the reason is recorded");
    assert!(
        error.contains("\"cash\" at \"/method\"") && error.contains("[\"card\"]"),
        "{error}"
    );
    assert!(error.contains("otherwise"), "{error}");
    assert_eq!(tasks_by_handler(&db, id).await, counts(&["classify"]));
    assert!(failed.finished_at.is_some());
    // Nothing is left to claim, and the auditor finds nothing wrong.
    assert!(db
        .engine
        .claim("test", 10, std::time::Duration::from_secs(10))
        .await
        .unwrap()
        .is_empty());
    assert!(db.engine.doctor().await.unwrap().is_healthy());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_first_stage_branch_decides_on_the_input_and_an_empty_arm_passes_it_on() {
    let db = TestDb::new(10).await;
    db.register(
        &Workflow::new("gate", 1).stage(
            Stage::branch("mode")
                .by("/0")
                .on("skip", Vec::<Stage>::new())
                .on("list", [Stage::map("each")])
                .on("3", [Stage::step("three")]),
        ),
    )
    .await;
    let worker = quick_worker(&db.engine, |w| {
        w.handler("gate", "each", |t| async move {
            Ok::<_, TaskError>(t.input().clone())
        })
        .handler(
            "gate",
            "three",
            |_| async move { Ok::<_, TaskError>(json!(3)) },
        )
    })
    .await;
    // One by one, and in one batch (another path into the first stage).
    let one = db.engine.start("gate", &json!(["skip", 1])).await.unwrap();
    let many = db
        .engine
        .start_many(
            "gate",
            [
                (json!(["list", 2, 3]), confluo::StartOptions::default()),
                (json!([3]), confluo::StartOptions::default()),
            ],
        )
        .await
        .unwrap();
    let outputs = [
        json!(["skip", 1]),
        json!({"outputs": ["list", 2, 3], "failed": []}),
        json!(3),
    ];
    for (id, expected) in [one].into_iter().chain(many).zip(outputs) {
        let done = db.engine.wait(id, WAIT).await.unwrap();
        assert_eq!(done.status, ExecutionStatus::Completed, "{done:?}");
        assert_eq!(done.output, Some(expected));
    }
    worker.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_map_reached_through_a_branch_refuses_an_input_that_is_not_an_array() {
    let db = TestDb::new(10).await;
    let spread = Workflow::new("spread", 1).step("load").stage(
        Stage::branch("shape")
            .by("/kind")
            .on("list", [Stage::map("each")]),
    );
    // An object: its acknowledgement cannot know a map comes after the branch.
    let output = json!({"kind": "list", "items": [1, 2]});
    let failed = first_step_returns(&db, &spread, output).await;
    let id = failed.id;
    assert_eq!(failed.status, ExecutionStatus::Failed);
    let error = failed.error.unwrap();
    assert!(
        error.contains("\"each\" needs a JSON array") && error.contains("got object"),
        "{error}"
    );
    assert_eq!(tasks_by_handler(&db, id).await, counts(&["load"]));
}

/// A map decided by `strategy`, a branch on its first output, and a step in each arm.
async fn fan_in_then_branch(db: &TestDb, strategy: FanInStrategy) -> String {
    let name = format!("fan_branch_{}", strategy.as_str());
    db.register(
        &Workflow::new(&name, 1)
            .stage(Stage::map("member").fan_in(strategy))
            .stage(
                Stage::branch("decide")
                    .by("/outputs/0")
                    .on("go", [Stage::step("after")])
                    .otherwise([Stage::step("other")]),
            ),
    )
    .await;
    name
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn members_finishing_together_take_the_branch_exactly_once() {
    const WIDTH: usize = 16;
    const ROUNDS: usize = 8;
    for strategy in STRATEGIES {
        let db = TestDb::new(WIDTH as u32 + 4).await;
        let wf = fan_in_then_branch(&db, strategy).await;
        for round in 0..ROUNDS {
            let id = db
                .engine
                .start(&wf, &(0..WIDTH).collect::<Vec<_>>())
                .await
                .unwrap();
            let members = claim_n(&db.engine, WIDTH).await;
            let replays = members.clone();
            let (outcomes, ()) =
                race_completions(&db.engine, members, json!("go"), |_| async {}).await;
            assert_eq!(
                common::fired(&outcomes),
                1,
                "{strategy} round {round}: {outcomes:?}"
            );
            // Replays of every member change nothing.
            for task in &replays {
                assert_eq!(
                    db.engine.complete(task, json!("go")).await.unwrap(),
                    Outcome::AlreadyRecorded
                );
            }
            let (branches, arms): (i64, i64) = sqlx::query_as(
                "SELECT count(*) FILTER (WHERE kind = 'branch'),
                        (SELECT count(*) FROM confluo.task t
                          WHERE t.execution_id = $1 AND t.handler IN ('after', 'other'))
                   FROM confluo.stage_group WHERE execution_id = $1",
            )
            .bind(id)
            .fetch_one(&db.pool)
            .await
            .unwrap();
            assert_eq!((branches, arms), (1, 1), "{strategy} round {round}");
            let after = claim_n(&db.engine, 1).await.remove(0);
            assert_eq!(after.handler(), "after");
            assert_eq!(after.input_stage(), Some(0));
            let input: Value = db.engine.task_input(&after).await.unwrap();
            assert_eq!(input["outputs"].as_array().unwrap().len(), WIDTH);
            db.engine.complete(&after, json!("done")).await.unwrap();
            let done = db.engine.execution(id).await.unwrap();
            assert_eq!(done.status, ExecutionStatus::Completed);
            assert_eq!(done.output, Some(json!("done")));
        }
        assert!(db.engine.doctor().await.unwrap().is_healthy(), "{strategy}");
    }
}

/// An execution whose block fired but whose branch was lost (rows deleted, as a broken
/// engine would leave it) is stalled; the auditor's repair decides the branch once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_auditor_decides_a_lost_branch_once() {
    let db = TestDb::new(6).await;
    let wf = fan_in_then_branch(&db, FanInStrategy::Countdown).await;
    let id = db.engine.start(&wf, &[1, 2, 3]).await.unwrap();
    for task in claim_n(&db.engine, 3).await {
        db.engine.complete(&task, json!("go")).await.unwrap();
    }
    sqlx::query("DELETE FROM confluo.stage_group WHERE execution_id = $1 AND stage_index > 0")
        .bind(id)
        .execute(&db.pool)
        .await
        .unwrap();
    let diagnosis = db.engine.doctor().await.unwrap();
    assert_eq!(diagnosis.stalled_executions.len(), 1, "{diagnosis:?}");
    assert_eq!(db.engine.repair().await.unwrap().executions_advanced, 1);
    assert_eq!(db.engine.repair().await.unwrap().found.len(), 0);
    let stages: Vec<(i32, String)> = sqlx::query_as(
        "SELECT stage_index, kind FROM confluo.stage_group WHERE execution_id = $1
          ORDER BY stage_index",
    )
    .bind(id)
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let kinds: Vec<(i32, &str)> = stages.iter().map(|(i, k)| (*i, k.as_str())).collect();
    assert_eq!(kinds, [(0, "map"), (1, "branch"), (2, "step")]);
    let after = claim_n(&db.engine, 1).await.remove(0);
    assert_eq!(after.handler(), "after");
}
