//! End-to-end throughput of the worker pipeline: claim, run, acknowledge, fan in.
//!
//! ```sh
//! cargo bench --bench throughput                  # every part, a few minutes
//! cargo bench --bench throughput -- --quick       # smaller, about a minute
//! cargo bench --bench throughput -- --only queue --jobs 20000 --rounds 3
//! ```
//!
//! Parts (`--only queue|scaling|latency`, default all):
//! - **queue**: `--jobs` no-op tasks (20 000) drained by one worker of `--concurrency` (8)
//!   handlers on a pool of concurrency + 4, enqueued as N executions of a one-step
//!   workflow (`Engine::start_many`) and as one map of width N; alternating rounds, median.
//!   Timed as the peers harness times it: from the worker's start until the tables show
//!   every task completed (polled every 5 ms once every handler has returned, as counted
//!   in process; polling the tables all along would load the database it measures).
//! - **scaling**: the cost per member of one map of width 1 000 and of width 100 000, with
//!   the same worker, and the cost in each tenth of the wide map (is it front-loaded?).
//! - **latency**: fan-in latency, from the last member's handler returning to the next
//!   stage's handler starting (one clock, one process), for maps of width 100, 1 000 and
//!   10 000, p50 and p99 over repeated runs.
//!
//! The server: `DATABASE_URL` when it answers, else a throwaway PostgreSQL from the
//! machine's binaries (or a container), as `confluo bench` does. Each part runs in a
//! database of its own, `confluo_bench_throughput`, recreated. Machines are noisy: compare
//! numbers of one run only.

use std::str::FromStr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use confluo::{Engine, StartOptions, TaskError, Workflow};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

const DATABASE: &str = "confluo_bench_throughput";

struct Args {
    jobs: usize,
    concurrency: usize,
    rounds: usize,
    wide: usize,
    only: Option<String>,
    quick: bool,
}

fn args() -> anyhow::Result<Args> {
    let mut args = Args {
        jobs: 20_000,
        concurrency: 8,
        rounds: 3,
        wide: 100_000,
        only: None,
        quick: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = |name: &str| it.next().with_context(|| format!("{name} needs a value"));
        match arg.as_str() {
            "--jobs" => args.jobs = value("--jobs")?.parse()?,
            "--concurrency" => args.concurrency = value("--concurrency")?.parse()?,
            "--rounds" => args.rounds = value("--rounds")?.parse()?,
            "--wide" => args.wide = value("--wide")?.parse()?,
            "--only" => args.only = Some(value("--only")?),
            "--quick" => args.quick = true,
            "--bench" => {} // cargo bench passes it
            other => anyhow::bail!(
                "unknown argument {other:?}; use --jobs N --concurrency C --rounds R --wide W \
                 --only queue|scaling|latency --quick"
            ),
        }
    }
    if args.quick {
        args.jobs = args.jobs.min(5_000);
        args.rounds = 1;
        args.wide = args.wide.min(20_000);
    }
    Ok(args)
}

fn main() -> anyhow::Result<()> {
    let args = args()?;
    if std::env::var_os("RUST_LOG").is_some() {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .init();
    }
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(run(args))
}

async fn run(args: Args) -> anyhow::Result<()> {
    let configured = match std::env::var("DATABASE_URL") {
        Ok(url) => Some(PgConnectOptions::from_str(&url).context("DATABASE_URL")?),
        Err(_) => None,
    };
    let server = confluo_testkit::Server::pick(configured.as_ref()).await?;
    let admin = server.admin();
    let part = |name: &str| args.only.as_deref().is_none_or(|o| o == name);
    println!(
        "confluo {} end to end; {} handlers, pool of {}",
        env!("CARGO_PKG_VERSION"),
        args.concurrency,
        args.concurrency + 4
    );
    if part("queue") {
        queue(&admin, &args).await?;
    }
    if part("scaling") {
        scaling(&admin, &args).await?;
    }
    if part("latency") {
        latency(&admin, &args).await?;
    }
    Ok(())
}

/// A fresh database with the schema and the benchmark's workflows.
async fn engine(admin: &PgConnectOptions, pool_size: u32) -> anyhow::Result<Engine> {
    let options = confluo_testkit::fresh_database(admin, DATABASE).await?;
    let pool = PgPoolOptions::new()
        .max_connections(pool_size)
        .test_before_acquire(false)
        .connect_with(confluo::read_committed(options))
        .await?;
    let engine = Engine::new(pool);
    engine.migrate().await?;
    engine
        .register(&Workflow::new("steps", 1).step("job"))
        .await?;
    engine.register(&Workflow::new("map", 1).map("job")).await?;
    engine
        .register(
            &Workflow::new("fan", 1)
                .step("plan")
                .map("member")
                .step("after"),
        )
        .await?;
    Ok(engine)
}

/// Waits until `expected` handlers have returned (counted in process, as the peers
/// harness does, so that no polling loads the database while the worker drains it), then
/// polls every 5 ms until no task and no execution is left unfinished (the last
/// acknowledgements land a moment after their handlers return).
async fn settle(engine: &Engine, ran: &AtomicUsize, expected: usize) -> anyhow::Result<()> {
    while ran.load(Ordering::Relaxed) < expected {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    loop {
        // Through the partial indexes of open tasks: cheap however many are completed.
        let open: i64 = sqlx::query_scalar(
            "SELECT (SELECT count(*) FROM confluo.task WHERE status IN ('pending', 'running'))
                  + (SELECT count(*) FROM confluo.execution WHERE status = 'running')",
        )
        .fetch_one(engine.pool())
        .await?;
        if open == 0 {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A no-op handler that counts its calls.
fn counting(
    ran: &Arc<AtomicUsize>,
) -> impl Fn(confluo::TaskContext) -> std::future::Ready<Result<(), TaskError>> + Send + Sync + 'static
{
    let ran = ran.clone();
    move |_| {
        ran.fetch_add(1, Ordering::Relaxed);
        std::future::ready(Ok(()))
    }
}

/// One drain: enqueue `jobs` no-op tasks the way `mode` says, run one worker until all are
/// completed. Returns (enqueue seconds, process seconds).
async fn drain(
    admin: &PgConnectOptions,
    args: &Args,
    mode: &str,
    jobs: usize,
) -> anyhow::Result<(f64, f64)> {
    let engine = engine(admin, args.concurrency as u32 + 4).await?;
    let enqueue = Instant::now();
    match mode {
        "steps" => {
            let starts = (0..jobs).map(|i| (i, StartOptions::new()));
            engine.start_many("steps", starts).await?;
        }
        _ => {
            engine.start("map", &(0..jobs).collect::<Vec<_>>()).await?;
        }
    }
    let enqueue_s = enqueue.elapsed().as_secs_f64();
    let started = Instant::now();
    let ran = Arc::new(AtomicUsize::new(0));
    let worker = engine
        .worker()
        .concurrency(args.concurrency)
        .handler(mode, "job", counting(&ran))
        .start()
        .await?;
    settle(&engine, &ran, jobs).await?;
    let process_s = started.elapsed().as_secs_f64();
    worker.shutdown().await;
    engine.pool().close().await;
    Ok((enqueue_s, process_s))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

async fn queue(admin: &PgConnectOptions, args: &Args) -> anyhow::Result<()> {
    let modes = ["steps", "map"];
    let mut results: Vec<(Vec<f64>, Vec<f64>)> = vec![(Vec::new(), Vec::new()); modes.len()];
    for round in 0..args.rounds {
        for (m, mode) in modes.iter().enumerate() {
            let (enqueue_s, process_s) = drain(admin, args, mode, args.jobs).await?;
            eprintln!(
                "round {}: {mode}: enqueue {enqueue_s:.3} s, process {process_s:.3} s, {:.0} jobs/s",
                round + 1,
                args.jobs as f64 / process_s
            );
            results[m].0.push(enqueue_s);
            results[m].1.push(process_s);
        }
    }
    println!(
        "\nqueue: {} no-op jobs, median of {} rounds",
        args.jobs, args.rounds
    );
    println!("| workload | enqueue s | process s | jobs/s |");
    println!("|---|---:|---:|---:|");
    for (m, mode) in modes.iter().enumerate() {
        let process = median(results[m].1.clone());
        let what = match *mode {
            "steps" => "N executions of one step (start_many)",
            _ => "one map of width N",
        };
        println!(
            "| {what} | {:.3} | {:.3} | {:.0} |",
            median(results[m].0.clone()),
            process,
            args.jobs as f64 / process
        );
    }
    Ok(())
}

async fn scaling(admin: &PgConnectOptions, args: &Args) -> anyhow::Result<()> {
    let narrow = 1_000;
    let mut per_member = Vec::new();
    for width in [narrow, args.wide] {
        let engine = engine(admin, args.concurrency as u32 + 4).await?;
        engine.start("map", &(0..width).collect::<Vec<_>>()).await?;
        let started = Instant::now();
        let ran = Arc::new(AtomicUsize::new(0));
        let worker = engine
            .worker()
            .concurrency(args.concurrency)
            .handler("map", "job", counting(&ran))
            .start()
            .await?;
        settle(&engine, &ran, width).await?;
        let elapsed = started.elapsed().as_secs_f64();
        worker.shutdown().await;
        // The cost of each tenth, from the members' own acknowledgement times.
        let tenths: Vec<f64> = sqlx::query_scalar(
            "WITH t AS (SELECT finished_at, ntile(10) OVER (ORDER BY finished_at) AS tenth
                          FROM confluo.task_all)
             SELECT extract(epoch FROM max(finished_at) - min(finished_at))::float8
                    / count(*) * 1000
               FROM t GROUP BY tenth ORDER BY tenth",
        )
        .fetch_all(engine.pool())
        .await?;
        engine.pool().close().await;
        let ms = elapsed * 1000.0 / width as f64;
        eprintln!("scaling: width {width}: {elapsed:.2} s, {ms:.3} ms per member");
        per_member.push((width, ms, tenths));
    }
    println!("\nscaling: one map, cost per member (worker start to last completion)");
    println!("| width | ms per member | ratio to width {narrow} | ms per member in each tenth (by completion) |");
    println!("|---:|---:|---:|---|");
    let base = per_member[0].1;
    for (width, ms, tenths) in &per_member {
        let tenths: Vec<String> = tenths.iter().map(|t| format!("{t:.2}")).collect();
        println!(
            "| {width} | {ms:.3} | {:.2}x | {} |",
            ms / base,
            tenths.join(" ")
        );
    }
    Ok(())
}

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("a clock after 1970")
        .as_micros() as u64
}

async fn latency(admin: &PgConnectOptions, args: &Args) -> anyhow::Result<()> {
    let engine = engine(admin, args.concurrency as u32 + 4).await?;
    let last_returned = Arc::new(AtomicU64::new(0));
    let samples: Arc<Mutex<Vec<f64>>> = Arc::default();
    let (l, s) = (last_returned.clone(), samples.clone());
    let mut worker = engine.worker().concurrency(args.concurrency);
    if let Ok(ms) = std::env::var("BENCH_ACK_WINDOW_MS") {
        worker = worker.ack_window(Duration::from_millis(ms.parse()?));
    }
    if let Ok(n) = std::env::var("BENCH_ACK_BATCH") {
        worker = worker.ack_batch(n.parse()?);
    }
    let worker = worker
        .handler("fan", "plan", |t| async move {
            let n: usize = t.input_as()?;
            Ok::<_, TaskError>((0..n).collect::<Vec<_>>())
        })
        .handler("fan", "member", move |_| {
            let l = l.clone();
            async move {
                l.fetch_max(now_us(), Ordering::SeqCst);
                Ok::<_, TaskError>(())
            }
        })
        .handler("fan", "after", move |_| {
            let started = now_us();
            let (l, s) = (last_returned.clone(), s.clone());
            async move {
                let last = l.swap(0, Ordering::SeqCst);
                s.lock()
                    .expect("samples")
                    .push((started.saturating_sub(last)) as f64 / 1000.0);
                Ok::<_, TaskError>(())
            }
        })
        .start()
        .await?;
    let runs: &[(usize, usize)] = if args.quick {
        &[(100, 10), (1_000, 5), (10_000, 2)]
    } else {
        &[(100, 40), (1_000, 20), (10_000, 6)]
    };
    println!("\nfan-in latency: last member's handler returns -> next stage's handler starts");
    println!("| width | runs | p50 ms | p99 ms | max ms |");
    println!("|---:|---:|---:|---:|---:|");
    for &(width, n) in runs {
        samples.lock().expect("samples").clear();
        for _ in 0..n {
            let id = engine.start("fan", &width).await?;
            engine.wait(id, Duration::from_secs(300)).await?;
        }
        let mut v = samples.lock().expect("samples").clone();
        v.sort_by(f64::total_cmp);
        let pick = |q: f64| v[((v.len() as f64 - 1.0) * q).round() as usize];
        println!(
            "| {width} | {} | {:.1} | {:.1} | {:.1} |",
            v.len(),
            pick(0.5),
            pick(0.99),
            v[v.len() - 1]
        );
    }
    worker.shutdown().await;
    engine.pool().close().await;
    Ok(())
}
