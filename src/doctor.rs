//! The auditor: finds what the engine's transactions never leave behind, and re-drives
//! it. Safe to run while workers run, and as often as wanted: every repair locks what it
//! touches, re-checks the finding from a snapshot taken after the lock, and changes
//! nothing if the finding no longer holds.

use serde::Serialize;

use crate::dispatch;
use crate::engine::Engine;
use crate::error::Result;
use crate::ids::{ExecutionId, GroupId, TaskId};
use crate::store::{audit, children, locks, signals};

/// What [`Engine::doctor`] found. Empty on a healthy database.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Diagnosis {
    /// Counters of running executions' groups that disagree with their members.
    pub counter_mismatches: Vec<CounterMismatch>,
    /// Groups of running executions with every member terminal that never fired: the
    /// silent stall of an unguarded fan-in.
    pub unfired_groups: Vec<GroupRef>,
    /// Running executions with nothing left to run: no open task and every group fired,
    /// but the next stage was never entered (or the execution never completed).
    pub stalled_executions: Vec<GroupRef>,
    /// Signals kept for a wait that is pending: a signal that was never received.
    pub unreceived_signals: Vec<SignalRef>,
    /// Child workflows' executions that ended while their member in a running parent
    /// still waits (`infinity`): an end that was never reported.
    pub unreported_children: Vec<ChildRef>,
    /// Running child workflows' executions of a parent that has ended, which nothing is
    /// cancelling.
    pub orphaned_children: Vec<ExecutionId>,
}

impl Diagnosis {
    /// Nothing found.
    pub fn is_healthy(&self) -> bool {
        self.counter_mismatches.is_empty()
            && self.unfired_groups.is_empty()
            && self.stalled_executions.is_empty()
            && self.unreceived_signals.is_empty()
            && self.unreported_children.is_empty()
            && self.orphaned_children.is_empty()
    }

    /// Number of findings.
    pub fn len(&self) -> usize {
        self.counter_mismatches.len()
            + self.unfired_groups.len()
            + self.stalled_executions.len()
            + self.unreceived_signals.len()
            + self.unreported_children.len()
            + self.orphaned_children.len()
    }

    /// True when nothing was found (the same as [`is_healthy`](Self::is_healthy)).
    pub fn is_empty(&self) -> bool {
        self.is_healthy()
    }
}

/// A counter that disagrees with the members it counts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct CounterMismatch {
    /// The group.
    pub group_id: GroupId,
    /// Its execution.
    pub execution_id: ExecutionId,
    /// Its stage.
    pub stage_index: i32,
    /// The stripe, for a striped group's stripe row; `None` for the group's own counter.
    pub stripe: Option<i32>,
    /// Which counter: `remaining` (non-terminal members), or a quorum join's `needed`
    /// (successes still needed) or `tolerable` (dead members it can still absorb).
    pub counter_name: String,
    /// What the counter says.
    pub counter: i32,
    /// What it should say: its non-terminal members (for a striped group's own counter,
    /// its stripes with non-terminal members).
    pub expected: i32,
}

/// A group, and the execution and stage it belongs to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct GroupRef {
    /// The group.
    pub group_id: GroupId,
    /// Its execution.
    pub execution_id: ExecutionId,
    /// Its stage.
    pub stage_index: i32,
}

/// A signal kept for an execution, by name.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct SignalRef {
    /// The execution.
    pub execution_id: ExecutionId,
    /// The signal's name.
    pub name: String,
}

/// A child workflow's execution and its member in the parent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct ChildRef {
    /// The child execution.
    pub execution_id: ExecutionId,
    /// Its member task in the parent.
    pub member: TaskId,
}

/// What [`Engine::repair`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Repairs {
    /// What was found before repairing.
    pub found: Diagnosis,
    /// Groups whose counters were re-counted from their members.
    pub counters_fixed: usize,
    /// Groups fired (their next stage dispatched, or their execution completed).
    pub groups_fired: usize,
    /// Stalled executions moved on.
    pub executions_advanced: usize,
    /// Kept signals handed to their pending waits.
    pub signals_received: usize,
    /// Ended children whose members were made due (their end reported).
    pub children_reported: usize,
    /// Orphaned children cancelled.
    pub orphans_cancelled: usize,
}

impl Repairs {
    /// Repairs made, of every kind.
    pub fn count(&self) -> usize {
        self.counters_fixed
            + self.groups_fired
            + self.executions_advanced
            + self.signals_received
            + self.children_reported
            + self.orphans_cancelled
    }
}

impl From<audit::GroupRow> for GroupRef {
    fn from(row: audit::GroupRow) -> Self {
        GroupRef {
            group_id: row.group_id,
            execution_id: row.execution_id,
            stage_index: row.stage_index,
        }
    }
}

impl Engine {
    /// Audits the database for states the engine's transitions never commit: counters
    /// that disagree with their members, groups whose members are all terminal that never
    /// fired, running executions with nothing left to run, signals kept while their wait
    /// is pending, child workflows' ends never reported to their parent, running children
    /// of ended parents that nothing cancels. Read-only; each kind of
    /// finding is read in one statement, so concurrent work cannot produce a false one.
    ///
    /// ```no_run
    /// # async fn run(engine: confluo::Engine) -> confluo::Result<()> {
    /// let diagnosis = engine.doctor().await?;
    /// if !diagnosis.is_healthy() {
    ///     eprintln!("{} findings: {diagnosis:?}", diagnosis.len());
    ///     engine.repair().await?;
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`Error::Database`](crate::Error::Database).
    ///
    /// # Cancel safety
    /// Reads only: dropping it changes nothing.
    pub async fn doctor(&self) -> Result<Diagnosis> {
        self.diagnose(None).await
    }

    /// [`doctor`](Self::doctor) over the running executions of `scope` (`None`: all).
    pub(crate) async fn diagnose(&self, scope: audit::Scope<'_>) -> Result<Diagnosis> {
        let mut conn = self.pool().acquire().await?;
        let counters = audit::counter_mismatches(&mut conn, scope).await?;
        let unfired = audit::unfired_groups(&mut conn, scope).await?;
        let stalled = audit::stalled_executions(&mut conn, scope).await?;
        let unreceived = signals::unreceived(&mut *conn, 1_000, scope).await?;
        let unreported = children::unreported(&mut *conn, 1_000, scope).await?;
        let orphaned = children::orphans(&mut *conn, 1_000, scope).await?;
        Ok(Diagnosis {
            counter_mismatches: counters
                .into_iter()
                .map(|r| CounterMismatch {
                    group_id: r.group_id,
                    execution_id: r.execution_id,
                    stage_index: r.stage_index,
                    stripe: r.stripe,
                    counter_name: r.name,
                    counter: r.counter,
                    expected: r.expected,
                })
                .collect(),
            unfired_groups: unfired.into_iter().map(GroupRef::from).collect(),
            stalled_executions: stalled.into_iter().map(GroupRef::from).collect(),
            unreceived_signals: unreceived
                .into_iter()
                .map(|(execution_id, name)| SignalRef { execution_id, name })
                .collect(),
            unreported_children: unreported
                .into_iter()
                .map(|(execution_id, member)| ChildRef {
                    execution_id,
                    member,
                })
                .collect(),
            orphaned_children: orphaned,
        })
    }

    /// Audits (as [`doctor`](Self::doctor)) and re-drives what it finds: re-counts
    /// disagreeing counters from their members, fires unfired groups (dispatching their
    /// next stage exactly once: the group's fired marker still guards it), moves
    /// stalled executions on, hands kept signals to their pending waits, makes the members
    /// of ended children due, and cancels orphaned children. Each repair is a transaction
    /// of its own that locks what it touches in the one lock order (the execution first,
    /// then stripes, then the group: `store::locks`) and re-checks its finding first, so
    /// repairing while workers run, or twice, is safe.
    ///
    /// # Errors
    /// [`Error::Database`](crate::Error::Database); what was repaired before the error
    /// stays repaired.
    ///
    /// # Cancel safety
    /// Each repair is a transaction of its own: dropped, what was repaired stays repaired and
    /// the one in progress is rolled back; calling it again finishes the job.
    pub async fn repair(&self) -> Result<Repairs> {
        let found = self.doctor().await?;
        self.repair_found(found, None).await
    }

    /// Repairs what [`diagnose`](Self::diagnose) found over `scope`.
    pub(crate) async fn repair_found(
        &self,
        found: Diagnosis,
        scope: audit::Scope<'_>,
    ) -> Result<Repairs> {
        let mut repairs = Repairs::default();
        let mut groups: Vec<GroupId> = found
            .counter_mismatches
            .iter()
            .map(|m| m.group_id)
            .collect();
        groups.dedup();
        for group in groups {
            let mut tx = crate::store::begin(self.pool()).await?;
            audit::recount(&mut tx, group).await?;
            tx.commit().await?;
            repairs.counters_fixed += 1;
        }
        // Re-read: a re-counted group may now be at zero and unfired.
        let unfired = if repairs.counters_fixed > 0 {
            let mut conn = self.pool().acquire().await?;
            audit::unfired_groups(&mut conn, scope).await?
        } else {
            Vec::new()
        };
        let unfired = found
            .unfired_groups
            .iter()
            .map(|g| (g.group_id, g.execution_id, g.stage_index))
            .chain(
                unfired
                    .iter()
                    .map(|g| (g.group_id, g.execution_id, g.stage_index)),
            );
        let mut seen = std::collections::HashSet::new();
        for (group, execution, stage) in unfired {
            if !seen.insert(group) {
                continue;
            }
            let mut tx = crate::store::begin(self.pool()).await?;
            // The execution (this may fire), stripes, then the group (`store::locks`),
            // then the re-check; if the group no longer needs firing, the re-count is
            // rolled back with the transaction.
            locks::execution(&mut tx, execution).await?;
            audit::recount(&mut tx, group).await?;
            if audit::lock_if_unfired(&mut tx, group).await? {
                if dispatch::fire(self, &mut tx, execution, group, stage).await? {
                    repairs.groups_fired += 1;
                }
                tx.commit().await?;
            }
        }
        for stalled in &found.stalled_executions {
            if self.redrive_stalled(stalled.execution_id).await? {
                repairs.executions_advanced += 1;
            }
        }
        for signal in &found.unreceived_signals {
            let mut tx = crate::store::begin(self.pool()).await?;
            locks::execution(&mut tx, signal.execution_id).await?;
            if crate::signal::receive_kept(self, &mut tx, signal.execution_id, &signal.name).await?
            {
                repairs.signals_received += 1;
            }
            tx.commit().await?;
        }
        for child in &found.unreported_children {
            let mut tx = crate::store::begin(self.pool()).await?;
            if children::wake_member(&mut tx, child.member).await? {
                repairs.children_reported += 1;
            }
            tx.commit().await?;
        }
        if !found.orphaned_children.is_empty() {
            let mut tx = crate::store::begin(self.pool()).await?;
            children::cascade_orphans(&mut tx, &found.orphaned_children).await?;
            tx.commit().await?;
            repairs.orphans_cancelled = self.cancel_orphans(usize::MAX).await?;
        }
        repairs.found = found;
        Ok(repairs)
    }

    /// Moves a stalled execution on, in one transaction holding its lock
    /// ([`dispatch::redrive`]): what it starts with, and what follows every fired group,
    /// is entered if it never was (a stall in a graph can sit on any branch, and a
    /// fan-out may have lost one dependent of several); a dependency that arrived at its
    /// join already arrives no second time. Returns whether the execution is stalled no
    /// more.
    async fn redrive_stalled(&self, execution: ExecutionId) -> Result<bool> {
        let mut tx = crate::store::begin(self.pool()).await?;
        let Some(stalled) = audit::lock_if_stalled(&mut tx, execution).await? else {
            return Ok(false);
        };
        dispatch::redrive(self, &mut tx, execution, &stalled).await?;
        let advanced = !audit::is_stalled(&mut tx, execution).await?;
        tx.commit().await?;
        Ok(advanced)
    }
}
