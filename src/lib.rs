//! # confluo
//!
//! Durable workflows on PostgreSQL whose fan-in is exactly-once by construction.
//!
//! A workflow is a list of stages run in order: a [`step`](Workflow::step) (one task), a
//! static [`parallel`](Workflow::parallel) block, or a dynamic [`map`](Workflow::map) (one
//! task per element of the previous output, 0 to 100 000 of them); a conditional
//! [`branch`](Stage::branch) picks which stages run next from the previous output, and a
//! durable [`sleep`](Stage::sleep) waits in the database. Workers claim tasks
//! with `FOR UPDATE SKIP LOCKED`, run async handlers under a renewed lease, retry with
//! backoff and dead-letter what keeps failing.
//!
//! **Fan-in**: each stage's group has a countdown row. Every terminal arrival (completed,
//! dead-lettered or cancelled) decrements it in the very statement that writes the member's
//! status, guarded by the attempt's lease token; the one transaction that sees zero
//! dispatches the next stage before it commits. Never zero dispatches (a stalled
//! workflow), never two (a duplicate charge), and no lock on the execution row per
//! completion.
//!
//! ```no_run
//! use confluo::{Engine, MapResults, TaskError, Workflow};
//! use serde_json::{json, Value};
//! use std::time::Duration;
//!
//! # #[tokio::main] async fn main() -> Result<(), confluo::Error> {
//! let engine = Engine::connect_env().await?; // DATABASE_URL or PG*
//! engine.migrate().await?;
//! engine
//!     .register(&Workflow::new("squares", 1).step("split").map("square").step("sum"))
//!     .await?;
//!
//! let worker = engine
//!     .worker()
//!     .handler("squares", "split", |t| async move {
//!         let n: u64 = t.input_as()?;
//!         Ok::<_, TaskError>((1..=n).collect::<Vec<_>>())
//!     })
//!     .handler("squares", "square", |t| async move {
//!         let x: u64 = t.input_as()?;
//!         Ok::<_, TaskError>(x * x)
//!     })
//!     .handler("squares", "sum", |t| async move {
//!         let squares: MapResults<u64> = t.input_as()?;
//!         Ok::<_, TaskError>(squares.outputs.iter().sum::<u64>())
//!     })
//!     .start()
//!     .await?;
//!
//! let id = engine.start("squares", &json!(100)).await?;
//! let done = engine.wait(id, Duration::from_secs(60)).await?;
//! assert_eq!(done.output, Some(json!(338_350)));
//! worker.shutdown().await;
//! # Ok(()) }
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]

mod activity;
mod archive;
mod auditor;
mod batch;
mod builtin;
mod callback;
mod children;
mod claimed;
mod connect;
mod dead_letters;
mod deadline;
mod definition;
mod dispatch;
mod doctor;
mod engine;
mod error;
mod execution;
mod fanin;
mod handler;
mod ids;
mod listing;
mod members;
pub mod metrics;
mod notifications;
mod outputs;
mod queue;
mod reclaim;
mod registry;
mod signal;
mod start;
mod store;
#[cfg(feature = "webhooks")]
pub mod webhooks;
mod worker;

pub use activity::{Activity, HandOver, MinuteActivity, TaskCounts};
pub use archive::Archived;
pub use auditor::{AuditRound, AuditorStatus, Unrepaired, AUDIT_SLICE};
pub use callback::MAX_CALLBACK_LEN;
pub use claimed::ClaimedTask;
pub use connect::{read_committed, ConnectBuilder};
pub use dead_letters::{DeadLetterDetail, DeadLetterFilter, DeadLetterSummary, Reprocessed};
pub use definition::{
    Arm, Branch, BranchChoice, DefinitionError, Join, OnMemberFailure, RetryPolicy, SignalWait,
    Stage, StageKind, Workflow,
};
pub use doctor::{ChildRef, CounterMismatch, Diagnosis, GroupRef, Repairs, SignalRef};
pub use engine::{Engine, EngineBuilder};
pub use error::{ConnectError, Error, Result};
pub use execution::{
    AttemptError, DeadLetter, Execution, ExecutionStatus, MapResults, MemberFailure,
    ParallelResults, StageProgress, UnknownStatus,
};
pub use fanin::{FanInStrategy, UnknownStrategy};
pub use handler::{BoxFuture, Handler, ResultExt, TaskContext, TaskError};
pub use ids::{ExecutionId, GroupId, LeaseToken, TaskId};
pub use listing::{ExecutionCounts, ExecutionSummary, ListFilter, QueueDepth, RegisteredWorkflow};
pub use members::{
    MemberDetail, MemberFilter, MemberPage, MemberStatus, MemberSummary, UnknownMemberStatus,
};
pub use notifications::Notification;
pub use outputs::{BlockMember, BlockOutputs, DEFAULT_INLINE_BLOCK_INPUT, MAX_MAP_WIDTH};
pub use queue::Outcome;
pub use registry::{WorkerInfo, WorkerState, WORKER_RETENTION};
pub use signal::SignalOutcome;
pub use start::{StartOptions, Started};
pub use worker::{
    Notifications, Worker, WorkerBuilder, DEFAULT_ARCHIVE_AFTER, DEFAULT_AUDIT_EVERY,
};

/// The README's examples, compiled as doctests so that they cannot drift from the API.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
