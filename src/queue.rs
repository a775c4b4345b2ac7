//! Claiming tasks and acknowledging attempts: the low-level API under the worker.
//!
//! Workers built with [`Engine::worker`] use these calls; they are public so that a
//! service can drive tasks itself (or a test can race acknowledgements precisely).
//! Every acknowledgement is fenced by the claim's [`LeaseToken`] and safe to repeat.

use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use serde_json::Value;

use crate::definition::StageKind;
use crate::dispatch;
use crate::engine::Engine;
use crate::error::{retry_conflicts, Error, Result};
use crate::execution::ExecutionStatus;
use crate::fanin::{self, FanInStrategy, Member};
use crate::ids::{ExecutionId, GroupId, LeaseToken, TaskId};
use crate::metrics;
use crate::store::tasks::HandlerKeys;
use crate::store::{executions, groups, locks, tasks};

/// A task claimed for one attempt.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ClaimedTask {
    /// The task.
    pub id: TaskId,
    /// Its execution.
    pub execution_id: ExecutionId,
    /// Its stage's group (countdown row).
    pub group_id: GroupId,
    /// Its workflow.
    pub workflow: String,
    /// The workflow version its execution is pinned to.
    pub workflow_version: i32,
    /// Its stage's position.
    pub stage_index: usize,
    /// The handler that runs it (stage name, or branch name in a parallel stage).
    pub handler: String,
    /// Its position in the group.
    pub item_index: u32,
    /// This attempt's number, from 1.
    pub attempt: u32,
    /// Attempts allowed in all.
    pub max_attempts: u32,
    /// The token that fences this attempt.
    pub lease: LeaseToken,
    /// When the lease runs out unless renewed.
    pub lease_expires_at: DateTime<Utc>,
    /// The stage's per-attempt timeout.
    pub timeout: Duration,
    /// The fan-in strategy of its group, which decides its arrival.
    pub fan_in: FanInStrategy,
    pub(crate) input: Option<Value>,
    pub(crate) execution_status: ExecutionStatus,
}

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
    /// The task was cancelled because its execution has stopped.
    Cancelled,
    /// This attempt's outcome had already been recorded (a replayed or duplicated
    /// acknowledgement): nothing changed.
    AlreadyRecorded,
    /// The attempt no longer holds the task (its lease expired and was reclaimed, or
    /// another attempt now runs): nothing changed.
    LeaseLost,
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

    /// The plan PostgreSQL chooses for a worker's claim statement over these `(workflow,
    /// handler)` pairs, as `EXPLAIN` prints it: a diagnostic for a claim that seems slow.
    /// It reads one index range per handler (`task_claim_handler_idx`) whatever the
    /// table's statistics, so it should never show a sort of the whole backlog.
    ///
    /// # Errors
    /// [`Error::Database`].
    ///
    /// # Cancel safety
    /// Reads only: dropping it changes nothing.
    pub async fn claim_plan(&self, handlers: &[(&str, &str)], limit: usize) -> Result<String> {
        let keys = HandlerKeys {
            workflows: handlers.iter().map(|(w, _)| (*w).to_owned()).collect(),
            handlers: handlers.iter().map(|(_, h)| (*h).to_owned()).collect(),
        };
        let mut conn = self.pool().acquire().await?;
        tasks::explain_claim(&mut conn, limit as i64, &keys).await
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
    /// its group (as a task of a stopped execution never runs). Returns how many went
    /// back to the queue.
    pub(crate) async fn release_many(&self, held: &[ClaimedTask]) -> Result<usize> {
        if held.is_empty() {
            return Ok(0);
        }
        let ids: Vec<TaskId> = held.iter().map(|t| t.id).collect();
        let tokens: Vec<LeaseToken> = held.iter().map(|t| t.lease).collect();
        let released = {
            let mut conn = self.pool().acquire().await?;
            tasks::release_many(&mut conn, &ids, &tokens).await?
        };
        for task in held.iter().filter(|t| !released.contains(&t.id)) {
            self.cancel_claimed(task).await?;
        }
        Ok(released.len())
    }

    /// The input of a claimed task: its map element, or the stage input read by reference
    /// (the execution input for the first stage, else the previous stage's output).
    ///
    /// # Errors
    /// [`Error::Database`].
    ///
    /// # Cancel safety
    /// Reads only: dropping it changes nothing.
    pub async fn task_input(&self, task: &ClaimedTask) -> Result<Value> {
        if let Some(input) = &task.input {
            return Ok(input.clone());
        }
        let mut conn = self.pool().acquire().await?;
        if task.stage_index == 0 {
            let row = executions::get(&mut *conn, task.execution_id)
                .await?
                .ok_or(Error::ExecutionNotFound(task.execution_id))?;
            return Ok(row.input.0);
        }
        groups::stage_output(&mut *conn, task.execution_id, task.stage_index as i32 - 1)
            .await?
            .ok_or(Error::ExecutionNotFound(task.execution_id))
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
        metrics::acknowledged(&outcome, started);
        Ok(outcome)
    }

    /// Refuses an output that cannot feed the next stage: a step before a map must return
    /// an array.
    pub(crate) async fn check_output(&self, task: &ClaimedTask, output: &Value) -> Result<()> {
        let workflow = match self.cached_definition(&task.workflow, task.workflow_version) {
            Some(workflow) => workflow,
            None => {
                let mut conn = self.pool().acquire().await?;
                self.definition(&mut conn, &task.workflow, task.workflow_version)
                    .await?
            }
        };
        let next_is_map = matches!(
            workflow
                .stages()
                .get(task.stage_index + 1)
                .map(|s| s.kind()),
            Some(StageKind::Map)
        );
        let stage = workflow
            .stages()
            .get(task.stage_index)
            .ok_or_else(|| beyond_stages(task.id, task.stage_index, &workflow))?;
        let is_step = matches!(stage.kind(), StageKind::Step);
        if is_step && next_is_map && !output.is_array() {
            return Err(Error::InvalidOutput {
                task: task.id,
                reason: format!(
                    "the next stage {:?} is a map, so this step must return a JSON array",
                    workflow.stages()[task.stage_index + 1].name()
                ),
            });
        }
        Ok(())
    }

    async fn complete_once(&self, task: &ClaimedTask, output: &Value) -> Result<Outcome> {
        let mut conn = self.pool().acquire().await?;
        // Most arrivals are not their group's last: one statement, no transaction around
        // it. A step's only member always is, so it goes straight to the transaction.
        let is_step = self
            .cached_definition(&task.workflow, task.workflow_version)
            .is_none_or(|w| {
                matches!(
                    w.stages().get(task.stage_index).map(|s| s.kind()),
                    Some(StageKind::Step) | None
                )
            });
        if !is_step
            && task
                .fan_in
                .complete_unless_last(&mut conn, task.id, task.lease, output)
                .await?
        {
            return Ok(Outcome::Completed { fired: false });
        }
        // This arrival may fire. A counting strategy holds the group's row when it finds
        // out, so it takes the execution's lock first (`store::locks`); the re-counting
        // ones hold only the task's row when they lock the execution.
        let mut tx = crate::store::begin_on(&mut conn).await?;
        if task.fan_in.counts() {
            locks::execution_of_task(&mut tx, task.id).await?;
        }
        let arrival = task
            .fan_in
            .complete(&mut tx, task.id, task.lease, output)
            .await?;
        let Some(arrival) = arrival else {
            drop(tx);
            drop(conn); // a pool of one connection needs it back to explain
            return self.explain_no_match(task.id, task.lease).await;
        };
        let fired = arrival.last
            && dispatch::fire(
                self,
                &mut tx,
                arrival.execution_id,
                arrival.group_id,
                arrival.stage_index,
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
        metrics::acknowledged(&outcome, started);
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
            .stages()
            .get(a.stage_index)
            .ok_or_else(|| beyond_stages(a.id, a.stage_index, &workflow))?;
        let fails_execution = stage.fails_execution_on_member_failure();
        if fails_execution || (a.fan_in.counts() && (permanent || a.attempt >= a.max_attempts)) {
            // A dead letter fails the execution, or counts its group down and may fire
            // it: the execution first (`store::locks`).
            locks::execution_of_task(&mut tx, a.id).await?;
        }
        let row =
            tasks::fail_counting_down(&mut tx, a.id, a.lease, error, permanent, only_if_expired)
                .await?;
        let Some(row) = row else {
            drop(tx);
            return self.explain_no_match(a.id, a.lease).await;
        };
        let member = Member {
            group_id: row.group_id,
            item_index: row.item_index,
        };
        // Countdown groups were counted by the failure's own statement.
        let counted = row.remaining.is_some();
        let outcome = match row.status.as_str() {
            "pending" => Outcome::RetryScheduled { at: row.run_at },
            "cancelled" => {
                if !counted {
                    fanin::count_without_deciding(a.fan_in, &mut tx, member).await?;
                }
                Outcome::Cancelled
            }
            _ if fails_execution => {
                if !counted {
                    fanin::count_without_deciding(a.fan_in, &mut tx, member).await?;
                }
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
                let last = a
                    .fan_in
                    .decide(&mut tx, a.execution_id, member, row.remaining)
                    .await?;
                let fired = last
                    && dispatch::fire(self, &mut tx, a.execution_id, row.group_id, row.stage_index)
                        .await?;
                Outcome::DeadLettered { fired }
            }
        };
        tx.commit().await?;
        Ok(outcome)
    }

    /// Gives a claimed task back without counting the attempt (e.g. at shutdown).
    /// Returns false if the attempt no longer held it.
    ///
    /// # Errors
    /// [`Error::Database`].
    ///
    /// # Cancel safety
    /// One statement: dropped, the task is given back or stays claimed; if it stays, it
    /// comes back when its lease expires, with the attempt counted.
    pub async fn release(&self, task: &ClaimedTask) -> Result<bool> {
        let mut conn = self.pool().acquire().await?;
        tasks::release(&mut conn, task.id, task.lease).await
    }

    /// Cancels a claimed task whose execution has stopped; it counts towards its group.
    /// Gives it back instead if the execution is running again (resumed).
    pub(crate) async fn cancel_claimed(&self, task: &ClaimedTask) -> Result<bool> {
        retry_conflicts(|| self.cancel_claimed_once(task)).await
    }

    async fn cancel_claimed_once(&self, task: &ClaimedTask) -> Result<bool> {
        let mut tx = crate::store::begin(self.pool()).await?;
        let Some(row) = tasks::cancel_claimed(&mut tx, task.id, task.lease).await? else {
            drop(tx);
            // The execution was resumed meanwhile (or the lease is lost): give it back.
            self.release(task).await?;
            return Ok(false);
        };
        let member = Member {
            group_id: row.group_id,
            item_index: row.item_index,
        };
        fanin::count_without_deciding(task.fan_in, &mut tx, member).await?;
        tx.commit().await?;
        Ok(true)
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

pub(crate) fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// The claimed rows as the tasks a worker runs; those this build cannot read (see
/// [`Engine::readable`]) apart, with why.
pub(crate) fn claimed_tasks(
    rows: Vec<tasks::ClaimedRow>,
) -> (Vec<ClaimedTask>, Vec<(TaskId, LeaseToken, String)>) {
    let mut unreadable = Vec::new();
    let tasks = rows
        .into_iter()
        .filter_map(|r| {
            let fan_in = match r.fan_in.parse::<FanInStrategy>() {
                Ok(fan_in) => fan_in,
                Err(e) => {
                    unreadable.push((r.id, r.lease_token, e.to_string()));
                    return None;
                }
            };
            Some(ClaimedTask {
                id: r.id,
                execution_id: r.execution_id,
                group_id: r.group_id,
                workflow: r.workflow_name,
                workflow_version: r.workflow_version,
                stage_index: r.stage_index as usize,
                handler: r.handler,
                item_index: r.item_index as u32,
                attempt: r.attempt as u32,
                max_attempts: r.max_attempts as u32,
                lease: r.lease_token,
                lease_expires_at: r.lease_expires_at,
                timeout: Duration::from_millis(r.timeout_ms.max(0) as u64),
                input: r.input.map(|j| j.0),
                execution_status: ExecutionStatus::parse(&r.execution_status),
                fan_in,
            })
        })
        .collect();
    (tasks, unreadable)
}

/// The error for a stage index beyond the workflow's stages.
pub(crate) fn beyond_stages(task: TaskId, index: usize, workflow: &crate::Workflow) -> Error {
    Error::UnreadableTask {
        task,
        reason: format!(
            "its stage index {index} is beyond the {} stage(s) of workflow {} v{}",
            workflow.stages().len(),
            workflow.name(),
            workflow.version()
        ),
    }
}

/// How long a claimed task this build cannot run waits before it is due again.
const SET_ASIDE: Duration = Duration::from_secs(60);

impl Engine {
    /// The claimed rows as tasks, once those this build cannot run are given back: a
    /// fan-in strategy it does not know (written by a newer version, say), a workflow
    /// version or stage it cannot find. Each of those is given back uncounted, due again
    /// in a minute (for a worker that can run it), and reported; the others are returned.
    pub(crate) async fn readable(&self, rows: Vec<tasks::ClaimedRow>) -> Result<Vec<ClaimedTask>> {
        let (tasks, mut unreadable) = claimed_tasks(rows);
        let mut readable = Vec::with_capacity(tasks.len());
        for task in tasks {
            let known = match self.cached_definition(&task.workflow, task.workflow_version) {
                Some(workflow) => Ok(workflow),
                None => {
                    let mut conn = self.pool().acquire().await?;
                    self.definition(&mut conn, &task.workflow, task.workflow_version)
                        .await
                }
            };
            match known {
                Ok(w) if task.stage_index < w.stages().len() => readable.push(task),
                Ok(w) => unreadable.push((
                    task.id,
                    task.lease,
                    beyond_stages(task.id, task.stage_index, &w).to_string(),
                )),
                Err(e) if e.is_not_found() => unreadable.push((task.id, task.lease, e.to_string())),
                Err(e) => return Err(e),
            }
        }
        if !unreadable.is_empty() {
            for (task, _, reason) in &unreadable {
                let error = Error::UnreadableTask {
                    task: *task,
                    reason: reason.clone(),
                };
                tracing::error!(task_id = %task, "{error}; given back, due again in {SET_ASIDE:?}");
            }
            let (ids, tokens): (Vec<TaskId>, Vec<LeaseToken>) = unreadable
                .iter()
                .map(|(id, token, _)| (*id, *token))
                .unzip();
            let mut conn = self.pool().acquire().await?;
            tasks::set_aside(&mut conn, &ids, &tokens, millis(SET_ASIDE)).await?;
        }
        Ok(readable)
    }
}
