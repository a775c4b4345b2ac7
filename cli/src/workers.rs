//! `confluo workers`: the worker registry.

use std::process::ExitCode;

use chrono::Utc;
use confluo::{Engine, WorkerState};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub target: crate::DatabaseArg,
    /// Alive workers only (not those lost or stopped).
    #[arg(long)]
    alive: bool,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

pub async fn run(engine: Engine, args: Args) -> anyhow::Result<ExitCode> {
    let mut workers = engine.workers().await?;
    if args.alive {
        workers.retain(|w| w.state == WorkerState::Alive);
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&workers)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "{:<44} {:<7} {:<20} {:>7} {:>7} {:>7} {:>7} {:>9}  handlers",
        "id", "state", "host", "pid", "conc", "running", "held", "seen"
    );
    let now = Utc::now();
    for w in &workers {
        let seen = (now - w.last_seen).num_milliseconds().max(0) as f64 / 1000.0;
        let handlers: Vec<String> = w
            .handlers
            .iter()
            .map(|(wf, h)| format!("{wf}/{h}"))
            .collect();
        println!(
            "{:<44} {:<7} {:<20} {:>7} {:>7} {:>7} {:>7} {:>8.1}s  {}",
            w.id,
            w.state.as_str(),
            w.host,
            w.pid,
            w.concurrency,
            w.running,
            w.held,
            seen,
            handlers.join(", ")
        );
    }
    let alive = workers
        .iter()
        .filter(|w| w.state == WorkerState::Alive)
        .count();
    println!("{} workers, {alive} alive", workers.len());
    Ok(ExitCode::SUCCESS)
}
