//! Acknowledging completions in batches: several members in one transaction, each group
//! (or stripe) counted down once per batch, so one lock-holding commit carries many
//! arrivals.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use serde_json::Value;
use sqlx::types::Json;

use crate::claimed::ClaimedTask;
use crate::dispatch;
use crate::engine::Engine;
use crate::error::{retry_conflicts, Result};
use crate::fanin::FanInStrategy;
use crate::ids::{ExecutionId, GroupId, LeaseToken, TaskId};
use crate::queue::Outcome;
use crate::store::tasks::{self, HandlerKeys};
use crate::store::{fan_in, locks};

/// A worker's standing claim on the stages a batch enters when it fires their groups:
/// as many of their members that its handlers run as it has room for, for `lease`.
pub(crate) struct HandOff<'a> {
    pub worker_id: &'a str,
    pub handlers: &'a HandlerKeys,
    pub lease: Duration,
    /// Takes room for up to `n` tasks without waiting; returns how many it took.
    pub take_room: &'a (dyn Fn(usize) -> usize + Sync),
    /// Gives back room taken and not used.
    pub give_back: &'a (dyn Fn(usize) + Sync),
    /// Tasks one hand-off claims at most.
    pub most: usize,
}

impl Engine {
    /// Records several successful attempts in one transaction. Each group (or stripe) is
    /// counted down once for all its members in the batch, and a group whose last
    /// arrival is in the batch fires before the commit, as with
    /// [`complete`](Self::complete). Batches whose members share a group, or a stripe,
    /// make the most of it: the group's row is locked once per batch instead of once per
    /// member.
    ///
    /// Returns one outcome per item, in order: [`Outcome::Completed`] (with `fired` on one
    /// member of each group that fired), or, for an item that was replayed or whose
    /// lease is lost, [`Outcome::AlreadyRecorded`] / [`Outcome::LeaseLost`]; those change
    /// nothing and do not hold the others back.
    ///
    /// # Errors
    /// [`Error::InvalidOutput`](crate::Error::InvalidOutput) if any output cannot feed
    /// its next stage (then nothing is recorded); [`Error::Database`](crate::Error::Database).
    ///
    /// # Cancel safety
    /// One transaction: dropped before the commit, nothing is recorded.
    pub async fn complete_batch(&self, items: &[(&ClaimedTask, Value)]) -> Result<Vec<Outcome>> {
        Ok(self.complete_batch_hinted(items, false, None).await?.0)
    }

    /// [`complete_batch`](Self::complete_batch), told whether the batch is likely to hold
    /// a group's last arrival (the worker has nothing else running): then it skips the
    /// single statement that refuses such a batch and goes straight to the transaction
    /// that can fire. Only the cost differs. With a `hand_off`, the firing transaction
    /// also claims members of the stages it entered for the worker (returned second).
    pub(crate) async fn complete_batch_hinted(
        &self,
        items: &[(&ClaimedTask, Value)],
        likely_last: bool,
        hand_off: Option<&HandOff<'_>>,
    ) -> Result<(Vec<Outcome>, Vec<ClaimedTask>)> {
        for (task, output) in items {
            self.check_output(task, output).await?;
        }
        let started = std::time::Instant::now();
        // A batch holding row-lock members (whose decision waits for the execution's
        // lock) locks its executions first. The others ask for them only when they fire,
        // without waiting, and start over locking them first if one is taken
        // (`store::locks`): taken up front, even by batches only likely to fire, the
        // execution's lock would be held most of the time under a busy map, and the
        // deadline sweep, which skips locked executions, could not time it out.
        let mut executions_first = items
            .iter()
            .any(|(t, _)| t.fan_in == FanInStrategy::RowLock);
        let (outcomes, handed) = loop {
            let result = retry_conflicts(|| {
                self.complete_batch_once(items, likely_last, hand_off, executions_first)
            })
            .await;
            match result {
                Err(e) if !executions_first && locks::is_taken(&e) => executions_first = true,
                other => break other?,
            }
        };
        for outcome in &outcomes {
            outcome.record(started);
        }
        Ok((outcomes, handed))
    }

    async fn complete_batch_once(
        &self,
        items: &[(&ClaimedTask, Value)],
        likely_last: bool,
        hand_off: Option<&HandOff<'_>>,
        executions_first: bool,
    ) -> Result<(Vec<Outcome>, Vec<ClaimedTask>)> {
        let ids: Vec<TaskId> = items.iter().map(|(t, _)| t.id).collect();
        let tokens: Vec<LeaseToken> = items.iter().map(|(t, _)| t.lease).collect();
        let outputs: Vec<Json<&Value>> = items.iter().map(|(_, o)| Json(o)).collect();

        let mut conn = self.pool().acquire().await?;
        // Most batches hold no group's last arrival: one statement, no transaction. Only
        // counting strategies can tell without a transaction (the statement refuses the
        // others too; skipping it spares re-counting batches a round trip).
        // A step's one member is always its group's last: a batch holding one goes
        // straight to the transaction.
        let counting = !likely_last
            && items
                .iter()
                .all(|(t, _)| t.fan_in.counts() && self.known_not_step(t));
        if counting && fan_in::complete_many_unless_last(&mut conn, &ids, &tokens, &outputs).await?
        {
            return Ok((
                vec![Outcome::Completed { fired: false }; items.len()],
                Vec::new(),
            ));
        }
        let mut tx = crate::store::begin_on(&mut conn).await?;
        if executions_first {
            let executions: Vec<ExecutionId> = items.iter().map(|(t, _)| t.execution_id).collect();
            locks::executions(&mut tx, &executions).await?;
        }
        let done = fan_in::complete_many(&mut tx, &ids, &tokens, &outputs).await?;
        let last: Vec<(ExecutionId, GroupId, i32)> = fan_in::last_arrivals(&mut tx, &done)
            .await?
            .into_iter()
            .map(|group| {
                let m = done.iter().find(|m| m.group_id == group).expect("a member");
                (m.execution_id, group, m.stage_index)
            })
            .collect();
        let fired = if last.is_empty() {
            dispatch::Fired::default()
        } else {
            dispatch::fire_many(self, &mut tx, &last, !executions_first).await?
        };
        let handed = match hand_off {
            Some(h) if !fired.entered.is_empty() => {
                // Room is taken only now, by the batch that fires: concurrent batches
                // that fire nothing leave it to the one that does.
                let room = (h.take_room)(h.most);
                let rows = if room == 0 {
                    Ok(Vec::new())
                } else {
                    tasks::claim_entered(
                        &mut tx,
                        h.worker_id,
                        room as i64,
                        crate::store::millis(h.lease),
                        h.handlers,
                        &fired.entered,
                    )
                    .await
                };
                match rows {
                    Ok(rows) => {
                        (h.give_back)(room - rows.len());
                        Some((h, rows))
                    }
                    Err(e) => {
                        (h.give_back)(room);
                        return Err(e);
                    }
                }
            }
            _ => None,
        };
        if let Err(e) = tx.commit().await {
            if let Some((h, rows)) = &handed {
                (h.give_back)(rows.len());
            }
            return Err(e.into());
        }
        drop(conn); // a pool of one connection needs it back, to read or to explain
        let handed = match handed {
            Some((h, rows)) => {
                let n = rows.len();
                let tasks = self.readable(rows).await;
                // Unreadable rows were given back: so are their places.
                (h.give_back)(n - tasks.as_ref().map_or(0, Vec::len));
                tasks?
            }
            None => Vec::new(),
        };
        let fired_groups = fired.groups;

        // `fired` goes to the batch's last member of each group that fired.
        let group_of: HashMap<TaskId, GroupId> = done.iter().map(|r| (r.id, r.group_id)).collect();
        let late: HashSet<TaskId> = done.iter().filter(|r| r.late).map(|r| r.id).collect();
        let mut first_of: HashMap<TaskId, usize> = HashMap::new();
        for (i, (task, _)) in items.iter().enumerate() {
            first_of.entry(task.id).or_insert(i);
        }
        let mut credited = HashSet::new();
        let mut outcomes = vec![Outcome::LeaseLost; items.len()];
        for (i, (task, _)) in items.iter().enumerate().rev() {
            outcomes[i] = match group_of.get(&task.id) {
                // The same acknowledgement twice in one batch: the second is a replay.
                Some(_) if first_of[&task.id] != i => Outcome::AlreadyRecorded,
                // Completed after its quorum group fired: cancelled instead.
                Some(_) if late.contains(&task.id) => Outcome::Cancelled,
                Some(group) => Outcome::Completed {
                    fired: fired_groups.contains(group) && credited.insert(*group),
                },
                None => self.explain_no_match(task.id, task.lease).await?,
            };
        }
        Ok((outcomes, handed))
    }
}
