//! Fan-in strategies: how the transaction that records a member's terminal status learns
//! whether that member was the last of its group.
//!
//! Each group is created with a strategy (stored on its row), and every arrival at that
//! group is decided by it, whichever process completes the member. The transaction that
//! learns it was the last fires the group and dispatches the next stage before it commits.
//! The statements of every arrival and the decision itself live in one module,
//! `store::fan_in`; this one only names the strategies.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// How the last arrival of a group is detected.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
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
    /// different rows, and the arrival that drains a stripe counts down the group row.
    /// Exactly one arrival still sees zero; concurrent finishers rarely queue on the same
    /// row. For wide blocks with many finishers.
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
}

impl fmt::Display for FanInStrategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A strategy name that this build does not know.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown fan-in strategy {0:?}: use countdown, striped or row_lock (naive needs the \
     naive-fan-in feature)"
)]
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
