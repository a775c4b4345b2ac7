//! The worker runtime: a pipeline that claims tasks in batches into a bounded local
//! queue, runs their handlers under a lease, a timeout and a concurrency limit, and
//! acknowledges their outcomes in batches.
//!
//! - [`fetch`]: the claimer (one claim statement per refill, sized by the room left in
//!   the local queue) and the lease renewal of tasks waiting in the local queue;
//! - [`attempt`]: running one attempt of a handler;
//! - [`acks`]: acknowledging endings, one batch statement per window;
//! - this module: the builder, the dispatcher between them, and shutdown.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Serialize;
use sqlx::postgres::PgConnectOptions;
use tokio::sync::{mpsc, Notify, Semaphore};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::claimed::ClaimedTask;
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::handler::{FnHandler, Handler, TaskContext, TaskError};
use crate::ids::{LeaseToken, TaskId};
use crate::registry::Registration;
use crate::store::tasks::HandlerKeys;
use crate::store::workflows;

mod acks;
mod attempt;
mod fetch;
mod room;

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
    local_queue: usize,
    batch_size: usize,
    ack_window: Duration,
    ack_batch: usize,
    poll_interval: Duration,
    lease: Duration,
    grace: Duration,
    partial: bool,
    inline_block_input: u64,
    /// `None`: [`Notifications::Pool`], or [`Notifications::Off`] behind a transaction
    /// pooler.
    notifications: Option<Notifications>,
    /// `None`: this worker archives nothing.
    archive_after: Option<Duration>,
    /// `None`: this worker runs no auditor's round.
    audit_every: Option<Duration>,
}

/// How a worker hears that tasks became claimable, between its polls
/// ([`WorkerBuilder::notifications`]).
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub enum Notifications {
    /// `LISTEN` on a connection of its own, opened with the pool's connect options (one
    /// connection more than the pool). The default.
    #[default]
    Pool,
    /// `LISTEN` on a connection of its own opened with these options: a direct connection
    /// to PostgreSQL when the pool goes through PgBouncer in transaction mode, where a
    /// `LISTEN` is lost as soon as its statement ends (the server connection goes back to
    /// PgBouncer's pool).
    Direct(Box<PgConnectOptions>),
    /// No `LISTEN` and no connection for it: the worker finds new tasks by polling every
    /// [`poll_interval`](WorkerBuilder::poll_interval), and claims again at once after a
    /// claim that filled its room. A batch of completions that fires a stage still claims
    /// that stage's members in its own transaction; anything else new (a started
    /// execution, a retry coming due, a stage fired by another worker or by a dead
    /// letter) waits for the next poll.
    Off,
}

/// Default [`WorkerBuilder::archive_after`]: how long after its execution ended a worker
/// moves a task to the history. Long enough that inspecting a run that just ended reads
/// the hot table, short enough that the hot table holds about a minute of ended work.
pub const DEFAULT_ARCHIVE_AFTER: Duration = Duration::from_secs(60);

/// Default [`WorkerBuilder::audit_every`]: how often the auditor runs a round, across all
/// workers. At [`AUDIT_SLICE`](crate::AUDIT_SLICE) executions a round, a minute covers
/// 30 000 running executions in an hour.
pub const DEFAULT_AUDIT_EVERY: Duration = Duration::from_secs(60);

/// Default [`WorkerBuilder::local_queue`]: claimed tasks waiting ahead of the handlers.
/// Chosen by measurement (20 000 no-op tasks, 8 handlers, pool of 12, 3 alternating
/// rounds on 2 cores): 256 with claims of 256 drained a map at 13 100 tasks/s, 1 024 with
/// claims of 512 at 28 000, 2 048 at 22 500. A worker holds every task until its ending
/// is acknowledged, so the queue must cover a claim's and an acknowledgement's round
/// trips at full speed.
const DEFAULT_LOCAL_QUEUE: usize = 1024;
/// Default [`WorkerBuilder::batch_size`]: tasks per claim statement at most.
const DEFAULT_BATCH_SIZE: usize = 512;
/// Default [`WorkerBuilder::ack_window`].
const DEFAULT_ACK_WINDOW: Duration = Duration::from_millis(2);
/// Default [`WorkerBuilder::ack_batch`].
const DEFAULT_ACK_BATCH: usize = 512;
/// Claim statements a worker has in flight at most: one refills while the other's rows
/// are written, so the database works on two (it has more than one core).
const CLAIMS_IN_FLIGHT: usize = 2;
/// Acknowledgement batches a worker writes at once at most, for the same reason.
const ACKS_IN_FLIGHT: usize = 2;

impl fmt::Debug for WorkerBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WorkerBuilder")
            .field("handlers", &self.handlers.keys().collect::<Vec<_>>())
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl Engine {
    /// A builder for a worker that runs this engine's tasks.
    pub fn worker(&self) -> WorkerBuilder {
        WorkerBuilder::new(self.clone())
    }
}

impl WorkerBuilder {
    fn new(engine: Engine) -> Self {
        WorkerBuilder {
            engine,
            handlers: HashMap::new(),
            settings: Settings {
                id: format!("worker-{}", uuid::Uuid::new_v4()),
                concurrency: 10,
                local_queue: DEFAULT_LOCAL_QUEUE,
                batch_size: DEFAULT_BATCH_SIZE,
                ack_window: DEFAULT_ACK_WINDOW,
                ack_batch: DEFAULT_ACK_BATCH,
                poll_interval: Duration::from_millis(500),
                lease: Duration::from_secs(30),
                grace: Duration::from_secs(10),
                partial: false,
                inline_block_input: crate::outputs::DEFAULT_INLINE_BLOCK_INPUT,
                notifications: None,
                archive_after: Some(DEFAULT_ARCHIVE_AFTER),
                audit_every: Some(DEFAULT_AUDIT_EVERY),
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

    /// Names this worker in the task rows it claims and in the worker registry
    /// ([`Engine::workers`]; default: `worker-<uuid>`). Ids must be unique among running
    /// workers: a worker that starts under the id of another takes its registry row over.
    /// A restarted process may reuse its id.
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

    /// How many claimed tasks wait in this worker's local queue, ahead of its handlers
    /// (default 1 024). The worker claims in batches to keep it filled, so a handler that
    /// returns finds its next task in memory instead of a round trip away. Waiting tasks
    /// are leased to this worker (their leases are renewed in one statement every third
    /// of the lease, at most a second apart) and given back, their attempt uncounted, at
    /// shutdown. A waiting task whose execution stops (cancelled, timed out, failed) is
    /// cancelled at the next renewal instead of run; one that starts before that runs, and
    /// what it returns dispatches nothing.
    ///
    /// **Fairness**: one worker holds at most `concurrency + local_queue` tasks at once
    /// (running, waiting, or awaiting their acknowledgement); other workers claim the
    /// rest: 1 034 by default with 10 handlers. Lower it when tasks are slow and several
    /// workers share a small backlog (with `0`, a worker claims only for its free handler
    /// slots): a task that waits in one worker's queue is not run by an idle other.
    ///
    /// **Crashes**: a worker that dies (SIGKILL, lost host) leaves every task it held
    /// leased until the lease expires; they are then reclaimed. Those whose handler had
    /// started count a failed attempt, as any attempt would; those that were still waiting
    /// go back uncounted. The worker reports the starts with its next renewal (at most a
    /// second later): a task whose handler started less than that before the crash is
    /// given back uncounted too, up to 3 times per task, and counted from then on, so that
    /// a task that kills its worker at once still runs out of attempts.
    pub fn local_queue(mut self, n: usize) -> Self {
        self.settings.local_queue = n;
        self
    }

    /// How many tasks one claim statement takes at most (default 512). A refill claims
    /// what the local queue has room for, up to this.
    pub fn batch_size(mut self, n: usize) -> Self {
        self.settings.batch_size = n.max(1);
        self
    }

    /// How long an ending (success or failure) may wait to be acknowledged with others
    /// in one statement (default 2 ms). Completions of the batch are written in one
    /// statement, each group counted down once for all its members in it, and a batch
    /// that drains a group fires it, exactly once, as a single acknowledgement would. The
    /// batch is flushed before the window ends when it fills
    /// ([`ack_batch`](Self::ack_batch)), when no handler is running and no task waits
    /// (so the last member of a group is not kept waiting), and when the worker stops.
    ///
    /// `Duration::ZERO` acknowledges each ending on its own, as soon as its handler
    /// returns.
    ///
    /// **What a crash loses**: at most the endings not yet flushed. Their tasks are still
    /// `running` under this worker's lease; once it expires they are reclaimed and run
    /// again (at-least-once, as for any attempt whose acknowledgement was lost).
    pub fn ack_window(mut self, window: Duration) -> Self {
        self.settings.ack_window = window;
        self
    }

    /// How many endings one acknowledgement batch holds at most (default 512).
    pub fn ack_batch(mut self, n: usize) -> Self {
        self.settings.ack_batch = n.max(1);
        self
    }

    /// How often an idle worker polls when no notification arrives (default 500 ms);
    /// notifications wake it at once, polling covers retries coming due and lost
    /// notifications.
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.settings.poll_interval = interval;
        self
    }

    /// How the worker hears of new tasks between polls (default [`Notifications::Pool`]:
    /// `LISTEN` on one more connection, opened like the pool's). Behind a transaction
    /// pooler ([`EngineBuilder::transaction_pooler`](crate::EngineBuilder::transaction_pooler))
    /// the default is [`Notifications::Off`]; give a direct connection
    /// ([`Notifications::Direct`]) to be woken at once. See the README's PgBouncer section.
    pub fn notifications(mut self, notifications: Notifications) -> Self {
        self.settings.notifications = Some(notifications);
        self
    }

    /// How long after an execution ended this worker's housekeeping moves its tasks out of
    /// the task table that claims read into the task history (default
    /// [`DEFAULT_ARCHIVE_AFTER`](crate::DEFAULT_ARCHIVE_AFTER), a minute); `None` leaves
    /// that to other workers or to [`Engine::archive`](crate::Engine::archive). Reads do
    /// not change (they read both tables); the task table stays the size of the work in
    /// flight, so that its vacuums stay quick and its dead rows few. Each housekeeping
    /// round archives for at most a quarter of a second, 50 executions per statement;
    /// workers skip the executions another one is archiving.
    pub fn archive_after(mut self, after: Option<Duration>) -> Self {
        self.settings.archive_after = after;
        self
    }

    /// How often the auditor runs a round ([`Engine::audit_round`](crate::Engine::audit_round)),
    /// shared by every worker of the database (default
    /// [`DEFAULT_AUDIT_EVERY`](crate::DEFAULT_AUDIT_EVERY), a minute): this worker's
    /// housekeeping offers to run it, and one worker at a time does, over the next
    /// [`AUDIT_SLICE`](crate::AUDIT_SLICE) running executions. It repairs what it finds
    /// and logs, counts and records the rest ([`Engine::auditor`](crate::Engine::auditor)).
    /// A worker offers its first round one interval after it starts. `None`: this worker
    /// never runs one (others may).
    pub fn audit_every(mut self, every: Option<Duration>) -> Self {
        self.settings.audit_every = every;
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

    /// The most a block's outputs may take, in bytes as PostgreSQL stores them (after its
    /// compression), to be loaded as the input of the stage after the block (default
    /// [`DEFAULT_INLINE_BLOCK_INPUT`](crate::DEFAULT_INLINE_BLOCK_INPUT), 16 MiB). The
    /// worker holds the aggregate as JSON text and as a parsed value, a few times that.
    /// Past it, the handler's [`TaskContext::input_as`] fails with a permanent error that
    /// says so, and the handler reads the members page by page with
    /// [`TaskContext::previous_block`]: a map of any width, in bounded memory.
    pub fn inline_block_input(mut self, bytes: u64) -> Self {
        self.settings.inline_block_input = bytes;
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
    /// handler (unless [`partial`](Self::partial)), registers the worker
    /// ([`Engine::workers`]), and starts it on the current tokio runtime.
    ///
    /// # Errors
    /// [`Error::MissingHandler`]; [`Error::WorkflowNotFound`] for a workflow that is not
    /// registered; [`Error::IsolationNotReadCommitted`] for a pool whose sessions default
    /// to another isolation level (see [`Engine::new`]); [`Error::NeedsDirectConnection`]
    /// for [`Notifications::Pool`] behind a transaction pooler; [`Error::Database`].
    ///
    /// # Cancel safety
    /// Dropped before it returns, no worker was started.
    pub async fn start(mut self) -> Result<Worker> {
        let served: HashSet<String> = self.handlers.keys().map(|(w, _)| w.clone()).collect();
        if served.is_empty() {
            return Err(Error::NoHandlers);
        }
        if self.engine.through_transaction_pooler() {
            // Every statement runs in a transaction that pins READ COMMITTED.
            if matches!(self.settings.notifications, Some(Notifications::Pool)) {
                return Err(Error::NeedsDirectConnection {
                    what: "a worker's LISTEN",
                    remedy: "give the worker a direct connection for it \
                             (.notifications(Notifications::Direct(options))), or let it poll \
                             (Notifications::Off, the default behind a pooler)",
                });
            }
        } else {
            crate::store::check_isolation(self.engine.pool()).await?;
        }
        for workflow in &served {
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
            // Sleeps are woken, and signal waits timed out, by the worker's own handlers,
            // for every version that has them (older executions may still be waiting in
            // an older version).
            let versions = workflows::all(self.engine.pool(), Some(workflow.as_str())).await?;
            for name in versions.iter().flat_map(|(w, _)| w.builtin_handlers()) {
                self.handlers
                    .entry((workflow.clone(), name.to_owned()))
                    .or_insert_with(|| builtin_handler(name, &self.engine));
            }
        }
        let mut keys = HandlerKeys::default();
        for (workflow, handler) in self.handlers.keys() {
            keys.workflows.push(workflow.clone());
            keys.handlers.push(handler.clone());
        }
        let mut served: Vec<(String, String)> = self.handlers.keys().cloned().collect();
        served.sort();
        let shutdown = CancellationToken::new();
        let settings = self.settings.clone();
        let (acks, ack_queue) = mpsc::unbounded_channel();
        let (local, local_queue) = mpsc::unbounded_channel();
        let state = Arc::new(State {
            engine: self.engine,
            handlers: self.handlers,
            keys,
            shutdown: shutdown.clone(),
            hard_stop: CancellationToken::new(),
            wake: Notify::new(),
            room: Arc::new(room::Room::new(settings.concurrency + settings.local_queue)),
            slots: Arc::new(Semaphore::new(settings.concurrency)),
            waiting: Mutex::new(HashMap::new()),
            unreported: Mutex::new(HashMap::new()),
            acks,
            local,
            served,
            settings,
        });
        state.engine.register_worker(&state.registration()).await?;
        let handle = tokio::spawn(run(state, local_queue, ack_queue));
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

/// What the pipeline's parts share.
struct State {
    engine: Engine,
    handlers: HashMap<(String, String), Arc<dyn Handler>>,
    keys: HandlerKeys,
    settings: Settings,
    /// Stop claiming; finish what runs within the grace period.
    shutdown: CancellationToken,
    /// The grace period is over: stop the handlers.
    hard_stop: CancellationToken,
    /// Tasks may have become claimable (a notification, or the local queue drained).
    wake: Notify,
    /// Tasks this worker may hold: `concurrency + local_queue` places, one taken per
    /// claimed task until its ending is acknowledged (or it is given back).
    room: Arc<room::Room>,
    /// Handler slots: `concurrency` permits, one per running handler.
    slots: Arc<Semaphore>,
    /// Claimed tasks waiting in the local queue, whose leases the fetcher renews; true
    /// once a renewal found the task's execution stopped.
    waiting: Mutex<HashMap<TaskId, Waiting>>,
    /// Attempts started since the last renewal and still running, whose starts the
    /// database does not know yet: the next renewal reports them (a lease that expires
    /// after that costs the task an attempt; before it, the task is given back uncounted).
    unreported: Mutex<HashMap<TaskId, LeaseToken>>,
    /// Endings on their way to the acknowledger.
    acks: mpsc::UnboundedSender<acks::Ack>,
    /// The local queue, which the fetchers fill, and the acknowledgers too with the
    /// next stages their batches fired.
    local: mpsc::UnboundedSender<Held>,
    /// The `(workflow, handler)` pairs served, sorted (for the registry).
    served: Vec<(String, String)>,
}

impl State {
    /// This worker's row in the registry.
    fn registration(&self) -> Registration<'_> {
        Registration {
            id: &self.settings.id,
            handlers: &self.served,
            concurrency: self.settings.concurrency,
            heartbeat: fetch::housekeeping_interval(&self.settings),
        }
    }

    /// Puts claimed tasks in the local queue (their room was taken by the claimer).
    fn hold(&self, tasks: Vec<ClaimedTask>) {
        {
            let mut waiting = self.waiting.lock().expect("waiting set poisoned");
            for task in &tasks {
                let entry = Waiting {
                    lease: task.lease,
                    stopped: false,
                };
                waiting.insert(task.id, entry);
            }
        }
        for task in tasks {
            let held = Held {
                task,
                room: self.room.clone(),
            };
            // The dispatcher drains the queue until every acknowledger has stopped, so
            // the receiver outlives every sender that could send.
            let _ = self.local.send(held);
        }
    }

    /// Whether nothing runs and nothing waits: no ending will arrive soon.
    fn idle(&self) -> bool {
        self.slots.available_permits() == self.settings.concurrency
            && self
                .waiting
                .lock()
                .expect("waiting set poisoned")
                .is_empty()
    }
}

/// A task waiting in the local queue.
#[derive(Clone, Copy, Debug)]
struct Waiting {
    lease: LeaseToken,
    /// A renewal found its execution stopped: cancel it instead of running it.
    stopped: bool,
}

/// One task this worker holds, with its permit of [`State::room`]: the room comes back
/// when this is dropped, after the task's ending was acknowledged or the task given back.
struct Held {
    task: ClaimedTask,
    room: Arc<room::Room>,
}

impl Drop for Held {
    fn drop(&mut self) {
        self.room.give_back(1);
    }
}

/// The dispatcher: hands tasks from the local queue to free handler slots until shutdown,
/// then gives back what still waits, lets running handlers finish within the grace
/// period, and flushes the last acknowledgements.
async fn run(
    state: Arc<State>,
    mut local: mpsc::UnboundedReceiver<Held>,
    ack_queue: mpsc::UnboundedReceiver<acks::Ack>,
) {
    let listener = tokio::spawn(fetch::listen(state.clone()));
    let housekeeping = tokio::spawn(fetch::housekeeping(state.clone()));
    let fetchers: Vec<_> = (0..CLAIMS_IN_FLIGHT)
        .map(|i| tokio::spawn(fetch::fetch(state.clone(), i == 0)))
        .collect();
    let ack_queue = Arc::new(tokio::sync::Mutex::new(ack_queue));
    let acknowledgers: Vec<_> = (0..ACKS_IN_FLIGHT)
        .map(|_| tokio::spawn(acks::acknowledge_batches(state.clone(), ack_queue.clone())))
        .collect();
    let mut running = JoinSet::new();
    let mut unclaimed = Vec::new();
    loop {
        let held = tokio::select! {
            _ = state.shutdown.cancelled() => break,
            next = local.recv() => match next {
                Some(held) => held,
                None => break,
            },
        };
        let slot = tokio::select! {
            slot = state.slots.clone().acquire_owned() => slot.expect("slots never close"),
            _ = state.shutdown.cancelled() => {
                unclaimed.push(held);
                break;
            }
        };
        let mut held = held;
        let waited = state
            .waiting
            .lock()
            .expect("waiting set poisoned")
            .remove(&held.task.id);
        if waited.is_some_and(|w| w.stopped) {
            held.task.execution_status = crate::execution::ExecutionStatus::Cancelled;
        }
        let task = &held.task;
        let span = tracing::debug_span!(
            "task",
            task_id = %task.id,
            execution_id = %task.execution_id,
            stage = task.stage_index,
            handler = %task.handler,
            attempt = task.attempt
        );
        running.spawn(attempt::run(state.clone(), held, slot).instrument(span));
        while running.try_join_next().is_some() {}
    }
    // The fetcher stops at the shutdown signal, never in the middle of a claim: whatever
    // it claimed is in the local queue, and goes back.
    for fetcher in fetchers {
        let _ = fetcher.await;
    }
    listener.abort();
    // Within one round: it stops between rounds (see `fetch::housekeeping`).
    let _ = housekeeping.await;
    while let Ok(held) = local.try_recv() {
        unclaimed.push(held);
    }
    give_back(&state, unclaimed).await;
    let deadline = tokio::time::sleep(state.settings.grace);
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
    for _ in &acknowledgers {
        let _ = state.acks.send(acks::Ack::Close);
    }
    for acknowledger in acknowledgers {
        let _ = acknowledger.await;
    }
    // What the last batches handed to this worker goes back too.
    let mut handed = Vec::new();
    while let Ok(held) = local.try_recv() {
        handed.push(held);
    }
    give_back(&state, handed).await;
    if let Err(error) = state.engine.worker_stopped(&state.settings.id).await {
        tracing::debug!(%error, "marking the worker stopped in the registry failed");
    }
}

/// Gives tasks of the local queue back at shutdown, their attempts uncounted. If the
/// database cannot be reached, their leases expire and they are reclaimed.
async fn give_back(state: &State, held: Vec<Held>) {
    if held.is_empty() {
        return;
    }
    let tasks: Vec<ClaimedTask> = held.iter().map(|h| h.task.clone()).collect();
    match state.engine.release_many(&tasks).await {
        Ok(n) => tracing::debug!(released = n, "gave back the local queue"),
        Err(error) => {
            tracing::warn!(%error, tasks = tasks.len(), "giving back the local queue failed; the tasks come back when their leases expire")
        }
    }
    state.waiting.lock().expect("waiting set poisoned").clear();
}

/// The handler workers run themselves for `name` (see [`builtin`](crate::builtin)).
fn builtin_handler(name: &'static str, engine: &Engine) -> Arc<dyn Handler> {
    let engine = engine.clone();
    Arc::new(FnHandler(move |ctx: TaskContext| {
        let engine = engine.clone();
        async move { crate::builtin::answer(&engine, name, ctx.task_id(), ctx.input()).await }
    }))
}
