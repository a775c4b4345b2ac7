//! Sending signals to executions ([`Engine::signal`]): the arrival a signal wait
//! ([`Stage::signal`](crate::Stage::signal)) counts down.

use serde::Serialize;
use serde_json::Value;
use sqlx::PgConnection;

use crate::dispatch;
use crate::engine::Engine;
use crate::error::{retry_conflicts, Error, Result};
use crate::execution::ExecutionStatus;
use crate::ids::ExecutionId;
use crate::store::{executions, fan_in, locks, signals};

/// What [`Engine::signal`] did with a signal.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "outcome", content = "status", rename_all = "snake_case")]
#[non_exhaustive]
pub enum SignalOutcome {
    /// The execution was waiting for it: the wait completed with the payload as its
    /// output, and what follows it was entered, in the signal's transaction.
    Received,
    /// The execution has not entered the wait: the signal is kept, and the wait receives
    /// it the moment it is entered (if it never is, e.g. on another arm of a branch, the
    /// signal changes nothing).
    Kept,
    /// The execution already has a signal of this name, received or kept: this one
    /// changed nothing, and the first payload stands.
    AlreadyReceived,
    /// The wait is over without it (it timed out, or a worker is timing it out right
    /// now): nothing was kept.
    TooLate,
    /// The execution has ended, with this status: nothing was kept.
    Ended(ExecutionStatus),
}

impl Engine {
    /// Sends the signal `name` with `payload` to an execution, for its wait of that name
    /// ([`Stage::signal`](crate::Stage::signal)). The payload becomes the wait's output,
    /// what the next stage receives. Each name is received once per execution: a second
    /// signal of the same name returns [`SignalOutcome::AlreadyReceived`] and changes
    /// nothing, so a webhook delivered twice is harmless.
    ///
    /// In one transaction that holds the execution's lock, as every stage transition
    /// does: a signal racing the entry of its wait is either kept and received at entry,
    /// or received by the wait entered just before, never both and never neither; racing
    /// the wait's timeout, whichever completes the wait's one task first decides, and the
    /// other changes nothing.
    ///
    /// # Errors
    /// [`Error::ExecutionNotFound`]; [`Error::UnknownSignal`] when the execution's
    /// workflow version has no wait of that name; [`Error::InvalidSignal`] when the
    /// payload cannot feed the stage after the wait (a map needs an array); nothing is
    /// kept then. [`Error::Database`] (then nothing was recorded, or the commit's answer
    /// was lost: sending again tells, with [`SignalOutcome::AlreadyReceived`]).
    ///
    /// # Cancel safety
    /// One transaction: dropped before its commit, nothing is recorded; sending again is
    /// safe either way.
    pub async fn signal(
        &self,
        execution: ExecutionId,
        name: &str,
        payload: Value,
    ) -> Result<SignalOutcome> {
        retry_conflicts(|| self.signal_once(execution, name, &payload)).await
    }

    async fn signal_once(
        &self,
        execution: ExecutionId,
        name: &str,
        payload: &Value,
    ) -> Result<SignalOutcome> {
        let mut tx = crate::store::begin(self.pool()).await?;
        // The execution first (`store::locks`): the entry of the wait holds it too.
        locks::execution(&mut tx, execution).await?;
        let row = executions::get(&mut *tx, execution)
            .await?
            .ok_or(Error::ExecutionNotFound(execution))?;
        let workflow = self
            .definition(&mut tx, &row.workflow_name, row.workflow_version)
            .await?;
        let Some(index) = workflow.signal_stage(name) else {
            return Err(Error::UnknownSignal {
                execution,
                workflow: row.workflow_name,
                version: row.workflow_version,
                name: name.to_owned(),
                known: workflow
                    .signal_names()
                    .into_iter()
                    .map(str::to_owned)
                    .collect(),
            });
        };
        if let Some(reason) = unfit_payload(&workflow, index, payload) {
            return Err(Error::InvalidSignal {
                name: name.to_owned(),
                reason,
            });
        }
        let status = ExecutionStatus::parse(&row.status);
        if status.is_terminal() {
            return Ok(SignalOutcome::Ended(status));
        }
        if signals::payload(&mut tx, execution, name).await?.is_some() {
            return Ok(SignalOutcome::AlreadyReceived);
        }
        let outcome = if receive(self, &mut tx, execution, name, payload).await? {
            SignalOutcome::Received
        } else if signals::wait_entered(&mut tx, execution, name).await? {
            return Ok(SignalOutcome::TooLate);
        } else {
            SignalOutcome::Kept
        };
        signals::insert(&mut tx, execution, name, payload).await?;
        tx.commit().await?;
        Ok(outcome)
    }
}

/// Hands `payload` to the execution's pending wait for `name`, and fires the wait's
/// group, entering what follows it: true if a wait was pending. The caller's transaction
/// holds the execution's lock.
async fn receive(
    engine: &Engine,
    conn: &mut PgConnection,
    execution: ExecutionId,
    name: &str,
    payload: &Value,
) -> Result<bool> {
    let Some(done) = signals::hand_over(conn, execution, name, payload).await? else {
        return Ok(false);
    };
    if !fan_in::last_arrivals(conn, std::slice::from_ref(&done))
        .await?
        .is_empty()
    {
        dispatch::fire(engine, conn, execution, done.group_id, done.stage_index).await?;
    }
    Ok(true)
}

/// [`receive`] for the signal `name` the execution has kept (an auditor's repair): true
/// if its wait was pending and received it. The caller's transaction holds the
/// execution's lock.
pub(crate) async fn receive_kept(
    engine: &Engine,
    conn: &mut PgConnection,
    execution: ExecutionId,
    name: &str,
) -> Result<bool> {
    match signals::payload(conn, execution, name).await? {
        Some(payload) => receive(engine, conn, execution, name, &payload).await,
        None => Ok(false),
    }
}

/// Why `payload` cannot be the output of the wait at `index`, if it cannot: the stage
/// after it is a map, which needs an array of at most [`MAX_MAP_WIDTH`](crate::MAX_MAP_WIDTH)
/// elements.
fn unfit_payload(workflow: &crate::Workflow, index: usize, payload: &Value) -> Option<String> {
    let next = workflow
        .plan()
        .next(index)
        .and_then(|i| workflow.stage_at(i))?;
    if !next.kind().maps() {
        return None;
    }
    let max = crate::MAX_MAP_WIDTH;
    match payload.as_array() {
        None => Some(format!(
            "the stage after it, {:?}, is a map, so the payload must be a JSON array",
            next.name()
        )),
        Some(items) if items.len() > max => Some(format!(
            "the stage after it, {:?}, is a map of at most {max} members, and the payload has \
             {} elements",
            next.name(),
            items.len()
        )),
        Some(_) => None,
    }
}
