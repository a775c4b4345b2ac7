//! Claims while millions of finished tasks pile up: does the history slow the hot path?
//! (Issue 15: "claims stay flat with 10 million finished task rows".)
//!
//! ```sh
//! cargo bench --bench retention                        # 10 million finished tasks, ~40 min
//! cargo bench --bench retention -- --finished 1000000  # a few minutes
//! cargo bench --bench retention -- --finished 1000000 --design archived
//! ```
//!
//! Two designs, each in a database of its own, one after the other in one run:
//! - **kept**: finished tasks stay in the task table (workers told not to archive:
//!   `archive_after(None)`, what every version before migration 0012 did);
//! - **archived**: after each chunk, [`Engine::archive`] moves the ended executions' tasks
//!   into the history (what workers' housekeeping does a minute after they end).
//!
//! Each design writes `--finished` tasks in chunks of `--chunk` (executions of 1 000
//! members: inserted pending, completed by one `UPDATE`, as claims and completions leave
//! them: a dead version per task, dead entries in the indexes of pending tasks), and after
//! each chunk vacuums the task table **where autovacuum's default trigger would**: once
//! the dead versions written since its last vacuum exceed 50 + 20 % of its rows (the
//! server's `autovacuum_vacuum_threshold` and `_scale_factor`; the bench counts the
//! versions its fill and moves leave dead, not those of its probes, and ignores
//! `autovacuum_naptime`). The machines
//! these benches run on turn autovacuum off; this stands in for it, the same way for both
//! designs. After each chunk, a probe: the p50 of claims of 512 over three fresh maps of
//! 5 120.
//!
//! Reported per design: the probe's p50 over the fill as a ratio to the empty table's
//! (at the end, and the worst), the vacuums the trigger asked for and their time, then, at
//! the end, the full measurement: claims of 512 over 20 000 pending tasks (p50, p90), and
//! how fast one worker of 8 no-op handlers drains a 20 000 map. Ratios to the empty table
//! are what to read: the machine's noise is larger than any absolute number here.

use std::str::FromStr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use confluo::{Engine, TaskError, Workflow};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

const PENDING: usize = 20_000;
const PROBE: usize = 5_120;
const CLAIM: usize = 512;
/// Finished tasks per execution in the generated history.
const HISTORY_WIDTH: i64 = 1_000;
/// Autovacuum's default trigger: vacuum once dead versions exceed this plus
/// `SCALE_FACTOR` of the table's rows.
const THRESHOLD: f64 = 50.0;
const SCALE_FACTOR: f64 = 0.2;

#[derive(Clone, Copy, PartialEq)]
enum Design {
    Kept,
    Archived,
}

impl Design {
    fn name(self) -> &'static str {
        match self {
            Design::Kept => "kept",
            Design::Archived => "archived",
        }
    }
}

/// What the bench was asked for.
struct Args {
    finished: i64,
    chunk: i64,
    designs: Vec<Design>,
}

fn main() -> anyhow::Result<()> {
    let mut args = Args {
        finished: 10_000_000,
        chunk: 250_000,
        designs: vec![Design::Kept, Design::Archived],
    };
    let mut it = std::env::args().skip(1);
    let number = |flag: &str, value: Option<String>| -> anyhow::Result<i64> {
        let n: i64 = value
            .with_context(|| format!("{flag} needs a number"))?
            .parse()
            .with_context(|| flag.to_owned())?;
        anyhow::ensure!(n > 0, "{flag} must be positive");
        Ok(n)
    };
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--finished" => args.finished = number("--finished", it.next())?,
            "--chunk" => args.chunk = number("--chunk", it.next())?,
            "--design" => {
                args.designs = match it.next().as_deref() {
                    Some("kept") => vec![Design::Kept],
                    Some("archived") => vec![Design::Archived],
                    Some("both") => vec![Design::Kept, Design::Archived],
                    other => anyhow::bail!("--design kept|archived|both, not {other:?}"),
                }
            }
            "--bench" => {}
            other => anyhow::bail!(
                "unknown argument {other:?}; use --finished N, --chunk N, --design kept|archived|both"
            ),
        }
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
    println!(
        "confluo {}: claims while {} finished tasks pile up, in chunks of {}",
        env!("CARGO_PKG_VERSION"),
        args.finished,
        args.chunk
    );
    let mut reports = Vec::new();
    for &design in &args.designs {
        let database = format!("confluo_bench_retention_{}", design.name());
        let options = confluo_testkit::fresh_database(&server.admin(), &database).await?;
        let pool = PgPoolOptions::new()
            .max_connections(12)
            .test_before_acquire(false)
            .connect_with(confluo::read_committed(options))
            .await?;
        let engine = Engine::new(pool);
        engine.migrate().await?;
        engine.register(&Workflow::new("map", 1).map("job")).await?;
        if reports.is_empty() {
            let (autovacuum, version): (String, String) = sqlx::query_as(
                "SELECT current_setting('autovacuum'), current_setting('server_version')",
            )
            .fetch_one(engine.pool())
            .await?;
            println!("PostgreSQL {version}, autovacuum = {autovacuum} (the bench vacuums at its default trigger)");
        }
        reports.push(fill_and_measure(&engine, design, &args).await?);
        engine.pool().close().await;
    }

    println!("\n| design | claim of {CLAIM} over {PROBE}, p50 ratio at the end | worst over the fill | vacuums (s) | archiving (s) | claim of {CLAIM} over {PENDING}, p50 ratio | p90 ratio | drain of {PENDING}, ratio |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    for r in &reports {
        println!(
            "| {} | {:.2}x | {:.2}x at {} | {} ({:.0}) | {:.0} | {:.2}x | {:.2}x | {:.2}x |",
            r.design.name(),
            r.probes.last().map_or(f64::NAN, |p| p.1),
            r.worst.1,
            r.worst.0,
            r.vacuums,
            r.vacuum_secs,
            r.archive_secs,
            r.end.claim_p50 / r.empty.claim_p50,
            r.end.claim_p90 / r.empty.claim_p90,
            r.end.drain / r.empty.drain,
        );
    }
    for r in &reports {
        println!(
            "\n{} (empty: claim p50 {:.2} ms, p90 {:.2} ms, drain {:.0} tasks/s; at the end: {:.2} / {:.2} ms, {:.0} tasks/s; task table at the end: {} live / {} dead versions by the stats)",
            r.design.name(),
            r.empty.claim_p50,
            r.empty.claim_p90,
            r.empty.drain,
            r.end.claim_p50,
            r.end.claim_p90,
            r.end.drain,
            r.end.live,
            r.end.dead,
        );
        let curve: Vec<String> = r
            .probes
            .iter()
            .map(|(n, ratio)| format!("{n}: {ratio:.2}x"))
            .collect();
        println!("probe p50 ratio by finished tasks: {}", curve.join(", "));
    }
    Ok(())
}

struct Report {
    design: Design,
    empty: Measured,
    end: Measured,
    /// (finished tasks so far, probe p50 / empty probe p50), after each chunk.
    probes: Vec<(i64, f64)>,
    worst: (i64, f64),
    vacuums: usize,
    vacuum_secs: f64,
    archive_secs: f64,
}

async fn fill_and_measure(engine: &Engine, design: Design, args: &Args) -> anyhow::Result<Report> {
    // A first round warms the caches and the pool up; it is not reported.
    measure(engine).await?;
    let empty = measure(engine).await?;
    let empty_probe = probe(engine).await?;
    let (mut vacuums, mut vacuum_secs, mut archive_secs) = (0, 0.0, 0.0);
    let mut probes = Vec::new();
    // The versions left dead in the task table since its last vacuum.
    let mut dead = 0.0_f64;
    let mut done = 0;
    let started = Instant::now();
    while done < args.finished {
        let n = args.chunk.min(args.finished - done);
        fill_history(engine, n).await?;
        done += n;
        // Each task leaves its pending version dead.
        dead += n as f64;
        // The task table's rows (as autovacuum's own analyses keep it informed).
        let mut live = done as f64;
        if design == Design::Archived {
            let archiving = Instant::now();
            let moved = engine.archive(Duration::ZERO, 1_000).await?;
            archive_secs += archiving.elapsed().as_secs_f64();
            // And its completed version, once moved out.
            dead += moved.tasks as f64;
            live = 0.0;
        }
        if dead > THRESHOLD + SCALE_FACTOR * live {
            let vacuuming = Instant::now();
            sqlx::query("VACUUM (ANALYZE) confluo.task")
                .execute(engine.pool())
                .await?;
            vacuum_secs += vacuuming.elapsed().as_secs_f64();
            vacuums += 1;
            dead = 0.0;
        }
        let p50 = probe(engine).await?;
        probes.push((done, p50 / empty_probe));
        eprintln!(
            "{}: {done} finished after {:.0} s, probe p50 {p50:.2} ms ({:.2}x), {vacuums} vacuums",
            design.name(),
            started.elapsed().as_secs_f64(),
            p50 / empty_probe
        );
    }
    let end = measure(engine).await?;
    let worst = probes
        .iter()
        .copied()
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .unwrap_or((0, f64::NAN));
    Ok(Report {
        design,
        empty,
        end,
        probes,
        worst,
        vacuums,
        vacuum_secs,
        archive_secs,
    })
}

#[derive(Clone, Copy)]
struct Measured {
    /// Dead and live row versions of the task table when the measurement began, as the
    /// statistics collector last heard.
    dead: i64,
    live: i64,
    claim_p50: f64,
    claim_p90: f64,
    drain: f64,
}

/// Claims of CLAIM over a fresh map of `width`, until none is left: their times in ms,
/// sorted. The map is cancelled and its claimed tasks ended afterwards, so that no lease
/// of theirs expires into a later measurement.
async fn claim_round(engine: &Engine, width: usize) -> anyhow::Result<Vec<f64>> {
    let map = engine.start("map", &(0..width).collect::<Vec<_>>()).await?;
    let mut times = Vec::new();
    loop {
        let started = Instant::now();
        let tasks = engine
            .claim("bench", CLAIM, Duration::from_secs(600))
            .await?;
        if tasks.is_empty() {
            break;
        }
        times.push(started.elapsed().as_secs_f64() * 1000.0);
    }
    engine.cancel(map).await?;
    sqlx::query(
        "UPDATE confluo.task SET status = 'cancelled', lease_expires_at = NULL, finished_at = now()
          WHERE execution_id = $1 AND status = 'running'",
    )
    .bind(map)
    .execute(engine.pool())
    .await?;
    times.sort_by(f64::total_cmp);
    Ok(times)
}

fn quantile(times: &[f64], q: f64) -> f64 {
    times[((times.len() - 1) as f64 * q).round() as usize]
}

/// The p50 of three claim rounds over PROBE pending tasks each (30 claims).
async fn probe(engine: &Engine) -> anyhow::Result<f64> {
    let mut times = Vec::new();
    for _ in 0..3 {
        times.extend(claim_round(engine, PROBE).await?);
    }
    times.sort_by(f64::total_cmp);
    Ok(quantile(&times, 0.5))
}

async fn measure(engine: &Engine) -> anyhow::Result<Measured> {
    let (dead, live): (i64, i64) = sqlx::query_as(
        "SELECT n_dead_tup, n_live_tup FROM pg_stat_user_tables
          WHERE schemaname = 'confluo' AND relname = 'task'",
    )
    .fetch_one(engine.pool())
    .await?;
    let times = claim_round(engine, PENDING).await?;

    // A drain by a worker (that archives nothing: the design is the bench's to apply).
    let ran = Arc::new(AtomicUsize::new(0));
    let counted = ran.clone();
    let id = engine
        .start("map", &(0..PENDING).collect::<Vec<_>>())
        .await?;
    let started = Instant::now();
    let worker = engine
        .worker()
        .concurrency(8)
        .archive_after(None)
        .handler("map", "job", move |_| {
            counted.fetch_add(1, Ordering::Relaxed);
            std::future::ready(Ok::<_, TaskError>(()))
        })
        .start()
        .await?;
    engine.wait(id, Duration::from_secs(600)).await?;
    let drain = PENDING as f64 / started.elapsed().as_secs_f64();
    worker.shutdown().await;
    anyhow::ensure!(
        ran.load(Ordering::Relaxed) >= PENDING,
        "the drain ran too few"
    );
    Ok(Measured {
        dead,
        live,
        claim_p50: quantile(&times, 0.5),
        claim_p90: quantile(&times, 0.9),
        drain,
    })
}

/// Writes `finished` completed tasks (executions of HISTORY_WIDTH members each, completed
/// too) in chunks: inserted pending, then completed by an `UPDATE`, as the engine's own
/// claims and completions leave them before a vacuum (a dead version per task, dead
/// entries in the partial indexes of pending tasks).
async fn fill_history(engine: &Engine, finished: i64) -> anyhow::Result<()> {
    const CHUNK: i64 = 500_000;
    let mut done = 0;
    while done < finished {
        let n = CHUNK.min(finished - done);
        let executions = (n + HISTORY_WIDTH - 1) / HISTORY_WIDTH;
        sqlx::raw_sql(&format!(
            "BEGIN;
             CREATE TEMP TABLE hist ON COMMIT DROP AS
                SELECT gen_random_uuid() AS execution_id, gen_random_uuid() AS group_id
                  FROM generate_series(1, {executions});
             INSERT INTO confluo.execution (id, workflow_name, workflow_version, status, input,
                                            current_stage, finished_at)
                SELECT execution_id, 'map', 1, 'completed', '[]'::jsonb, 1, now() FROM hist;
             INSERT INTO confluo.stage_group (id, execution_id, stage_index, stage_name, kind,
                                              width, remaining, fired_at)
                SELECT group_id, execution_id, 0, 'job', 'map', {HISTORY_WIDTH}, 0, now() FROM hist;
             INSERT INTO confluo.task (id, execution_id, group_id, workflow_name, workflow_version,
                                       stage_index, handler, item_index, input, max_attempts,
                                       backoff_base_ms, backoff_max_ms, backoff_jitter, timeout_ms)
                SELECT gen_random_uuid(), h.execution_id, h.group_id, 'map', 1, 0, 'job', i,
                       to_jsonb(i), 3, 1000, 60000, 0.2, 300000
                  FROM hist h, generate_series(0, {HISTORY_WIDTH} - 1) AS i
                 LIMIT {n};
             UPDATE confluo.task t
                SET status = 'completed', attempt = 1, output = 'null'::jsonb,
                    lease_token = gen_random_uuid(), started_at = now(), finished_at = now()
               FROM hist h WHERE t.execution_id = h.execution_id;
             COMMIT;"
        ))
        .execute(engine.pool())
        .await?;
        done += n;
    }
    Ok(())
}
