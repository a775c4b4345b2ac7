//! The engine's own handlers: what runs the tasks no user handler runs. A durable sleep's
//! task (`confluo:sleep`) wakes with a `null` output; a signal wait's timeout
//! (`confluo:signal`) gives the stage's `on_timeout` output or fails for good; a member of
//! a map of child workflows (`confluo:child`) reports its child's end. Workers run them
//! themselves ([`Worker`](crate::Worker)); a loop of its own built on
//! [`Engine::claim`] runs them with [`Engine::run_builtin`].

use serde_json::Value;

use crate::claimed::ClaimedTask;
use crate::definition::{timed_out, CHILD_HANDLER, SIGNAL_HANDLER, SLEEP_HANDLER};
use crate::engine::Engine;
use crate::error::Result;
use crate::handler::TaskError;
use crate::ids::TaskId;
use crate::queue::Outcome;

/// Whether `handler` names one of the engine's own handlers.
pub(crate) fn is_builtin(handler: &str) -> bool {
    [SLEEP_HANDLER, SIGNAL_HANDLER, CHILD_HANDLER].contains(&handler)
}

/// What the engine's own handler `handler` answers for the task `task` with `input`.
/// (`input` is read only by a signal wait's timeout.)
pub(crate) async fn answer(
    engine: &Engine,
    handler: &str,
    task: TaskId,
    input: &Value,
) -> std::result::Result<Value, TaskError> {
    match handler {
        CHILD_HANDLER => engine.child_result(task).await,
        SIGNAL_HANDLER => timed_out(input).map_err(TaskError::permanent),
        _ => Ok(Value::Null),
    }
}

impl Engine {
    /// Runs `task` when it is one of the engine's own (a durable sleep's, a signal
    /// wait's timeout, a member of a map of child workflows: its handler starts with
    /// `confluo:`) and acknowledges the answer as a worker does, with
    /// [`complete`](Self::complete) or [`fail`](Self::fail) (a child that failed fails
    /// its member for good). Returns `None`, doing nothing, for a user handler's task.
    ///
    /// A [`Worker`](crate::Worker) does this itself; call it from a loop of your own
    /// built on [`claim`](Self::claim), which returns these tasks too: left unrun, they
    /// come back when their lease expires, and the stages they belong to wait.
    ///
    /// # Errors
    /// As [`complete`](Self::complete) and [`fail`](Self::fail); [`Error::Database`](crate::Error::Database)
    /// when the task's input cannot be read (nothing recorded).
    ///
    /// # Cancel safety
    /// Reads, then one acknowledgement: dropped before the acknowledgement commits,
    /// nothing is recorded and the attempt stays running until its lease expires (or it
    /// is run again: safe to repeat, like `complete`).
    pub async fn run_builtin(&self, task: &ClaimedTask) -> Result<Option<Outcome>> {
        if !is_builtin(task.handler()) {
            return Ok(None);
        }
        let input = if task.handler() == SIGNAL_HANDLER {
            self.task_input(task).await?
        } else {
            Value::Null
        };
        let outcome = match answer(self, task.handler(), task.id(), &input).await {
            Ok(output) => self.complete(task, output).await?,
            Err(error) => {
                self.fail(task, error.message(), error.is_permanent())
                    .await?
            }
        };
        Ok(Some(outcome))
    }
}
