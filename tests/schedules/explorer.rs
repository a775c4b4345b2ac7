//! The schedule explorer: K members of one group finish together, each through the
//! engine's own `complete` on a connection of its own behind a [`Gate`], or K arrivals
//! decide one signal wait (signals, its timeout, the entry of the wait). At each step
//! the explorer lets one finisher's next statement reach the server; a statement that
//! blocks on a lock is noticed (`pg_blocking_pids`) and the others move on. Every
//! interleaving is explored depth first (each run replays a prefix of choices from a
//! fresh group), or random ones are sampled.

use std::time::{Duration, Instant};

use confluo::{
    ClaimedTask, Engine, ExecutionId, FanInStrategy, Join, Outcome, SignalOutcome, Stage, Workflow,
};
use serde_json::json;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;

use super::gate::{Gate, Turn};

/// One finisher: an engine whose only connection goes through a gate, and how its
/// member ends.
struct Finisher {
    engine: Engine,
    gate: Gate,
    end: End,
}

/// How a finisher's member ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum End {
    /// `complete()`: one statement while the counter stays above 1, else a transaction.
    Complete,
    /// `fail(.., permanent)`: dead-lettered in a transaction that also decides fan-in.
    DeadLetter,
    /// `Engine::signal` to a wait (the wait workflow): received, or kept for a wait not
    /// entered yet, decides it; told already received, or too late, it changes nothing.
    Signal,
    /// A worker timing the wait out: its claim of the wait's task (due at once), then
    /// `run_builtin`; finding nothing to claim, it changes nothing.
    Timeout,
    /// The completion of the step before the wait, which enters the wait (and hands it
    /// a signal kept for it).
    EnterWait,
}

impl End {
    /// Whether it arrives at a signal wait (the wait workflow) rather than a map's group.
    fn waits(self) -> bool {
        matches!(self, End::Signal | End::Timeout | End::EnterWait)
    }
}

/// The signal the wait workflow waits for.
const SIGNAL: &str = "approval";

/// What one schedule did.
#[derive(Debug, Clone)]
pub struct Run {
    /// The statements in the order they reached the server, as `(finisher, sql)`.
    pub steps: Vec<(usize, String)>,
    /// Groups of the next stage that exist afterwards: 1 is exactly-once, 0 a stall.
    pub dispatched: i64,
    /// Finishers told `fired`.
    pub fired: usize,
    /// Decision points where the replayed prefix no longer matched (should stay 0).
    pub diverged: usize,
    /// Number of runnable finishers at each decision point, and the index chosen.
    branches: Vec<(usize, usize)>,
}

impl Run {
    /// The schedule, one statement per line, finishers named A, B, C...
    pub fn render(&self) -> String {
        self.steps
            .iter()
            .map(|(f, sql)| format!("  {}: {sql}", (b'A' + *f as u8) as char))
            .collect::<Vec<_>>()
            .join("\n")
    }
}

/// Totals over the schedules explored.
#[derive(Debug, Default)]
pub struct Summary {
    pub schedules: usize,
    pub exactly_once: usize,
    pub stalls: usize,
    pub double_fires: usize,
    pub diverged: usize,
    /// The first schedule that did not dispatch exactly once.
    pub first_violation: Option<Run>,
}

pub struct Explorer {
    setup: Engine,
    pool: PgPool,
    finishers: Vec<Finisher>,
    workflow: String,
    /// The wait workflow (`before → approval wait → after`) rather than the map's.
    wait: bool,
    /// The map has a quorum join: a member it cancelled as it fired may be told so.
    quorum: bool,
}

impl Explorer {
    /// One finisher per entry of `ends` against the database of `options`, for groups
    /// decided by `strategy`: members of a map joined by `join`, or, when `ends` arrive at a signal wait
    /// (all of them must), arrivals at a wait that times out at once.
    pub async fn new(
        pool: PgPool,
        options: &PgConnectOptions,
        strategy: FanInStrategy,
        ends: &[End],
        join: Join,
    ) -> Explorer {
        let wait = ends.iter().any(|e| e.waits());
        assert!(
            ends.iter().all(|e| e.waits() == wait),
            "map and wait arrivals in one schedule"
        );
        let (workflow, wf) = if wait {
            let workflow = format!("explore-wait-{strategy}");
            let wf = Workflow::new(&workflow, 1)
                .stage(Stage::step("before").fan_in(strategy))
                .stage(
                    Stage::from(
                        Stage::signal(SIGNAL)
                            .within(Duration::from_millis(1))
                            .on_timeout(json!("timed out")),
                    )
                    .fan_in(strategy),
                )
                .stage(Stage::step("after").fan_in(strategy));
            (workflow, wf)
        } else {
            let workflow = format!(
                "explore-{strategy}-{}",
                join.to_string().replace(['(', ')'], "")
            );
            let wf = Workflow::new(&workflow, 1)
                .stage(Stage::map("member").fan_in(strategy).join(join))
                .step("after");
            (workflow, wf)
        };
        let setup = Engine::new(pool.clone());
        setup.register(&wf).await.expect("register");
        let mut finishers = Vec::new();
        for &end in ends {
            let gate = Gate::start(options).await;
            let pool = PgPoolOptions::new()
                .max_connections(1)
                .connect_with(gate.options(options))
                .await
                .expect("connect through the gate");
            let engine = Engine::new(pool);
            engine.register(&wf).await.expect("cache the definition");
            finishers.push(Finisher { engine, gate, end });
        }
        Explorer {
            setup,
            pool,
            finishers,
            workflow,
            wait,
            quorum: join.quorum().is_some(),
        }
    }

    /// Explores every interleaving, depth first.
    pub async fn exhaustive(&self, limit: usize) -> Summary {
        let mut summary = Summary::default();
        let mut prefix: Vec<usize> = Vec::new();
        loop {
            let run = self.run(&prefix, None).await;
            let branches = run.branches.clone();
            summary.add(run);
            if summary.schedules >= limit {
                panic!("more than {limit} schedules: raise the limit or sample");
            }
            // Backtrack to the deepest decision point with an untried option.
            prefix = branches.iter().map(|(_, chosen)| *chosen).collect();
            loop {
                match prefix.pop() {
                    None => return summary,
                    Some(chosen) if chosen + 1 < branches[prefix.len()].0 => {
                        prefix.push(chosen + 1);
                        break;
                    }
                    Some(_) => {}
                }
            }
        }
    }

    /// Samples `n` random interleavings (seeded, so a failure can be replayed).
    pub async fn random(&self, n: usize, seed: u64) -> Summary {
        let mut summary = Summary::default();
        let mut rng = seed.max(1);
        for _ in 0..n {
            summary.add(self.run(&[], Some(&mut rng)).await);
        }
        summary
    }

    /// One schedule: a fresh group of K members, claimed, then completed together with
    /// the choices of `prefix` first, then the first runnable finisher (or a random one);
    /// or a fresh wait, entered first unless a finisher enters it, and due to time out.
    async fn run(&self, prefix: &[usize], mut rng: Option<&mut u64>) -> Run {
        let k = self.finishers.len();
        let input: Vec<usize> = (0..k).collect();
        let execution = self
            .setup
            .start(&self.workflow, &input)
            .await
            .expect("start");
        let mut tasks = if self.wait {
            // The step before the wait: completed here, or by the finisher that enters.
            let before = claim(&self.setup, execution, 1).await.remove(0);
            if self.finishers.iter().any(|f| f.end == End::EnterWait) {
                vec![Some(before)]
            } else {
                self.setup
                    .complete(&before, json!("before"))
                    .await
                    .expect("enter the wait");
                tokio::time::sleep(Duration::from_millis(5)).await; // its timeout is due
                Vec::new()
            }
        } else {
            claim(&self.setup, execution, k)
                .await
                .into_iter()
                .map(Some)
                .collect()
        }
        .into_iter();
        let mut pids = Vec::new();
        for f in &self.finishers {
            pids.push(
                sqlx::query_scalar::<_, i32>("SELECT pg_backend_pid()")
                    .fetch_one(f.engine.pool())
                    .await
                    .expect("backend pid"),
            );
            f.gate.arm(true);
        }
        let handles: Vec<_> = self
            .finishers
            .iter()
            .enumerate()
            .map(|(i, f)| {
                let (engine, end) = (f.engine.clone(), f.end);
                let task = match end {
                    End::Complete | End::DeadLetter | End::EnterWait => tasks.next().flatten(),
                    End::Signal | End::Timeout => None,
                };
                tokio::spawn(arrive(
                    engine,
                    end,
                    task,
                    execution,
                    self.workflow.clone(),
                    i,
                    self.quorum,
                ))
            })
            .collect();

        let mut run = Run {
            steps: Vec::new(),
            dispatched: 0,
            fired: 0,
            diverged: 0,
            branches: Vec::new(),
        };
        loop {
            let held = self.quiesce(&handles, &pids).await;
            let runnable: Vec<usize> = held.iter().map(|(i, _)| *i).collect();
            if runnable.is_empty() {
                if handles.iter().all(|h| h.is_finished()) {
                    break;
                }
                // All waiting on one another: PostgreSQL's deadlock detector will abort
                // one, whose transaction the engine retries.
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
            let depth = run.branches.len();
            let choice = match (prefix.get(depth), rng.as_deref_mut()) {
                (Some(&c), _) if c < runnable.len() => c,
                (Some(_), _) => {
                    run.diverged += 1;
                    0
                }
                (None, Some(state)) => (next_random(state) % runnable.len() as u64) as usize,
                (None, None) => 0,
            };
            run.branches.push((runnable.len(), choice));
            let (finisher, sql) = held[choice].clone();
            run.steps.push((finisher, sql));
            self.finishers[finisher].gate.release();
        }
        for f in &self.finishers {
            f.gate.arm(false);
        }
        for h in handles {
            run.fired += usize::from(h.await.expect("finisher panicked"));
        }
        // The stage after the decided group: the map's `after` (1), or the wait's (2).
        run.dispatched = sqlx::query_scalar(
            "SELECT count(*) FROM confluo.stage_group WHERE execution_id = $1 AND stage_index = $2",
        )
        .bind(execution)
        .bind(if self.wait { 2 } else { 1 })
        .fetch_one(&self.pool)
        .await
        .expect("count dispatches");
        self.setup.cancel(execution).await.expect("cancel");
        run
    }

    /// Waits until every finisher has returned, holds a statement at its gate, or waits
    /// on a lock held by another (seen twice in a row: a waiter that was just granted its
    /// lock may not have woken yet); returns the held statements.
    async fn quiesce(
        &self,
        handles: &[tokio::task::JoinHandle<bool>],
        pids: &[i32],
    ) -> Vec<(usize, String)> {
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut confirmed = 0;
        loop {
            let mut held = Vec::new();
            let mut in_flight = Vec::new();
            let mut busy = false;
            for (i, f) in self.finishers.iter().enumerate() {
                match f.gate.turn() {
                    Turn::Held(sql) => held.push((i, sql)),
                    Turn::Idle if handles[i].is_finished() => {}
                    Turn::InFlight => in_flight.push(pids[i]),
                    Turn::Idle => busy = true,
                }
            }
            if !busy {
                if in_flight.is_empty() {
                    return held; // nothing can move until the explorer releases something
                }
                if self.all_blocked(&in_flight).await {
                    confirmed += 1;
                    if confirmed == 2 {
                        return held;
                    }
                } else {
                    confirmed = 0;
                }
            } else {
                confirmed = 0;
            }
            assert!(Instant::now() < deadline, "finishers never settled");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// Whether every backend of `pids` waits on a lock another holds.
    async fn all_blocked(&self, pids: &[i32]) -> bool {
        sqlx::query_scalar(
            "SELECT bool_and(cardinality(pg_blocking_pids(pid)) > 0) FROM unnest($1::int[]) pid",
        )
        .bind(pids)
        .fetch_one(&self.pool)
        .await
        .expect("pg_blocking_pids")
    }
}

impl Summary {
    fn add(&mut self, run: Run) {
        self.schedules += 1;
        self.diverged += run.diverged;
        match (run.dispatched, run.fired) {
            (1, 1) => self.exactly_once += 1,
            (0, _) => self.stalls += 1,
            _ => self.double_fires += 1,
        }
        if !(run.dispatched == 1 && run.fired == 1) && self.first_violation.is_none() {
            self.first_violation = Some(run);
        }
    }
}

/// One finisher's arrival; whether it was told it decided the group (`fired`, a signal
/// received or kept, a timeout that completed the wait).
async fn arrive(
    engine: Engine,
    end: End,
    task: Option<ClaimedTask>,
    execution: ExecutionId,
    workflow: String,
    i: usize,
    quorum: bool,
) -> bool {
    let told = |outcome: Outcome| match outcome {
        Outcome::Completed { fired } | Outcome::DeadLettered { fired } => fired,
        // Cancelled by the quorum that fired before it (told when it ends), or late.
        Outcome::LeaseLost | Outcome::Cancelled if quorum => false,
        other => panic!("unexpected outcome {other:?}"),
    };
    match end {
        End::Complete => told(engine.complete(&task.unwrap(), json!(i)).await.unwrap()),
        End::DeadLetter => told(engine.fail(&task.unwrap(), "injected", true).await.unwrap()),
        // Entering the wait decides nothing: a signal kept for it was told so.
        End::EnterWait => {
            engine
                .complete(&task.unwrap(), json!("before"))
                .await
                .unwrap();
            false
        }
        End::Signal => match engine.signal(execution, SIGNAL, json!(i)).await.unwrap() {
            SignalOutcome::Received | SignalOutcome::Kept => true,
            SignalOutcome::AlreadyReceived | SignalOutcome::TooLate => false,
            other => panic!("unexpected signal outcome {other:?}"),
        },
        End::Timeout => {
            // The wait's task only: once a signal decided, `after`'s is due too.
            let wait = [(workflow.as_str(), "confluo:signal")];
            let claimed = engine
                .claim_for("explorer-timeout", &wait, 1, Duration::from_secs(300))
                .await
                .unwrap();
            match claimed.first() {
                Some(wait) => told(engine.run_builtin(wait).await.unwrap().unwrap()),
                None => false, // a signal took the wait first
            }
        }
    }
}

async fn claim(engine: &Engine, execution: ExecutionId, k: usize) -> Vec<ClaimedTask> {
    let mut tasks = engine
        .claim("explorer", k, Duration::from_secs(300))
        .await
        .expect("claim");
    assert_eq!(tasks.len(), k, "the group's members are claimable");
    assert!(tasks.iter().all(|t| t.execution_id() == execution));
    tasks.sort_by_key(|t| t.item_index());
    tasks
}

/// xorshift64: a seeded sequence, so a sampled schedule can be replayed.
fn next_random(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}
