//! `confluo demo`: a wide map and its fan-in, run by real workers (each with its own
//! pool, as separate processes would be) in a database of its own, then checked.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use confluo::{
    Engine, ExecutionStatus, FanInStrategy, MapResults, RetryPolicy, Stage, TaskError, Workflow,
};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

#[derive(clap::Args)]
pub struct Args {
    /// Members of the map.
    #[arg(long, default_value_t = 10_000)]
    width: u64,
    /// Workers, each with a pool of its own (0: leave the work to `confluo worker`
    /// processes).
    #[arg(long, default_value_t = 3)]
    workers: usize,
    /// Every N-th member fails for good and is dead-lettered (0: none).
    #[arg(long, default_value_t = 1_000)]
    fail_every: u64,
    /// Fan-in strategy of the map: countdown, striped or row_lock.
    #[arg(long, default_value_t = FanInStrategy::Countdown)]
    strategy: FanInStrategy,
    /// The demo's own database (dropped and created anew, unless --workers 0).
    #[arg(long, default_value = "confluo_demo")]
    database: String,
    /// Give the execution this long (e.g. 30s, 5m): past it, it is timed out and its
    /// pending members cancelled.
    #[arg(long, value_parser = crate::executions::parse_age)]
    deadline: Option<chrono::Duration>,
    /// Serve Prometheus metrics on this address (e.g. 127.0.0.1:9464) while it runs.
    #[arg(long)]
    metrics: Option<std::net::SocketAddr>,
}

/// The demo's workflow name.
pub const WORKFLOW: &str = "demo-orders";

/// The demo workflow: a step that plans N items, a map over them, a fan-in step.
pub fn workflow(strategy: FanInStrategy) -> Workflow {
    Workflow::new(WORKFLOW, 1)
        // The list of items the map fans out over.
        .step("plan")
        // One member per item: every `fail_every`-th fails for good (a dead letter), every
        // 7th fails once and succeeds on retry.
        .stage(Stage::map("process").fan_in(strategy).retry(
            RetryPolicy::exponential(3).backoff(Duration::from_millis(50), Duration::from_secs(1)),
        ))
        // The fan-in: runs once, with every output and the list of failures.
        .step("report")
}

pub async fn run(admin: PgConnectOptions, args: Args, throwaway: bool) -> anyhow::Result<ExitCode> {
    // Workers of other processes work in the database as it is; otherwise it starts anew.
    let options = if args.workers == 0 {
        confluo_testkit::existing_database(&admin, &args.database).await?
    } else {
        confluo_testkit::fresh_database(&admin, &args.database).await?
    };
    let engine = Engine::new(
        PgPoolOptions::new()
            .max_connections(4)
            .connect_with(confluo::read_committed(options.clone()))
            .await?,
    );
    engine.migrate().await?;
    match engine.register(&workflow(args.strategy)).await {
        // A `confluo worker` registered it first, with its default strategy.
        Err(confluo::Error::DefinitionConflict { .. }) if args.workers == 0 => {
            eprintln!(
                "the workflow is registered already (by a worker): its fan-in strategy applies"
            );
        }
        other => other?,
    }
    println!(
        "confluo demo: a map of width {} ({}) then a fan-in step, {} workers with pools of their own",
        args.width, args.strategy, args.workers
    );
    if let Some(addr) = args.metrics {
        crate::worker::serve_metrics(addr)?;
    }
    check_connections(&engine, args.workers).await?;
    let mut workers = Vec::new();
    let route = crate::route::Route::direct(options.clone());
    for i in 0..args.workers {
        workers.push(
            start_worker(
                &route,
                &format!("demo-worker-{i}"),
                args.fail_every,
                Duration::ZERO,
            )
            .await?,
        );
    }
    if args.workers == 0 {
        println!(
            "no workers of its own: run `confluo worker --database {}` elsewhere",
            args.database
        );
    }
    let started = Instant::now();
    let mut options = confluo::StartOptions::new();
    if let Some(deadline) = args.deadline {
        options = options.deadline(deadline.to_std()?);
    }
    let id = engine.start_with(WORKFLOW, &args.width, options).await?.id;
    println!("execution {id}");
    let bar = ProgressBar::new(args.width).with_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:40}] {pos}/{len} members {msg}")?
            .progress_chars("=> "),
    );
    let execution = loop {
        let execution = engine.execution(id).await?;
        if let Some(map) = execution.stages.get(1) {
            bar.set_position(u64::from(map.completed + map.dead));
            bar.set_message(format!("({} dead letters)", map.dead));
        }
        if execution.status.is_terminal() {
            break execution;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    bar.finish_and_clear();
    let elapsed = started.elapsed();
    for worker in workers {
        worker.shutdown().await;
    }
    print!("{}", crate::executions::timeline(&execution));
    println!(
        "\n  {} members in {:.2?} ({:.0}/s); output: {}",
        args.width,
        elapsed,
        args.width as f64 / elapsed.as_secs_f64(),
        execution.output.clone().unwrap_or_default()
    );

    if execution.status == ExecutionStatus::TimedOut {
        println!(
            "  the execution passed its deadline: it was timed out and what was pending cancelled"
        );
        return Ok(ExitCode::from(1));
    }
    // The fan-in, checked from the database itself: every group fired once, and the
    // report step was dispatched exactly once.
    let (groups, fired, reports): (i64, i64, i64) = sqlx::query_as(
        "SELECT count(*), count(fired_at),
                (SELECT count(*) FROM confluo.task_all WHERE execution_id = $1 AND stage_index = 2)
           FROM confluo.stage_group WHERE execution_id = $1",
    )
    .bind(id)
    .fetch_one(engine.pool())
    .await?;
    let exactly_once = groups == 3 && fired == 3 && reports == 1;
    println!(
        "  fan-in: {groups} groups, {fired} fired, {reports} report task dispatched: {}",
        if exactly_once {
            "exactly once"
        } else {
            "VIOLATION"
        }
    );
    if throwaway {
        println!(
            "  (the throwaway server goes when this command ends: with DATABASE_URL set, the \
             run stays, and the demo prints the commands to look at it)"
        );
    } else {
        println!("look at this run again (same --database-url or DATABASE_URL):");
        println!(
            "  confluo inspect {id} --members --database {}",
            args.database
        );
        println!(
            "  confluo dead-letters list --execution {id} --database {}",
            args.database
        );
    }
    if execution.status != ExecutionStatus::Completed || !exactly_once {
        println!("the demo did not complete as expected");
        return Ok(ExitCode::from(1));
    }
    Ok(ExitCode::SUCCESS)
}

/// Connections each demo worker opens: its pool and its listener.
const CONNECTIONS_PER_WORKER: i64 = WORKER_POOL as i64 + 1;
/// The pool of each demo worker.
const WORKER_POOL: u32 = 4;

/// Refuses, before starting any, more workers than the server has connections for
/// (`max_connections`, less its reserved slots and what is open now), saying what fits.
async fn check_connections(engine: &Engine, workers: usize) -> anyhow::Result<()> {
    let room = confluo_testkit::ConnectionRoom::of(engine.pool()).await?;
    let free = room.free();
    let needed = workers as i64 * CONNECTIONS_PER_WORKER;
    if needed > free {
        anyhow::bail!(
            "--workers {workers} needs {needed} connections ({CONNECTIONS_PER_WORKER} per worker: \
             a pool of {WORKER_POOL} and a listener), but the server has {free} left \
             (max_connections = {}, {} reserved, {} open): use --workers {} \
             or fewer, or raise max_connections",
            room.max,
            room.reserved,
            room.open,
            (free / CONNECTIONS_PER_WORKER).max(0)
        );
    }
    Ok(())
}

/// Registers the demo workflow (countdown fan-in) unless registered already: by
/// `confluo demo`, perhaps with another fan-in strategy, which then applies.
pub async fn register_unless_there(engine: &Engine) -> anyhow::Result<()> {
    match engine.register(&workflow(FanInStrategy::Countdown)).await {
        Err(confluo::Error::DefinitionConflict { .. }) | Ok(()) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// The `application_name` of the demo workflow's workers.
const WORKER_APPLICATION: &str = "confluo-worker";

/// A worker with a pool of its own serving the demo workflow: every `fail_every`-th item
/// fails for good (0: none), every 7th fails once; each member takes `pace` (zero: no
/// time at all; `serve --demo` slows them so that the dashboard's countdown is seen).
pub async fn start_worker(
    route: &crate::route::Route,
    id: &str,
    fail_every: u64,
    pace: Duration,
) -> anyhow::Result<confluo::Worker> {
    let engine = route.engine(WORKER_POOL, WORKER_APPLICATION).await?;
    let mut worker = engine.worker().id(id);
    if let Some(notifications) = route.notifications(WORKER_APPLICATION) {
        worker = worker.notifications(notifications);
    }
    Ok(worker
        .concurrency(32)
        .handler(WORKFLOW, "plan", |t| async move {
            let n: u64 = t.input_as()?;
            Ok::<_, TaskError>((0..n).collect::<Vec<_>>())
        })
        .handler(WORKFLOW, "process", move |t| async move {
            let item: u64 = t.input_as()?;
            if !pace.is_zero() {
                tokio::time::sleep(pace).await;
            }
            if fail_every > 0 && item % fail_every == fail_every - 1 {
                return Err(TaskError::permanent(format!("item {item} is out of stock")));
            }
            if item % 7 == 3 && t.attempt() == 1 {
                return Err(TaskError::retryable("payment gateway timeout"));
            }
            Ok(item * 2)
        })
        .handler(WORKFLOW, "report", |t| async move {
            let r: MapResults<u64> = t.input_as()?;
            Ok::<_, TaskError>(json!({
                "processed": r.outputs.len(),
                "failed": r.failed.len(),
                "total": r.outputs.iter().sum::<u64>(),
            }))
        })
        .start()
        .await?)
}
