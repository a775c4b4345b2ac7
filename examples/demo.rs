//! End-to-end demo: a workflow with a wide map and a fan-in, run by real workers (each
//! with its own connection pool, as separate processes would be), printing what happened.
//!
//! ```sh
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres cargo run --release --example demo -- --width 10000 --workers 3
//! ```

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use confluo::{Engine, MapResults, RetryPolicy, Stage, TaskError, Workflow};
use serde_json::json;
use sqlx::postgres::PgPoolOptions;

struct Args {
    width: u64,
    workers: usize,
    fail_every: u64,
}

fn parse_args() -> anyhow::Result<Args> {
    let mut args = Args {
        width: 10_000,
        workers: 3,
        fail_every: 1_000,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--width" => args.width = value()?.parse().context("--width")?,
            "--workers" => args.workers = value()?.parse().context("--workers")?,
            "--fail-every" => args.fail_every = value()?.parse().context("--fail-every")?,
            "-h" | "--help" => {
                println!("usage: demo [--width N (10000)] [--workers N (3)] [--fail-every N (1000, 0 = never)]");
                std::process::exit(0);
            }
            other => bail!("unknown argument {other:?}; try --help"),
        }
    }
    Ok(args)
}

fn workflow() -> Workflow {
    Workflow::new("demo-orders", 1)
        // Produces the list of items the map fans out over.
        .step("plan")
        // One task per item; every `fail_every`-th item fails permanently (dead letter),
        // and every 7th fails once and succeeds on retry.
        .stage(Stage::map("process").retry(
            RetryPolicy::exponential(3).backoff(Duration::from_millis(50), Duration::from_secs(1)),
        ))
        // Fan-in: runs once, with every successful output and the list of failures.
        .step("report")
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = parse_args()?;
    let url = std::env::var("DATABASE_URL").context(
        "set DATABASE_URL, e.g. DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres",
    )?;
    let engine = Engine::connect(&url)
        .await
        .with_context(|| format!("cannot connect to {url}"))?;
    engine.migrate().await?;
    let wf = workflow();
    engine.register(&wf).await?;

    println!(
        "confluo demo: map of width {} then a fan-in step, {} workers with separate pools",
        args.width, args.workers
    );
    let mut workers = Vec::new();
    for i in 0..args.workers {
        let pool = PgPoolOptions::new()
            .max_connections(4)
            .connect(&url)
            .await?;
        let fail_every = args.fail_every;
        let worker = Engine::new(pool)
            .worker()
            .id(format!("demo-worker-{i}"))
            .concurrency(32)
            .poll_interval(Duration::from_millis(100))
            .handler("demo-orders", "plan", |t| async move {
                let n: u64 = t.input_as()?;
                Ok::<_, TaskError>((0..n).collect::<Vec<_>>())
            })
            .handler("demo-orders", "process", move |t| async move {
                let item: u64 = t.input_as()?;
                if fail_every > 0 && item % fail_every == fail_every - 1 {
                    return Err(TaskError::permanent(format!("item {item} is out of stock")));
                }
                if item % 7 == 3 && t.attempt() == 1 {
                    return Err(TaskError::retryable("payment gateway timeout"));
                }
                Ok(item * 2)
            })
            .handler("demo-orders", "report", |t| async move {
                let r: MapResults<u64> = t.input_as()?;
                Ok::<_, TaskError>(json!({
                    "processed": r.outputs.len(),
                    "failed": r.failed.len(),
                    "total": r.outputs.iter().sum::<u64>(),
                    "first_failure": r.failed.first().and_then(|f| f.error.clone()),
                }))
            })
            .start()
            .await?;
        workers.push(worker);
    }

    let started = Instant::now();
    let id = engine.start("demo-orders", &args.width).await?;
    println!("started execution {id}");
    loop {
        let exec = engine.execution(id).await?;
        if let Some(map) = exec.stages.get(1) {
            print!(
                "\r  map: {:>7}/{} done, {:>5} dead, {:>7} remaining   ",
                map.completed, map.width, map.dead, map.remaining
            );
            use std::io::Write;
            std::io::stdout().flush().ok();
        }
        if exec.status.is_terminal() {
            println!();
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let elapsed = started.elapsed();
    let exec = engine.execution(id).await?;
    for worker in workers {
        worker.shutdown().await;
    }

    println!(
        "\nexecution {} is {} after {:.2?}",
        exec.id, exec.status, elapsed
    );
    println!(
        "{:<8} {:<9} {:>7} {:>9} {:>5} {:>9}  fired",
        "stage", "kind", "width", "completed", "dead", "remaining"
    );
    for s in &exec.stages {
        println!(
            "{:<8} {:<9} {:>7} {:>9} {:>5} {:>9}  {}",
            s.name,
            s.kind,
            s.width,
            s.completed,
            s.dead,
            s.remaining,
            s.fired_at
                .map(|t| t.format("%H:%M:%S%.3f").to_string())
                .unwrap_or_else(|| "-".into())
        );
    }
    println!("output: {}", exec.output.clone().unwrap_or_default());
    if let Some(dead) = exec.dead_letters.first() {
        println!(
            "dead letters: {} (first: item {}, {:?})",
            exec.stages[1].dead,
            dead.item_index,
            dead.errors.last().map(|e| &e.error)
        );
    }

    // Check the fan-in from the database itself: one group per stage, each fired once,
    // and exactly one task of the fan-in step.
    let (groups, fired, report_tasks): (i64, i64, i64) = sqlx::query_as(
        "SELECT count(*), count(fired_at),
                (SELECT count(*) FROM confluo.task_all WHERE execution_id = $1 AND stage_index = 2)
           FROM confluo.stage_group WHERE execution_id = $1",
    )
    .bind(id)
    .fetch_one(engine.pool())
    .await?;
    println!(
        "fan-in check: {groups} groups, {fired} fired, {report_tasks} report task(s) dispatched ({})",
        if groups == 3 && fired == 3 && report_tasks == 1 { "exactly once" } else { "VIOLATION" }
    );
    if exec.status != confluo::ExecutionStatus::Completed || report_tasks != 1 {
        bail!("the demo did not complete as expected");
    }
    Ok(())
}
