use confluo::{Engine, MapResults, RetryPolicy, Stage, TaskError, Workflow};
use serde_json::json;
use std::process::ExitCode;
use std::time::Duration;

#[tokio::main]
async fn main() -> ExitCode {
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error}"); // the Display text says what to do
            ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<(), confluo::Error> {
    // DATABASE_URL, else the PG* variables. Or Engine::new(your_pool).
    let engine = Engine::connect_env().await?;
    engine.migrate().await?; // idempotent; safe from several processes at once

    engine
        .register(
            &Workflow::new("orders", 1)
                .step("plan") // returns an array: the map fans out over it
                .stage(Stage::map("charge").retry(RetryPolicy::exponential(5)))
                .step("report"), // the fan-in: runs once, after every member is terminal
        )
        .await?;

    let worker = engine
        .worker()
        .concurrency(32)
        .handler("orders", "plan", |t| async move {
            let n: u32 = t.input_as()?;
            Ok::<_, TaskError>((0..n).collect::<Vec<_>>())
        })
        .handler("orders", "charge", |t| async move {
            let item: u32 = t.input_as()?;
            if item == 13 {
                return Err(TaskError::permanent("card declined")); // dead letter, no retries
            }
            Ok(item * 100)
        })
        .handler("orders", "report", |t| async move {
            let r: MapResults<u32> = t.input_as()?; // successful outputs + failures
            Ok::<_, TaskError>(json!({ "charged": r.outputs.len(), "failed": r.failed.len() }))
        })
        .start()
        .await?;

    let id = engine.start("orders", &json!(20)).await?;
    let done = engine.wait(id, Duration::from_secs(60)).await?;
    println!("{} -> {}", done.status, done.output.unwrap_or_default());
    // completed -> {"charged":19,"failed":1}
    worker.shutdown().await;
    Ok(())
}
