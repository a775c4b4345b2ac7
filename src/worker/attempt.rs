//! Running one attempt: the handler on its own tokio task (a panic is a failed attempt),
//! under the stage's timeout, while the lease is renewed every third of it.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::OwnedSemaphorePermit;
use tokio::time::{sleep, Instant};

use super::acks::{self, Ack, Ending};
use super::{Held, State};
use serde_json::Value;

use crate::error::Error;
use crate::execution::ExecutionStatus;
use crate::handler::{TaskContext, TaskError};
use crate::outputs::BlockOutputs;

/// Runs the attempt of a held task in a handler slot, then hands its ending to the
/// acknowledger, freeing the slot; the room in the worker is freed once the ending is
/// acknowledged. Without an acknowledgement window, it acknowledges the ending itself,
/// in the slot.
pub(super) async fn run(state: Arc<State>, held: Held, slot: OwnedSemaphorePermit) {
    let task = &held.task;
    if task.execution_status != ExecutionStatus::Running {
        if let Err(error) = state.engine.cancel_claimed(task).await {
            tracing::warn!(%error, task_id = %task.id, "cancelling a task of a stopped execution failed");
        }
        return;
    }
    state
        .unreported
        .lock()
        .expect("unreported set poisoned")
        .insert(task.id, task.lease);
    let ending = run_handler(&state, &held).await;
    state
        .unreported
        .lock()
        .expect("unreported set poisoned")
        .remove(&task.id);
    if state.settings.ack_window.is_zero() {
        // Acknowledged here, in the slot: handlers cannot outrun their acknowledgements.
        acks::acknowledge(&state, &held.task, &ending).await;
        return;
    }
    drop(slot);
    if let Err(unsent) = state.acks.send(Ack::Ending(Box::new((held, ending)))) {
        // The acknowledger is gone only after every attempt ended; acknowledge here.
        if let Ack::Ending(ending) = unsent.0 {
            let (held, ending) = *ending;
            acks::acknowledge(&state, &held.task, &ending).await;
        }
    }
}

/// Runs the handler to its ending.
async fn run_handler(state: &State, held: &Held) -> Ending {
    let task = &held.task;
    // Stage 0 and steps after steps come with their input; after a block it is read now,
    // unless it is too large, and the members can be read page by page either way.
    let previous_block = task
        .input_stage
        .filter(|_| task.input.is_none())
        .map(|block| BlockOutputs::new(state.engine.clone(), task.execution_id, block));
    let mut withheld = None;
    let input = match &task.input {
        Some(input) => input.clone(),
        None => match state
            .engine
            .task_input_within(task, state.settings.inline_block_input)
            .await
        {
            Ok(input) => input,
            Err(error @ Error::BlockInputTooLarge { .. }) => {
                withheld = Some(error.to_string());
                Value::Null
            }
            Err(error) => {
                return Ending::Returned(Err(TaskError::retryable(format!(
                    "loading the input failed: {error}"
                ))))
            }
        },
    };
    let Some(handler) = state
        .handlers
        .get(&(task.workflow.clone(), task.handler.clone()))
        .cloned()
    else {
        // Claims are filtered by handler, so this is a bug; give the task back.
        return Ending::Stopped;
    };
    let cancellation = state.hard_stop.child_token();
    let context = TaskContext {
        input,
        task_id: task.id,
        execution_id: task.execution_id,
        workflow: task.workflow.clone(),
        stage_index: task.stage_index,
        handler: task.handler.clone(),
        item_index: task.item_index,
        attempt: task.attempt,
        max_attempts: task.max_attempts,
        cancellation: cancellation.clone(),
        previous_block,
        withheld,
    };
    // Spawned, so that a panic is caught as a failed attempt instead of killing the loop.
    let started = Instant::now();
    let mut call = tokio::spawn(handler.call(context));
    let timeout = sleep(task.timeout);
    tokio::pin!(timeout);
    // First renewal a third of the lease from now. Not `interval(..)` and its first
    // tick: that tick is due at once, yet waits for the timer's next millisecond, and a
    // millisecond per attempt was most of a short handler's slot time (6 600 no-op tasks
    // per second with 8 handlers, against 18 000 without it).
    let every = state.settings.lease / 3;
    let mut renew = tokio::time::interval_at(Instant::now() + every, every);
    let ending = loop {
        tokio::select! {
            joined = &mut call => break match joined {
                Ok(result) => Ending::Returned(result),
                Err(e) if e.is_panic() => Ending::Panicked(panic_message(e.into_panic())),
                Err(_) => Ending::Stopped,
            },
            _ = &mut timeout => {
                cancellation.cancel();
                call.abort();
                break Ending::TimedOut;
            }
            _ = state.hard_stop.cancelled() => {
                call.abort();
                break Ending::Stopped;
            }
            _ = renew.tick() => match state.engine.renew_lease(task, state.settings.lease).await {
                Ok(Some(ExecutionStatus::Running)) => {}
                Ok(Some(_)) => cancellation.cancel(),
                Ok(None) => {
                    // Told first, as `TaskContext::cancellation` promises, with a moment to
                    // stop on its own; whatever it returns changes nothing.
                    cancellation.cancel();
                    let _ = tokio::time::timeout(LOST_LEASE_GRACE, &mut call).await;
                    call.abort();
                    break Ending::LeaseLost;
                }
                Err(error) => tracing::warn!(%error, task_id = %task.id, "renewing a lease failed"),
            },
        }
    };
    crate::metrics::handler_ran(
        &task.workflow,
        &task.handler,
        ending.label(),
        started.elapsed().as_secs_f64(),
    );
    ending
}

/// How long a handler whose lease was lost has, once told, to stop before it is aborted.
const LOST_LEASE_GRACE: Duration = Duration::from_secs(1);

fn panic_message(payload: Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a non-string panic payload".to_owned()
    }
}
