//! Claims with many finished tasks present: does the task table's history slow the hot
//! path? (Issue 15: "claims stay flat with 10 million finished task rows".)
//!
//! ```sh
//! cargo bench --bench retention                       # 10 million finished rows, ~20 min
//! cargo bench --bench retention -- --finished 1000000 # about 2 minutes
//! cargo bench --bench retention -- --finished 1000000 --settle 90
//! ```
//!
//! States of one database, measured one after the other in one run:
//! 1. **empty**: no finished task (after a first round that warms caches up, not shown);
//! 2. **finished, not vacuumed by hand**: `--finished` tasks inserted pending and then
//!    completed by bulk `UPDATE`s, with autovacuum at the server's settings meanwhile, as
//!    a busy installation's history looks (each completion leaves a dead version, and dead
//!    entries in the indexes of pending tasks that claims walk, until a vacuum reaches
//!    them); the table's live and dead row versions are printed;
//! 3. with `--settle S`: **S seconds later**, after what autovacuum did meanwhile (if the
//!    server runs it: the bench prints the setting);
//! 4. **finished, vacuumed**: the same after `VACUUM (ANALYZE)`.
//!
//! In each: 20 000 pending tasks of one map; the p50 and p90 of `Engine::claim` of 512 over
//! them (the claim statement alone, nothing run or acknowledged), then, on a fresh map of
//! 20 000, how fast one worker of 8 no-op handlers drains it (its claims by handler,
//! batched acknowledgements, the fan-in). Ratios to the empty table are what to read:
//! the machine's noise is larger than any absolute number here.

use std::str::FromStr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use confluo::{Engine, TaskError, Workflow};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

const DATABASE: &str = "confluo_bench_retention";
const PENDING: usize = 20_000;
const CLAIM: usize = 512;
/// Finished tasks per execution in the generated history.
const HISTORY_WIDTH: i64 = 1_000;

/// What the bench was asked for.
struct Args {
    finished: i64,
    /// Seconds to leave autovacuum after the history is written, before a third state.
    settle: u64,
}

fn main() -> anyhow::Result<()> {
    let mut finished: i64 = 10_000_000;
    let mut settle = 0;
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--finished" => {
                finished = it
                    .next()
                    .context("--finished needs a number")?
                    .parse()
                    .context("--finished")?
            }
            "--settle" => {
                settle = it
                    .next()
                    .context("--settle needs a number of seconds")?
                    .parse()
                    .context("--settle")?
            }
            "--bench" => {}
            other => {
                anyhow::bail!("unknown argument {other:?}; use --finished N, --settle SECONDS")
            }
        }
    }
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(run(Args { finished, settle }))
}

async fn run(args: Args) -> anyhow::Result<()> {
    let finished = args.finished;
    let configured = match std::env::var("DATABASE_URL") {
        Ok(url) => Some(PgConnectOptions::from_str(&url).context("DATABASE_URL")?),
        Err(_) => None,
    };
    let server = confluo_testkit::Server::pick(configured.as_ref()).await?;
    let options = confluo_testkit::fresh_database(&server.admin(), DATABASE).await?;
    let pool = PgPoolOptions::new()
        .max_connections(12)
        .test_before_acquire(false)
        .connect_with(confluo::read_committed(options))
        .await?;
    let engine = Engine::new(pool);
    engine.migrate().await?;
    engine.register(&Workflow::new("map", 1).map("job")).await?;
    println!(
        "confluo {}: claims and drains with finished tasks present",
        env!("CARGO_PKG_VERSION")
    );
    let autovacuum: String = sqlx::query_scalar("SHOW autovacuum")
        .fetch_one(engine.pool())
        .await?;
    println!("autovacuum = {autovacuum} on this server");

    // A first round warms the caches and the pool up; it is not reported.
    measure(&engine).await?;
    let mut rows = Vec::new();
    rows.push(("empty".to_owned(), measure(&engine).await?));
    let filling = Instant::now();
    fill_history(&engine, finished).await?;
    eprintln!(
        "{finished} finished tasks written in {:.0} s",
        filling.elapsed().as_secs_f64()
    );
    rows.push((
        format!("{finished} finished, not vacuumed by hand"),
        measure(&engine).await?,
    ));
    if args.settle > 0 {
        tokio::time::sleep(Duration::from_secs(args.settle)).await;
        rows.push((
            format!("{finished} finished, {} s of autovacuum later", args.settle),
            measure(&engine).await?,
        ));
    }
    let vacuuming = Instant::now();
    sqlx::query("VACUUM (ANALYZE) confluo.task")
        .execute(engine.pool())
        .await?;
    eprintln!("vacuumed in {:.0} s", vacuuming.elapsed().as_secs_f64());
    rows.push((
        format!("{finished} finished, vacuumed"),
        measure(&engine).await?,
    ));

    let base = rows[0].1;
    println!("\n| task table | live / dead row versions | claim of {CLAIM}, p50 ms | p90 ms | ratio (p50) | drain of {PENDING}, tasks/s | ratio |");
    println!("|---|---:|---:|---:|---:|---:|---:|");
    for (name, m) in &rows {
        println!(
            "| {name} | {} / {} | {:.2} | {:.2} | {:.2}x | {:.0} | {:.2}x |",
            m.live,
            m.dead,
            m.claim_p50,
            m.claim_p90,
            m.claim_p50 / base.claim_p50,
            m.drain,
            m.drain / base.drain
        );
    }
    engine.pool().close().await;
    Ok(())
}

#[derive(Clone, Copy)]
struct Measured {
    /// Dead and live row versions of the task table when the measurement began.
    dead: i64,
    live: i64,
    claim_p50: f64,
    claim_p90: f64,
    drain: f64,
}

async fn measure(engine: &Engine) -> anyhow::Result<Measured> {
    let (dead, live): (i64, i64) = sqlx::query_as(
        "SELECT n_dead_tup, n_live_tup FROM pg_stat_user_tables
          WHERE schemaname = 'confluo' AND relname = 'task'",
    )
    .fetch_one(engine.pool())
    .await?;
    // Claims alone: a map of PENDING, claimed CLAIM at a time until none is left; then
    // its execution is cancelled and the claimed tasks ended, so that no lease of theirs
    // expires into a later measurement.
    let claimed_map = engine
        .start("map", &(0..PENDING).collect::<Vec<_>>())
        .await?;
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
    engine.cancel(claimed_map).await?;
    sqlx::query(
        "UPDATE confluo.task SET status = 'cancelled', lease_expires_at = NULL, finished_at = now()
          WHERE execution_id = $1 AND status = 'running'",
    )
    .bind(claimed_map)
    .execute(engine.pool())
    .await?;
    times.sort_by(f64::total_cmp);
    let pick = |q: f64| times[((times.len() - 1) as f64 * q).round() as usize];

    // A drain by a worker.
    let ran = Arc::new(AtomicUsize::new(0));
    let counted = ran.clone();
    let id = engine
        .start("map", &(0..PENDING).collect::<Vec<_>>())
        .await?;
    let started = Instant::now();
    let worker = engine
        .worker()
        .concurrency(8)
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
        claim_p50: pick(0.5),
        claim_p90: pick(0.9),
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
