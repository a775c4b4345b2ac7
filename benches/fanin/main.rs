//! Fan-in benchmark: completions per second, completion and fan-in latency, and
//! stalls / double fires, for each strategy against the no-fan-in floor, side by side in
//! one run against `DATABASE_URL`.
//!
//! ```sh
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres cargo bench --bench fanin -- --quick
//! cargo bench --bench fanin -- --widths 100,10000 --finishers 8,32 --budget 20
//! ```
//!
//! Results: a table on stdout; JSON, CSV and an SVG chart under `target/fanin-bench/`.

mod report;
mod round_trips;
mod scenario;

use std::collections::HashMap;
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use confluo::{Engine, FanInStrategy, TaskError};
use indicatif::{ProgressBar, ProgressStyle};
use scenario::{Mode, Setup, Started};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Connection};

struct Args {
    widths: Vec<usize>,
    finishers: Vec<usize>,
    modes: Vec<Mode>,
    budget: Duration,
    batch: usize,
    quick: bool,
}

fn list<T: FromStr>(value: &str) -> anyhow::Result<Vec<T>>
where
    T::Err: std::error::Error + Send + Sync + 'static,
{
    value.split(',').map(|v| Ok(v.trim().parse()?)).collect()
}

fn parse_args() -> anyhow::Result<Args> {
    let mut args = Args {
        widths: vec![10, 100, 1_000, 10_000, 100_000],
        finishers: vec![1, 8, 32, 64],
        modes: vec![
            Mode::Floor,
            Mode::Strategy(FanInStrategy::Countdown),
            Mode::Strategy(FanInStrategy::Striped),
            Mode::Strategy(FanInStrategy::RowLock),
            Mode::Strategy(FanInStrategy::NaiveRecount),
        ],
        budget: Duration::from_secs(20),
        batch: 1,
        quick: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--bench" => {} // passed by `cargo bench`
            "--quick" => {
                args.quick = true;
                args.widths = vec![1_000];
                args.finishers = vec![8];
                args.budget = Duration::from_secs(8);
            }
            "--widths" => args.widths = list(&value()?)?,
            "--finishers" => args.finishers = list(&value()?)?,
            "--strategies" => {
                args.modes = value()?
                    .split(',')
                    .map(|s| Mode::parse(s.trim()))
                    .collect::<anyhow::Result<_>>()?
            }
            "--budget" => args.budget = Duration::from_secs_f64(value()?.parse()?),
            "--batch" => args.batch = value()?.parse::<usize>()?.max(1),
            "-h" | "--help" => {
                println!(
                    "fanin bench [--quick] [--widths 10,100,...] [--finishers 1,8,...] \
                     [--strategies floor,countdown,striped,row_lock,naive] [--budget SECONDS per scenario] \
                     [--batch N: completions per transaction, the floor's included]"
                );
                std::process::exit(0);
            }
            other => bail!("unknown argument {other:?}; try --help"),
        }
    }
    Ok(args)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = parse_args()?;
    let url = std::env::var("DATABASE_URL").context(
        "the benchmark needs DATABASE_URL, e.g. DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres",
    )?;
    let admin = PgConnectOptions::from_str(&url)?;
    let options = fresh_database(&admin, "confluo_bench").await?;
    let max_finishers = *args.finishers.iter().max().unwrap_or(&1);
    let pool = PgPoolOptions::new()
        .max_connections(max_finishers as u32 + 2)
        .min_connections(max_finishers as u32)
        .acquire_timeout(Duration::from_secs(120))
        .connect_with(options.clone())
        .await?;
    let engine = Engine::new(pool.clone());
    engine.migrate().await?;

    // One worker runs the step after every block, and records when it started.
    let started: Started = Arc::new(Mutex::new(HashMap::new()));
    let mut worker = Engine::new(
        PgPoolOptions::new()
            .max_connections(4)
            .connect_with(options.clone())
            .await?,
    )
    .worker()
    .partial(true)
    .concurrency(16)
    .poll_interval(Duration::from_secs(1));
    for mode in &args.modes {
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

    let total = args.widths.len() * args.finishers.len() * args.modes.len();
    let bar = ProgressBar::new(total as u64).with_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} {msg}")?
            .progress_chars("=> "),
    );
    let setup = Setup {
        pool: &pool,
        started: &started,
        budget: args.budget,
        batch: args.batch,
    };
    let mut results = Vec::new();
    for &width in &args.widths {
        for &finishers in &args.finishers {
            for &mode in &args.modes {
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
    for &mode in &args.modes {
        bar.set_message(format!("{mode}: counting round trips"));
        let (per_completion, pings_per_completion) =
            scenario::round_trips(&setup, &proxy, &options, mode, (width, finishers)).await?;
        trips.push(report::RoundTrips {
            mode,
            width,
            finishers,
            batch: args.batch,
            per_completion,
            pings_per_completion,
        });
    }
    bar.finish_and_clear();
    worker.shutdown().await;

    let report = report::Report::new(results, trips);
    print!("{}", report.table());
    let dir = std::path::PathBuf::from(
        std::env::var("CARGO_TARGET_DIR").unwrap_or_else(|_| "target".into()),
    )
    .join("fanin-bench");
    std::fs::create_dir_all(&dir)?;
    report.write(&dir)?;
    println!(
        "\nresults: {}/{{results.json,results.csv,chart.svg}}",
        dir.display()
    );
    if report.violations() > 0 {
        println!(
            "note: stalls or double fires above come only from the naive strategy, as expected"
        );
    }
    Ok(())
}

/// Drops and recreates a database of the benchmark's own on the same server.
async fn fresh_database(admin: &PgConnectOptions, name: &str) -> anyhow::Result<PgConnectOptions> {
    let mut conn = admin
        .connect()
        .await
        .context("cannot connect to DATABASE_URL")?;
    sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        .execute(&mut conn)
        .await?;
    sqlx::query(&format!("CREATE DATABASE {name}"))
        .execute(&mut conn)
        .await?;
    conn.close().await?;
    Ok(admin.clone().database(name))
}
