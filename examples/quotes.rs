//! Join rules: `any` (the first success fires) and `at_least(k)` (a quorum).
//!
//! ```sh
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres cargo run --example quotes
//! ```
//!
//! `ask` asks three vendors for a quote and fires on the first answer (`Join::Any`):
//! `vendor_a` answers at once, `vendor_b` a second later, `vendor_c` fails after a second;
//! both are cancelled when `vendor_a`'s answer fires the block. `buy` takes that quote and
//! returns the three replicas to write the order to; `replicate` (a map) fires once two of
//! them took it (`Join::AtLeast(2)`), and fails the order as soon as two are down. It
//! prints, per order, how it ended, e.g.
//! `Q-1 completed -> bought from vendor_a at 95, written to r1, r3 (2 of 3)`.

use std::time::Duration;

use anyhow::Context;
use confluo::{Engine, Join, Stage, TaskError, Workflow};
use serde_json::{json, Value};

fn workflow() -> Workflow {
    Workflow::new("quotes", 1)
        .stage(Stage::parallel("ask", ["vendor_a", "vendor_b", "vendor_c"]).join(Join::Any))
        .step("buy")
        .stage(Stage::map("replicate").join(Join::AtLeast(2)))
        .step("confirm")
}

/// A vendor's answer: its quote, passing on which replicas are down.
fn quote(vendor: &str, price: i64, input: &Value) -> Value {
    json!({"vendor": vendor, "price": price, "down": input["down"]})
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
        .handler("quotes", "vendor_a", |t| async move {
            Ok::<_, TaskError>(quote("vendor_a", 95, t.input()))
        })
        .handler("quotes", "vendor_b", |t| async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            Ok::<_, TaskError>(quote("vendor_b", 90, t.input()))
        })
        .handler("quotes", "vendor_c", |_| async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            Err::<Value, _>(TaskError::permanent("vendor_c is closed today"))
        })
        .handler("quotes", "buy", |t| async move {
            // {"outputs": {"vendor_a": {...}}, "failed": [vendor_b, vendor_c cancelled]}
            let (_, quote) = t.input()["outputs"]
                .as_object()
                .and_then(|o| o.iter().next())
                .ok_or_else(|| TaskError::permanent("no quote"))?;
            let down = quote["down"].as_array().cloned().unwrap_or_default();
            let replicas: Vec<Value> = ["r1", "r2", "r3"]
                .iter()
                .map(|r| json!({"replica": r, "down": down.contains(&json!(r)), "quote": quote}))
                .collect();
            Ok::<_, TaskError>(json!(replicas))
        })
        .handler("quotes", "replicate", |t| async move {
            let replica = t.input()["replica"].as_str().unwrap_or("?").to_owned();
            if t.input()["down"] == true {
                return Err(TaskError::permanent(format!("replica {replica} is down")));
            }
            Ok(json!({"replica": replica, "quote": t.input()["quote"]}))
        })
        .handler("quotes", "confirm", |t| async move {
            // {"outputs": [the replicas that took it], "failed": [...]}
            let written = t.input()["outputs"].as_array().cloned().unwrap_or_default();
            let quote = &written[0]["quote"];
            let replicas: Vec<&str> = written
                .iter()
                .filter_map(|w| w["replica"].as_str())
                .collect();
            Ok::<_, TaskError>(json!(format!(
                "bought from {} at {}, written to {} ({} of 3)",
                quote["vendor"].as_str().unwrap_or("?"),
                quote["price"],
                replicas.join(", "),
                replicas.len()
            )))
        })
        .start()
        .await?;

    let orders = [("Q-1", json!(["r2"])), ("Q-2", json!(["r2", "r3"]))];
    let mut started = Vec::new();
    for (order, down) in &orders {
        started.push(
            engine
                .start("quotes", &json!({"order": order, "down": down}))
                .await?,
        );
    }
    for ((order, _), id) in orders.iter().zip(started) {
        let done = engine.wait(id, Duration::from_secs(60)).await?;
        let said = match (&done.output, &done.error) {
            (Some(Value::String(s)), _) => s.clone(),
            // The error ends with the last dead letter's task id and message.
            (_, Some(e)) => e.split("; the last").next().unwrap_or(e).to_owned(),
            _ => format!("{done:?}"),
        };
        println!("{order} {} -> {said}", done.status);
    }
    worker.shutdown().await;
    Ok(())
}
