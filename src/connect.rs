//! Connecting: a pool on a URL, the `PG*` environment or options of your own, with its
//! sessions pinned to READ COMMITTED, and an error that names the server when it cannot
//! be reached.

use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Connection};

use crate::engine::Engine;
use crate::error::{ConnectError, Error, Result};
use crate::fanin::FanInStrategy;

/// `options` with their sessions pinned to READ COMMITTED (`default_transaction_isolation`,
/// sent with each connection's startup: no round trip), for a pool of your own to give
/// [`Engine::new`] where the server, database or role defaults to another level.
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
///
/// let options: PgConnectOptions = "postgres://app@db/app".parse()?;
/// let pool = PgPoolOptions::new()
///     .max_connections(20)
///     .connect_with(confluo::read_committed(options))
///     .await?;
/// let engine = confluo::Engine::new(pool);
/// # Ok(()) }
/// ```
pub fn read_committed(options: PgConnectOptions) -> PgConnectOptions {
    options.options([crate::store::READ_COMMITTED_OPTION])
}

/// Where and how to connect an [`Engine`], for what [`Engine::connect`] does not set: the
/// pool's size, the `application_name` operators see in `pg_stat_activity`, time-outs,
/// the default fan-in strategy. No sqlx types needed.
///
/// ```no_run
/// # async fn demo() -> confluo::Result<()> {
/// use std::time::Duration;
///
/// let engine = confluo::ConnectBuilder::from_env() // DATABASE_URL, else PG*
///     .max_connections(20)
///     .application_name("billing-worker")
///     .connect_timeout(Duration::from_secs(5))
///     .connect()
///     .await?;
/// # let _ = engine; Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct ConnectBuilder {
    target: Target,
    max_connections: u32,
    application_name: Option<String>,
    connect_timeout: Duration,
    acquire_timeout: Duration,
    fan_in: FanInStrategy,
    transaction_pooler: bool,
}

#[derive(Debug, Clone)]
enum Target {
    Url(String),
    Env,
    Options(Box<PgConnectOptions>),
}

impl ConnectBuilder {
    fn with(target: Target) -> Self {
        ConnectBuilder {
            target,
            max_connections: 10,
            application_name: None,
            connect_timeout: Duration::from_secs(10),
            acquire_timeout: Duration::from_secs(30),
            fan_in: FanInStrategy::default(),
            transaction_pooler: false,
        }
    }

    /// To the database of a URL, e.g. `postgres://app:secret@db/app?sslmode=verify-full`
    /// (see the README's TLS section for `sslmode` and `sslrootcert`).
    pub fn new(url: impl Into<String>) -> Self {
        Self::with(Target::Url(url.into()))
    }

    /// To `DATABASE_URL` if set, else PostgreSQL's usual `PG*` variables (`PGHOST`,
    /// `PGPORT`, `PGUSER`, `PGPASSWORD`, `PGDATABASE`, ...).
    pub fn from_env() -> Self {
        Self::with(Target::Env)
    }

    /// With sqlx's connect options, for what a URL cannot say.
    pub fn from_options(options: PgConnectOptions) -> Self {
        Self::with(Target::Options(Box::new(options)))
    }

    /// Connections in the pool at most (default 10). A worker uses one per claim,
    /// acknowledgement batch or renewal at a time, plus one for `LISTEN`.
    pub fn max_connections(mut self, n: u32) -> Self {
        self.max_connections = n.max(1);
        self
    }

    /// The `application_name` of the pool's sessions (what `pg_stat_activity` shows).
    pub fn application_name(mut self, name: impl Into<String>) -> Self {
        self.application_name = Some(name.into());
        self
    }

    /// How long the first connection may take before [`connect`](Self::connect) gives up
    /// (default 10 s).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// How long a call waits for a free connection of the pool (default 30 s).
    pub fn acquire_timeout(mut self, timeout: Duration) -> Self {
        self.acquire_timeout = timeout;
        self
    }

    /// The default fan-in strategy of executions started through this engine; see
    /// [`EngineBuilder::fan_in`](crate::EngineBuilder::fan_in).
    pub fn fan_in(mut self, strategy: FanInStrategy) -> Self {
        self.fan_in = strategy;
        self
    }

    /// The URL is a pooler in transaction mode (PgBouncer's `pool_mode = transaction`):
    /// statements are prepared unnamed and run inside transactions, and the sessions'
    /// isolation is not pinned with a startup option (PgBouncer refuses startup options it
    /// does not know; every statement pins READ COMMITTED itself). See
    /// [`EngineBuilder::transaction_pooler`](crate::EngineBuilder::transaction_pooler) for
    /// all it changes, and apply migrations over a direct connection.
    ///
    /// ```no_run
    /// # async fn demo() -> confluo::Result<()> {
    /// let engine = confluo::ConnectBuilder::new("postgres://app@pgbouncer:6432/app")
    ///     .transaction_pooler()
    ///     .max_connections(2)
    ///     .connect()
    ///     .await?;
    /// # let _ = engine; Ok(()) }
    /// ```
    pub fn transaction_pooler(mut self) -> Self {
        self.transaction_pooler = true;
        self
    }

    /// Connects once, to fail at once with the reason when the server cannot be reached
    /// or refuses, then opens the pool: its sessions pinned to READ COMMITTED (see
    /// [`read_committed`]), and no ping each time it hands a connection out (sqlx's
    /// default; a connection that died is found out by the statement that uses it, and
    /// every confluo write is safe to repeat).
    ///
    /// # Errors
    /// [`Error::NoDatabaseConfigured`] ([`from_env`](Self::from_env) with nothing set);
    /// [`Error::InvalidDatabaseUrl`]; [`Error::Connect`], naming the server and why
    /// (refused, no answer in time, authentication, no such database, TLS).
    ///
    /// # Cancel safety
    /// Dropped before it returns, nothing is left connected.
    pub async fn connect(self) -> Result<Engine> {
        let mut options = match self.target {
            Target::Url(url) => {
                url.parse::<PgConnectOptions>()
                    .map_err(|e| Error::InvalidDatabaseUrl {
                        reason: url_reason(&e),
                    })?
            }
            Target::Options(options) => *options,
            Target::Env => match std::env::var("DATABASE_URL") {
                Ok(url) => {
                    url.parse::<PgConnectOptions>()
                        .map_err(|e| Error::InvalidDatabaseUrl {
                            reason: format!("DATABASE_URL: {}", url_reason(&e)),
                        })?
                }
                Err(_) if std::env::vars().any(|(k, _)| k.starts_with("PG")) => {
                    PgConnectOptions::new()
                }
                Err(_) => return Err(Error::NoDatabaseConfigured),
            },
        };
        if let Some(name) = &self.application_name {
            options = options.application_name(name);
        }
        let options = if self.transaction_pooler {
            options
        } else {
            read_committed(options)
        };
        let server = server_of(&options);
        let first = tokio::time::timeout(self.connect_timeout, options.connect()).await;
        match first {
            Ok(Ok(conn)) => {
                let _ = conn.close().await;
            }
            Ok(Err(error)) => return Err(Error::Connect(ConnectError::new(server, error))),
            Err(_) => {
                return Err(Error::Connect(ConnectError::timed_out(
                    server,
                    self.connect_timeout,
                )))
            }
        }
        let pool = PgPoolOptions::new()
            .max_connections(self.max_connections)
            .acquire_timeout(self.acquire_timeout)
            .test_before_acquire(false)
            .connect_lazy_with(options);
        let builder = Engine::builder(pool).fan_in(self.fan_in);
        Ok(if self.transaction_pooler {
            builder.transaction_pooler().build()
        } else {
            builder.build()
        })
    }
}

/// Where `options` point, as a person would write it: `host:port/database`, or the
/// socket's directory.
fn server_of(options: &PgConnectOptions) -> String {
    format!(
        "{}:{}/{}",
        options.get_host(),
        options.get_port(),
        options.get_database().unwrap_or(options.get_username())
    )
}

/// Why a URL did not parse, without repeating the URL (it may hold a password).
fn url_reason(error: &sqlx::Error) -> String {
    match error {
        sqlx::Error::Configuration(e) => e.to_string(),
        other => other.to_string(),
    }
}

impl Engine {
    /// Connects a pool of up to 10 connections to `url` (TLS as the URL says: see the
    /// README's TLS section). [`ConnectBuilder`] sets more.
    ///
    /// The pool's sessions are pinned to READ COMMITTED (`default_transaction_isolation`,
    /// sent with each connection's startup), whatever the server's, database's or role's
    /// default: confluo's statements are designed for it (see [`Engine::new`]).
    ///
    /// # Errors
    /// [`Error::InvalidDatabaseUrl`]; [`Error::Connect`], at once, naming the server and
    /// why it cannot be reached or refused.
    ///
    /// # Cancel safety
    /// Dropped before it returns, nothing is left connected.
    pub async fn connect(url: &str) -> Result<Self> {
        ConnectBuilder::new(url).connect().await
    }

    /// [`connect`](Self::connect) with connect options of your own (TLS, application
    /// name, ...); READ COMMITTED is pinned on top of them.
    ///
    /// # Errors
    /// [`Error::Connect`].
    ///
    /// # Cancel safety
    /// As [`connect`](Self::connect).
    pub async fn connect_with(options: PgConnectOptions) -> Result<Self> {
        ConnectBuilder::from_options(options).connect().await
    }

    /// Connects from the environment: `DATABASE_URL` if set, else PostgreSQL's usual `PG*`
    /// variables (`PGHOST`, `PGPORT`, `PGUSER`, `PGPASSWORD`, `PGDATABASE`, ...).
    ///
    /// # Errors
    /// [`Error::NoDatabaseConfigured`] when neither is set; as [`connect`](Self::connect).
    ///
    /// # Cancel safety
    /// As [`connect`](Self::connect).
    pub async fn connect_env() -> Result<Self> {
        ConnectBuilder::from_env().connect().await
    }
}
