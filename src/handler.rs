//! What a worker runs: handlers, the context they receive, and the errors they return.

use std::fmt;
use std::future::Future;
use std::pin::Pin;

use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::ids::{ExecutionId, TaskId};
use crate::outputs::BlockOutputs;

/// A boxed, sendable future, as returned by [`Handler::call`].
pub type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// Runs one attempt of a task. Closures are handlers through
/// [`WorkerBuilder::handler`](crate::WorkerBuilder::handler); implement this trait for
/// handlers that carry state and register them with
/// [`WorkerBuilder::handler_object`](crate::WorkerBuilder::handler_object).
pub trait Handler: Send + Sync + 'static {
    /// Runs the attempt. An `Err` is a failed attempt; so is a panic, a timeout, or an
    /// output that the next stage cannot use.
    fn call(&self, task: TaskContext) -> BoxFuture<Result<Value, TaskError>>;
}

/// Adapts an async closure returning any serializable output into a [`Handler`].
pub(crate) struct FnHandler<F>(pub(crate) F);

impl<F, Fut, O> Handler for FnHandler<F>
where
    F: Fn(TaskContext) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<O, TaskError>> + Send + 'static,
    O: Serialize + Send + 'static,
{
    fn call(&self, task: TaskContext) -> BoxFuture<Result<Value, TaskError>> {
        let fut = (self.0)(task);
        Box::pin(async move {
            let output = fut.await?;
            serde_json::to_value(output)
                .map_err(|e| TaskError::retryable(format!("output is not serializable: {e}")))
        })
    }
}

/// Everything a handler knows about the attempt it runs.
#[derive(Debug, Clone)]
pub struct TaskContext {
    pub(crate) input: Value,
    pub(crate) task_id: TaskId,
    pub(crate) execution_id: ExecutionId,
    pub(crate) workflow: String,
    pub(crate) stage_index: usize,
    pub(crate) handler: String,
    pub(crate) item_index: u32,
    pub(crate) attempt: u32,
    pub(crate) max_attempts: u32,
    pub(crate) cancellation: CancellationToken,
    /// The block before this stage, when there is one.
    pub(crate) previous_block: Option<BlockOutputs>,
    /// Why the input was not loaded (the previous block's outputs are too large).
    pub(crate) withheld: Option<String>,
}

impl TaskContext {
    /// The input: the map element, or the stage input (the execution input for the first
    /// stage, else the previous stage's output; after a parallel or map stage, a
    /// [`ParallelResults`](crate::ParallelResults) or [`MapResults`](crate::MapResults)).
    ///
    /// After a block whose members' outputs are larger than the worker's
    /// [`inline_block_input`](crate::WorkerBuilder::inline_block_input), the input is not
    /// loaded: this is `null`, [`input_as`](Self::input_as) fails saying so, and the
    /// handler reads the members with [`previous_block`](Self::previous_block).
    pub fn input(&self) -> &Value {
        &self.input
    }

    /// The input deserialized as `T`; a mismatch is a permanent error (retrying would
    /// not change the input), and so is an input too large to be loaded (see
    /// [`input`](Self::input)).
    pub fn input_as<T: DeserializeOwned>(&self) -> Result<T, TaskError> {
        if let Some(reason) = &self.withheld {
            return Err(TaskError::permanent(reason.clone()));
        }
        T::deserialize(&self.input).map_err(|e| {
            TaskError::permanent(format!("input does not match the expected type: {e}"))
        })
    }

    /// The members of the parallel or map block before this stage, with their outputs,
    /// to read page by page in bounded memory whatever the width; `None` when the previous
    /// stage is a step or there is none. Works whether or not the input was loaded.
    pub fn previous_block(&self) -> Option<&BlockOutputs> {
        self.previous_block.as_ref()
    }

    /// The task.
    pub fn task_id(&self) -> TaskId {
        self.task_id
    }

    /// Its execution.
    pub fn execution_id(&self) -> ExecutionId {
        self.execution_id
    }

    /// The workflow name.
    pub fn workflow(&self) -> &str {
        &self.workflow
    }

    /// The stage's position.
    pub fn stage_index(&self) -> usize {
        self.stage_index
    }

    /// The handler name (stage name, or branch name).
    pub fn handler(&self) -> &str {
        &self.handler
    }

    /// Position in the group: the element index of a map, the branch index of a block.
    pub fn item_index(&self) -> u32 {
        self.item_index
    }

    /// This attempt's number, from 1.
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// Attempts allowed in all.
    pub fn max_attempts(&self) -> u32 {
        self.max_attempts
    }

    /// Cancelled when the attempt should stop early: its execution stopped, its lease was
    /// lost, or the worker is shutting down past its grace period. Handlers that run long
    /// should `select!` on it; whatever they return afterwards changes nothing.
    pub fn cancellation(&self) -> &CancellationToken {
        &self.cancellation
    }
}

/// A failed attempt, as a handler reports it: retryable (the default) or permanent (the
/// task is dead-lettered without further attempts).
///
/// Any `std::error::Error` converts into a retryable `TaskError`, so `?` works in
/// handlers; mark the other kind with [`ResultExt::permanent`].
///
/// ```
/// use confluo::{ResultExt, TaskError};
///
/// fn parse(s: &str) -> Result<u32, TaskError> {
///     let n: u32 = s.parse().permanent()?; // bad data: retrying will not help
///     Ok(n)
/// }
/// assert!(parse("x").unwrap_err().is_permanent());
/// ```
pub struct TaskError {
    message: String,
    permanent: bool,
}

impl TaskError {
    /// A failure worth retrying (per the stage's retry policy).
    pub fn retryable(error: impl fmt::Display) -> Self {
        TaskError {
            message: error.to_string(),
            permanent: false,
        }
    }

    /// A failure that retrying cannot fix: the task is dead-lettered at once.
    pub fn permanent(error: impl fmt::Display) -> Self {
        TaskError {
            message: error.to_string(),
            permanent: true,
        }
    }

    /// Whether the task should be dead-lettered without further attempts.
    pub fn is_permanent(&self) -> bool {
        self.permanent
    }

    /// The message recorded with the attempt.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Debug for TaskError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TaskError")
            .field("message", &self.message)
            .field("permanent", &self.permanent)
            .finish()
    }
}

impl fmt::Display for TaskError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl<E: std::error::Error> From<E> for TaskError {
    fn from(error: E) -> Self {
        let mut message = error.to_string();
        let mut source = error.source();
        while let Some(cause) = source {
            message.push_str(": ");
            message.push_str(&cause.to_string());
            source = cause.source();
        }
        TaskError::retryable(message)
    }
}

/// Marks a `Result`'s error as retryable or permanent at the call site.
pub trait ResultExt<T> {
    /// The error, if any, dead-letters the task at once.
    fn permanent(self) -> Result<T, TaskError>;
    /// The error, if any, is retried per the stage's policy.
    fn retryable(self) -> Result<T, TaskError>;
}

impl<T, E: fmt::Display> ResultExt<T> for Result<T, E> {
    fn permanent(self) -> Result<T, TaskError> {
        self.map_err(TaskError::permanent)
    }

    fn retryable(self) -> Result<T, TaskError> {
        self.map_err(TaskError::retryable)
    }
}
