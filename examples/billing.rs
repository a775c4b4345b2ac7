//! Child workflows: a billing run fans out one multi-step `charge` workflow per account
//! and joins once, when the last charge has ended.
//!
//! ```sh
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres cargo run --example billing
//! ```
//!
//! `charge` is `authorize` -> `capture` -> `receipt`. `billing_run` is `select` (returns
//! the accounts) -> `charge_each` (a map of `charge` children, one per account) ->
//! `report` (receives every child's output, and which children failed). One card is
//! declined: its child fails, and the run reports it instead of failing (the map's
//! default; `fail_execution_on_member_failure` would fail the run and cancel the other
//! children). `billing_now` maps over its input at once: its children start with it,
//! and cancelling it before any worker runs cancels them too. `confluo list --parent
//! <run>` lists a run's children.

use std::time::Duration;

use anyhow::Context;
use confluo::{Engine, ExecutionStatus, ListFilter, Stage, TaskError, Workflow};
use serde_json::{json, Value};

const ACCOUNTS: usize = 200;
const DECLINED: usize = 13;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let engine = Engine::connect_env()
        .await
        .context("set DATABASE_URL, e.g. postgres://postgres@127.0.0.1:5432/postgres")?;
    engine.migrate().await?;
    // The child first: registering the parent checks that it exists.
    engine
        .register(
            &Workflow::new("charge", 1)
                .step("authorize")
                .step("capture")
                .step("receipt"),
        )
        .await?;
    engine
        .register(
            &Workflow::new("billing_run", 1)
                .step("select")
                .stage(Stage::map_workflow("charge_each", "charge"))
                .step("report"),
        )
        .await?;
    engine
        .register(
            &Workflow::new("billing_now", 1)
                .map_workflow("charge_each", "charge")
                .step("report"),
        )
        .await?;

    let accounts: Vec<Value> = (0..ACCOUNTS)
        .map(|n| json!({"account": n, "cents": 100 + n}))
        .collect();
    let run = engine.start("billing_run", &accounts).await?;
    // Its 50 children start in the transaction that starts it; the cancel stops them all.
    let cancelled = engine.start("billing_now", &accounts[..50]).await?;
    engine.cancel(cancelled).await?;

    let worker = engine
        .worker()
        .poll_interval(Duration::from_millis(100))
        .handler("billing_run", "select", |t| async move {
            Ok::<_, TaskError>(t.input().clone())
        })
        .handler("charge", "authorize", |t| async move {
            if t.input()["account"] == DECLINED {
                return Err(TaskError::permanent("card declined"));
            }
            Ok(json!({"account": t.input()["account"], "cents": t.input()["cents"]}))
        })
        .handler("charge", "capture", |t| async move {
            Ok::<_, TaskError>(t.input().clone())
        })
        .handler("charge", "receipt", |t| async move {
            Ok::<_, TaskError>(json!({"receipt": format!("R-{}", t.input()["account"])}))
        })
        .handler("billing_run", "report", |t| async move {
            let charged = t.input()["outputs"].as_array().map_or(0, Vec::len);
            let declined: Vec<&Value> = t.input()["failed"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|f| &f["index"])
                .collect();
            Ok::<_, TaskError>(json!({"charged": charged, "declined": declined}))
        })
        .start()
        .await?;

    let done = engine.wait(run, Duration::from_secs(120)).await?;
    worker.shutdown().await;
    let children = engine
        .list(&ListFilter::new().parent(run).limit(ACCOUNTS + 1))
        .await?;
    let failed = children
        .iter()
        .filter(|c| c.status == ExecutionStatus::Failed)
        .count();
    println!(
        "run {} -> {} ({} children, {failed} failed)",
        done.status,
        done.output.unwrap_or_default(),
        children.len()
    );
    let stopped = engine.execution(cancelled).await?;
    let children = engine.list(&ListFilter::new().parent(cancelled)).await?;
    let with_it = children
        .iter()
        .filter(|c| c.status == ExecutionStatus::Cancelled)
        .count();
    println!(
        "billing_now {} ({} children, {with_it} cancelled)",
        stopped.status,
        children.len()
    );
    Ok(())
}
