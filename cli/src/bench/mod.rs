//! `confluo bench`: completions per second, completion and fan-in latency, round trips,
//! and stalls / double fires, for each strategy against the no-fan-in floor, side by side
//! in one run, in a database of its own.
//!
//! ```sh
//! confluo bench --quick
//! confluo bench --widths 100,10000 --finishers 8,32 --budget 20
//! ```
//!
//! Results: a table on stdout; JSON, CSV and an SVG chart under `--out`
//! (`target/fanin-bench/` by default).

mod report;
mod round_trips;
mod scenario;

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use confluo::{Engine, TaskError};
use indicatif::{ProgressBar, ProgressStyle};
use scenario::{Mode, Setup, Started};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

#[derive(clap::Args)]
pub struct Args {
    /// One short scenario (width 1 000, 8 finishers, 8 s each): a smoke run; replaces
    /// --widths, --finishers and --budget.
    #[arg(long)]
    quick: bool,
    /// Block widths, comma-separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "10,100,1000,10000,100000"
    )]
    widths: Vec<usize>,
    /// Concurrent finishers (connections completing members at once), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32,64", value_parser = at_least_one)]
    finishers: Vec<usize>,
    /// What to compare: floor, countdown, striped, row_lock, and naive (in a build with
    /// the naive-fan-in feature). Default: all of them.
    #[arg(long, value_delimiter = ',', value_parser = Mode::parse)]
    strategies: Vec<Mode>,
    /// Seconds per scenario.
    #[arg(long, default_value_t = 20.0, value_parser = positive_seconds)]
    budget: f64,
    /// Completions per transaction (the floor's included).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    batch: u32,
    /// Where to write results.json, results.csv and chart.svg.
    #[arg(long, default_value = "target/fanin-bench")]
    out: PathBuf,
    /// The benchmark's own database (dropped and created anew).
    #[arg(long, default_value = "confluo_bench")]
    database: String,
}

fn at_least_one(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!("{s:?}: expected a whole number of at least 1")),
    }
}

fn positive_seconds(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(x) if x > 0.0 && x.is_finite() => Ok(x),
        _ => Err(format!("{s:?}: expected a positive number of seconds")),
    }
}

impl Args {
    fn modes(&self) -> Vec<Mode> {
        if !self.strategies.is_empty() {
            return self.strategies.clone();
        }
        // The naive strategy only exists in builds with the naive-fan-in feature.
        ["floor", "countdown", "striped", "row_lock", "naive"]
            .iter()
            .filter_map(|m| Mode::parse(m).ok())
            .collect()
    }
}

pub async fn run(admin: PgConnectOptions, mut args: Args) -> anyhow::Result<ExitCode> {
    if args.quick {
        args.widths = vec![1_000];
        args.finishers = vec![8];
        args.budget = 8.0;
    }
    let modes = args.modes();
    let options = confluo_testkit::fresh_database(&admin, &args.database).await?;
    let max_finishers = *args.finishers.iter().max().unwrap_or(&1);
    let pool = PgPoolOptions::new()
        .max_connections(max_finishers as u32 + 2)
        .min_connections(max_finishers as u32)
        .acquire_timeout(Duration::from_secs(120))
        .connect_with(confluo::read_committed(options.clone()))
        .await?;
    let engine = Engine::new(pool.clone());
    engine.migrate().await?;

    // One worker runs the step after every block, and records when it started.
    let started: Started = Arc::new(Mutex::new(HashMap::new()));
    let mut worker = Engine::new(
        PgPoolOptions::new()
            .max_connections(4)
            .connect_with(confluo::read_committed(options.clone()))
            .await?,
    )
    .worker()
    // The naive strategy's stalls are what the bench counts: no auditor moves them on.
    .audit_every(None)
    .partial(true)
    .concurrency(16)
    .poll_interval(Duration::from_secs(1));
    for mode in &modes {
        let wf = mode.workflow();
        engine.register(&wf).await?;
        let started = started.clone();
        worker = worker.handler(wf.name(), "after", move |t| {
            started
                .lock()
                .unwrap()
                .insert(t.execution_id(), Instant::now());
            async { Ok::<_, TaskError>(()) }
        });
    }
    let worker = worker.start().await?;

    let total = args.widths.len() * args.finishers.len() * modes.len();
    let bar = ProgressBar::new(total as u64).with_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} {msg}")?
            .progress_chars("=> "),
    );
    let setup = Setup {
        pool: &pool,
        started: &started,
        budget: Duration::from_secs_f64(args.budget),
        batch: args.batch as usize,
    };
    let mut results = Vec::new();
    for &width in &args.widths {
        for &finishers in &args.finishers {
            for &mode in &modes {
                bar.set_message(format!("{mode} width {width} x {finishers} finishers"));
                let result = scenario::run(&setup, mode, width, finishers)
                    .await
                    .with_context(|| format!("{mode} width {width} finishers {finishers}"))?;
                bar.inc(1);
                results.push(result);
            }
        }
    }
    // Round trips per completion, once per mode, at a moderate width.
    let proxy = round_trips::CountingProxy::start(&options).await?;
    let width = args
        .widths
        .iter()
        .copied()
        .filter(|w| *w <= 1_000)
        .max()
        .unwrap_or(1_000);
    let finishers = max_finishers.min(8);
    let mut trips = Vec::new();
    for &mode in &modes {
        bar.set_message(format!("{mode}: counting round trips"));
        let (per_completion, pings_per_completion) =
            scenario::round_trips(&setup, &proxy, &options, mode, (width, finishers)).await?;
        trips.push(report::RoundTrips {
            mode,
            width,
            finishers,
            batch: args.batch as usize,
            per_completion,
            pings_per_completion,
        });
    }
    bar.finish_and_clear();
    worker.shutdown().await;

    let report = report::Report::new(results, trips);
    print!("{}", report.table());
    let dir = args.out;
    std::fs::create_dir_all(&dir)?;
    report.write(&dir)?;
    println!(
        "\nresults: {}/{{results.json,results.csv,chart.svg}}",
        dir.display()
    );
    if report.naive_violations() > 0 {
        println!("note: the naive strategy stalled, as it does under concurrency");
    }
    if report.violations() > 0 {
        println!(
            "VIOLATION: {} stalls or double fires from strategies that must have none",
            report.violations()
        );
        return Ok(ExitCode::from(1));
    }
    Ok(ExitCode::SUCCESS)
}
