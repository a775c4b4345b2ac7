//! One scenario: a block of `width` members completed by `finishers` connections at once,
//! repeated for a few blocks, under one strategy or the no-fan-in floor.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use confluo::{ClaimedTask, Engine, ExecutionId, FanInStrategy, Outcome};
use hdrhistogram::Histogram;
use serde::Serialize;
use serde_json::json;
use sqlx::PgPool;
use tokio::sync::Barrier;

/// What completes the members.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// The same task rows completed by the same connections with no fan-in at all.
    Floor,
    Strategy(FanInStrategy),
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Mode::Floor => f.write_str("floor"),
            Mode::Strategy(s) => write!(f, "{s}"),
        }
    }
}

impl Mode {
    pub fn parse(s: &str) -> anyhow::Result<Mode> {
        match s {
            "floor" => Ok(Mode::Floor),
            other => Ok(Mode::Strategy(other.parse()?)),
        }
    }

    /// The workflow this mode's blocks run: a map decided by the strategy, then a step.
    pub fn workflow(self) -> confluo::Workflow {
        let strategy = match self {
            Mode::Floor => FanInStrategy::Countdown, // its members are never acknowledged through it
            Mode::Strategy(s) => s,
        };
        confluo::Workflow::new(format!("bench-{self}"), 1)
            .stage(confluo::Stage::map("member").fan_in(strategy))
            .step("after")
    }
}

/// Shared by all scenarios: when the step after each block started on the worker.
pub type Started = Arc<Mutex<HashMap<ExecutionId, Instant>>>;

#[derive(Clone, Debug, Serialize)]
pub struct Result {
    pub mode: Mode,
    pub width: usize,
    pub finishers: usize,
    /// Completions acknowledged per transaction.
    pub batch: usize,
    pub blocks: usize,
    pub completions: u64,
    /// Completions per second over the measured phases.
    pub rate: f64,
    pub latency_p50_ms: f64,
    pub latency_p99_ms: f64,
    /// How long the completion that fired took (its own transaction, dispatch included).
    pub firing_p50_ms: Option<f64>,
    /// From the start of the completion that fired to the next stage's handler starting.
    pub fan_in_p50_ms: Option<f64>,
    pub fan_in_p99_ms: Option<f64>,
    pub fan_in_samples: u64,
    /// Mean wall time of one block, from the barrier to the last completion.
    pub block_seconds: f64,
    /// Blocks with every member completed and nothing dispatched.
    pub stalls: usize,
    /// Blocks dispatched more than once.
    pub double_fires: usize,
    /// The budget ran out before a block finished; `rate` is what was reached.
    pub cut: bool,
}

pub struct Setup<'a> {
    pub pool: &'a PgPool,
    pub started: &'a Started,
    pub budget: Duration,
    pub batch: usize,
}

/// Runs one scenario. The caller's pool must hold at least `finishers` connections.
pub async fn run(
    setup: &Setup<'_>,
    mode: Mode,
    width: usize,
    finishers: usize,
) -> anyhow::Result<Result> {
    let engine = Engine::new(setup.pool.clone());
    let workflow = format!("bench-{mode}");
    let blocks_wanted = (5_000 / width).clamp(1, 30);
    let input: Vec<usize> = (0..width).collect();
    // The budget starts with the first block's completions: creating and claiming a
    // 100 000-wide block is setup, not fan-in.
    let mut deadline: Option<Instant> = None;

    let mut latency = Histogram::<u64>::new(3)?;
    let mut fan_in = Histogram::<u64>::new(3)?;
    let mut firing = Histogram::<u64>::new(3)?;
    let (mut completions, mut measured, mut blocks, mut stalls, mut doubles) =
        (0u64, Duration::ZERO, 0, 0, 0);
    let mut cut = false;
    let mut last_block = Duration::ZERO;
    // Blocks repeat (for latency samples) while the budget allows another; only the first
    // block is cut short by the budget.
    while blocks < blocks_wanted && deadline.is_none_or(|d| Instant::now() + last_block < d) {
        let id = engine.start(&workflow, &input).await?;
        let tasks = claim_all(&engine, width).await?;
        let block_deadline = match deadline {
            None => *deadline.insert(Instant::now() + setup.budget),
            Some(_) => Instant::now() + Duration::from_secs(3_600),
        };
        let block = complete_block(
            &engine,
            setup.pool,
            mode,
            tasks,
            (finishers, setup.batch),
            block_deadline,
        )
        .await?;
        last_block = block.elapsed;
        blocks += 1;
        completions += block.completions;
        measured += block.elapsed;
        latency.add(&block.latency)?;
        if block.completions < width as u64 {
            cut = true;
            engine.cancel(id).await?;
            break;
        }
        let next_groups: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM confluo.stage_group WHERE execution_id = $1 AND stage_index = 1",
        )
        .bind(id)
        .fetch_one(setup.pool)
        .await?;
        match (mode, block.fired.len(), next_groups) {
            (Mode::Floor, _, _) => engine.cancel(id).await.map(drop)?,
            (_, 0, 0) => stalls += 1,
            (_, 1, 1) => {
                let (fired_at, took) = block.fired[0];
                firing.record(took.as_micros() as u64)?;
                if let Some(started) = wait_started(setup.started, id, Duration::from_secs(5)).await
                {
                    fan_in.record(started.saturating_duration_since(fired_at).as_micros() as u64)?;
                }
            }
            _ => doubles += 1,
        }
    }
    let ms = |h: &Histogram<u64>, q: f64| h.value_at_quantile(q) as f64 / 1_000.0;
    Ok(Result {
        mode,
        width,
        finishers,
        batch: setup.batch,
        blocks,
        completions,
        rate: completions as f64 / measured.as_secs_f64().max(1e-9),
        latency_p50_ms: ms(&latency, 0.5),
        latency_p99_ms: ms(&latency, 0.99),
        firing_p50_ms: (!firing.is_empty()).then(|| ms(&firing, 0.5)),
        fan_in_p50_ms: (!fan_in.is_empty()).then(|| ms(&fan_in, 0.5)),
        fan_in_p99_ms: (!fan_in.is_empty()).then(|| ms(&fan_in, 0.99)),
        fan_in_samples: fan_in.len(),
        block_seconds: measured.as_secs_f64() / blocks.max(1) as f64,
        stalls,
        double_fires: doubles,
        cut,
    })
}

pub async fn claim_all(engine: &Engine, width: usize) -> anyhow::Result<Vec<ClaimedTask>> {
    let mut tasks = Vec::with_capacity(width);
    while tasks.len() < width {
        let batch = engine
            .claim("bench", 5_000, Duration::from_secs(3_600))
            .await?;
        if batch.is_empty() {
            bail!("only {} of {width} members became claimable", tasks.len());
        }
        tasks.extend(batch);
    }
    Ok(tasks)
}

pub struct Block {
    pub completions: u64,
    elapsed: Duration,
    latency: Histogram<u64>,
    /// Start instants and durations of the completions that fired the group.
    fired: Vec<(Instant, Duration)>,
}

/// Completes the block's members from `finishers` tasks released together by a barrier,
/// each taking the next member from a shared cursor, until done or past `deadline`.
pub async fn complete_block(
    engine: &Engine,
    pool: &PgPool,
    mode: Mode,
    tasks: Vec<ClaimedTask>,
    (finishers, batch): (usize, usize),
    deadline: Instant,
) -> anyhow::Result<Block> {
    let tasks = Arc::new(tasks);
    let cursor = Arc::new(AtomicUsize::new(0));
    let barrier = Arc::new(Barrier::new(finishers + 1));
    let mut handles = Vec::new();
    for _ in 0..finishers {
        let (engine, pool, tasks, cursor, barrier) = (
            engine.clone(),
            pool.clone(),
            tasks.clone(),
            cursor.clone(),
            barrier.clone(),
        );
        handles.push(tokio::spawn(async move {
            let mut latency = Histogram::<u64>::new(3)?;
            let mut fired = Vec::new();
            let mut done = 0u64;
            barrier.wait().await;
            loop {
                let i = cursor.fetch_add(batch, Ordering::Relaxed);
                if i >= tasks.len() || Instant::now() > deadline {
                    break;
                }
                let slice = &tasks[i..(i + batch).min(tasks.len())];
                let t0 = Instant::now();
                let outcomes = match (mode, batch) {
                    (Mode::Floor, _) => floor_complete(&pool, slice).await?,
                    (Mode::Strategy(_), 1) => vec![engine.complete(&slice[0], json!(i)).await?],
                    (Mode::Strategy(_), _) => {
                        let items: Vec<_> =
                            slice.iter().map(|t| (t, json!(t.item_index()))).collect();
                        engine.complete_batch(&items).await?
                    }
                };
                let took = t0.elapsed();
                latency.record(took.as_micros() as u64)?;
                for outcome in outcomes {
                    match outcome {
                        Outcome::Completed { fired: true } => fired.push((t0, took)),
                        Outcome::Completed { fired: false } => {}
                        other => bail!("unexpected outcome {other:?}"),
                    }
                    done += 1;
                }
            }
            anyhow::Ok((done, latency, fired))
        }));
    }
    barrier.wait().await;
    let start = Instant::now();
    let mut block = Block {
        completions: 0,
        elapsed: Duration::ZERO,
        latency: Histogram::new(3)?,
        fired: Vec::new(),
    };
    for h in handles {
        let (done, latency, fired) = h.await.context("finisher panicked")??;
        block.completions += done;
        block.latency.add(&latency)?;
        block.fired.extend(fired);
    }
    block.elapsed = start.elapsed();
    Ok(block)
}

/// The floor: the same guarded status transition for the same members, one statement
/// per batch (its own implicit transaction, as cheap as a completion can be), and
/// nothing else.
async fn floor_complete(pool: &PgPool, tasks: &[ClaimedTask]) -> anyhow::Result<Vec<Outcome>> {
    let ids: Vec<_> = tasks.iter().map(|t| t.id()).collect();
    let tokens: Vec<_> = tasks.iter().map(|t| t.lease()).collect();
    let outputs: Vec<_> = tasks
        .iter()
        .map(|t| sqlx::types::Json(json!(t.item_index())))
        .collect();
    let rows = sqlx::query(
        "UPDATE confluo.task t
            SET status = 'completed', output = i.output, finished_at = now(),
                lease_expires_at = NULL
           FROM unnest($1::uuid[], $2::uuid[], $3::jsonb[]) AS i(id, token, output)
          WHERE t.id = i.id AND t.lease_token = i.token AND t.status = 'running'",
    )
    .bind(&ids)
    .bind(&tokens)
    .bind(&outputs)
    .execute(pool)
    .await?
    .rows_affected();
    if rows != tasks.len() as u64 {
        bail!("floor completion matched {rows} of {} rows", tasks.len());
    }
    Ok(vec![Outcome::Completed { fired: false }; tasks.len()])
}

async fn wait_started(started: &Started, id: ExecutionId, timeout: Duration) -> Option<Instant> {
    let until = Instant::now() + timeout;
    loop {
        if let Some(t) = started.lock().unwrap().get(&id) {
            return Some(*t);
        }
        if Instant::now() > until {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// Round trips per completion of `mode`: one block of `width` members completed by
/// `finishers` connections that go through a counting proxy (the ones opening the
/// connections and registering the workflow are not counted).
pub async fn round_trips(
    setup: &Setup<'_>,
    proxy: &super::round_trips::CountingProxy,
    upstream: &sqlx::postgres::PgConnectOptions,
    mode: Mode,
    (width, finishers): (usize, usize),
) -> anyhow::Result<(f64, f64)> {
    let counted_pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(finishers as u32)
        .min_connections(finishers as u32)
        .connect_with(confluo::read_committed(proxy.options(upstream)))
        .await?;
    let counted = Engine::new(counted_pool.clone());
    counted.register(&mode.workflow()).await?; // caches the definition
    let mut warm = Vec::new();
    for _ in 0..finishers {
        warm.push(counted_pool.acquire().await?);
    }
    drop(warm);

    let engine = Engine::new(setup.pool.clone());
    let input: Vec<usize> = (0..width).collect();
    let id = engine.start(&format!("bench-{mode}"), &input).await?;
    let tasks = claim_all(&engine, width).await?;
    proxy.reset();
    let block = complete_block(
        &counted,
        &counted_pool,
        mode,
        tasks,
        (finishers, setup.batch),
        Instant::now() + Duration::from_secs(3_600),
    )
    .await?;
    // The pool pings a returned connection in the background: let the last ones land.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (turns, pings) = proxy.turns();
    counted_pool.close().await;
    if mode == Mode::Floor {
        engine.cancel(id).await?;
    }
    let per = |n: u64| n as f64 / block.completions.max(1) as f64;
    Ok((per(turns), per(pings)))
}
