//! `confluo stress`: many wide executions run by several workers (tasks or processes)
//! under injected faults, then the invariants checked in the database.

mod chaos;
mod check;
mod handlers;

use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use confluo::{Engine, FanInStrategy, Notifications, WorkerBuilder};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;

use handlers::{Context, HandlerFaults};

/// The application name of worker connections: the connection killer aims at these only.
const WORKER_APPLICATION: &str = "confluo-stress-worker";

#[derive(clap::Args)]
pub struct Args {
    /// Executions to run.
    #[arg(long, default_value_t = 200)]
    executions: usize,
    /// Width of each execution's map.
    #[arg(long, default_value_t = 1_000)]
    width: usize,
    /// The map fires once this many of its members completed (`Join::AtLeast`; with
    /// `1`, as `Join::Any`), cancelling the rest, and fails its execution once that is
    /// out of reach; 0: once every member is terminal (`Join::All`).
    #[arg(long, default_value_t = 0)]
    quorum: u32,
    /// Worker tasks in this process, each with a pool of its own (ignored with --processes).
    #[arg(long, default_value_t = 4)]
    workers: usize,
    /// Worker processes to spawn instead of in-process workers.
    #[arg(long, default_value_t = 0)]
    processes: usize,
    /// Fan-in strategy: countdown, striped or row_lock.
    #[arg(long, default_value = "countdown")]
    strategy: FanInStrategy,
    /// Database (created afresh on the server, dropped at the start of the next run).
    #[arg(long, default_value = "confluo_stress")]
    database: String,
    #[command(flatten)]
    faults: HandlerFaults,
    /// Completions replayed per second by a rogue client (each must change nothing).
    #[arg(long, default_value_t = 0.0)]
    replays_per_second: f64,
    /// Zombie completions per second: after the lease was reclaimed (each must change nothing).
    #[arg(long, default_value_t = 0.0)]
    zombies_per_second: f64,
    /// Running executions cancelled per second by an operator, at any moment of their run.
    #[arg(long, default_value_t = 0.0)]
    cancels_per_second: f64,
    /// Share of executions started with a deadline (1 to 20 s, drawn per execution): those
    /// still running past it are timed out by the workers' sweep.
    #[arg(long, default_value_t = 0.0)]
    deadline_rate: f64,
    /// Terminate a random worker connection this often, in milliseconds (0: never).
    #[arg(long, default_value_t = 0)]
    kill_connection_every_ms: u64,
    /// SIGKILL a random worker process this often, in milliseconds, and start another
    /// (0: never; needs --processes).
    #[arg(long, default_value_t = 0)]
    kill_worker_every_ms: u64,
    /// Every fault on, at moderate rates (explicit flags still apply on top).
    #[arg(long)]
    all_faults: bool,
    /// Seed of the injected faults.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Give up waiting for the executions after this many seconds (then check anyway).
    #[arg(long, default_value_t = 900)]
    timeout: u64,
    /// Lease of worker attempts, in milliseconds (short: killed workers' tasks come back soon).
    #[arg(long, default_value_t = 3_000)]
    lease_ms: u64,
    /// Workers' acknowledgement window in milliseconds (0: every ending acknowledged on
    /// its own); the library's default when not given.
    #[arg(long)]
    ack_window_ms: Option<u64>,
    /// Connections in each worker's pool.
    #[arg(long, default_value_t = 4)]
    worker_connections: u32,
    /// Workers open no `LISTEN` connection (`Notifications::Off`): each uses its pool
    /// only, and polls every 500 ms.
    #[arg(long)]
    no_listen: bool,
    /// The workers' pools go through this PgBouncer in transaction mode (its URL; the
    /// run's database name replaces the URL's), as `ConnectBuilder::transaction_pooler`
    /// says; their `LISTEN`, unless --no-listen, goes to the server directly. The harness
    /// and its chaos clients connect directly.
    #[arg(long, env = "CONFLUO_STRESS_PGBOUNCER", value_name = "URL")]
    through_pgbouncer: Option<String>,
}

/// The environment variable that hands worker processes the PgBouncer URL.
const PGBOUNCER_ENV: &str = "CONFLUO_STRESS_PGBOUNCER";

/// A worker process of a stress run.
#[derive(clap::Args)]
pub struct WorkerArgs {
    /// The handler faults and seed, as JSON.
    #[arg(long)]
    config: String,
}

#[derive(serde::Serialize, serde::Deserialize)]
struct WorkerConfig {
    database: String,
    faults: HandlerFaults,
    seed: u64,
    lease_ms: u64,
    ack_window_ms: Option<u64>,
    worker_connections: u32,
    no_listen: bool,
}

/// Where a worker's pool connects: the run's database directly, or through PgBouncer.
#[derive(Clone)]
struct WorkerTarget {
    direct: PgConnectOptions,
    pgbouncer: Option<PgConnectOptions>,
}

impl WorkerTarget {
    fn new(direct: &PgConnectOptions, pgbouncer: Option<&str>) -> anyhow::Result<Self> {
        let pgbouncer = match pgbouncer {
            None => None,
            Some(url) => Some(
                url.parse::<PgConnectOptions>()
                    .map_err(|e| anyhow::anyhow!("--through-pgbouncer: {e}"))?
                    .database(direct.get_database().unwrap_or("postgres")),
            ),
        };
        Ok(WorkerTarget {
            direct: direct.clone(),
            pgbouncer,
        })
    }

    /// A worker's pool and its engine, and the pool for the handlers' own writes (the same).
    async fn engine(&self, connections: u32) -> anyhow::Result<(Engine, PgPool)> {
        Ok(match &self.pgbouncer {
            None => {
                let pool = pool(&self.direct, connections, WORKER_APPLICATION).await?;
                (Engine::new(pool.clone()), pool)
            }
            Some(bouncer) => {
                // PgBouncer refuses the isolation startup option; every statement pins it.
                let pool = PgPoolOptions::new()
                    .max_connections(connections)
                    .acquire_timeout(Duration::from_secs(60))
                    .connect_with(bouncer.clone().application_name(WORKER_APPLICATION))
                    .await?;
                let engine = Engine::builder(pool.clone()).transaction_pooler().build();
                (engine, pool)
            }
        })
    }

    /// How a worker hears of new tasks: not at all, on a connection like its pool's, or,
    /// through PgBouncer, on a direct one.
    fn notifications(&self, no_listen: bool) -> Notifications {
        match (&self.pgbouncer, no_listen) {
            (_, true) => Notifications::Off,
            (None, false) => Notifications::Pool,
            (Some(_), false) => Notifications::Direct(Box::new(confluo::read_committed(
                self.direct.clone().application_name(WORKER_APPLICATION),
            ))),
        }
    }
}

/// The stress runs' worker: 16 handlers, a short lease, the acknowledgement window asked
/// for, listening for new tasks unless `no_listen`, and no auditor's rounds: a stall must
/// show in the run's own checks, not be moved on quietly.
fn worker_builder(
    engine: Engine,
    notifications: Notifications,
    lease: Duration,
    ack_window_ms: Option<u64>,
) -> WorkerBuilder {
    let builder = engine
        .worker()
        .audit_every(None)
        .concurrency(16)
        .lease(lease)
        .poll_interval(Duration::from_millis(500))
        .notifications(notifications);
    match ack_window_ms {
        Some(ms) => builder.ack_window(Duration::from_millis(ms)),
        None => builder,
    }
}

impl Args {
    fn apply_all_faults(&mut self) {
        if !self.all_faults {
            return;
        }
        let f = &mut self.faults;
        let or = |v: &mut f64, d: f64| {
            if *v == 0.0 {
                *v = d
            }
        };
        or(&mut f.error_rate, 0.05);
        or(&mut f.exhaust_rate, 0.002);
        or(&mut f.panic_rate, 0.01);
        or(&mut f.hang_rate, 0.001);
        or(&mut self.replays_per_second, 20.0);
        or(&mut self.zombies_per_second, 5.0);
        or(&mut self.cancels_per_second, 0.5);
        or(&mut self.deadline_rate, 0.05);
        if self.kill_connection_every_ms == 0 {
            self.kill_connection_every_ms = 1_500;
        }
        if self.kill_worker_every_ms == 0 && self.processes > 0 {
            self.kill_worker_every_ms = 4_000;
        }
    }
}

async fn pool(
    options: &PgConnectOptions,
    connections: u32,
    application: &str,
) -> anyhow::Result<PgPool> {
    Ok(PgPoolOptions::new()
        .max_connections(connections)
        .acquire_timeout(Duration::from_secs(60))
        .connect_with(confluo::read_committed(
            options.clone().application_name(application),
        ))
        .await?)
}

/// Drops and creates the run's database, migrates it, and creates the harness's tables.
async fn fresh_database(
    server: &PgConnectOptions,
    name: &str,
    quorum: u32,
) -> anyhow::Result<PgConnectOptions> {
    let options = confluo_testkit::fresh_database(server, name).await?;
    let engine = Engine::new(pool(&options, 2, "confluo-stress").await?);
    engine.migrate().await?;
    sqlx::raw_sql(
        "CREATE SCHEMA confluo_stress;
         CREATE TABLE confluo_stress.fault (kind text NOT NULL, at timestamptz NOT NULL DEFAULT now());
         CREATE TABLE confluo_stress.started (
             execution_id uuid NOT NULL, stage_index int NOT NULL, task_id uuid NOT NULL,
             PRIMARY KEY (execution_id, stage_index, task_id));
         CREATE TABLE confluo_stress.seen (
             execution_id uuid NOT NULL, handler text NOT NULL, outputs bigint NOT NULL,
             total bigint NOT NULL, failed bigint NOT NULL);",
    )
    .execute(engine.pool())
    .await?;
    engine.register(&handlers::audit_workflow()).await?;
    engine.register(&handlers::workflow(quorum)).await?;
    Ok(options)
}

/// Runs the stress test against the server of `server` (`url` is the same, for worker
/// processes).
pub async fn run(server: PgConnectOptions, url: &str, mut args: Args) -> anyhow::Result<ExitCode> {
    args.apply_all_faults();
    handlers::silence_injected_panics();
    if args.quorum as usize > args.width {
        anyhow::bail!(
            "--quorum {} asks for more successes than a map of --width {} has members: every \
             execution would fail; give at most the width",
            args.quorum,
            args.width
        );
    }
    let options = fresh_database(&server, &args.database, args.quorum).await?;
    let main = pool(&options, 6, "confluo-stress").await?;
    let engine = Engine::builder(main.clone()).fan_in(args.strategy).build();
    let ctx = Context {
        pool: main.clone(),
        faults: args.faults.clone(),
        seed: args.seed,
    };
    let target = WorkerTarget::new(&options, args.through_pgbouncer.as_deref())?;
    println!(
        "stress: {} executions x width {}, strategy {}, {} on database {}{}",
        args.executions,
        args.width,
        args.strategy,
        if args.processes > 0 {
            format!("{} worker processes", args.processes)
        } else {
            format!("{} worker tasks", args.workers)
        },
        args.database,
        if target.pgbouncer.is_some() {
            ", workers through PgBouncer"
        } else {
            ""
        }
    );

    // Workers.
    let lease = Duration::from_millis(args.lease_ms);
    let mut in_process = Vec::new();
    let mut processes = None;
    if args.processes > 0 {
        let config = serde_json::to_string(&WorkerConfig {
            database: args.database.clone(),
            faults: args.faults.clone(),
            seed: args.seed,
            lease_ms: args.lease_ms,
            ack_window_ms: args.ack_window_ms,
            worker_connections: args.worker_connections,
            no_listen: args.no_listen,
        })?;
        // The URL (password included) goes through the environment: a command line is
        // visible to every local user in `ps`.
        let mut env = vec![("DATABASE_URL", url.to_owned())];
        if let Some(bouncer) = &args.through_pgbouncer {
            env.push((PGBOUNCER_ENV, bouncer.clone()));
        }
        processes = Some(chaos::Processes::spawn(
            args.processes,
            env,
            vec!["stress-worker".into(), "--config".into(), config],
        )?);
    } else {
        for _ in 0..args.workers {
            let (worker_engine, worker_pool) = target.engine(args.worker_connections).await?;
            let worker_ctx = Context {
                pool: worker_pool,
                ..ctx.clone()
            };
            let builder = worker_builder(
                worker_engine,
                target.notifications(args.no_listen),
                lease,
                args.ack_window_ms,
            );
            in_process.push(worker_ctx.install(builder).start().await?);
        }
    }

    // Chaos.
    let stop = Arc::new(AtomicBool::new(false));
    let seen = Arc::new(chaos::Seen::default());
    let mut chaos_tasks = Vec::new();
    if args.replays_per_second > 0.0 {
        let e = Engine::new(pool(&options, 2, "confluo-stress-rogue").await?);
        chaos_tasks.push(tokio::spawn(chaos::replays(
            ctx.clone(),
            e,
            args.replays_per_second,
            stop.clone(),
            seen.clone(),
        )));
    }
    if args.zombies_per_second > 0.0 {
        let e = Engine::new(pool(&options, 2, "confluo-stress-rogue").await?);
        chaos_tasks.push(tokio::spawn(chaos::zombies(
            ctx.clone(),
            e,
            args.zombies_per_second,
            stop.clone(),
            seen.clone(),
        )));
    }
    if args.cancels_per_second > 0.0 {
        let e = Engine::new(pool(&options, 2, "confluo-stress-operator").await?);
        chaos_tasks.push(tokio::spawn(chaos::cancels(
            e,
            args.cancels_per_second,
            stop.clone(),
            seen.clone(),
        )));
    }
    // Not a fault: the workflow waits for approvals, and this sends them.
    {
        let e = Engine::new(pool(&options, 2, "confluo-stress-approver").await?);
        chaos_tasks.push(tokio::spawn(chaos::signals(e, stop.clone(), seen.clone())));
    }
    if args.kill_connection_every_ms > 0 {
        let every = Duration::from_millis(args.kill_connection_every_ms);
        chaos_tasks.push(tokio::spawn(chaos::kill_connections(
            engine.clone(),
            every,
            stop.clone(),
            seen.clone(),
        )));
    }

    // Executions.
    let started = Instant::now();
    let mut ids = Vec::with_capacity(args.executions);
    for i in 0..args.executions {
        // Deterministic per seed: the same executions get the same deadlines.
        let draw = |salt: u64| {
            // splitmix64 of (seed, salt, i): independent uniform draws in [0, 1).
            let mut x = args
                .seed
                .wrapping_add(salt.wrapping_mul(0xD1B5_4A32_D192_ED03))
                .wrapping_add((i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
            x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            x ^= x >> 31;
            (x >> 11) as f64 / (1u64 << 53) as f64
        };
        let mut options = confluo::StartOptions::new();
        if draw(1) < args.deadline_rate {
            options = options.deadline(Duration::from_millis(1_000 + (draw(2) * 19_000.0) as u64));
        }
        ids.push(
            engine
                .start_with(handlers::WORKFLOW, &json!({"width": args.width}), options)
                .await?
                .id,
        );
    }
    let bar = ProgressBar::new(args.executions as u64).with_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} executions {msg}")?
            .progress_chars("=> "),
    );
    let deadline = started + Duration::from_secs(args.timeout);
    let mut next_kill = Instant::now() + Duration::from_millis(args.kill_worker_every_ms.max(1));
    let mut kills = 0usize;
    let mut crashes = Vec::new();
    let mut peak = 0i64;
    loop {
        let (terminal, open, connections): (i64, i64, i64) = sqlx::query_as(
            "SELECT (SELECT count(*) FROM confluo.execution
                      WHERE status <> 'running' AND parent_execution IS NULL),
                    (SELECT count(*) FROM confluo.task_all WHERE status IN ('pending', 'running')),
                    (SELECT count(*) FROM pg_stat_activity
                      WHERE backend_type = 'client backend' AND datname = current_database())",
        )
        .fetch_one(&main)
        .await?;
        peak = peak.max(connections);
        bar.set_position(terminal as u64);
        bar.set_message(format!("{open} tasks open"));
        if (terminal as usize >= args.executions && open == 0) || Instant::now() > deadline {
            break;
        }
        if let Some(p) = processes.as_mut() {
            if let Some(crash) = p.crashed() {
                crashes.push(crash);
            }
            if args.kill_worker_every_ms > 0 && Instant::now() >= next_kill {
                p.kill_one(kills * 7 + 3).await?;
                kills += 1;
                seen.killed_workers
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                next_kill = Instant::now() + Duration::from_millis(args.kill_worker_every_ms);
            }
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let elapsed = started.elapsed();
    bar.finish_and_clear();
    stop.store(true, Ordering::Relaxed);
    for t in chaos_tasks {
        let _ = t.await;
    }
    for w in in_process {
        w.shutdown().await;
    }
    if let Some(p) = processes {
        p.stop().await;
    }

    let checks = check::all(&main, args.width).await?;
    let mut violations: Vec<String> = seen.violations.lock().unwrap().clone();
    violations.extend(crashes);
    print!("{}", summary(&main, &args, elapsed, &seen).await?);
    let max_connections: String = sqlx::query_scalar("SHOW max_connections")
        .fetch_one(&main)
        .await?;
    println!(
        "  {:<28} {peak} to this database, of max_connections {max_connections} (sampled every 250 ms)",
        "server connections, peak"
    );
    println!("\ninvariants:");
    for c in &checks {
        println!(
            "  [{}] {}",
            if c.failures.is_empty() {
                "ok"
            } else {
                "VIOLATED"
            },
            c.name
        );
        for f in &c.failures {
            println!("        {f}");
        }
    }
    for v in &violations {
        println!("  [VIOLATED] {v}");
    }
    let failed = checks.iter().any(|c| !c.failures.is_empty()) || !violations.is_empty();
    println!(
        "\n{}",
        if failed {
            "FAILED: invariants violated"
        } else {
            "PASSED: every invariant holds"
        }
    );
    Ok(if failed {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}

async fn summary(
    pool: &PgPool,
    args: &Args,
    elapsed: Duration,
    seen: &chaos::Seen,
) -> anyhow::Result<String> {
    let counts = |parents: bool| {
        sqlx::query_as::<_, (i64, i64, i64, i64, i64)>(
            "SELECT count(*), count(*) FILTER (WHERE status = 'completed'),
                    count(*) FILTER (WHERE status = 'failed'),
                    count(*) FILTER (WHERE status = 'cancelled'),
                    count(*) FILTER (WHERE status = 'timed_out')
               FROM confluo.execution WHERE (parent_execution IS NULL) = $1",
        )
        .bind(parents)
        .fetch_one(pool)
    };
    let outcomes = |(n, completed, failed, cancelled, timed_out): (i64, i64, i64, i64, i64)| {
        format!(
            "{n} ({completed} completed, {failed} failed, {cancelled} cancelled, {timed_out} timed out)"
        )
    };
    let executions = outcomes(counts(true).await?);
    let children = outcomes(counts(false).await?);
    let (deadlines, tasks, retries, dead, fired): (i64, i64, i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM confluo.execution WHERE deadline_at IS NOT NULL),
                (SELECT count(*) FROM confluo.task_all),
                (SELECT COALESCE(sum(greatest(attempt - 1, 0)), 0)::bigint FROM confluo.task_all),
                (SELECT count(*) FROM confluo.task_all WHERE status = 'dead'),
                (SELECT count(*) FROM confluo.stage_group WHERE fired_at IS NOT NULL)",
    )
    .fetch_one(pool)
    .await?;
    let faults: Vec<(String, i64)> = sqlx::query_as(
        "SELECT kind, count(*) FROM confluo_stress.fault GROUP BY kind ORDER BY kind",
    )
    .fetch_all(pool)
    .await?;
    let mut out = String::from("\nsummary\n");
    let mut line = |k: &str, v: String| out += &format!("  {k:<28} {v}\n");
    line("strategy", args.strategy.to_string());
    line("executions", executions);
    line("child executions (audits)", children);
    line("tasks", tasks.to_string());
    line("retries (extra attempts)", retries.to_string());
    line("dead letters", dead.to_string());
    line("groups fired", fired.to_string());
    line("elapsed", format!("{:.1} s", elapsed.as_secs_f64()));
    line(
        "throughput",
        format!("{:.0} tasks/s", tasks as f64 / elapsed.as_secs_f64()),
    );
    line("faults injected:", String::new());
    for (kind, n) in faults {
        line(&format!("  {kind}"), n.to_string());
    }
    line(
        "  executions cancelled",
        seen.cancelled.load(Ordering::Relaxed).to_string(),
    );
    line(
        "  child executions cancelled",
        seen.children_cancelled.load(Ordering::Relaxed).to_string(),
    );
    line("  deadlines set", deadlines.to_string());
    line(
        "  signals received / kept",
        format!(
            "{} / {}",
            seen.signals_received.load(Ordering::Relaxed),
            seen.signals_kept.load(Ordering::Relaxed)
        ),
    );
    line(
        "  connection killed",
        seen.killed_connections.load(Ordering::Relaxed).to_string(),
    );
    line(
        "  worker process killed",
        seen.killed_workers.load(Ordering::Relaxed).to_string(),
    );
    Ok(out)
}

/// A worker process: the stress handlers until killed.
pub async fn worker_process(
    options: PgConnectOptions,
    args: WorkerArgs,
) -> anyhow::Result<ExitCode> {
    let config: WorkerConfig = serde_json::from_str(&args.config)?;
    handlers::silence_injected_panics();
    let options = options.database(&config.database);
    let bouncer = std::env::var(PGBOUNCER_ENV).ok();
    let target = WorkerTarget::new(&options, bouncer.as_deref())?;
    let (engine, worker_pool) = target.engine(config.worker_connections).await?;
    let ctx = Context {
        pool: worker_pool,
        faults: config.faults,
        seed: config.seed,
    };
    let builder = worker_builder(
        engine,
        target.notifications(config.no_listen),
        Duration::from_millis(config.lease_ms),
        config.ack_window_ms,
    );
    let worker = ctx.install(builder).start().await?;
    tokio::signal::ctrl_c().await?;
    worker.shutdown().await;
    Ok(ExitCode::SUCCESS)
}
