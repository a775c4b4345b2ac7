//! The public entry point: connecting, migrating, registering workflows, starting,
//! querying, waiting for and cancelling executions.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use serde::Serialize;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{PgConnection, PgPool};

use crate::definition::{StageKind, Workflow};
use crate::dispatch;
use crate::error::{retry_conflicts, Error, Result};
use crate::execution::{AttemptError, DeadLetter, Execution, ExecutionStatus, StageProgress};
use crate::fanin::FanInStrategy;
use crate::ids::ExecutionId;
use crate::store::{self, executions, groups, workflows};
use crate::worker::WorkerBuilder;

/// A handle on confluo's tables in one PostgreSQL database. Cheap to clone; clones share
/// the pool and the definition cache.
///
/// ```no_run
/// # async fn demo() -> confluo::Result<()> {
/// use confluo::{Engine, Workflow};
/// use serde_json::json;
///
/// let engine = Engine::connect("postgres://postgres@127.0.0.1/postgres").await?;
/// engine.migrate().await?;
/// engine.register(&Workflow::new("hello", 1).step("greet")).await?;
/// let id = engine.start("hello", &json!({"name": "Ada"})).await?;
/// println!("{}", engine.execution(id).await?.status);
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct Engine {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    pool: PgPool,
    fan_in: FanInStrategy,
    definitions: RwLock<HashMap<(String, i32), Arc<Workflow>>>,
}

/// A century: deadlines further out are capped, so that the timestamp stays in range.
const MAX_DEADLINE_MS: i64 = 100 * 365 * 24 * 3600 * 1000;

/// Options of [`Engine::start_with`].
#[derive(Clone, Debug, Default)]
pub struct StartOptions {
    version: Option<i32>,
    idempotency_key: Option<String>,
    deadline: Option<Duration>,
}

impl StartOptions {
    /// Default options: the latest registered version, no idempotency key.
    pub fn new() -> Self {
        Self::default()
    }

    /// Runs this version instead of the latest registered one.
    pub fn version(mut self, version: i32) -> Self {
        self.version = Some(version);
        self
    }

    /// Starting twice with the same key (per workflow name) returns the first execution's
    /// id and starts nothing, also when the two calls race.
    pub fn idempotency_key(mut self, key: impl Into<String>) -> Self {
        self.idempotency_key = Some(key.into());
        self
    }

    /// Gives the execution this long to finish, counted from its start. Once the deadline
    /// passes, a worker's housekeeping pass (every half lease, at most 5 s apart) moves it
    /// to [`ExecutionStatus::TimedOut`](crate::ExecutionStatus::TimedOut) and cancels its
    /// pending tasks in the same transaction; running handlers see their
    /// [`cancellation`](crate::TaskContext::cancellation) at their next lease renewal, and
    /// what they return dispatches nothing.
    ///
    /// ```
    /// use std::time::Duration;
    /// let options = confluo::StartOptions::new().deadline(Duration::from_secs(15 * 60));
    /// # let _ = options;
    /// ```
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.deadline = Some(deadline);
        self
    }
}

/// Builds an [`Engine`] with non-default options.
#[derive(Debug)]
pub struct EngineBuilder {
    pool: PgPool,
    fan_in: FanInStrategy,
}

impl EngineBuilder {
    /// The default fan-in strategy of executions started through this engine (default
    /// [`FanInStrategy::Countdown`]). It is recorded on each execution, and each group
    /// stores the strategy it was created with, so every worker decides a group the same
    /// way whatever its own engine's default. A stage can override it with
    /// [`Stage::fan_in`](crate::Stage::fan_in).
    pub fn fan_in(mut self, strategy: FanInStrategy) -> Self {
        self.fan_in = strategy;
        self
    }

    /// Builds the engine.
    pub fn build(self) -> Engine {
        Engine {
            inner: Arc::new(Inner {
                pool: self.pool,
                fan_in: self.fan_in,
                definitions: RwLock::new(HashMap::new()),
            }),
        }
    }
}

impl Engine {
    /// An engine on the caller's pool, with default options.
    pub fn new(pool: PgPool) -> Self {
        Self::builder(pool).build()
    }

    /// An engine on the caller's pool, with options to set.
    pub fn builder(pool: PgPool) -> EngineBuilder {
        EngineBuilder {
            pool,
            fan_in: FanInStrategy::default(),
        }
    }

    /// Connects a pool of up to 10 connections to `url`.
    ///
    /// # Errors
    /// [`Error::Database`] if the URL is invalid or the server unreachable.
    pub async fn connect(url: &str) -> Result<Self> {
        let pool = PgPoolOptions::new()
            .max_connections(10)
            .connect(url)
            .await?;
        Ok(Self::new(pool))
    }

    /// Connects from the environment: `DATABASE_URL` if set, else PostgreSQL's usual `PG*`
    /// variables (`PGHOST`, `PGPORT`, `PGUSER`, `PGPASSWORD`, `PGDATABASE`, ...).
    ///
    /// # Errors
    /// [`Error::NoDatabaseConfigured`] when neither is set; [`Error::Database`] if the
    /// server is unreachable.
    pub async fn connect_env() -> Result<Self> {
        if let Ok(url) = std::env::var("DATABASE_URL") {
            return Self::connect(&url).await;
        }
        if !std::env::vars().any(|(k, _)| k.starts_with("PG")) {
            return Err(Error::NoDatabaseConfigured);
        }
        let pool = PgPoolOptions::new()
            .max_connections(10)
            .connect_with(PgConnectOptions::new())
            .await?;
        Ok(Self::new(pool))
    }

    /// The pool this engine uses.
    pub fn pool(&self) -> &PgPool {
        &self.inner.pool
    }

    /// The default fan-in strategy of executions started through this engine.
    pub fn fan_in(&self) -> FanInStrategy {
        self.inner.fan_in
    }

    /// Creates or upgrades confluo's schema (`confluo`) with the embedded migrations.
    /// Idempotent and safe to call from several processes at once.
    ///
    /// # Errors
    /// [`Error::Migrate`] or [`Error::Database`].
    pub async fn migrate(&self) -> Result<()> {
        store::migrate(&self.inner.pool).await
    }

    /// Validates a definition and stores it. Registering an identical definition again is
    /// a no-op, so every process can register what it runs at start.
    ///
    /// # Errors
    /// [`Error::InvalidDefinition`] for an invalid definition;
    /// [`Error::DefinitionConflict`] if this name and version hold another definition.
    pub async fn register(&self, workflow: &Workflow) -> Result<()> {
        workflow.validate()?;
        workflows::register(&self.inner.pool, workflow).await?;
        self.cache(workflow.clone());
        Ok(())
    }

    /// Starts the latest registered version of `workflow` with `input`.
    ///
    /// # Errors
    /// [`Error::WorkflowNotFound`]; [`Error::InvalidInput`] when the first stage is a map
    /// and the input is not an array; [`Error::Json`]; [`Error::Database`].
    ///
    /// # Cancel safety
    /// The start is one transaction: dropped before it commits, nothing was started.
    pub async fn start<I: Serialize + ?Sized>(
        &self,
        workflow: &str,
        input: &I,
    ) -> Result<ExecutionId> {
        self.start_with(workflow, input, StartOptions::default())
            .await
    }

    /// [`start`](Self::start) with a version or an idempotency key.
    ///
    /// # Errors
    /// As [`start`](Self::start).
    pub async fn start_with<I: Serialize + ?Sized>(
        &self,
        workflow: &str,
        input: &I,
        options: StartOptions,
    ) -> Result<ExecutionId> {
        let mut tx = self.inner.pool.begin().await?;
        let id = self.start_using(&mut tx, workflow, input, options).await?;
        tx.commit().await?;
        Ok(id)
    }

    /// Starts an execution inside the caller's transaction, so that it exists if and only
    /// if the caller's own writes commit.
    ///
    /// # Errors
    /// As [`start`](Self::start).
    pub async fn start_using<I: Serialize + ?Sized>(
        &self,
        conn: &mut PgConnection,
        workflow: &str,
        input: &I,
        options: StartOptions,
    ) -> Result<ExecutionId> {
        let input = serde_json::to_value(input)?;
        let definition = workflows::load(&mut *conn, workflow, options.version).await?;
        let definition = self.cache(definition);
        if matches!(definition.stages()[0].kind(), StageKind::Map) && !input.is_array() {
            return Err(Error::InvalidInput {
                workflow: workflow.to_owned(),
                reason: format!(
                    "the first stage {:?} is a map, so the input must be a JSON array",
                    definition.stages()[0].name()
                ),
            });
        }
        let deadline_ms = options.deadline.map(|d| {
            i64::try_from(d.as_millis()).map_or(MAX_DEADLINE_MS, |ms| ms.min(MAX_DEADLINE_MS))
        });
        let (id, created) = executions::insert(
            conn,
            executions::NewExecution {
                id: ExecutionId::new(),
                workflow_name: definition.name(),
                workflow_version: definition.version(),
                input: &input,
                idempotency_key: options.idempotency_key.as_deref(),
                fan_in: self.fan_in(),
                deadline_ms,
            },
        )
        .await?;
        if created {
            dispatch::enter(conn, id, &definition, 0, None, self.fan_in()).await?;
            tracing::debug!(execution_id = %id, workflow, "execution started");
        }
        Ok(id)
    }

    /// A snapshot of an execution: status, output, per-stage progress, dead letters.
    ///
    /// # Errors
    /// [`Error::ExecutionNotFound`]; [`Error::Database`].
    pub async fn execution(&self, id: ExecutionId) -> Result<Execution> {
        let pool = &self.inner.pool;
        let row = executions::get(pool, id)
            .await?
            .ok_or(Error::ExecutionNotFound(id))?;
        let stages = executions::stages(pool, id).await?;
        let status = ExecutionStatus::parse(&row.status);
        let output = match (status, row.output_group) {
            (ExecutionStatus::Completed, Some(group)) => Some(groups::output(pool, group).await?),
            _ => None,
        };
        let dead_letters = executions::dead_tasks(pool, id, 100)
            .await?
            .into_iter()
            .map(|d| DeadLetter {
                task_id: d.id,
                stage_index: d.stage_index as usize,
                handler: d.handler,
                item_index: d.item_index as u32,
                attempts: d.attempt as u32,
                errors: serde_json::from_value::<Vec<AttemptError>>(d.errors.0).unwrap_or_default(),
            })
            .collect();
        Ok(Execution {
            id: row.id,
            workflow: row.workflow_name,
            version: row.workflow_version,
            status,
            input: row.input.0,
            idempotency_key: row.idempotency_key,
            output,
            error: row.error,
            current_stage: row.current_stage as usize,
            stages: stages
                .into_iter()
                .map(|s| StageProgress {
                    index: s.stage_index as usize,
                    name: s.stage_name,
                    kind: s.kind,
                    group_id: s.id,
                    width: s.width as u32,
                    remaining: s.remaining.map_or(s.pending + s.running, i64::from) as u32,
                    fan_in: s.fan_in.parse().ok(),
                    pending: s.pending as u32,
                    running: s.running as u32,
                    completed: s.completed as u32,
                    dead: s.dead as u32,
                    cancelled: s.cancelled as u32,
                    attempts: s.attempts as u64,
                    entered_at: s.entered_at,
                    fired_at: s.fired_at,
                })
                .collect(),
            dead_letters,
            created_at: row.created_at,
            updated_at: row.updated_at,
            finished_at: row.finished_at,
            deadline: row.deadline_at,
        })
    }

    /// The status alone (one cheap query).
    ///
    /// # Errors
    /// [`Error::ExecutionNotFound`]; [`Error::Database`].
    pub async fn status(&self, id: ExecutionId) -> Result<ExecutionStatus> {
        executions::status(&self.inner.pool, id)
            .await?
            .map(|s| ExecutionStatus::parse(&s))
            .ok_or(Error::ExecutionNotFound(id))
    }

    /// Waits until the execution is terminal (completed, failed, cancelled or timed out)
    /// and returns its snapshot.
    ///
    /// # Errors
    /// [`Error::WaitTimeout`] after `timeout` (the execution goes on);
    /// [`Error::ExecutionNotFound`]; [`Error::Database`].
    ///
    /// # Cancel safety
    /// Only reads: dropping the future changes nothing.
    pub async fn wait(&self, id: ExecutionId, timeout: Duration) -> Result<Execution> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut pause = Duration::from_millis(5);
        loop {
            if self.status(id).await?.is_terminal() {
                return self.execution(id).await;
            }
            if tokio::time::Instant::now() + pause > deadline {
                return Err(Error::WaitTimeout(id));
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(200));
        }
    }

    /// Cancels a running execution: its pending tasks are cancelled in the same
    /// transaction, so queued work never runs; members already running may finish, but
    /// nothing is dispatched after them. Returns false if it was not running.
    ///
    /// # Errors
    /// [`Error::ExecutionNotFound`]; [`Error::Database`].
    pub async fn cancel(&self, id: ExecutionId) -> Result<bool> {
        let stopped = retry_conflicts(|| async {
            let mut tx = self.inner.pool.begin().await?;
            let stopped = executions::stop(&mut tx, id, "cancelled", None).await?;
            tx.commit().await?;
            Ok(stopped)
        })
        .await?;
        if !stopped {
            // Not running: tell a finished execution from one that does not exist.
            self.status(id).await?;
        }
        Ok(stopped)
    }

    /// A builder for a worker that runs this engine's tasks.
    pub fn worker(&self) -> WorkerBuilder {
        WorkerBuilder::new(self.clone())
    }

    /// The definition of `name` at `version`, from the cache or the database.
    pub(crate) async fn definition(
        &self,
        conn: &mut PgConnection,
        name: &str,
        version: i32,
    ) -> Result<Arc<Workflow>> {
        match self.cached_definition(name, version) {
            Some(wf) => Ok(wf),
            None => Ok(self.cache(workflows::load(conn, name, Some(version)).await?)),
        }
    }

    /// The definition of `name` at `version` if this process has seen it.
    pub(crate) fn cached_definition(&self, name: &str, version: i32) -> Option<Arc<Workflow>> {
        self.inner
            .definitions
            .read()
            .expect("definition cache poisoned")
            .get(&(name.to_owned(), version))
            .cloned()
    }

    /// Definitions never change once registered, so caching them is always safe.
    fn cache(&self, workflow: Workflow) -> Arc<Workflow> {
        let key = (workflow.name().to_owned(), workflow.version());
        let workflow = Arc::new(workflow);
        self.inner
            .definitions
            .write()
            .expect("definition cache poisoned")
            .entry(key)
            .or_insert(workflow)
            .clone()
    }
}
