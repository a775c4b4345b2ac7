//! The library's typed errors.

use crate::definition::DefinitionError;

/// Everything a confluo call can fail with.
///
/// Branch on the `is_*` predicates rather than on variants where one exists: the enum is
/// `#[non_exhaustive]` and grows as the engine does.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The workflow definition was rejected at registration.
    #[error("invalid workflow definition: {0}")]
    InvalidDefinition(#[from] DefinitionError),

    /// A different definition is already registered under this name and version.
    /// Definitions are immutable once registered: register a new version instead.
    #[error("workflow {name} v{version} is already registered with a different definition")]
    DefinitionConflict {
        /// The workflow name.
        name: String,
        /// The version that is taken.
        version: i32,
    },

    /// No workflow of this name (and version, when one was asked for) is registered.
    #[error("workflow {name}{} is not registered", version.map(|v| format!(" v{v}")).unwrap_or_default())]
    WorkflowNotFound {
        /// The workflow name.
        name: String,
        /// The version asked for, if any.
        version: Option<i32>,
    },

    /// A [`Stage::map_workflow`](crate::Stage::map_workflow) names a workflow (or version)
    /// that is not registered.
    #[error(
        "stage {stage:?} of workflow {workflow} maps over workflow {child}{}, which is not \
         registered: register the child workflow first",
        version.map(|v| format!(" v{v}")).unwrap_or_default()
    )]
    UnknownChildWorkflow {
        /// The workflow being registered.
        workflow: String,
        /// Its stage.
        stage: String,
        /// The child workflow named.
        child: String,
        /// The version pinned, if any.
        version: Option<i32>,
    },

    /// No execution has this id.
    #[error("execution {0} not found")]
    ExecutionNotFound(crate::ExecutionId),

    /// No task has this id.
    #[error("task {0} not found")]
    TaskNotFound(crate::TaskId),

    /// The task asked to be reprocessed is not dead-lettered.
    #[error("task {task} is {status}, not dead-lettered: only dead letters can be reprocessed")]
    NotDeadLettered {
        /// The task.
        task: crate::TaskId,
        /// Its status (`pending`, `running`, `completed` or `cancelled`).
        status: String,
    },

    /// The dead letter's execution is completed, cancelled or timed out: reprocessing it
    /// would run work whose result nothing reads. (A failed execution is resumed.)
    #[error("execution {execution} is {status}: its dead letters cannot be reprocessed")]
    ExecutionNotResumable {
        /// The execution.
        execution: crate::ExecutionId,
        /// Its status.
        status: crate::ExecutionStatus,
    },

    /// The dead letter's execution failed and its deadline has passed since: resumed, it
    /// would be timed out at once and what was requeued cancelled.
    #[error("execution {execution} is past its deadline: its dead letters cannot be reprocessed")]
    DeadlinePassed {
        /// The execution.
        execution: crate::ExecutionId,
    },

    /// Resuming the dead letter's execution would fail it again at once: a stage that
    /// finished while it was failed, fired by the resume, fails on entering what follows
    /// it (a branch without a matching arm, a child input that does not fit). Nothing was
    /// requeued; the dead letter stays.
    #[error(
        "execution {execution} cannot be resumed: on resuming, {reason}; the dead letter \
         stays (cancel the execution, or start a new one with an input that avoids this)"
    )]
    ResumeFailsAtOnce {
        /// The execution.
        execution: crate::ExecutionId,
        /// The failure the resume would record.
        reason: String,
    },

    /// Resuming the dead letter's execution could not move it on: every stage it entered
    /// has fired, so what the resume would requeue (members of stages that went on
    /// without them) can fire nothing. It failed on entering a stage, not on a task (a
    /// map joined `any` or `at_least(k)` over fewer than k elements, a branch without a
    /// matching arm), and no reprocess undoes that. Nothing was requeued; the dead letter
    /// stays.
    #[error(
        "execution {execution} cannot be resumed: it failed on entering a stage ({error}), \
         and every stage it entered has fired, so nothing a reprocess requeues can move it \
         on; the dead letter stays (cancel the execution, or start a new one with an input \
         that avoids this)"
    )]
    ResumeMovesNothing {
        /// The execution.
        execution: crate::ExecutionId,
        /// The failure it stays failed with.
        error: String,
    },

    /// A worker was started without a handler for a stage (or branch) of a workflow it serves.
    #[error(
        "workflow {workflow} v{version} needs a handler named {handler:?}, and the worker has none"
    )]
    MissingHandler {
        /// The workflow name.
        workflow: String,
        /// The version checked.
        version: i32,
        /// The handler (stage or branch) name with no handler.
        handler: String,
    },

    /// A worker was started without any handler.
    #[error("the worker has no handlers: register at least one with WorkerBuilder::handler")]
    NoHandlers,

    /// The execution input does not fit the workflow, e.g. a map as first stage needs an array.
    #[error("invalid input for workflow {workflow}: {reason}")]
    InvalidInput {
        /// The workflow name.
        workflow: String,
        /// What is wrong with it.
        reason: String,
    },

    /// A callback URL given to [`StartOptions::callback`](crate::StartOptions::callback)
    /// that cannot be posted to. Nothing was started.
    #[error(
        "callback URL {url:?} is invalid: {reason}; give an http:// or https:// URL with a host"
    )]
    InvalidCallback {
        /// The URL given.
        url: String,
        /// Why it is refused.
        reason: &'static str,
    },

    /// The execution's workflow version has no signal wait of this name.
    #[error(
        "execution {execution} (workflow {workflow} v{version}) waits for no signal named          {name:?}; {}",
        match known.as_slice() {
            [] => "its workflow has no signal stage".to_owned(),
            names => format!("it waits for {}: check the name", names.iter().map(|n| format!("{n:?}")).collect::<Vec<_>>().join(", ")),
        }
    )]
    UnknownSignal {
        /// The execution.
        execution: crate::ExecutionId,
        /// Its workflow.
        workflow: String,
        /// Its workflow's version (executions stay on the version they started with).
        version: i32,
        /// The signal name given.
        name: String,
        /// The names its signal waits have.
        known: Vec<String>,
    },

    /// A signal's payload cannot be its wait's output. Nothing was kept.
    #[error("signal {name:?} was refused, nothing kept: {reason}")]
    InvalidSignal {
        /// The signal.
        name: String,
        /// What is wrong with its payload.
        reason: String,
    },

    /// A task's output does not fit the next stage, e.g. a step followed by a map must
    /// return an array. Nothing was recorded: the attempt should be failed instead.
    #[error("invalid output of task {task}: {reason}")]
    InvalidOutput {
        /// The task whose output was refused.
        task: crate::TaskId,
        /// What is wrong with it.
        reason: String,
    },

    /// A map's input has more elements than a map may have
    /// ([`MAX_MAP_WIDTH`](crate::MAX_MAP_WIDTH)). Nothing was started.
    #[error(
        "workflow {workflow:?}: the map stage {stage:?} would have {width} members, more than \
         the {max} a map may have; split the input over several executions, or map over \
         batches of items"
    )]
    MapTooWide {
        /// The workflow.
        workflow: String,
        /// The map stage's name.
        stage: String,
        /// The members asked for.
        width: usize,
        /// [`MAX_MAP_WIDTH`](crate::MAX_MAP_WIDTH).
        max: usize,
    },

    /// The outputs of the block before a stage are too large to be one task's input.
    /// The handler can read them page by page instead.
    #[error(
        "the outputs of the block at stage {stage} take {stored} bytes as stored, more than \
         the {limit} allowed for one task's input: read them page by page with \
         `TaskContext::previous_block()` (or `Engine::block_outputs`), or raise the limit \
         with `WorkerBuilder::inline_block_input`"
    )]
    BlockInputTooLarge {
        /// The block's stage index.
        stage: usize,
        /// Bytes its members' outputs take, as PostgreSQL stores them.
        stored: u64,
        /// The limit.
        limit: u64,
    },

    /// A group was created with a fan-in strategy this build does not know (e.g. `naive`,
    /// without the `naive-fan-in` feature).
    #[error(transparent)]
    UnknownFanIn(#[from] crate::fanin::UnknownStrategy),

    /// A task's row holds something this build of confluo cannot act on: a fan-in
    /// strategy it does not know (a newer version wrote it, or `naive` without the
    /// `naive-fan-in` feature), a stage its workflow does not have. The task is left for a
    /// worker that can: given back when it was claimed, skipped when it was reclaimed.
    #[error(
        "task {task} cannot be handled by this build of confluo: {reason}; it was left for \
         a worker that can (upgrade this one, or run `confluo doctor` and inspect the row)"
    )]
    UnreadableTask {
        /// The task.
        task: crate::TaskId,
        /// What this build cannot read.
        reason: String,
    },

    /// Serializing an input or deserializing a stored value failed.
    #[error("JSON (de)serialization failed: {0}")]
    Json(#[from] serde_json::Error),

    /// Waiting for an execution ran out of time; the execution itself goes on.
    #[error("timed out waiting for execution {0}")]
    WaitTimeout(crate::ExecutionId),

    /// No database URL was given and none is set in the environment.
    #[error(
        "no database configured: set DATABASE_URL (e.g. \
         postgres://postgres@127.0.0.1:5432/postgres) or the PG* variables, or pass a URL"
    )]
    NoDatabaseConfigured,

    /// The database URL does not parse. (The URL is not repeated: it may hold a password.)
    #[error(
        "the database URL is not valid ({reason}): write it as \
         postgres://user:password@host:port/database"
    )]
    InvalidDatabaseUrl {
        /// What is wrong with it.
        reason: String,
    },

    /// The server could not be reached, or refused the connection.
    #[error(transparent)]
    Connect(#[from] ConnectError),

    /// The database has no confluo schema, or an older one than this build needs.
    #[error(
        "the database has no confluo schema, or an older one ({detail}): run \
         `confluo migrate`, or call Engine::migrate() when your service starts"
    )]
    NotMigrated {
        /// What PostgreSQL said was missing.
        detail: String,
    },

    /// The pool's connections default to an isolation level other than READ COMMITTED
    /// (`default_transaction_isolation`, set for the server, database or role). confluo
    /// pins READ COMMITTED on its own transactions, but its single statements run at the
    /// session's level, and under REPEATABLE READ or SERIALIZABLE they fail with
    /// serialization errors where READ COMMITTED re-reads the row.
    #[error(
        "the pool's connections default to {found} isolation, and confluo's statements need \
         READ COMMITTED: connect with Engine::connect or Engine::connect_with (which pin it), \
         or build your pool from confluo::read_committed(your_connect_options) (which sets \
         default_transaction_isolation for its sessions)"
    )]
    IsolationNotReadCommitted {
        /// The level the connections default to, e.g. `serializable`.
        found: String,
    },

    /// Something that needs a PostgreSQL session of its own was asked of an engine behind
    /// a transaction pooler ([`ConnectBuilder::transaction_pooler`](crate::ConnectBuilder::transaction_pooler)),
    /// which hands each transaction to any server connection and keeps no session state.
    #[error(
        "{what} needs a PostgreSQL session of its own, which a transaction pooler \
         (PgBouncer in transaction mode) does not keep: {remedy}"
    )]
    NeedsDirectConnection {
        /// What was asked, e.g. `applying migrations`.
        what: &'static str,
        /// What to do instead.
        remedy: &'static str,
    },

    /// Applying the embedded migrations failed.
    #[error(transparent)]
    Migrate(#[from] sqlx::migrate::MigrateError),

    /// The database reported an error or could not be reached. Its text is said once
    /// (the sqlx error is the variant's value, not a second link of the error's chain).
    #[error("{}", database_message(.0))]
    Database(sqlx::Error),
}

impl From<sqlx::Error> for Error {
    fn from(error: sqlx::Error) -> Self {
        if let sqlx::Error::Database(db) = &error {
            let message = db.message();
            let ours = message.contains("\"confluo") || message.contains("confluo.");
            // Undefined table, column or function; no such schema.
            if ours
                && matches!(
                    db.code().as_deref(),
                    Some("42P01" | "42703" | "42883" | "3F000")
                )
            {
                return Error::NotMigrated {
                    detail: message.to_owned(),
                };
            }
        }
        Error::Database(error)
    }
}

fn database_message(error: &sqlx::Error) -> String {
    match error {
        sqlx::Error::Database(db) => match db.code() {
            Some(code) => format!("PostgreSQL: {} (SQLSTATE {code})", db.message()),
            None => format!("PostgreSQL: {}", db.message()),
        },
        sqlx::Error::PoolTimedOut => "no database connection came free in time: the pool is \
            too small for the load (ConnectBuilder::max_connections), or the server stopped \
            answering"
            .to_owned(),
        other => other.to_string(),
    }
}

/// Why the server could not be reached or refused, naming it.
#[derive(Debug, thiserror::Error)]
#[error("cannot connect to PostgreSQL at {server}: {reason}")]
pub struct ConnectError {
    server: String,
    reason: String,
    error: Option<sqlx::Error>,
}

impl ConnectError {
    pub(crate) fn new(server: String, error: sqlx::Error) -> Self {
        let reason = match &error {
            sqlx::Error::Io(io) if io.kind() == std::io::ErrorKind::ConnectionRefused => {
                "connection refused: is PostgreSQL running, and listening on that address \
                 and port?"
                    .to_owned()
            }
            sqlx::Error::Io(io) if io.kind() == std::io::ErrorKind::NotFound => {
                "no server socket there: is PostgreSQL running, and is that its socket \
                 directory?"
                    .to_owned()
            }
            sqlx::Error::Io(io) if io.to_string().contains("certificate") => format!(
                "{io} (TLS: sslrootcert must hold the CA that signed the server's \
                 certificate, and the host must be a name the certificate carries)"
            ),
            sqlx::Error::Io(io) => io.to_string(),
            sqlx::Error::Tls(tls) => format!("TLS: {tls} (check sslmode and sslrootcert)"),
            sqlx::Error::Database(db) => match db.code().as_deref() {
                Some("28P01" | "28000") => format!(
                    "{} (check the user and password in the URL, and pg_hba.conf)",
                    db.message()
                ),
                Some("3D000") => format!(
                    "{} (create it with CREATE DATABASE, or name one that exists)",
                    db.message()
                ),
                _ => db.message().to_owned(),
            },
            other => other.to_string(),
        };
        ConnectError {
            server,
            reason,
            error: Some(error),
        }
    }

    pub(crate) fn timed_out(server: String, after: std::time::Duration) -> Self {
        ConnectError {
            server,
            reason: format!(
                "no answer within {after:?} (is the host right, and does a firewall let \
                 the port through?)"
            ),
            error: None,
        }
    }

    /// The server, as `host:port/database` (or the socket directory for the host).
    pub fn server(&self) -> &str {
        &self.server
    }

    /// sqlx's error, when there was one (`None` when the attempt timed out).
    pub fn sqlx_error(&self) -> Option<&sqlx::Error> {
        self.error.as_ref()
    }
}

impl Error {
    /// Whether the definition was rejected (invalid or conflicting).
    pub fn is_invalid_definition(&self) -> bool {
        matches!(
            self,
            Error::InvalidDefinition(_) | Error::DefinitionConflict { .. }
        )
    }

    /// Whether something asked for does not exist (workflow, execution or task).
    pub fn is_not_found(&self) -> bool {
        matches!(
            self,
            Error::WorkflowNotFound { .. } | Error::ExecutionNotFound(_) | Error::TaskNotFound(_)
        )
    }

    /// Whether the error comes from the database or the connection to it. Such errors are
    /// usually transient; every confluo write is safe to retry.
    pub fn is_database(&self) -> bool {
        matches!(
            self,
            Error::Database(_) | Error::Migrate(_) | Error::Connect(_)
        )
    }

    /// Whether the transaction lost a deadlock or serialization race and was rolled back
    /// as a whole; repeating the call is safe.
    pub(crate) fn is_retryable_conflict(&self) -> bool {
        match self {
            Error::Database(sqlx::Error::Database(db)) => {
                matches!(db.code().as_deref(), Some("40P01") | Some("40001"))
            }
            _ => false,
        }
    }
}

/// How many times a transaction that lost a deadlock (or a serialization race) is
/// repeated.
pub(crate) const CONFLICT_RETRIES: u32 = 5;

/// Runs `attempt` again while it loses a deadlock or serialization race, at most
/// [`CONFLICT_RETRIES`] more times. Each attempt must be one whole transaction (rolled
/// back as a whole when it lost), so repeating it is safe.
pub(crate) async fn retry_conflicts<T, F, Fut>(mut attempt: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T>>,
{
    let mut conflicts = 0;
    loop {
        match attempt().await {
            Err(e) if e.is_retryable_conflict() && conflicts < CONFLICT_RETRIES => conflicts += 1,
            other => return other,
        }
    }
}

/// `Result` with confluo's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
