//! An order pipeline: a step, a map over the order's lines, parallel checks of which one
//! may fail, and a final step that sees every result.
//!
//! ```sh
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres cargo run --example orders
//! ```
//!
//! `validate` (step: returns the order's lines) -> `reserve` (map: one task per line) ->
//! `fraud`, `stock`, `address` (parallel checks of the reservation; `stock` is down and
//! ends dead-lettered, the others pass) -> `confirm` (step: sees the checks that passed
//! and the one that failed).

use std::time::Duration;

use anyhow::Context;
use confluo::{Engine, MapResults, ParallelResults, RetryPolicy, Stage, TaskError, Workflow};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Line {
    sku: String,
    quantity: u32,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Order {
    id: String,
    lines: Vec<Line>,
    city: String,
}

fn workflow() -> Workflow {
    let quick =
        RetryPolicy::exponential(3).backoff(Duration::from_millis(50), Duration::from_millis(200));
    Workflow::new("orders", 1)
        .step("validate")
        .stage(Stage::map("reserve").retry(quick))
        // Members may fail: the next stage gets the others' outputs and the failures.
        .stage(Stage::parallel("checks", ["fraud", "stock", "address"]).retry(quick))
        .step("confirm")
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
        .handler("orders", "validate", |t| async move {
            let order: Order = t.input_as()?;
            if order.lines.is_empty() {
                return Err(TaskError::permanent("an order needs at least one line"));
            }
            // A step before a map returns the array the map fans out over.
            Ok::<_, TaskError>(json!(order.lines))
        })
        .handler("orders", "reserve", |t| async move {
            let line: Line = t.input_as()?;
            Ok::<_, TaskError>(json!({"sku": line.sku, "reserved": line.quantity}))
        })
        .handler("orders", "fraud", |_| async {
            Ok::<_, TaskError>(json!("clean"))
        })
        .handler("orders", "stock", |_| async {
            Err::<Value, _>(TaskError::retryable("stock service unavailable"))
        })
        .handler("orders", "address", |t| async move {
            let reserved: MapResults<Value> = t.input_as()?;
            Ok::<_, TaskError>(json!({"parcels": reserved.outputs.len()}))
        })
        .handler("orders", "confirm", |t| async move {
            let checks: ParallelResults<Value> = t.input_as()?;
            Ok::<_, TaskError>(json!({
                "passed": checks.outputs.keys().collect::<Vec<_>>(),
                "failed": checks.failed.iter().filter_map(|f| f.branch.clone()).collect::<Vec<_>>(),
            }))
        })
        .start()
        .await?;

    let order = Order {
        id: "A-1001".into(),
        city: "Lyon".into(),
        lines: vec![
            Line {
                sku: "kettle".into(),
                quantity: 1,
            },
            Line {
                sku: "mug".into(),
                quantity: 4,
            },
            Line {
                sku: "tea".into(),
                quantity: 2,
            },
        ],
    };
    let id = engine.start("orders", &order).await?;
    let done = engine.wait(id, Duration::from_secs(60)).await?;
    worker.shutdown().await;

    println!("execution {id}: {}", done.status);
    for stage in &done.stages {
        println!(
            "  {:<9} {:<8} width {:>2}: {} completed, {} dead",
            stage.name, stage.kind, stage.width, stage.completed, stage.dead
        );
    }
    for dead in &done.dead_letters {
        let last = dead.errors.last().map_or("", |e| e.error.as_str());
        println!(
            "  dead letter: {} after {} attempts ({last})",
            dead.handler, dead.attempts
        );
    }
    println!("  output: {}", done.output.unwrap_or(Value::Null));
    Ok(())
}
