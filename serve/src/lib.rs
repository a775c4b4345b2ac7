//! # confluo-serve
//!
//! confluo's HTTP API: a JSON interface under `/api/v1` to what the command line does
//! (start, list, inspect, cancel and signal executions; list, show and reprocess dead letters;
//! workflows, workers, stats, health) and its OpenAPI document, generated from the code
//! and served at `/api/v1/openapi.json`. `confluo serve` runs it; a service can also mount
//! [`router`] in its own axum application.
//!
//! ```no_run
//! # async fn run() -> anyhow::Result<()> {
//! let engine = confluo::Engine::connect_env().await?;
//! let config = confluo_serve::Config::new("127.0.0.1:8080".parse()?);
//! confluo_serve::serve(engine, &config, std::future::pending()).await?;
//! # Ok(()) }
//! ```
//!
//! # Security
//! It listens on 127.0.0.1 by default. Listening on any other address requires a bearer
//! token ([`Config::token`]): every request but the health and readiness probes must then
//! carry `Authorization: Bearer <token>`. Without a token, whatever the address, it
//! answers only requests whose peer is loopback and that no proxy says it forwarded
//! ([`Config::insecure_open_to_anyone_without_a_token`] is the loud way out). Behind a
//! reverse proxy, set a token: one that adds no forwarding header looks local. Write endpoints (start, cancel, signal,
//! reprocess) can be turned off ([`Config::read_only`]); they then answer 403.
//!
//! # Errors
//! Every error is JSON: `{"status": 404, "code": "execution_not_found", "message": "..."}`,
//! with 400 for bad input, 401 without the token, 403 for writes when they are off, 404 for
//! what does not exist, 409 for a conflict with the current state (cancelling an execution
//! that ended, reprocessing a task that is not dead), 503 when PostgreSQL cannot be
//! reached, and 500 otherwise.
#![forbid(unsafe_code)]
#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]

mod activity;
mod api;
mod auth;
mod dashboard;
mod error;
mod history;
mod openapi;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use confluo::Engine;

pub use auth::CLIENT_HEADER;
pub use error::{ApiError, ServeError};
pub use openapi::ApiDoc;

/// The largest request body accepted: a start's input (a map's elements) can be large.
pub const MAX_BODY_BYTES: usize = 32 * 1024 * 1024;

/// How the API is served.
#[derive(Clone)]
pub struct Config {
    listen: SocketAddr,
    token: Option<String>,
    writes: bool,
    open_beyond_loopback: bool,
}

impl std::fmt::Debug for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Config")
            .field("listen", &self.listen)
            .field("token", &self.token.as_ref().map(|_| "<set>"))
            .field("writes", &self.writes)
            .field("open_beyond_loopback", &self.open_beyond_loopback)
            .finish()
    }
}

impl Config {
    /// Serves on `listen`, with no token and writes on. An address other than a loopback
    /// one needs a [`token`](Self::token).
    pub fn new(listen: SocketAddr) -> Self {
        Config {
            listen,
            token: None,
            writes: true,
            open_beyond_loopback: false,
        }
    }

    /// **Insecure**: without a token, answers anyone who can reach it, from any address
    /// and through any proxy, with read and (unless [`read_only`](Self::read_only)) write
    /// access to every execution. Without this, a server with no token answers only
    /// requests whose peer is loopback and that no proxy forwarded, whatever address it
    /// listens on. For a network you trust entirely; a token is almost always better.
    pub fn insecure_open_to_anyone_without_a_token(mut self) -> Self {
        self.open_beyond_loopback = true;
        self
    }

    /// Requires `Authorization: Bearer <token>` on every request but the health and
    /// readiness probes.
    pub fn token(mut self, token: impl Into<String>) -> Self {
        self.token = Some(token.into());
        self
    }

    /// Turns the write endpoints (start, cancel, signal, reprocess) off: they answer 403.
    pub fn read_only(mut self) -> Self {
        self.writes = false;
        self
    }

    /// The address to listen on.
    pub fn listen(&self) -> SocketAddr {
        self.listen
    }

    /// Whether this configuration may be served: [`router`] and [`serve`] check it too;
    /// call it to refuse before doing anything else.
    ///
    /// # Errors
    /// [`ServeError::TokenRequired`] beyond loopback with no token;
    /// [`ServeError::EmptyToken`].
    pub fn check(&self) -> Result<(), ServeError> {
        match &self.token {
            Some(token) if token.trim().is_empty() => Err(ServeError::EmptyToken),
            None if !self.listen.ip().is_loopback() && !self.open_beyond_loopback => {
                Err(ServeError::TokenRequired {
                    listen: self.listen,
                })
            }
            _ => Ok(()),
        }
    }
}

/// What every handler shares.
#[derive(Clone)]
pub(crate) struct AppState {
    pub(crate) engine: Engine,
    pub(crate) token: Option<Arc<str>>,
    pub(crate) writes: bool,
    pub(crate) open_beyond_loopback: bool,
    pub(crate) activity: Arc<activity::Cached>,
    pub(crate) queue_history: Arc<history::QueueHistory>,
}

/// The API's routes under `/api/v1` and the dashboard, checked against `config` (the
/// token rule, the write switch). The listen address is not used here: mount it where you
/// like, but without a token it answers only loopback peers, which it learns from axum's
/// `ConnectInfo`: serve it with `into_make_service_with_connect_info::<SocketAddr>()`
/// (otherwise every request is refused, 403 `token_required`). Called inside a tokio runtime, it also samples the queue's depth every 15 s for
/// the stats' last hour (until the router is dropped).
///
/// # Errors
/// [`ServeError::TokenRequired`] when `config` listens beyond loopback with no token;
/// [`ServeError::EmptyToken`].
pub fn router(engine: Engine, config: &Config) -> Result<Router, ServeError> {
    config.check()?;
    let state = AppState {
        queue_history: history::QueueHistory::start(engine.clone()),
        engine,
        token: config.token.as_deref().map(Arc::from),
        writes: config.writes,
        open_beyond_loopback: config.open_beyond_loopback,
        activity: Arc::default(),
    };
    if config.open_beyond_loopback && config.token.is_none() {
        tracing::warn!(
            "the API answers anyone who can reach it, without a token \
             (Config::insecure_open_to_anyone_without_a_token)"
        );
    }
    Ok(api::routes(state))
}

/// Binds `config`'s address and serves the API until `shutdown` completes, then lets the
/// requests in flight finish.
///
/// # Errors
/// As [`router`]; [`ServeError::Bind`] when the address cannot be bound;
/// [`ServeError::Io`] if accepting connections fails.
///
/// # Cancel safety
/// Dropping the future closes the listener and every open connection at once; requests
/// in flight are cut off (each of the API's writes is one transaction: it committed or it
/// did not). Complete `shutdown` instead to let them finish.
pub async fn serve(
    engine: Engine,
    config: &Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let app = router(engine, config)?;
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .map_err(|source| ServeError::Bind {
            listen: config.listen,
            source,
        })?;
    tracing::info!(listen = %config.listen, writes = config.writes, "serving the API");
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(shutdown)
    .await
    .map_err(ServeError::Io)
}
