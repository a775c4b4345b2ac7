//! The public entry point: connecting, migrating, registering workflows, querying,
//! waiting for and cancelling executions (starting them is in [`crate::start`]).

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use sqlx::{PgConnection, PgPool};

use crate::definition::Workflow;
use crate::error::{retry_conflicts, Error, Result};
use crate::execution::{AttemptError, DeadLetter, Execution, ExecutionStatus, StageProgress};
use crate::fanin::FanInStrategy;
use crate::ids::ExecutionId;
use crate::store::{self, executions, groups, workflows};

/// A handle on confluo's tables in one PostgreSQL database. Cheap to clone; clones share
/// the pool and the definition cache. Connect with [`Engine::connect`] (or
/// [`ConnectBuilder`](crate::ConnectBuilder) for a pool size, an application name, ...),
/// or wrap a pool of your own with [`Engine::new`].
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
    transaction_pooler: bool,
    definitions: RwLock<HashMap<(String, i32), Arc<Workflow>>>,
    /// Expired tasks this process could not reclaim (an unreadable row): later passes
    /// skip them rather than trip on them again, and each is reported once.
    unreclaimable: std::sync::Mutex<std::collections::HashSet<crate::TaskId>>,
}

/// Builds an [`Engine`] with non-default options.
#[derive(Debug)]
pub struct EngineBuilder {
    pool: PgPool,
    fan_in: FanInStrategy,
    transaction_pooler: bool,
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

    /// The pool goes through a pooler in transaction mode (PgBouncer's `pool_mode =
    /// transaction`), which hands each transaction to whichever server connection is free
    /// and keeps no session state (off by default). Then:
    ///
    /// - every statement is prepared unnamed, and one that runs outside a transaction runs
    ///   in a READ COMMITTED transaction of its own (two round trips more). This is
    ///   process-wide: from the first such engine built on, every engine of the process
    ///   prepares its statements unnamed (correct on a direct connection too, at the cost
    ///   of a parse per statement);
    /// - the pool's sessions need no isolation pin: every statement runs in a transaction
    ///   that pins READ COMMITTED;
    /// - [`Engine::migrate`] refuses ([`Error::NeedsDirectConnection`]): migrations hold a
    ///   session lock, so apply them over a direct connection;
    /// - a worker does not `LISTEN` through the pool: by default it polls, or listens on
    ///   a direct connection ([`Notifications::Direct`](crate::Notifications::Direct)).
    ///
    /// The fan-in's guarantees are unchanged: they rest on row locks and guarded updates
    /// inside single transactions, which a transaction pooler keeps on one server
    /// connection. See the README's "Behind PgBouncer".
    pub fn transaction_pooler(mut self) -> Self {
        self.transaction_pooler = true;
        self
    }

    /// Builds the engine.
    pub fn build(self) -> Engine {
        if self.transaction_pooler {
            store::use_unnamed_statements();
        }
        Engine {
            inner: Arc::new(Inner {
                pool: self.pool,
                fan_in: self.fan_in,
                transaction_pooler: self.transaction_pooler,
                definitions: RwLock::new(HashMap::new()),
                unreclaimable: Default::default(),
            }),
        }
    }
}

impl Engine {
    /// An engine on the caller's pool, with default options.
    ///
    /// The pool's sessions must default to READ COMMITTED, PostgreSQL's own default:
    /// confluo pins it on every transaction it begins, but its autocommitted statements
    /// (claims, batched acknowledgements) run at the session's level, and
    /// [`WorkerBuilder::start`](crate::WorkerBuilder::start) refuses a pool whose level is
    /// another ([`Error::IsolationNotReadCommitted`]). If the server, database or role sets
    /// `default_transaction_isolation`, build the pool from [`read_committed`](crate::read_committed)`(options)`,
    /// or use [`Engine::connect_with`].
    pub fn new(pool: PgPool) -> Self {
        Self::builder(pool).build()
    }

    /// An engine on the caller's pool, with options to set.
    pub fn builder(pool: PgPool) -> EngineBuilder {
        EngineBuilder {
            pool,
            fan_in: FanInStrategy::default(),
            transaction_pooler: false,
        }
    }

    /// The pool this engine uses.
    pub fn pool(&self) -> &PgPool {
        &self.inner.pool
    }

    /// The default fan-in strategy of executions started through this engine.
    pub fn fan_in(&self) -> FanInStrategy {
        self.inner.fan_in
    }

    /// Whether this engine's pool goes through a transaction pooler
    /// ([`EngineBuilder::transaction_pooler`]).
    pub fn through_transaction_pooler(&self) -> bool {
        self.inner.transaction_pooler
    }

    /// Creates or upgrades confluo's schema (`confluo`) with the embedded migrations.
    /// Idempotent and safe to call from several processes at once.
    ///
    /// # Errors
    /// [`Error::Migrate`] or [`Error::Database`]; [`Error::NeedsDirectConnection`] behind a
    /// transaction pooler ([`EngineBuilder::transaction_pooler`]).
    ///
    /// # Cancel safety
    /// Each migration is applied in a transaction of its own: dropped, those applied stay
    /// applied and calling it again applies the rest.
    pub async fn migrate(&self) -> Result<()> {
        if self.inner.transaction_pooler {
            return Err(Error::NeedsDirectConnection {
                what: "applying migrations",
                remedy: "apply them over a direct connection to PostgreSQL \
                         (Engine::connect(direct_url).await?.migrate(), or `confluo migrate` \
                         with a direct DATABASE_URL), then start this engine",
            });
        }
        store::migrate(&self.inner.pool).await
    }

    /// Whether the database answers with the schema this build needs: a readiness probe
    /// that reads no row, cheap however large the tables.
    ///
    /// # Errors
    /// [`Error::NotMigrated`]; [`Error::Database`] when the server cannot be reached.
    ///
    /// # Cancel safety
    /// Reads nothing: dropping it changes nothing.
    pub async fn ready(&self) -> Result<()> {
        store::probe(&self.inner.pool).await
    }

    /// Validates a definition and stores it. Registering an identical definition again is
    /// a no-op, so every process can register what it runs at start.
    ///
    /// # Errors
    /// [`Error::InvalidDefinition`] for an invalid definition;
    /// [`Error::DefinitionConflict`] if this name and version hold another definition;
    /// [`Error::UnknownChildWorkflow`] when a [`Stage::map_workflow`](crate::Stage::map_workflow)
    /// names a workflow (or version) not registered yet (a workflow may map over its own
    /// name: a tree walk, which ends where an input array is empty).
    ///
    /// # Cancel safety
    /// Reads, then one statement: dropped, the definition is stored or not; registering it
    /// again is a no-op if it was.
    pub async fn register(&self, workflow: &Workflow) -> Result<()> {
        workflow.validate()?;
        for (stage, child, version) in workflow.child_workflows() {
            let itself =
                child == workflow.name() && version.is_none_or(|v| v == workflow.version());
            if itself {
                continue;
            }
            match workflows::load(&self.inner.pool, child, version).await {
                Err(Error::WorkflowNotFound { .. }) => {
                    return Err(Error::UnknownChildWorkflow {
                        workflow: workflow.name().to_owned(),
                        stage: stage.to_owned(),
                        child: child.to_owned(),
                        version,
                    })
                }
                other => {
                    other?;
                }
            }
        }
        workflows::register(&self.inner.pool, workflow).await?;
        self.cache(workflow.clone());
        Ok(())
    }

    /// A snapshot of an execution: status, output, per-stage progress, dead letters.
    ///
    /// # Errors
    /// [`Error::ExecutionNotFound`]; [`Error::Database`].
    ///
    /// # Cancel safety
    /// Reads only: dropping it changes nothing.
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
                    quorum: s.quorum.map(|k| k as u32),
                    pending: s.pending as u32,
                    running: s.running as u32,
                    completed: s.completed as u32,
                    dead: s.dead as u32,
                    cancelled: s.cancelled as u32,
                    attempts: s.attempts as u64,
                    entered_at: s.entered_at,
                    fired_at: s.fired_at,
                    branch: s.branch.map(|b| b.0),
                    wakes_at: s.wakes_at,
                })
                .collect(),
            dead_letters,
            created_at: row.created_at,
            updated_at: row.updated_at,
            finished_at: row.finished_at,
            deadline: row.deadline_at,
            parent: row.parent_execution,
        })
    }

    /// The status alone (one cheap query).
    ///
    /// # Errors
    /// [`Error::ExecutionNotFound`]; [`Error::Database`].
    ///
    /// # Cancel safety
    /// Reads only: dropping it changes nothing.
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
    /// nothing is dispatched after them. Its child workflows' executions (and theirs)
    /// are cancelled next, before this returns, in transactions of their own
    /// ([`cancel_orphans`](Self::cancel_orphans)); should that fail, workers' housekeeping
    /// finishes it. Returns false if it was not running.
    ///
    /// # Errors
    /// [`Error::ExecutionNotFound`]; [`Error::Database`].
    ///
    /// # Cancel safety
    /// One transaction: dropped before its commit, nothing is cancelled. If the commit's
    /// answer is lost, [`status`](Self::status) tells; cancelling again is harmless.
    pub async fn cancel(&self, id: ExecutionId) -> Result<bool> {
        let stopped = retry_conflicts(|| async {
            let mut tx = crate::store::begin(&self.inner.pool).await?;
            let stopped = executions::stop(&mut tx, id, "cancelled", None).await?;
            tx.commit().await?;
            Ok(stopped)
        })
        .await?;
        if !stopped {
            // Not running: tell a finished execution from one that does not exist.
            self.status(id).await?;
        } else if let Err(error) = self.cancel_orphans(usize::MAX).await {
            tracing::warn!(%error, execution_id = %id, "cancelling the children of a cancelled execution failed: workers' housekeeping will");
        }
        Ok(stopped)
    }

    /// The expired tasks this engine could not reclaim (see
    /// [`reclaim_expired`](Self::reclaim_expired)).
    pub(crate) fn unreclaimable(
        &self,
    ) -> std::sync::MutexGuard<'_, std::collections::HashSet<crate::TaskId>> {
        self.inner
            .unreclaimable
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
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
