//! The auditor that runs by itself: a worker's housekeeping runs a round of
//! [`doctor`](Engine::doctor) and [`repair`](Engine::repair) over a slice of the running
//! executions, one worker at a time, and reports what it found: a log line per finding,
//! Prometheus counters, and [`Engine::auditor`] (`GET /api/v1/stats`, the dashboard).
//! A stall is never silent.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::doctor::Diagnosis;
use crate::engine::Engine;
use crate::error::Result;
use crate::ids::ExecutionId;
use crate::store::{self, auditor};

/// The running executions one round audits, at most: a round costs what the auditor's
/// queries cost over that many executions, whatever the database holds.
pub const AUDIT_SLICE: usize = 500;

/// What one round of the auditor did ([`Engine::audit_round`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct AuditRound {
    /// Running executions audited.
    pub audited: usize,
    /// Findings.
    pub found: usize,
    /// Repairs made (counters re-counted, groups fired, executions moved on, signals
    /// received, children reported, orphans cancelled).
    pub repaired: usize,
    /// What the round found and could not repair.
    pub unrepaired: Vec<Unrepaired>,
}

/// A finding that a repair did not clear.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[non_exhaustive]
pub struct Unrepaired {
    /// The execution.
    pub execution_id: ExecutionId,
    /// What was found, in words.
    pub finding: String,
    /// When the round found it.
    pub at: DateTime<Utc>,
}

/// Where the auditor's rounds stand ([`Engine::auditor`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[non_exhaustive]
pub struct AuditorStatus {
    /// When the last round ran; `None`: never (no worker has run one yet).
    pub last_round_at: Option<DateTime<Utc>>,
    /// Rounds run.
    pub rounds: u64,
    /// Findings in all rounds.
    pub found: u64,
    /// Repairs in all rounds.
    pub repaired: u64,
    /// What the rounds found and could not repair, still so when last audited (at most
    /// 100, the newest first). Empty on a healthy database.
    pub unrepaired: Vec<Unrepaired>,
}

impl Engine {
    /// Runs one round of the auditor if none ran for `every` (by any worker: the rounds
    /// are shared through the database, so one worker at a time runs them): audits the
    /// next `slice` running executions after where the last round stopped (then starts
    /// over), repairs what it finds ([`repair`](Self::repair)'s repairs, each safe while
    /// workers run), and records what it could not repair. Every finding is logged
    /// (`warn`), every unrepaired one again (`error`), and counted
    /// (`confluo_audit_findings_total`, `confluo_audit_repairs_total`,
    /// `confluo_audit_unrepaired`). Workers run it in their housekeeping
    /// ([`WorkerBuilder::audit_every`](crate::WorkerBuilder::audit_every)). Returns `None`
    /// when the round was not due.
    ///
    /// # Errors
    /// [`Error::Database`](crate::Error::Database); what was repaired before stays
    /// repaired, and the round counts as run (the next one is due after `every`, and
    /// audits the next slice).
    ///
    /// # Cancel safety
    /// Each repair is a transaction of its own: dropped, what was repaired stays repaired
    /// and the next round audits the slice again.
    pub async fn audit_round(&self, every: Duration, slice: usize) -> Result<Option<AuditRound>> {
        let limit = i64::try_from(slice.max(1)).unwrap_or(i64::MAX);
        let executions = {
            let mut conn = self.pool().acquire().await?;
            let Some(cursor) = auditor::claim_round(&mut conn, store::millis(every)).await? else {
                return Ok(None);
            };
            auditor::slice(&mut conn, cursor, limit).await?
        };
        // A short slice reached the end: the next round starts over.
        let next = match executions.last() {
            Some(last) if executions.len() as i64 == limit => Some(*last),
            _ => None,
        };
        let mut round = AuditRound {
            audited: executions.len(),
            ..AuditRound::default()
        };
        // Recorded whatever happened, so that a slice whose audit keeps failing is not
        // audited for ever: the next round takes the next one.
        let audited = self.audit_slice(&executions, &mut round).await;
        crate::metrics::audit_round(round.repaired, round.unrepaired.len());
        let mut conn = self.pool().acquire().await?;
        auditor::finish_round(
            &mut conn,
            next,
            &executions,
            round.found as i64,
            round.repaired as i64,
            &json!(round.unrepaired),
        )
        .await?;
        audited?;
        Ok(Some(round))
    }

    /// Audits `executions`, repairs, and notes in `round` what it found, repaired and
    /// left.
    async fn audit_slice(&self, executions: &[ExecutionId], round: &mut AuditRound) -> Result<()> {
        if executions.is_empty() {
            return Ok(());
        }
        let found = self.diagnose(Some(executions)).await?;
        if found.is_healthy() {
            return Ok(());
        }
        for (execution, finding) in found.findings() {
            tracing::warn!(execution_id = %execution, finding, "the auditor found");
        }
        crate::metrics::audit_findings(&found);
        round.found = found.len();
        let repairs = self.repair_found(found, Some(executions)).await?;
        round.repaired = repairs.count();
        let left = self.diagnose(Some(executions)).await?;
        let at = Utc::now();
        for (execution_id, finding) in left.findings() {
            tracing::error!(%execution_id, finding, "the auditor could not repair");
            round.unrepaired.push(Unrepaired {
                execution_id,
                finding,
                at,
            });
        }
        Ok(())
    }

    /// Where the auditor's rounds stand: when the last ran, what they found and repaired,
    /// and what they could not repair.
    ///
    /// # Errors
    /// [`Error::Database`](crate::Error::Database).
    ///
    /// # Cancel safety
    /// Reads only: dropping it changes nothing.
    pub async fn auditor(&self) -> Result<AuditorStatus> {
        let row = auditor::get(self.pool()).await?;
        Ok(AuditorStatus {
            last_round_at: row.round_at,
            rounds: row.rounds.max(0) as u64,
            found: row.found.max(0) as u64,
            repaired: row.repaired.max(0) as u64,
            unrepaired: serde_json::from_value(row.unrepaired.0)?,
        })
    }
}

impl Diagnosis {
    /// Each finding with its execution, in words (as the auditor logs it).
    pub fn findings(&self) -> Vec<(ExecutionId, String)> {
        let mut all = Vec::new();
        for m in &self.counter_mismatches {
            let stripe = m.stripe.map_or(String::new(), |s| format!(" (stripe {s})"));
            all.push((
                m.execution_id,
                format!(
                    "stage {}: counter {}{stripe} of group {} says {}, its members say {}",
                    m.stage_index, m.counter_name, m.group_id, m.counter, m.expected
                ),
            ));
        }
        for g in &self.unfired_groups {
            all.push((
                g.execution_id,
                format!(
                    "stage {}: group {} reached its join and never fired (a stall)",
                    g.stage_index, g.group_id
                ),
            ));
        }
        for g in &self.stalled_executions {
            all.push((
                g.execution_id,
                format!(
                    "running with nothing left to run after stage {} (a stall)",
                    g.stage_index
                ),
            ));
        }
        for s in &self.unreceived_signals {
            all.push((
                s.execution_id,
                format!("signal {:?} kept while its wait is pending", s.name),
            ));
        }
        for c in &self.unreported_children {
            all.push((
                c.execution_id,
                format!(
                    "ended, and its member {} in the parent was never told",
                    c.member
                ),
            ));
        }
        for id in &self.orphaned_children {
            all.push((*id, "running child of an ended parent".to_owned()));
        }
        all
    }
}
