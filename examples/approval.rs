//! Signals: an expense waits for a person's approval, sent from outside the workflow,
//! and takes a default path when nobody answers in time.
//!
//! ```sh
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres cargo run --example approval
//! ```
//!
//! `submit` (step) -> `approval` (signal wait, two seconds at most; on a timeout its
//! output is `{"approved": false, "by": "timeout"}`) -> `decide` (branch on `/approved`):
//! `pay` or `reject`. Three expenses: one approved before it reaches the wait (the signal
//! is kept), one rejected while it waits, one nobody answers. The same signals can be
//! sent from a shell: `confluo signal <execution> approval '{"approved": true}'`.

use std::time::Duration;

use anyhow::Context;
use confluo::{Engine, SignalOutcome, Stage, TaskError, Workflow};
use serde_json::json;

fn workflow() -> Workflow {
    Workflow::new("expense", 1)
        .step("submit")
        .stage(
            Stage::signal("approval")
                .within(Duration::from_secs(2))
                .on_timeout(json!({"approved": false, "by": "timeout"})),
        )
        .stage(
            Stage::branch("decide")
                .by("/approved")
                .on("true", [Stage::step("pay")])
                .otherwise([Stage::step("reject")]),
        )
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let engine = Engine::connect_env()
        .await
        .context("set DATABASE_URL, e.g. postgres://postgres@127.0.0.1:5432/postgres")?;
    engine.migrate().await?;
    engine.register(&workflow()).await?;

    let early = engine
        .start("expense", &json!({"id": "E-1", "amount": 40}))
        .await?;
    let waiting = engine
        .start("expense", &json!({"id": "E-2", "amount": 900}))
        .await?;
    let silent = engine
        .start("expense", &json!({"id": "E-3", "amount": 75}))
        .await?;
    // Before any worker runs: E-1 has not reached its wait, so the signal is kept.
    let kept = engine
        .signal(early, "approval", json!({"approved": true, "by": "ada"}))
        .await?;
    assert_eq!(kept, SignalOutcome::Kept);

    let worker = engine
        .worker()
        .poll_interval(Duration::from_millis(100))
        .handler("expense", "submit", |t| async move {
            Ok::<_, TaskError>(t.input().clone())
        })
        .handler("expense", "pay", |t| async move {
            Ok::<_, TaskError>(json!({"paid_by": t.input()["by"]}))
        })
        .handler("expense", "reject", |t| async move {
            Ok::<_, TaskError>(json!({"rejected_by": t.input()["by"]}))
        })
        .start()
        .await?;

    // E-2 is answered while it waits: the signal completes the wait, in its transaction.
    while engine.execution(waiting).await?.stages.len() < 2 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let received = engine
        .signal(
            waiting,
            "approval",
            json!({"approved": false, "by": "grace"}),
        )
        .await?;
    assert_eq!(received, SignalOutcome::Received);

    for (name, id) in [("E-1", early), ("E-2", waiting), ("E-3", silent)] {
        let done = engine.wait(id, Duration::from_secs(60)).await?;
        println!(
            "{name} {} -> {}",
            done.status,
            done.output.unwrap_or_default()
        );
    }
    worker.shutdown().await;
    Ok(())
}
