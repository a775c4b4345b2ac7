//! Dependency fan-in (a DAG): stages that wait for several earlier stages.
//!
//! ```sh
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres cargo run --example reconcile
//! ```
//!
//! `fetch_orders` and `fetch_refunds` start together (the second `at_start`);
//! `check_each` (a map over the orders) waits for `fetch_orders` alone; `reconcile` waits
//! for `check_each` and `fetch_refunds`, and receives both outputs by name, entered once
//! by whichever of the two finished last. It prints, per day, what `reconcile` saw, e.g.
//! `2026-12-01: 3 orders checked (1 flagged), 1 refunds -> net 160`.

use std::time::Duration;

use anyhow::Context;
use confluo::{Engine, Stage, TaskError, Workflow};
use serde_json::{json, Value};

fn workflow() -> Workflow {
    Workflow::new("reconcile", 1)
        .step("fetch_orders") // returns the day's orders (an array)
        .stage(Stage::step("fetch_refunds").at_start()) // runs alongside fetch_orders
        .stage(Stage::map("check_each").after(["fetch_orders"]))
        .stage(Stage::step("reconcile").after(["check_each", "fetch_refunds"]))
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
        .handler("reconcile", "fetch_orders", |t| async move {
            // A stand-in for a query: three orders on the first day, two on the others.
            let n = if t.input()["day"] == "2026-12-01" {
                3
            } else {
                2
            };
            let orders: Vec<Value> = (0..n)
                .map(|i| json!({"id": format!("O-{i}"), "amount": 50 + 10 * i}))
                .collect();
            Ok::<_, TaskError>(json!(orders))
        })
        .handler("reconcile", "fetch_refunds", |_| async move {
            Ok::<_, TaskError>(json!([{"order": "O-0", "amount": 20}]))
        })
        .handler("reconcile", "check_each", |t| async move {
            let amount = t.input()["amount"].as_i64().unwrap_or(0);
            Ok::<_, TaskError>(
                json!({"id": t.input()["id"], "amount": amount, "flag": amount > 65}),
            )
        })
        .handler("reconcile", "reconcile", |t| async move {
            // {"check_each": {"outputs": [...], "failed": [...]}, "fetch_refunds": [...]}
            let checked = t.input()["check_each"]["outputs"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            let refunds = t.input()["fetch_refunds"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            let sum = |items: &[Value]| {
                items
                    .iter()
                    .filter_map(|v| v["amount"].as_i64())
                    .sum::<i64>()
            };
            Ok::<_, TaskError>(json!({
                "orders": checked.len(),
                "flagged": checked.iter().filter(|c| c["flag"] == true).count(),
                "refunds": refunds.len(),
                "net": sum(&checked) - sum(&refunds),
            }))
        })
        .start()
        .await?;

    let days = ["2026-12-01", "2026-12-02"];
    let mut started = Vec::new();
    for day in days {
        started.push(engine.start("reconcile", &json!({"day": day})).await?);
    }
    for (day, id) in days.iter().zip(started) {
        let done = engine.wait(id, Duration::from_secs(60)).await?;
        let out = done.output.unwrap_or(Value::Null);
        println!(
            "{day}: {} orders checked ({} flagged), {} refunds -> net {}",
            out["orders"], out["flagged"], out["refunds"], out["net"]
        );
    }
    worker.shutdown().await;
    Ok(())
}
