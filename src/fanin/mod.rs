//! Fan-in: deciding, in the very transaction that records a member's terminal status,
//! whether that member was the last of its group.
//!
//! Each group is created with a strategy (stored on its row), and every arrival at that
//! group is decided by it, whichever process completes the member. The transaction that
//! learns it was the last fires the group and dispatches the next stage before it commits
//! ([`crate::dispatch`]).

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use sqlx::PgConnection;

use crate::error::Result;
use crate::ids::{ExecutionId, GroupId, LeaseToken, TaskId};
use crate::store::completions::{self, CompletedRow, CountdownRow};
use crate::store::groups;

mod countdown;
#[cfg(feature = "naive-fan-in")]
mod naive;
mod row_lock;
mod striped;

/// How the last arrival of a group is detected.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum FanInStrategy {
    /// A countdown row per group, decremented by every terminal arrival in the statement
    /// that writes the member's status; the caller that sees zero fires. O(1) per
    /// completion, no lock on the execution row.
    #[default]
    Countdown,
    /// The countdown spread over stripe rows (one per 16 members, at most 256): members
    /// are dealt to the stripes in turn, so neighbours that finish together count down
    /// different rows, and the arrival that drains a stripe counts down the group row. Exactly one arrival still sees zero; concurrent finishers
    /// rarely queue on the same row. For wide blocks with many finishers.
    Striped,
    /// The classic way, kept as the baseline: lock the execution row `FOR UPDATE`, then
    /// re-count the group's members; fire when all are terminal. Correct, but O(width)
    /// per completion, and every completion of the execution queues on one row.
    RowLock,
    /// The bug this crate exists to prevent: re-count the group without any lock. Under
    /// READ COMMITTED, finishers that commit together each miss the other and nobody
    /// fires. Only with the `naive-fan-in` feature, for tests and benchmarks.
    #[cfg(feature = "naive-fan-in")]
    NaiveRecount,
}

impl FanInStrategy {
    /// The name stored on the group row.
    pub fn as_str(self) -> &'static str {
        match self {
            FanInStrategy::Countdown => "countdown",
            FanInStrategy::RowLock => "row_lock",
            FanInStrategy::Striped => "striped",
            #[cfg(feature = "naive-fan-in")]
            FanInStrategy::NaiveRecount => "naive",
        }
    }

    /// Whether the strategy keeps a counter (countdown, striped): an arrival counts it
    /// down and learns from it whether it was the last, holding the counter's row.
    pub(crate) fn counts(self) -> bool {
        matches!(self, FanInStrategy::Countdown | FanInStrategy::Striped)
    }

    /// Records a successful attempt and decides whether it was its group's last arrival.
    /// `None`: the attempt no longer holds its lease, or was already acknowledged.
    pub(crate) async fn complete(
        self,
        conn: &mut PgConnection,
        id: TaskId,
        token: LeaseToken,
        output: &Value,
    ) -> Result<Option<Arrival>> {
        match self {
            FanInStrategy::Countdown => countdown::complete(conn, id, token, output).await,
            FanInStrategy::Striped => striped::complete(conn, id, token, output).await,
            _ => {
                // Re-counting strategies: write the status, then decide.
                let Some(row) = completions::complete_plain(conn, id, token, output).await? else {
                    return Ok(None);
                };
                let member = Member {
                    group_id: row.group_id,
                    item_index: row.item_index,
                };
                let last = self.decide(conn, row.execution_id, member, None).await?;
                Ok(Some(Arrival {
                    group_id: row.group_id,
                    execution_id: row.execution_id,
                    stage_index: row.stage_index,
                    last,
                }))
            }
        }
    }

    /// Records a successful attempt that cannot be its group's last in one statement of
    /// its own (its own implicit transaction: status and count-down still commit
    /// together), for the strategies that keep a counter. False, with nothing changed,
    /// when it may be the last arrival or the guard matches nothing: then
    /// [`complete`](Self::complete) in a transaction decides.
    pub(crate) async fn complete_unless_last(
        self,
        conn: &mut PgConnection,
        id: TaskId,
        token: LeaseToken,
        output: &Value,
    ) -> Result<bool> {
        match self {
            FanInStrategy::Countdown => {
                completions::complete_unless_last(conn, id, token, output, false).await
            }
            FanInStrategy::Striped => {
                completions::complete_unless_last(conn, id, token, output, true).await
            }
            _ => Ok(false),
        }
    }

    /// Decides whether a terminal arrival whose status this transaction already wrote (a
    /// completion by a re-counting strategy, or a dead letter) was its group's last.
    /// `remaining` is what that statement left on the counter of a countdown group.
    pub(crate) async fn decide(
        self,
        conn: &mut PgConnection,
        execution_id: ExecutionId,
        member: Member,
        remaining: Option<i32>,
    ) -> Result<bool> {
        let group_id = member.group_id;
        match self {
            FanInStrategy::Countdown => Ok(remaining == Some(0)),
            FanInStrategy::Striped => striped::count_down(conn, member).await,
            FanInStrategy::RowLock => row_lock::decide(conn, execution_id, group_id).await,
            #[cfg(feature = "naive-fan-in")]
            FanInStrategy::NaiveRecount => naive::decide(conn, group_id).await,
        }
    }
}

/// The groups whose last arrival is among `completed`, the members that one batch
/// statement completed ([`completions::complete_many`]). That statement already counted down
/// countdown and striped groups; re-counting strategies decide here, once per group.
pub(crate) async fn last_arrivals(
    conn: &mut PgConnection,
    completed: &[CompletedRow],
) -> Result<Vec<GroupId>> {
    let mut groups: BTreeMap<GroupId, &CompletedRow> = BTreeMap::new();
    for row in completed {
        groups.entry(row.group_id).or_insert(row);
    }
    let mut last = Vec::new();
    for (group, row) in groups {
        let decided = match row.fan_in.parse::<FanInStrategy>()? {
            FanInStrategy::Countdown | FanInStrategy::Striped => row.remaining == Some(0),
            FanInStrategy::RowLock => row_lock::decide(conn, row.execution_id, group).await?,
            #[cfg(feature = "naive-fan-in")]
            FanInStrategy::NaiveRecount => naive::decide(conn, group).await?,
        };
        if decided {
            last.push(group);
        }
    }
    Ok(last)
}

/// Counts a member that became terminal where no fan-in decision is due (cancelled, or
/// dead-lettered in a stage that fails its execution), if the statement that wrote its
/// status did not count it already.
pub(crate) async fn count_without_deciding(
    strategy: FanInStrategy,
    conn: &mut PgConnection,
    member: Member,
) -> Result<()> {
    match strategy {
        FanInStrategy::Countdown => {
            groups::count_down(conn, &[member.group_id], &[1]).await?;
        }
        FanInStrategy::Striped => {
            striped::count_down(conn, member).await?;
        }
        _ => {} // re-counting strategies keep no counter
    }
    Ok(())
}

/// A member of a group, as its stripe needs it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Member {
    pub group_id: GroupId,
    pub item_index: i32,
}

impl fmt::Display for FanInStrategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A strategy name that this build does not know.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown fan-in strategy {0:?} (naive needs the naive-fan-in feature)")]
pub struct UnknownStrategy(pub String);

impl FromStr for FanInStrategy {
    type Err = UnknownStrategy;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "countdown" => Ok(FanInStrategy::Countdown),
            "row_lock" | "row-lock" => Ok(FanInStrategy::RowLock),
            "striped" => Ok(FanInStrategy::Striped),
            #[cfg(feature = "naive-fan-in")]
            "naive" => Ok(FanInStrategy::NaiveRecount),
            other => Err(UnknownStrategy(other.to_owned())),
        }
    }
}

/// A terminal arrival at a group, as decided by its strategy.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Arrival {
    pub group_id: GroupId,
    pub execution_id: ExecutionId,
    pub stage_index: i32,
    /// Whether this arrival was the group's last: its transaction fires the group.
    pub last: bool,
}

impl From<CountdownRow> for Arrival {
    /// An arrival counted down on a counter: the last if it left the group at zero.
    fn from(row: CountdownRow) -> Self {
        Arrival {
            group_id: row.group_id,
            execution_id: row.execution_id,
            stage_index: row.stage_index,
            last: row.remaining == Some(0),
        }
    }
}
