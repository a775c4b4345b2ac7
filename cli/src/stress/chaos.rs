//! Faults injected from outside the handlers: a rogue client that replays completions and
//! completes after its lease was reclaimed (a zombie), an operator who cancels running
//! executions, a killer of database connections, and a supervisor that SIGKILLs worker
//! processes and starts new ones.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use confluo::{ClaimedTask, Engine, Outcome};
use serde_json::Value;
use tokio::process::{Child, Command};

use super::handlers::{Context, Task};

/// Violations seen by the chaos side (a replay or a zombie that changed something).
#[derive(Default)]
pub struct Seen {
    pub violations: std::sync::Mutex<Vec<String>>,
    pub killed_connections: AtomicU64,
    pub killed_workers: AtomicU64,
    pub cancelled: AtomicU64,
    pub children_cancelled: AtomicU64,
    /// Signals received by a waiting execution, and kept for one not there yet.
    pub signals_received: AtomicU64,
    pub signals_kept: AtomicU64,
}

impl Seen {
    fn violation(&self, what: String) {
        self.violations.lock().unwrap().push(what);
    }
}

async fn run_task(ctx: &Context, engine: &Engine, task: &ClaimedTask) -> anyhow::Result<Value> {
    let input = engine.task_input(task).await?;
    let t = Task {
        execution_id: task.execution_id(),
        task_id: task.id(),
        stage_index: task.stage_index(),
        handler: task.handler(),
        item_index: task.item_index(),
        attempt: task.attempt(),
    };
    ctx.perform(t, &input, false)
        .await
        .map_err(|e| anyhow::anyhow!("{}", e.message()))
}

/// Claims one task like a worker would, with `lease`, and runs it (without faults);
/// `None` if there was nothing to claim or running it failed (the task is given back).
async fn claim_and_run(
    ctx: &Context,
    engine: &Engine,
    who: &str,
    lease: Duration,
) -> Option<(ClaimedTask, Value)> {
    let task = engine.claim(who, 1, lease).await.ok()?.pop()?;
    if task.handler() == "confluo:child" {
        // A child's member: its answer is the engine's to give (and acknowledge).
        let _ = engine.run_builtin(&task).await;
        return None;
    }
    match run_task(ctx, engine, &task).await {
        Ok(output) => Some((task, output)),
        Err(_) => {
            let _ = engine.release(&task).await;
            None
        }
    }
}

/// Now and then completes a task, then sends the same completion again: the replay must
/// be `AlreadyRecorded`.
pub async fn replays(
    ctx: Context,
    engine: Engine,
    per_second: f64,
    stop: Arc<AtomicBool>,
    seen: Arc<Seen>,
) {
    let pause = Duration::from_secs_f64(1.0 / per_second);
    while !stop.load(Ordering::Relaxed) {
        tokio::time::sleep(pause).await;
        let lease = Duration::from_secs(30);
        let Some((task, output)) = claim_and_run(&ctx, &engine, "rogue-replayer", lease).await
        else {
            continue;
        };
        // An error (e.g. a killed connection) leaves the lease to expire: nothing lost.
        let Ok(Outcome::Completed { .. }) = engine.complete(&task, output.clone()).await else {
            continue;
        };
        ctx.record_fault("replayed completion").await;
        match engine.complete(&task, output).await {
            Ok(Outcome::AlreadyRecorded) | Err(_) => {}
            Ok(other) => seen.violation(format!("replay of task {} was {other:?}", task.id())),
        }
    }
}

/// Now and then claims a task with a short lease, lets it expire, reclaims it, then
/// completes it: the zombie completion must be `LeaseLost` and change nothing. (Only once
/// the attempt is seen reclaimed: an expired lease nobody reclaimed yet still holds, and
/// its completion is accepted, as it should be.)
pub async fn zombies(
    ctx: Context,
    engine: Engine,
    per_second: f64,
    stop: Arc<AtomicBool>,
    seen: Arc<Seen>,
) {
    let pause = Duration::from_secs_f64(1.0 / per_second);
    let lease = Duration::from_millis(200);
    while !stop.load(Ordering::Relaxed) {
        tokio::time::sleep(pause).await;
        let Some((task, output)) = claim_and_run(&ctx, &engine, "rogue-zombie", lease).await else {
            continue;
        };
        tokio::time::sleep(lease * 2).await;
        // One sweep takes the oldest expired leases first, so while killed workers' tasks
        // expire by the thousand it may not reach this one: sweep until the attempt is no
        // longer held (by anyone's sweep), or give up on this zombie.
        let mut reclaimed = false;
        for _ in 0..20 {
            if stop.load(Ordering::Relaxed) || engine.reclaim_expired(1_000).await.is_err() {
                break;
            }
            match engine.claimed(task.id(), task.lease()).await {
                Ok(None) => {
                    reclaimed = true;
                    break;
                }
                Ok(Some(_)) => tokio::time::sleep(lease).await,
                Err(_) => break,
            }
        }
        if !reclaimed {
            continue;
        }
        ctx.record_fault("zombie completion").await;
        match engine.complete(&task, output).await {
            Ok(Outcome::LeaseLost) | Err(_) => {}
            Ok(other) => seen.violation(format!(
                "zombie completion of task {} was {other:?}",
                task.id()
            )),
        }
    }
}

/// Terminates a random worker connection (`pg_terminate_backend`) every `every`.
pub async fn kill_connections(
    engine: Engine,
    every: Duration,
    stop: Arc<AtomicBool>,
    seen: Arc<Seen>,
) {
    while !stop.load(Ordering::Relaxed) {
        tokio::time::sleep(every).await;
        let killed: Result<Option<bool>, _> = sqlx::query_scalar(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
              WHERE datname = current_database() AND application_name = $1
              ORDER BY random() LIMIT 1",
        )
        .bind(super::WORKER_APPLICATION)
        .fetch_optional(engine.pool())
        .await
        .map(Option::flatten);
        if let Ok(Some(true)) = killed {
            seen.killed_connections.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Worker processes: started, SIGKILLed at random every `kill_every` (if set) and
/// replaced, and stopped at the end.
pub struct Processes {
    children: Vec<Child>,
    /// Each process's environment on top of this one's (`DATABASE_URL`, ...): URLs with
    /// passwords stay off command lines, which every local user sees in `ps`.
    env: Vec<(&'static str, String)>,
    command: Vec<String>,
}

impl Processes {
    pub fn spawn(
        count: usize,
        env: Vec<(&'static str, String)>,
        command: Vec<String>,
    ) -> anyhow::Result<Processes> {
        let mut processes = Processes {
            children: Vec::new(),
            env,
            command,
        };
        for _ in 0..count {
            let child = processes.start()?;
            processes.children.push(child);
        }
        Ok(processes)
    }

    fn start(&self) -> anyhow::Result<Child> {
        Ok(Command::new(std::env::current_exe()?)
            .args(&self.command)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .kill_on_drop(true)
            .spawn()?)
    }

    /// SIGKILLs one process at random and starts another in its place.
    pub async fn kill_one(&mut self, which: usize) -> anyhow::Result<()> {
        let i = which % self.children.len();
        self.children[i].start_kill()?; // SIGKILL: no shutdown, leases left to expire
        let _ = self.children[i].wait().await;
        self.children[i] = self.start()?;
        Ok(())
    }

    /// Stops every process (SIGKILL: whatever they held is reclaimed by the others' leases).
    pub async fn stop(mut self) {
        for child in &mut self.children {
            let _ = child.start_kill();
            let _ = child.wait().await;
        }
    }

    /// Any process that exited on its own (a crash is a violation).
    pub fn crashed(&mut self) -> Option<String> {
        for child in &mut self.children {
            if let Ok(Some(status)) = child.try_wait() {
                return Some(format!("a worker process exited on its own: {status}"));
            }
        }
        None
    }
}

/// A running execution picked at random, a child (an audit) when `child`, else a
/// parent, and whether it is a child (`None` also when the query fails, e.g. on a killed
/// connection).
async fn random_running(engine: &Engine, child: bool) -> Option<(confluo::ExecutionId, bool)> {
    sqlx::query_as(
        "SELECT id, parent_execution IS NOT NULL FROM confluo.execution
          WHERE status = 'running' AND (parent_execution IS NOT NULL) = $1
          ORDER BY random() LIMIT 1",
    )
    .bind(child)
    .fetch_optional(engine.pool())
    .await
    .ok()
    .flatten()
}

/// The approver: every few milliseconds, signals a running execution picked at random,
/// whatever it is doing (before its wait, while it waits, as it times out, twice), with
/// `{"approved": <its id>}`. The checks then find each wait completed once, by its signal
/// or its timeout.
pub async fn signals(engine: Engine, stop: Arc<AtomicBool>, seen: Arc<Seen>) {
    while !stop.load(Ordering::Relaxed) {
        tokio::time::sleep(Duration::from_millis(5)).await;
        let picked = random_running(&engine, false).await;
        let Some((id, _)) = picked else { continue };
        let payload = serde_json::json!({ "approved": id });
        // An error (e.g. a killed connection) records nothing; the run goes on.
        match engine.signal(id, super::handlers::SIGNAL, payload).await {
            Ok(confluo::SignalOutcome::Received) => {
                seen.signals_received.fetch_add(1, Ordering::Relaxed);
            }
            Ok(confluo::SignalOutcome::Kept) => {
                seen.signals_kept.fetch_add(1, Ordering::Relaxed);
            }
            Ok(_) | Err(_) => {}
        }
    }
}

/// Now and then cancels a running execution, whatever it is doing (its groups may be
/// firing at that very moment): every other one a child, when one runs (its member then
/// fails; children run only in the last stage, and would seldom be picked otherwise).
pub async fn cancels(engine: Engine, per_second: f64, stop: Arc<AtomicBool>, seen: Arc<Seen>) {
    let pause = Duration::from_secs_f64(1.0 / per_second);
    let mut turn = 0u64;
    while !stop.load(Ordering::Relaxed) {
        tokio::time::sleep(pause).await;
        turn += 1;
        let child = if turn % 2 == 0 {
            random_running(&engine, true).await
        } else {
            None
        };
        let picked = match child {
            Some(child) => Some(child),
            None => random_running(&engine, false).await,
        };
        // An error (e.g. a killed connection) cancels nothing; the run goes on.
        if let Some((id, child)) = picked {
            if let Ok(true) = engine.cancel(id).await {
                let count = if child {
                    &seen.children_cancelled
                } else {
                    &seen.cancelled
                };
                count.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}
