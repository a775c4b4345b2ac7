//! The worker runtime: claims tasks, runs their handlers under a lease, a timeout and a
//! concurrency limit, and acknowledges the outcome.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use sqlx::postgres::{PgListener, PgPoolOptions};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio::time::{sleep, Instant};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::execution::ExecutionStatus;
use crate::handler::{FnHandler, Handler, TaskContext, TaskError};
use crate::queue::{ClaimedTask, Outcome};
use crate::store::{self, tasks::KEY_SEPARATOR, workflows};

/// Configures and starts a [`Worker`]; from [`Engine::worker`].
///
/// ```no_run
/// # async fn demo(engine: confluo::Engine) -> confluo::Result<()> {
/// use confluo::TaskError;
/// use std::time::Duration;
///
/// let worker = engine
///     .worker()
///     .handler("hello", "greet", |task| async move {
///         let name: String = task.input_as()?;
///         Ok::<_, TaskError>(format!("hello, {name}"))
///     })
///     .concurrency(16)
///     .start()
///     .await?;
/// // ... later
/// worker.shutdown().await;
/// # Ok(()) }
/// ```
pub struct WorkerBuilder {
    engine: Engine,
    handlers: HashMap<(String, String), Arc<dyn Handler>>,
    settings: Settings,
}

/// A worker's tunables, as set on its builder.
#[derive(Clone, Debug)]
struct Settings {
    id: String,
    concurrency: usize,
    batch_size: usize,
    poll_interval: Duration,
    lease: Duration,
    grace: Duration,
    partial: bool,
}

impl fmt::Debug for WorkerBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WorkerBuilder")
            .field("handlers", &self.handlers.keys().collect::<Vec<_>>())
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl WorkerBuilder {
    pub(crate) fn new(engine: Engine) -> Self {
        WorkerBuilder {
            engine,
            handlers: HashMap::new(),
            settings: Settings {
                id: format!("worker-{}", uuid::Uuid::new_v4()),
                concurrency: 10,
                batch_size: 10,
                poll_interval: Duration::from_millis(500),
                lease: Duration::from_secs(30),
                grace: Duration::from_secs(10),
                partial: false,
            },
        }
    }

    /// Runs `handler` for the tasks of `workflow` named `name` (a step or map stage's
    /// name, or a parallel branch's name).
    pub fn handler<F, Fut, O>(self, workflow: &str, name: &str, handler: F) -> Self
    where
        F: Fn(TaskContext) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = std::result::Result<O, TaskError>> + Send + 'static,
        O: Serialize + Send + 'static,
    {
        self.handler_object(workflow, name, Arc::new(FnHandler(handler)))
    }

    /// Like [`handler`](Self::handler), for a [`Handler`] implementation.
    pub fn handler_object(mut self, workflow: &str, name: &str, handler: Arc<dyn Handler>) -> Self {
        self.handlers
            .insert((workflow.to_owned(), name.to_owned()), handler);
        self
    }

    /// Names this worker in the task rows it claims (default: `worker-<uuid>`).
    pub fn id(mut self, id: impl Into<String>) -> Self {
        self.settings.id = id.into();
        self
    }

    /// How many handlers run at once (default 10). Each running handler holds no
    /// database connection, so this can exceed the pool size.
    pub fn concurrency(mut self, n: usize) -> Self {
        self.settings.concurrency = n.max(1);
        self
    }

    /// How many tasks one claim statement takes at most (default 10): larger batches
    /// mean fewer round trips under load.
    pub fn batch_size(mut self, n: usize) -> Self {
        self.settings.batch_size = n.max(1);
        self
    }

    /// How often an idle worker polls when no notification arrives (default 500 ms);
    /// notifications wake it at once, polling covers retries coming due and lost
    /// notifications.
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.settings.poll_interval = interval;
        self
    }

    /// How long a claim holds a task without renewal (default 30 s). Renewed every third
    /// of it while the handler runs; after a crash, the task is reclaimed this long after
    /// the last renewal.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.settings.lease = lease.max(Duration::from_millis(100));
        self
    }

    /// How long [`Worker::shutdown`] lets running handlers finish before it stops them and
    /// releases their tasks (default 10 s).
    pub fn shutdown_grace(mut self, grace: Duration) -> Self {
        self.settings.grace = grace;
        self
    }

    /// Serve only the handlers given, and leave the other stages of the same workflows to
    /// other workers (e.g. a pool of workers with a GPU for one stage). Off by default:
    /// [`start`](Self::start) then refuses a worker that lacks a handler.
    pub fn partial(mut self, partial: bool) -> Self {
        self.settings.partial = partial;
        self
    }

    /// Checks that every stage of the latest version of each workflow served has a
    /// handler (unless [`partial`](Self::partial)), and starts the worker on the current
    /// tokio runtime.
    ///
    /// # Errors
    /// [`Error::MissingHandler`]; [`Error::WorkflowNotFound`] for a workflow that is not
    /// registered; [`Error::Database`].
    pub async fn start(self) -> Result<Worker> {
        let served: HashSet<&str> = self.handlers.keys().map(|(w, _)| w.as_str()).collect();
        if served.is_empty() {
            return Err(Error::NoHandlers);
        }
        for workflow in served {
            let definition = workflows::load(self.engine.pool(), workflow, None).await?;
            for name in definition.handler_names() {
                if !self.settings.partial
                    && !self
                        .handlers
                        .contains_key(&(workflow.to_owned(), name.to_owned()))
                {
                    return Err(Error::MissingHandler {
                        workflow: workflow.to_owned(),
                        version: definition.version(),
                        handler: name.to_owned(),
                    });
                }
            }
        }
        let keys = self
            .handlers
            .keys()
            .map(|(w, h)| format!("{w}{KEY_SEPARATOR}{h}"))
            .collect();
        let shutdown = CancellationToken::new();
        let state = Arc::new(State {
            engine: self.engine,
            handlers: self.handlers,
            keys,
            settings: self.settings.clone(),
            shutdown: shutdown.clone(),
            hard_stop: CancellationToken::new(),
            wake: Notify::new(),
        });
        let handle = tokio::spawn(run(state));
        Ok(Worker {
            id: self.settings.id,
            shutdown,
            handle,
        })
    }
}

/// A running worker. Dropping it does not stop it: call [`shutdown`](Self::shutdown).
#[derive(Debug)]
pub struct Worker {
    id: String,
    shutdown: CancellationToken,
    handle: tokio::task::JoinHandle<()>,
}

impl Worker {
    /// This worker's id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Stops claiming, lets running handlers finish within the grace period, then stops
    /// the rest and releases their tasks (their attempts do not count), and returns.
    ///
    /// # Cancel safety
    /// Dropping this future leaves the worker shutting down in the background.
    pub async fn shutdown(self) {
        self.shutdown.cancel();
        let _ = self.handle.await;
    }
}

struct State {
    engine: Engine,
    handlers: HashMap<(String, String), Arc<dyn Handler>>,
    keys: Vec<String>,
    settings: Settings,
    shutdown: CancellationToken,
    hard_stop: CancellationToken,
    wake: Notify,
}

async fn run(state: Arc<State>) {
    let listener = tokio::spawn(listen(state.clone()));
    let slots = Arc::new(Semaphore::new(state.settings.concurrency));
    let mut running = JoinSet::new();
    let mut next_reclaim = Instant::now();
    let mut claim_errors = 0u32;
    while !state.shutdown.is_cancelled() {
        while running.try_join_next().is_some() {}
        if Instant::now() >= next_reclaim {
            if let Err(error) = state.engine.reclaim_expired(100).await {
                tracing::warn!(%error, "reclaiming expired leases failed");
            }
            if let Err(error) = state.engine.time_out_expired(100).await {
                tracing::warn!(%error, "timing out executions past their deadline failed");
            }
            match state.engine.queue_depth().await {
                Ok(depth) => crate::metrics::queue_depth(&depth),
                Err(error) => tracing::debug!(%error, "sampling the queue depth failed"),
            }
            next_reclaim = Instant::now() + (state.settings.lease / 2).min(Duration::from_secs(5));
        }
        let free = slots.available_permits().min(state.settings.batch_size);
        let mut claimed = 0;
        if free > 0 {
            match state
                .engine
                .claim_matching(
                    &state.settings.id,
                    free,
                    state.settings.lease,
                    Some(&state.keys),
                )
                .await
            {
                Ok(tasks) => {
                    claim_errors = 0;
                    claimed = tasks.len();
                    for task in tasks {
                        let permit = slots
                            .clone()
                            .try_acquire_owned()
                            .expect("claimed no more than the free slots");
                        let span = tracing::debug_span!(
                            "task",
                            task_id = %task.id,
                            execution_id = %task.execution_id,
                            stage = task.stage_index,
                            handler = %task.handler,
                            attempt = task.attempt
                        );
                        running.spawn(run_task(state.clone(), task, permit).instrument(span));
                    }
                }
                Err(error) => {
                    claim_errors += 1;
                    tracing::warn!(%error, "claiming tasks failed");
                }
            }
        }
        if free > 0 && claimed == free {
            continue; // more may be waiting
        }
        let pause = if claim_errors > 0 {
            (state.settings.poll_interval * claim_errors).min(Duration::from_secs(5))
        } else {
            state.settings.poll_interval
        };
        tokio::select! {
            _ = state.shutdown.cancelled() => {}
            _ = state.wake.notified(), if free > 0 && claim_errors == 0 => {}
            _ = slots.acquire(), if free == 0 => {}
            _ = sleep(pause) => {}
        }
    }
    listener.abort();
    let deadline = sleep(state.settings.grace);
    tokio::pin!(deadline);
    loop {
        tokio::select! {
            next = running.join_next() => if next.is_none() { break },
            _ = &mut deadline => {
                state.hard_stop.cancel();
                while running.join_next().await.is_some() {}
                break;
            }
        }
    }
}

/// Wakes the claim loop on every notification; reconnects on error.
async fn listen(state: Arc<State>) {
    loop {
        let result = async {
            // A connection of its own, so that listening never takes a slot of the pool.
            let pool = PgPoolOptions::new()
                .max_connections(1)
                .max_lifetime(None)
                .idle_timeout(None)
                .connect_with((*state.engine.pool().connect_options()).clone())
                .await?;
            let mut listener = PgListener::connect_with(&pool).await?;
            listener.listen(store::TASKS_CHANNEL).await?;
            loop {
                listener.recv().await?;
                state.wake.notify_one();
            }
        }
        .await;
        let error: sqlx::Error = match result {
            Ok(()) => return,
            Err(e) => e,
        };
        tracing::debug!(%error, "notification listener lost its connection; polling meanwhile");
        state.wake.notify_one();
        sleep(Duration::from_secs(1)).await;
    }
}

/// How an attempt ended, before it is acknowledged.
enum Ending {
    Returned(std::result::Result<serde_json::Value, TaskError>),
    Panicked(String),
    TimedOut,
    LeaseLost,
    Stopped,
}

async fn run_task(state: Arc<State>, task: ClaimedTask, _slot: OwnedSemaphorePermit) {
    if task.execution_status != ExecutionStatus::Running {
        if let Err(error) = state.engine.cancel_claimed(&task).await {
            tracing::warn!(%error, task_id = %task.id, "cancelling a task of a stopped execution failed");
        }
        return;
    }
    let input = match state.engine.task_input(&task).await {
        Ok(input) => input,
        Err(error) => {
            acknowledge(
                &state,
                &task,
                Ending::Returned(Err(TaskError::retryable(format!(
                    "loading the input failed: {error}"
                )))),
            )
            .await;
            return;
        }
    };
    let Some(handler) = state
        .handlers
        .get(&(task.workflow.clone(), task.handler.clone()))
        .cloned()
    else {
        // Claims are filtered by handler, so this is a bug; give the task back.
        let _ = state.engine.release(&task).await;
        return;
    };
    let cancellation = state.hard_stop.child_token();
    let context = TaskContext {
        input,
        task_id: task.id,
        execution_id: task.execution_id,
        workflow: task.workflow.clone(),
        stage_index: task.stage_index,
        handler: task.handler.clone(),
        item_index: task.item_index,
        attempt: task.attempt,
        max_attempts: task.max_attempts,
        cancellation: cancellation.clone(),
    };
    // Spawned, so that a panic is caught as a failed attempt instead of killing the loop.
    let started = Instant::now();
    let mut call = tokio::spawn(handler.call(context));
    let timeout = sleep(task.timeout);
    tokio::pin!(timeout);
    let mut renew = tokio::time::interval(state.settings.lease / 3);
    renew.tick().await;
    let ending = loop {
        tokio::select! {
            joined = &mut call => break match joined {
                Ok(result) => Ending::Returned(result),
                Err(e) if e.is_panic() => Ending::Panicked(panic_message(e.into_panic())),
                Err(_) => Ending::Stopped,
            },
            _ = &mut timeout => {
                call.abort();
                break Ending::TimedOut;
            }
            _ = state.hard_stop.cancelled() => {
                call.abort();
                break Ending::Stopped;
            }
            _ = renew.tick() => match state.engine.renew_lease(&task, state.settings.lease).await {
                Ok(Some(ExecutionStatus::Running)) => {}
                Ok(Some(_)) => cancellation.cancel(),
                Ok(None) => {
                    call.abort();
                    break Ending::LeaseLost;
                }
                Err(error) => tracing::warn!(%error, task_id = %task.id, "renewing a lease failed"),
            },
        }
    };
    let label = match &ending {
        Ending::Returned(Ok(_)) => "ok",
        Ending::Returned(Err(_)) => "error",
        Ending::Panicked(_) => "panic",
        Ending::TimedOut => "timeout",
        Ending::LeaseLost => "lease_lost",
        Ending::Stopped => "stopped",
    };
    crate::metrics::handler_ran(
        &task.workflow,
        &task.handler,
        label,
        started.elapsed().as_secs_f64(),
    );
    acknowledge(&state, &task, ending).await;
}

/// Records the ending of an attempt, repeating on connection errors: every
/// acknowledgement is idempotent, so a repeat after a lost answer changes nothing. If the
/// database stays out of reach, the lease expires and the task is reclaimed: never lost.
async fn acknowledge(state: &State, task: &ClaimedTask, ending: Ending) {
    let engine = &state.engine;
    let mut pause = Duration::from_millis(50);
    for _ in 0..8 {
        let result = match &ending {
            Ending::Returned(Ok(output)) => match engine.complete(task, output.clone()).await {
                Err(Error::InvalidOutput { reason, .. }) => engine.fail(task, &reason, false).await,
                other => other,
            },
            Ending::Returned(Err(error)) => {
                engine
                    .fail(task, error.message(), error.is_permanent())
                    .await
            }
            Ending::Panicked(message) => {
                engine
                    .fail(task, &format!("handler panicked: {message}"), false)
                    .await
            }
            Ending::TimedOut => {
                let message = format!("handler timed out after {:?}", task.timeout);
                engine.fail(task, &message, false).await
            }
            Ending::LeaseLost => return,
            Ending::Stopped => engine.release(task).await.map(|_| Outcome::Cancelled),
        };
        match result {
            Ok(outcome) => {
                tracing::debug!(task_id = %task.id, ?outcome, "attempt acknowledged");
                return;
            }
            Err(error) if error.is_database() => {
                tracing::warn!(%error, task_id = %task.id, "acknowledging failed; repeating");
                sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(2));
            }
            Err(error) => {
                tracing::error!(%error, task_id = %task.id, "acknowledging failed");
                return;
            }
        }
    }
}

fn panic_message(payload: Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a non-string panic payload".to_owned()
    }
}
