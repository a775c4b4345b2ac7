//! The worker registry: who is working, on what, and whether it is still alive.
//!
//! Every [`Worker`](crate::Worker) registers when it starts, sends a heartbeat on each of
//! its housekeeping rounds (every half lease, at most every 5 s) with how many handlers run
//! and how many tasks it holds, and marks itself stopped at shutdown. A worker whose
//! heartbeat is more than three intervals old is [`WorkerState::Lost`]: it died without
//! stopping (SIGKILL, a lost host or network), and the tasks it held come back as their
//! leases expire. Rows of workers stopped or lost for [`WORKER_RETENTION`] are deleted by
//! any running worker's housekeeping.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::engine::Engine;
use crate::error::Result;
use crate::store::{millis, workers};

/// How long the registry keeps the row of a worker that stopped or went silent.
pub const WORKER_RETENTION: Duration = Duration::from_secs(3600);

/// A registered worker, as its last heartbeat left it ([`Engine::workers`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[non_exhaustive]
pub struct WorkerInfo {
    /// The worker's id ([`WorkerBuilder::id`](crate::WorkerBuilder::id)); also the
    /// `worker_id` of the tasks it claims.
    pub id: String,
    /// The host name it runs on.
    pub host: String,
    /// Its process id on that host.
    pub pid: u32,
    /// The confluo version it runs.
    pub version: String,
    /// The `(workflow, handler)` pairs it serves (in JSON: `{"workflow", "handler"}`
    /// objects).
    #[serde(serialize_with = "pairs_as_objects")]
    #[cfg_attr(feature = "openapi", schema(value_type = Vec<Object>, example = json!([{"workflow": "orders", "handler": "charge"}])))]
    pub handlers: Vec<(String, String)>,
    /// Handlers it runs at once, at most.
    pub concurrency: u32,
    /// Handlers running at the last heartbeat.
    pub running: u32,
    /// Tasks held at the last heartbeat: running, waiting in its local queue, or ended and
    /// not yet acknowledged.
    pub held: u32,
    /// When it started.
    pub started_at: DateTime<Utc>,
    /// Its last heartbeat (or its stop).
    pub last_seen: DateTime<Utc>,
    /// When it stopped, if it did.
    pub stopped_at: Option<DateTime<Utc>>,
    /// Alive, lost or stopped, by the database server's clock.
    pub state: WorkerState,
}

/// Whether a registered worker is still working.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum WorkerState {
    /// Its last heartbeat is recent (within three intervals).
    Alive,
    /// No heartbeat for three intervals, and it never said it stopped: it died, or cannot
    /// reach the database.
    Lost,
    /// It shut down.
    Stopped,
}

impl WorkerState {
    /// `alive`, `lost` or `stopped`.
    pub fn as_str(&self) -> &'static str {
        match self {
            WorkerState::Alive => "alive",
            WorkerState::Lost => "lost",
            WorkerState::Stopped => "stopped",
        }
    }
}

/// What a starting worker registers.
pub(crate) struct Registration<'a> {
    pub id: &'a str,
    pub handlers: &'a [(String, String)],
    pub concurrency: usize,
    pub heartbeat: Duration,
}

impl Engine {
    /// Every registered worker: alive first, then lost, then stopped (each by id). Rows of
    /// workers gone for longer than [`WORKER_RETENTION`] are deleted by running workers.
    ///
    /// # Errors
    /// [`Error::Database`](crate::Error::Database).
    ///
    /// # Cancel safety
    /// Reads only: dropping it changes nothing.
    pub async fn workers(&self) -> Result<Vec<WorkerInfo>> {
        let mut conn = self.pool().acquire().await?;
        let rows = workers::list(&mut conn).await?;
        Ok(rows
            .into_iter()
            .map(|r| WorkerInfo {
                id: r.id,
                host: r.host,
                pid: u32::try_from(r.pid).unwrap_or_default(),
                version: r.version,
                handlers: handler_pairs(&r.handlers.0),
                concurrency: count(r.concurrency),
                running: count(r.running),
                held: count(r.held),
                started_at: r.started_at,
                last_seen: r.last_seen,
                stopped_at: r.stopped_at,
                state: match r.state.as_str() {
                    "stopped" => WorkerState::Stopped,
                    "lost" => WorkerState::Lost,
                    _ => WorkerState::Alive,
                },
            })
            .collect())
    }

    /// Registers a starting worker.
    pub(crate) async fn register_worker(&self, w: &Registration<'_>) -> Result<()> {
        let handlers: Vec<serde_json::Value> = w
            .handlers
            .iter()
            .map(
                |(workflow, handler)| serde_json::json!({"workflow": workflow, "handler": handler}),
            )
            .collect();
        let host = host_name();
        let mut conn = self.pool().acquire().await?;
        workers::register(
            &mut conn,
            &workers::Registration {
                id: w.id,
                host: &host,
                pid: i32::try_from(std::process::id()).unwrap_or(i32::MAX),
                version: env!("CARGO_PKG_VERSION"),
                handlers: &serde_json::Value::Array(handlers),
                concurrency: i32::try_from(w.concurrency).unwrap_or(i32::MAX),
                heartbeat_ms: millis(w.heartbeat).max(1),
            },
        )
        .await
    }

    /// A worker's heartbeat, which also ages out the rows of workers long gone. False
    /// when its row was gone (it registers again).
    pub(crate) async fn worker_heartbeat(
        &self,
        id: &str,
        running: usize,
        held: usize,
    ) -> Result<bool> {
        let mut conn = self.pool().acquire().await?;
        workers::heartbeat(
            &mut conn,
            id,
            i32::try_from(running).unwrap_or(i32::MAX),
            i32::try_from(held).unwrap_or(i32::MAX),
            millis(WORKER_RETENTION),
        )
        .await
    }

    /// Marks a worker stopped.
    pub(crate) async fn worker_stopped(&self, id: &str) -> Result<()> {
        let mut conn = self.pool().acquire().await?;
        workers::stopped(&mut conn, id).await
    }
}

fn pairs_as_objects<S: serde::Serializer>(
    pairs: &[(String, String)],
    serializer: S,
) -> std::result::Result<S::Ok, S::Error> {
    #[derive(Serialize)]
    struct Pair<'a> {
        workflow: &'a str,
        handler: &'a str,
    }
    serializer.collect_seq(
        pairs
            .iter()
            .map(|(workflow, handler)| Pair { workflow, handler }),
    )
}

fn count(n: i32) -> u32 {
    u32::try_from(n).unwrap_or_default()
}

fn handler_pairs(value: &serde_json::Value) -> Vec<(String, String)> {
    value
        .as_array()
        .map(|pairs| {
            pairs
                .iter()
                .map(|p| {
                    let field = |name: &str| p[name].as_str().unwrap_or_default().to_owned();
                    (field("workflow"), field("handler"))
                })
                .collect()
        })
        .unwrap_or_default()
}

/// This host's name: `HOSTNAME` when set, else the kernel's (Linux), else `unknown`.
fn host_name() -> String {
    std::env::var("HOSTNAME")
        .ok()
        .filter(|h| !h.trim().is_empty())
        .or_else(|| {
            std::fs::read_to_string("/proc/sys/kernel/hostname")
                .ok()
                .map(|h| h.trim().to_owned())
                .filter(|h| !h.is_empty())
        })
        .unwrap_or_else(|| "unknown".to_owned())
}
