//! Claiming tasks and acknowledging attempts: the low-level API under the worker.
//!
//! Workers built with [`Engine::worker`] use these calls; they are public so that a
//! service can drive tasks itself (or a test can race acknowledgements precisely).
//! Every acknowledgement is fenced by the claim's [`LeaseToken`] and safe to repeat.

use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::types::Json;
use sqlx::Connection;

use crate::claimed::{beyond_stages, ClaimedTask};
use crate::definition::StageKind;
use crate::dispatch;
use crate::engine::Engine;
use crate::error::{retry_conflicts, Error, Result};
use crate::execution::ExecutionStatus;
use crate::fanin::FanInStrategy;
use crate::ids::{ExecutionId, LeaseToken, TaskId};
use crate::metrics;
use crate::store::tasks::HandlerKeys;
use crate::store::{executions, fan_in, locks, millis, quorum, tasks};

/// What an acknowledgement did.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Outcome {
    /// The completion was recorded; `fired` if it was its group's last arrival and
    /// dispatched the next stage (or completed the execution).
    Completed {
        /// Whether this arrival fired the group.
        fired: bool,
    },
    /// The failure was recorded and another attempt is scheduled.
    RetryScheduled {
        /// When the task becomes claimable again.
        at: DateTime<Utc>,
    },
    /// The failure was recorded and the task is dead-lettered (attempts exhausted, or a
    /// permanent error). It counts towards fan-in.
    DeadLettered {
        /// Whether this arrival fired the group.
        fired: bool,
    },
    /// The task was cancelled: its execution has stopped, or, completing, its stage's
    /// quorum join ([`Join`](crate::Join)) had fired already (its output is not passed on).
    Cancelled,
    /// This attempt's outcome had already been recorded (a replayed or duplicated
    /// acknowledgement): nothing changed.
    AlreadyRecorded,
    /// The attempt no longer holds the task (its lease expired and was reclaimed, or
    /// another attempt now runs): nothing changed.
    LeaseLost,
}

impl Outcome {
    /// Counts this outcome in the metrics (`confluo_tasks_total` by `outcome`, and the
    /// fan-in latency of a firing); `started` is when its call began.
    pub(crate) fn record(&self, started: Instant) {
        let (label, fired) = match self {
            Outcome::Completed { fired } => ("completed", *fired),
            Outcome::RetryScheduled { .. } => ("retry_scheduled", false),
            Outcome::DeadLettered { fired } => ("dead_lettered", *fired),
            Outcome::Cancelled => ("cancelled", false),
            Outcome::AlreadyRecorded => ("already_recorded", false),
            Outcome::LeaseLost => ("lease_lost", false),
        };
        metrics::acknowledged(label, fired, started);
    }
}

impl Engine {
    /// Claims up to `limit` due tasks of any workflow for `lease`.
    ///
    /// # Errors
    /// [`Error::Database`].
    ///
    /// # Cancel safety
    /// One statement. Dropped after the server ran it and before its rows came back, the
    /// tasks it claimed are nobody's: they come back when their leases expire, each with an
    /// attempt counted (it may have run). Use [`Engine::worker`], which never drops a claim.
    pub async fn claim(
        &self,
        worker_id: &str,
        limit: usize,
        lease: Duration,
    ) -> Result<Vec<ClaimedTask>> {
        self.claim_matching(worker_id, limit, lease, None, false)
            .await
    }

    /// Claims up to `limit` due tasks of the given handlers (`None`: any) for `lease`;
    /// `queued`: for a local queue, whose holder reports later which ones it started.
    pub(crate) async fn claim_matching(
        &self,
        worker_id: &str,
        limit: usize,
        lease: Duration,
        handlers: Option<&HandlerKeys>,
        queued: bool,
    ) -> Result<Vec<ClaimedTask>> {
        let mut conn = self.pool().acquire().await?;
        let started = Instant::now();
        let rows = tasks::claim(
            &mut conn,
            worker_id,
            limit as i64,
            millis(lease),
            handlers,
            queued,
        )
        .await?;
        metrics::claimed(started, rows.iter().map(|r| r.waited));
        drop(conn); // a pool of one connection
        self.readable(rows).await
    }

    /// The plans PostgreSQL chooses for a worker's claim statement over these `(workflow,
    /// handler)` pairs, as `EXPLAIN` prints them: the custom plan of a statement's first
    /// runs, then the generic plan a prepared statement switches to (labelled `custom
    /// plan:` and `generic plan:`). A diagnostic for a claim that seems slow: both read
    /// one index range per handler (`task_claim_handler_idx`) whatever the table's
    /// statistics, so neither should show a sort of the whole backlog.
    ///
    /// # Errors
    /// [`Error::Database`].
    ///
    /// # Cancel safety
    /// Explains only, on a connection of its own that it closes: dropping it changes
    /// nothing.
    pub async fn claim_plan(&self, handlers: &[(&str, &str)], limit: usize) -> Result<String> {
        let keys = HandlerKeys {
            workflows: handlers.iter().map(|(w, _)| (*w).to_owned()).collect(),
            handlers: handlers.iter().map(|(_, h)| (*h).to_owned()).collect(),
        };
        let mut conn = self.explain_connection().await?;
        let plans = tasks::explain_claim(&mut conn, limit as i64, &keys).await;
        let _ = conn.close().await;
        Ok(plans?.to_string())
    }

    /// The plans PostgreSQL chooses for a worker's acknowledgement of `batch` completed
    /// attempts, as [`claim_plan`](Self::claim_plan) prints them: first the statement
    /// that completes a batch holding no group's last arrival, then the one that can fire.
    /// Each must look every attempt up by its primary key (`task_pkey`), whatever the
    /// statistics: a plan that scans the running tasks for each attempt makes a batch
    /// cost its size times the running tasks. A batch of one is a statement of its own,
    /// with scalar parameters (one guarded update by key): most acknowledgements without
    /// a window are one completion.
    ///
    /// # Errors
    /// [`Error::Database`].
    ///
    /// # Cancel safety
    /// As [`claim_plan`](Self::claim_plan).
    pub async fn completion_plan(&self, batch: usize) -> Result<String> {
        let mut conn = self.explain_connection().await?;
        let plans = fan_in::explain_completions(&mut conn, batch.max(1)).await;
        let _ = conn.close().await;
        let (unless_last, many) = plans?;
        Ok(format!(
            "-- a batch that holds no last arrival\n{unless_last}\n\n\
             -- a batch that may fire\n{many}"
        ))
    }

    /// A connection of its own for a diagnostic that prepares a statement.
    async fn explain_connection(&self) -> Result<sqlx::PgConnection> {
        Ok(sqlx::PgConnection::connect_with(&self.pool().connect_options()).await?)
    }

    /// Extends the leases of attempts held in a worker's local queue, and of those it
    /// started since its last renewal (`true`: their starts are recorded), in one
    /// statement. Returns the tasks it extended, with whether their execution still runs.
    pub(crate) async fn renew_leases(
        &self,
        held: &[(TaskId, LeaseToken, bool)],
        lease: Duration,
    ) -> Result<Vec<(TaskId, bool)>> {
        let ids: Vec<TaskId> = held.iter().map(|h| h.0).collect();
        let tokens: Vec<LeaseToken> = held.iter().map(|h| h.1).collect();
        let started: Vec<bool> = held.iter().map(|h| h.2).collect();
        let mut conn = self.pool().acquire().await?;
        let renewed =
            tasks::renew_leases(&mut conn, &ids, &tokens, &started, millis(lease)).await?;
        Ok(renewed
            .into_iter()
            .map(|(id, status)| (id, status == "running"))
            .collect())
    }

    /// Gives claimed tasks back without counting their attempts, in one statement; a task
    /// whose execution has stopped meanwhile is cancelled instead, and counted towards
    /// its group (as a task of a stopped execution never runs), and so is a member of a
    /// quorum group that fired without it. Returns how many went back to the queue.
    pub(crate) async fn release_many(&self, held: &[ClaimedTask]) -> Result<usize> {
        // A quorum member goes back only under its execution's lock, which every firing
        // holds: one at a time ([`cancel_claimed`](Self::cancel_claimed) first).
        let (quorum, plain): (Vec<&ClaimedTask>, Vec<&ClaimedTask>) =
            held.iter().partition(|t| self.in_quorum_stage(t));
        // The batch first: one statement gives most of them back.
        let mut back = 0;
        if !plain.is_empty() {
            let ids: Vec<TaskId> = plain.iter().map(|t| t.id).collect();
            let tokens: Vec<LeaseToken> = plain.iter().map(|t| t.lease).collect();
            let released = {
                let mut conn = self.pool().acquire().await?;
                tasks::release_many(&mut conn, &ids, &tokens).await?
            };
            back += released.len();
            for task in plain.iter().filter(|t| !released.contains(&t.id)) {
                self.cancel_claimed(task).await?;
            }
        }
        // Then each quorum member; one that fails comes back when its lease expires.
        for task in quorum {
            match retry_conflicts(|| self.give_back_once(task)).await {
                Ok(given) => back += usize::from(given == GivenBack::Released),
                Err(error) => {
                    tracing::warn!(%error, task_id = %task.id, "giving a task back failed")
                }
            }
        }
        Ok(back)
    }

    /// Whether the task's stage has a quorum join (or its definition is not at hand: then
    /// it takes the careful path).
    fn in_quorum_stage(&self, task: &ClaimedTask) -> bool {
        self.cached_definition(&task.workflow, task.workflow_version)
            .is_none_or(|w| {
                w.stage_at(task.stage_index)
                    .is_none_or(|s| s.join_rule().quorum().is_some())
            })
    }

    /// The input of a claimed task: its map element, or the stage input read by reference
    /// (the execution input for the first stage, else the output of its
    /// [`input_stage`](ClaimedTask::input_stage)). After
    /// a block whose members' outputs take more than
    /// [`DEFAULT_INLINE_BLOCK_INPUT`](crate::DEFAULT_INLINE_BLOCK_INPUT) bytes as stored,
    /// nothing is aggregated: read them with [`Engine::block_outputs`] instead.
    ///
    /// # Errors
    /// [`Error::BlockInputTooLarge`]; [`Error::Database`].
    ///
    /// # Cancel safety
    /// Reads only: dropping it changes nothing.
    pub async fn task_input(&self, task: &ClaimedTask) -> Result<Value> {
        self.task_input_within(task, crate::outputs::DEFAULT_INLINE_BLOCK_INPUT)
            .await
    }

    /// [`task_input`](Self::task_input) with another limit for a block's outputs.
    pub(crate) async fn task_input_within(&self, task: &ClaimedTask, limit: u64) -> Result<Value> {
        if let Some(input) = &task.input {
            return Ok(input.clone());
        }
        let Some(input_stage) = task.input_stage else {
            let mut conn = self.pool().acquire().await?;
            let row = executions::get(&mut *conn, task.execution_id)
                .await?
                .ok_or(Error::ExecutionNotFound(task.execution_id))?;
            return Ok(row.input.0);
        };
        self.block_input(task.execution_id, input_stage, limit)
            .await
    }

    /// Extends the lease of a running attempt. Returns the execution's status, or `None`
    /// if the attempt has lost its lease.
    ///
    /// # Errors
    /// [`Error::Database`].
    ///
    /// # Cancel safety
    /// One statement: dropped, the lease is renewed or not; renewing again is harmless.
    pub async fn renew_lease(
        &self,
        task: &ClaimedTask,
        lease: Duration,
    ) -> Result<Option<ExecutionStatus>> {
        let mut conn = self.pool().acquire().await?;
        Ok(
            tasks::renew_lease(&mut conn, task.id, task.lease, millis(lease))
                .await?
                .map(|s| ExecutionStatus::parse(&s)),
        )
    }

    /// Records a successful attempt and counts it towards its group, in one transaction;
    /// the last arrival dispatches the next stage before it commits.
    ///
    /// Safe to repeat: a replay returns [`Outcome::AlreadyRecorded`], a stale attempt
    /// [`Outcome::LeaseLost`], and neither changes anything.
    ///
    /// # Errors
    /// [`Error::InvalidOutput`] (nothing recorded) when the output cannot feed the next
    /// stage, e.g. a step before a map must return an array; [`Error::TaskNotFound`];
    /// [`Error::Database`] (then nothing was recorded, or the commit's answer was lost:
    /// repeat the call to find out).
    ///
    /// # Cancel safety
    /// One transaction, or a single autocommitted statement when the arrival cannot be
    /// its group's last: dropped before the commit, nothing is recorded. Dropped after
    /// the server committed (the fast path's statement commits on its own, and a
    /// transaction's answer can be lost), the completion stands and the caller never
    /// learns the outcome: calling again returns [`Outcome::AlreadyRecorded`], and if that
    /// commit fired the group, the next stage runs all the same (`fired` is only news).
    pub async fn complete(&self, task: &ClaimedTask, output: Value) -> Result<Outcome> {
        self.check_output(task, &output).await?;
        let started = Instant::now();
        let outcome = retry_conflicts(|| self.complete_once(task, &output)).await?;
        outcome.record(started);
        Ok(outcome)
    }

    /// Whether this process knows the task's stage is not a step (the one member of a
    /// step, a sleep or a signal wait is always its group's last arrival; an unknown stage
    /// is treated as one).
    pub(crate) fn known_not_step(&self, task: &ClaimedTask) -> bool {
        self.cached_definition(&task.workflow, task.workflow_version)
            .is_some_and(|w| {
                w.stage_at(task.stage_index)
                    .is_some_and(|s| !s.has_one_member())
            })
    }

    /// Refuses an output that cannot feed the next stage: a step before a map must return
    /// an array. After a step followed by a branch, only the stage entered knows; a map
    /// there is checked when it is entered (an output it cannot use fails the execution).
    pub(crate) async fn check_output(&self, task: &ClaimedTask, output: &Value) -> Result<()> {
        let workflow = match self.cached_definition(&task.workflow, task.workflow_version) {
            Some(workflow) => workflow,
            None => {
                let mut conn = self.pool().acquire().await?;
                self.definition(&mut conn, &task.workflow, task.workflow_version)
                    .await?
            }
        };
        let next = workflow
            .plan()
            .next(task.stage_index)
            .and_then(|i| workflow.stage_at(i));
        let next_is_map = next.is_some_and(|s| s.kind().maps());
        let next_name = next.map_or("", |s| s.name());
        let stage = workflow
            .stage_at(task.stage_index)
            .ok_or_else(|| beyond_stages(task.id, task.stage_index, &workflow))?;
        // A signal wait's output (its timeout output here) feeds the next stage as a step's.
        let is_step = matches!(stage.kind(), StageKind::Step | StageKind::Signal { .. });
        if is_step && next_is_map && !output.is_array() {
            return Err(Error::InvalidOutput {
                task: task.id,
                reason: format!(
                    "the next stage {next_name:?} is a map, so this step must return a JSON array"
                ),
            });
        }
        if let (true, true, Some(items)) = (is_step, next_is_map, output.as_array()) {
            if items.len() > crate::MAX_MAP_WIDTH {
                return Err(Error::InvalidOutput {
                    task: task.id,
                    reason: format!(
                        "the next stage {next_name:?} is a map of at most {} members, and this step \
                         returned {} elements",
                        crate::MAX_MAP_WIDTH,
                        items.len()
                    ),
                });
            }
        }
        Ok(())
    }

    async fn complete_once(&self, task: &ClaimedTask, output: &Value) -> Result<Outcome> {
        let (ids, tokens, outputs) = ([task.id], [task.lease], [Json(output)]);
        let mut conn = self.pool().acquire().await?;
        // Most arrivals are not their group's last: one statement, no transaction around
        // it. A step's only member always is, so it goes straight to the transaction.
        if task.fan_in.counts()
            && self.known_not_step(task)
            && fan_in::complete_many_unless_last(&mut conn, &ids, &tokens, &outputs).await?
        {
            return Ok(Outcome::Completed { fired: false });
        }
        // This arrival may fire. A counting strategy holds the group's row when it finds
        // out, so it takes the execution's lock first (`store::locks`); the re-counting
        // ones hold only the task's row when they lock the execution.
        let mut tx = crate::store::begin_on(&mut conn).await?;
        if task.fan_in.counts() {
            locks::execution(&mut tx, task.execution_id).await?;
        }
        let done = fan_in::complete_many(&mut tx, &ids, &tokens, &outputs).await?;
        let Some(row) = done.first() else {
            drop(tx);
            drop(conn); // a pool of one connection needs it back to explain
            return self.explain_no_match(task.id, task.lease).await;
        };
        if row.late {
            // Its quorum group had fired: `complete_many` cancelled it.
            tx.commit().await?;
            return Ok(Outcome::Cancelled);
        }
        let last = !fan_in::last_arrivals(&mut tx, &done).await?.is_empty();
        let fired = last
            && dispatch::fire(
                self,
                &mut tx,
                row.execution_id,
                row.group_id,
                row.stage_index,
            )
            .await?;
        tx.commit().await?;
        Ok(Outcome::Completed { fired })
    }

    /// Records a failed attempt: a retry after backoff, or (attempts exhausted, or
    /// `permanent`) a dead letter that counts towards fan-in, or fails the execution when
    /// its stage says so (a step always does).
    ///
    /// # Errors
    /// [`Error::TaskNotFound`]; [`Error::Database`]. Safe to repeat, like
    /// [`complete`](Self::complete).
    ///
    /// # Cancel safety
    /// One transaction: dropped before its commit, nothing is recorded and the attempt stays
    /// running until its lease expires (or it is failed again: safe to repeat).
    pub async fn fail(&self, task: &ClaimedTask, error: &str, permanent: bool) -> Result<Outcome> {
        let attempt = Attempt {
            id: task.id,
            lease: task.lease,
            execution_id: task.execution_id,
            workflow: &task.workflow,
            workflow_version: task.workflow_version,
            stage_index: task.stage_index,
            fan_in: task.fan_in,
            attempt: task.attempt,
            max_attempts: task.max_attempts,
        };
        self.fail_attempt(&attempt, error, permanent, false).await
    }

    pub(crate) async fn fail_attempt(
        &self,
        attempt: &Attempt<'_>,
        error: &str,
        permanent: bool,
        only_if_expired: bool,
    ) -> Result<Outcome> {
        let started = Instant::now();
        let outcome =
            retry_conflicts(|| self.fail_once(attempt, error, permanent, only_if_expired)).await?;
        outcome.record(started);
        Ok(outcome)
    }

    async fn fail_once(
        &self,
        a: &Attempt<'_>,
        error: &str,
        permanent: bool,
        only_if_expired: bool,
    ) -> Result<Outcome> {
        let mut tx = crate::store::begin(self.pool()).await?;
        let workflow = self
            .definition(&mut tx, a.workflow, a.workflow_version)
            .await?;
        let stage = workflow
            .stage_at(a.stage_index)
            .ok_or_else(|| beyond_stages(a.id, a.stage_index, &workflow))?;
        let fails_execution = stage.fails_execution_on_member_failure();
        let quorum = stage.join_rule().quorum().is_some();
        if fails_execution
            || quorum
            || (a.fan_in.counts() && (permanent || a.attempt >= a.max_attempts))
        {
            // A dead letter fails the execution, or counts its group down and may fire
            // it: the execution first (`store::locks`). A quorum member's failure asks
            // whether its group fired without it (then it is cancelled, not retried):
            // holding the execution, it sees every firing that committed.
            locks::execution(&mut tx, a.execution_id).await?;
        }
        let row = fan_in::fail(&mut tx, a.id, a.lease, error, permanent, only_if_expired).await?;
        let Some(row) = row else {
            drop(tx);
            return self.explain_no_match(a.id, a.lease).await;
        };
        // The failure's own statement counted a terminal member down.
        let outcome = match row.status.as_str() {
            "pending" => Outcome::RetryScheduled { at: row.run_at },
            "cancelled" => Outcome::Cancelled,
            _ if fails_execution => {
                let message = format!(
                    "stage {:?} failed: task {} was dead-lettered after {} attempt(s): {}",
                    stage.name(),
                    a.id,
                    row.attempt,
                    error
                );
                executions::stop(&mut tx, a.execution_id, "failed", Some(&message)).await?;
                Outcome::DeadLettered { fired: false }
            }
            _ => {
                let counted = fan_in::Counted {
                    remaining: row.remaining,
                    quorum: stage.join_rule().quorum().map(|k| k as i32),
                    reached: false,
                    unreachable: row.unreachable,
                };
                let verdict = fan_in::decide(
                    a.fan_in,
                    &mut tx,
                    a.execution_id,
                    row.group_id,
                    counted,
                    &[],
                )
                .await?;
                let fired = match verdict {
                    fan_in::Verdict::Wait => false,
                    fan_in::Verdict::Fire => {
                        dispatch::fire(self, &mut tx, a.execution_id, row.group_id, row.stage_index)
                            .await?
                    }
                    fan_in::Verdict::Unreachable => {
                        let q = quorum::state(&mut tx, row.group_id).await?;
                        let message = format!(
                            "stage {:?} failed: its join {} needs {} of its {} members to \
                             complete, and {} were dead-lettered, so it can no longer fire; the \
                             last, task {}, after {} attempt(s): {}",
                            stage.name(),
                            stage.join_rule(),
                            q.quorum,
                            q.width,
                            q.dead,
                            a.id,
                            row.attempt,
                            error
                        );
                        executions::stop(&mut tx, a.execution_id, "failed", Some(&message)).await?;
                        false
                    }
                };
                Outcome::DeadLettered { fired }
            }
        };
        tx.commit().await?;
        Ok(outcome)
    }

    /// Gives a claimed task back without counting the attempt (e.g. at shutdown); a task
    /// that must not run is cancelled instead and counted towards its group: its
    /// execution has stopped, or it is a member of a quorum group
    /// ([`Join`](crate::Join)) that fired without it. Returns false if the attempt no
    /// longer held it.
    ///
    /// # Errors
    /// [`Error::Database`].
    ///
    /// # Cancel safety
    /// One transaction: dropped before its commit, the task stays claimed and comes back
    /// when its lease expires, with the attempt counted.
    pub async fn release(&self, task: &ClaimedTask) -> Result<bool> {
        Ok(retry_conflicts(|| self.give_back_once(task)).await? != GivenBack::Lost)
    }

    /// Cancels a claimed task whose execution has stopped (or whose quorum group fired
    /// without it); it counts towards its group. Gives it back instead if the execution
    /// is running again (resumed) and its group still waits. True if it cancelled it.
    pub(crate) async fn cancel_claimed(&self, task: &ClaimedTask) -> Result<bool> {
        Ok(retry_conflicts(|| self.give_back_once(task)).await? == GivenBack::Cancelled)
    }

    /// Cancels the claimed task if it must not run, else gives it back uncounted, in one
    /// transaction that holds its execution's lock first (`store::locks`): holding it, a
    /// firing of its group has committed or has not begun, and a resume too.
    async fn give_back_once(&self, task: &ClaimedTask) -> Result<GivenBack> {
        let mut tx = crate::store::begin(self.pool()).await?;
        locks::execution(&mut tx, task.execution_id).await?;
        let given = if fan_in::cancel_claimed(&mut tx, task.id, task.lease).await? {
            GivenBack::Cancelled
        } else if tasks::release(&mut tx, task.id, task.lease).await? {
            GivenBack::Released
        } else {
            GivenBack::Lost
        };
        tx.commit().await?;
        Ok(given)
    }

    /// Why a guarded transition matched nothing.
    pub(crate) async fn explain_no_match(&self, id: TaskId, lease: LeaseToken) -> Result<Outcome> {
        let mut conn = self.pool().acquire().await?;
        match tasks::status_and_token(&mut conn, id).await? {
            None => Err(Error::TaskNotFound(id)),
            Some((status, Some(token))) if token == lease && status != "running" => {
                Ok(Outcome::AlreadyRecorded)
            }
            Some(_) => Ok(Outcome::LeaseLost),
        }
    }
}

/// What giving a claimed task back did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum GivenBack {
    /// Cancelled and counted: it must not run.
    Cancelled,
    /// Back in the queue, its attempt uncounted.
    Released,
    /// The attempt no longer held it.
    Lost,
}

/// The fields of an attempt that recording its failure needs.
pub(crate) struct Attempt<'a> {
    pub id: TaskId,
    pub lease: LeaseToken,
    pub execution_id: ExecutionId,
    pub workflow: &'a str,
    pub workflow_version: i32,
    pub stage_index: usize,
    pub fan_in: FanInStrategy,
    pub attempt: u32,
    pub max_attempts: u32,
}
