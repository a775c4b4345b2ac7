//! Conditional branches: the output of one step picks which stages run next.
//!
//! ```sh
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres cargo run --example payments
//! ```
//!
//! `classify` (step: returns the payment with its method) -> `route` (branch on
//! `/method`: `card` charges the card; `invoice` sends an invoice, then waits for the
//! transfer; anything else goes to manual review) -> `receipt` (step: sees the output of
//! the arm that ran). Only the chosen arm's tasks are created. It prints, per payment, the
//! arm taken and the receipt, e.g. `P-2 invoice -> arm "invoice" -> {"paid":"transfer",...}`.

use std::time::Duration;

use anyhow::Context;
use confluo::{Engine, Stage, TaskError, Workflow};
use serde_json::{json, Value};

fn workflow() -> Workflow {
    Workflow::new("payments", 1)
        .step("classify")
        .stage(
            Stage::branch("route")
                .by("/method")
                .on("card", [Stage::step("charge_card")])
                .on(
                    "invoice",
                    [Stage::step("send_invoice"), Stage::step("await_transfer")],
                )
                .otherwise([Stage::step("manual_review")]),
        )
        .step("receipt")
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let engine = Engine::connect_env()
        .await
        .context("set DATABASE_URL, e.g. postgres://postgres@127.0.0.1:5432/postgres")?;
    engine.migrate().await?;
    engine.register(&workflow()).await?;

    let worker = engine
        .worker()
        .handler("payments", "classify", |t| async move {
            let payment = t.input().clone();
            let method = payment["method"].as_str().unwrap_or("unknown").to_owned();
            Ok::<_, TaskError>(
                json!({"id": payment["id"], "amount": payment["amount"], "method": method}),
            )
        })
        .handler("payments", "charge_card", |t| async move {
            Ok::<_, TaskError>(
                json!({"id": t.input()["id"], "paid": "card", "amount": t.input()["amount"]}),
            )
        })
        .handler("payments", "send_invoice", |t| async move {
            Ok::<_, TaskError>(json!({"id": t.input()["id"], "invoiced": t.input()["amount"]}))
        })
        .handler("payments", "await_transfer", |t| async move {
            Ok::<_, TaskError>(
                json!({"id": t.input()["id"], "paid": "transfer", "amount": t.input()["invoiced"]}),
            )
        })
        .handler("payments", "manual_review", |t| async move {
            Ok::<_, TaskError>(
                json!({"id": t.input()["id"], "paid": null, "review": t.input()["method"]}),
            )
        })
        .handler("payments", "receipt", |t| async move {
            Ok::<_, TaskError>(t.input().clone())
        })
        .start()
        .await?;

    let payments = [
        json!({"id": "P-1", "amount": 40, "method": "card"}),
        json!({"id": "P-2", "amount": 900, "method": "invoice"}),
        json!({"id": "P-3", "amount": 12, "method": "voucher"}),
    ];
    let mut started = Vec::new();
    for payment in &payments {
        started.push(engine.start("payments", payment).await?);
    }
    for (payment, id) in payments.iter().zip(started) {
        let done = engine.wait(id, Duration::from_secs(60)).await?;
        let arm = done.stages.iter().find_map(|s| s.branch.as_ref()).map_or(
            "no branch".to_owned(),
            |b| match &b.arm {
                Some(arm) => format!("arm {arm:?}"),
                None => "otherwise".to_owned(),
            },
        );
        println!(
            "{} {} -> {arm} -> {}",
            payment["id"].as_str().unwrap_or("?"),
            payment["method"].as_str().unwrap_or("?"),
            done.output.unwrap_or(Value::Null)
        );
    }
    worker.shutdown().await;
    Ok(())
}
