//! Acknowledging endings: singly, or gathered for a short window and written in batches
//! (completions in one statement per batch, each group counted down once per batch).

use std::sync::Arc;
use std::time::Duration;

use futures_util::future::join_all;
use serde_json::Value;
use tokio::sync::{mpsc, Mutex};
use tokio::time::{sleep, timeout_at, Instant};

use super::{Held, State};
use crate::batch::HandOff;
use crate::claimed::ClaimedTask;
use crate::error::Error;
use crate::handler::TaskError;
use crate::queue::Outcome;

/// How an attempt ended, before it is acknowledged.
pub(super) enum Ending {
    Returned(std::result::Result<Value, TaskError>),
    Panicked(String),
    TimedOut,
    LeaseLost,
    Stopped,
}

impl Ending {
    /// The `ending` label of the handler-duration metric.
    pub(super) fn label(&self) -> &'static str {
        match self {
            Ending::Returned(Ok(_)) => "ok",
            Ending::Returned(Err(_)) => "error",
            Ending::Panicked(_) => "panic",
            Ending::TimedOut => "timeout",
            Ending::LeaseLost => "lease_lost",
            Ending::Stopped => "stopped",
        }
    }
}

/// A message to the acknowledger.
pub(super) enum Ack {
    /// An attempt's ending, with the task it holds.
    Ending(Box<(Held, Ending)>),
    /// Every attempt has ended: flush and stop.
    Close,
}

/// Endings of a batch other than completions acknowledged at once, at most.
const FAILURES_AT_ONCE: usize = 4;

/// How many times an acknowledgement is repeated on connection errors before the task is
/// left to its lease.
const ACK_TRIES: usize = 8;

/// Gathers endings into batches and acknowledges them, until [`Ack::Close`]. A batch is
/// flushed when its window ends, when it is full, when the worker is idle (no handler
/// running, nothing waiting: no ending will come soon, so a group's last member is not
/// kept waiting), and at close. Several acknowledgers share the queue: one gathers while
/// the others write, so under load batches grow to what one write takes and the database
/// works on more than one at a time.
pub(super) async fn acknowledge_batches(
    state: Arc<State>,
    queue: Arc<Mutex<mpsc::UnboundedReceiver<Ack>>>,
) {
    let window = state.settings.ack_window;
    let limit = state.settings.ack_batch;
    let mut open = true;
    while open {
        let mut batch = Vec::new();
        {
            let mut queue = queue.lock().await;
            match queue.recv().await {
                Some(Ack::Ending(ending)) => batch.push(*ending),
                Some(Ack::Close) | None => break,
            }
            let deadline = Instant::now() + window;
            while batch.len() < limit {
                // Take what is already there without waiting.
                match queue.try_recv() {
                    Ok(Ack::Ending(ending)) => {
                        batch.push(*ending);
                        continue;
                    }
                    Ok(Ack::Close) | Err(mpsc::error::TryRecvError::Disconnected) => {
                        open = false;
                        break;
                    }
                    Err(mpsc::error::TryRecvError::Empty) => {}
                }
                if state.idle() {
                    break;
                }
                match timeout_at(deadline, queue.recv()).await {
                    Ok(Some(Ack::Ending(ending))) => batch.push(*ending),
                    Ok(Some(Ack::Close)) | Ok(None) => {
                        open = false;
                        break;
                    }
                    Err(_) => break, // the window is over
                }
            }
        }
        flush(&state, batch).await;
    }
}

/// Acknowledges one batch: its completions in one call, every other ending on its own
/// (failures are rare, and each decides its own retry). The held tasks' room comes back
/// when the batch is dropped, at the end.
async fn flush(state: &State, batch: Vec<(Held, Ending)>) {
    let engine = &state.engine;
    let mut completions: Vec<(&ClaimedTask, Value)> = Vec::with_capacity(batch.len());
    let mut others: Vec<(&ClaimedTask, &Ending)> = Vec::new();
    for (held, ending) in &batch {
        let task = &held.task;
        match ending {
            // An output the next stage cannot use goes on its own: `complete` refuses it
            // and `acknowledge` records the failed attempt.
            Ending::Returned(Ok(output)) if engine.check_output(task, output).await.is_ok() => {
                completions.push((task, output.clone()))
            }
            Ending::LeaseLost => {}
            _ => others.push((task, ending)),
        }
    }
    if !completions.is_empty() {
        // Nothing else running: this batch is likely some group's last arrivals.
        complete_batch(state, &completions, state.idle()).await;
    }
    // A few at a time: each takes a connection of the pool.
    for chunk in others.chunks(FAILURES_AT_ONCE) {
        join_all(
            chunk
                .iter()
                .map(|(task, ending)| acknowledge(state, task, ending)),
        )
        .await;
    }
    drop(batch);
}

/// Writes a batch of completions, repeating on connection errors (a repeat after a lost
/// answer finds them recorded: nothing changes twice).
async fn complete_batch(state: &State, items: &[(&ClaimedTask, Value)], likely_last: bool) {
    // The next stages this batch fires are claimed in its transaction, as far as
    // there is room (none once the worker stops).
    let take_room = |n: usize| {
        if state.shutdown.is_cancelled() {
            0
        } else {
            state.room.try_take(1, n)
        }
    };
    let give_back = |n: usize| state.room.give_back(n);
    let hand_off = HandOff {
        worker_id: &state.settings.id,
        handlers: &state.keys,
        lease: state.settings.lease,
        take_room: &take_room,
        give_back: &give_back,
        most: state.settings.batch_size,
    };
    let mut pause = Duration::from_millis(50);
    for _ in 0..ACK_TRIES {
        let result = state
            .engine
            .complete_batch_hinted(items, likely_last, Some(&hand_off))
            .await;
        match result {
            Ok((outcomes, handed)) => {
                state.hold(handed);
                tracing::debug!(
                    completions = items.len(),
                    fired = outcomes
                        .iter()
                        .filter(|o| matches!(o, Outcome::Completed { fired: true }))
                        .count(),
                    "batch acknowledged"
                );
                return;
            }
            Err(error) if error.is_database() => {
                tracing::warn!(%error, completions = items.len(), "acknowledging a batch failed; repeating");
                sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(2));
            }
            Err(error) => {
                // Not expected (outputs were checked): acknowledge them one by one.
                tracing::warn!(%error, "acknowledging a batch failed; acknowledging singly");
                for (task, output) in items {
                    acknowledge(state, task, &Ending::Returned(Ok(output.clone()))).await;
                }
                return;
            }
        }
    }
    tracing::error!(
        completions = items.len(),
        "acknowledging a batch kept failing; its tasks come back when their leases expire"
    );
}

/// Records the ending of one attempt, repeating on connection errors: every
/// acknowledgement is idempotent, so a repeat after a lost answer changes nothing. If the
/// database stays out of reach, the lease expires and the task is reclaimed: never lost.
pub(super) async fn acknowledge(state: &State, task: &ClaimedTask, ending: &Ending) {
    let engine = &state.engine;
    let mut pause = Duration::from_millis(50);
    for _ in 0..ACK_TRIES {
        let result = match ending {
            Ending::Returned(Ok(output)) => match engine.complete(task, output.clone()).await {
                Err(Error::InvalidOutput { reason, .. }) => engine.fail(task, &reason, false).await,
                other => other,
            },
            Ending::Returned(Err(error)) => {
                engine
                    .fail(task, error.message(), error.is_permanent())
                    .await
            }
            Ending::Panicked(message) => {
                engine
                    .fail(task, &format!("handler panicked: {message}"), false)
                    .await
            }
            Ending::TimedOut => {
                let message = format!("handler timed out after {:?}", task.timeout);
                engine.fail(task, &message, false).await
            }
            Ending::LeaseLost => return,
            Ending::Stopped => engine.release(task).await.map(|_| Outcome::Cancelled),
        };
        match result {
            Ok(outcome) => {
                tracing::debug!(task_id = %task.id, ?outcome, "attempt acknowledged");
                return;
            }
            Err(error) if error.is_database() => {
                tracing::warn!(%error, task_id = %task.id, "acknowledging failed; repeating");
                sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(2));
            }
            Err(error) => {
                tracing::error!(%error, task_id = %task.id, "acknowledging failed");
                return;
            }
        }
    }
}
