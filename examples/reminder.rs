//! Durable sleep: a step, a sleep that survives restarts, and a step after it.
//!
//! ```sh
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres cargo run --example reminder
//! ```
//!
//! `sign_up` (step: returns the user and when their trial ends, three seconds from now)
//! -> `grace` (sleep: two seconds) -> `remind` -> `wait_for_end` (sleep until the time
//! `sign_up` returned) -> `convert`. Stop the program while it sleeps and run it again
//! with `RESUME=<execution id>`: the sleeping execution carries on where it was.

use std::time::{Duration, Instant};

use anyhow::Context;
use confluo::{Engine, ExecutionId, Stage, TaskError, Workflow};
use serde_json::json;

fn workflow() -> Workflow {
    Workflow::new("reminder", 1)
        .step("sign_up")
        .stage(Stage::sleep("grace", Duration::from_secs(2)))
        .step("remind")
        .stage(Stage::sleep_until("wait_for_end", "/trial_ends"))
        .step("convert")
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let engine = Engine::connect_env()
        .await
        .context("set DATABASE_URL, e.g. postgres://postgres@127.0.0.1:5432/postgres")?;
    engine.migrate().await?;
    engine.register(&workflow()).await?;
    let started = Instant::now();
    let seconds = move || started.elapsed().as_secs_f64();

    let worker = engine
        .worker()
        .handler("reminder", "sign_up", move |t| async move {
            let ends = chrono::Utc::now() + chrono::Duration::seconds(3);
            println!(
                "{:4.1} s  sign_up: trial ends at {}",
                seconds(),
                ends.to_rfc3339()
            );
            Ok::<_, TaskError>(json!({"user": t.input()["user"], "trial_ends": ends.to_rfc3339()}))
        })
        .handler("reminder", "remind", move |t| async move {
            println!("{:4.1} s  remind: user {}", seconds(), t.input()["user"]);
            Ok::<_, TaskError>(t.input().clone())
        })
        .handler("reminder", "convert", move |t| async move {
            println!("{:4.1} s  convert: user {}", seconds(), t.input()["user"]);
            Ok::<_, TaskError>(json!({"converted": t.input()["user"]}))
        })
        .start()
        .await?;

    let id = match std::env::var("RESUME") {
        Ok(id) => ExecutionId::from(
            id.parse::<uuid::Uuid>()
                .context("RESUME: an execution id")?,
        ),
        Err(_) => engine.start("reminder", &json!({"user": 7})).await?,
    };
    println!("execution {id}");
    let done = engine.wait(id, Duration::from_secs(60)).await?;
    worker.shutdown().await;
    println!(
        "{:4.1} s  {}: {}",
        seconds(),
        done.status,
        done.output.unwrap_or_default()
    );
    Ok(())
}
