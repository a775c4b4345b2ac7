//! Join rules: when a parallel or map stage's group fires.

use serde::{Deserialize, Serialize};

use super::{Stage, StageKind};
use crate::fanin::FanInStrategy;

/// When a parallel or map stage fires its group ([`Stage::join`]).
///
/// ```
/// use confluo::{Join, Stage, Workflow};
///
/// let wf = Workflow::new("quotes", 1)
///     .stage(Stage::parallel("ask", ["vendor_a", "vendor_b", "vendor_c"]).join(Join::Any))
///     .step("buy");
/// assert!(wf.validate().is_ok());
/// let replicate = Stage::map("write").join(Join::AtLeast(2));
/// assert_eq!(replicate.join_rule(), Join::AtLeast(2));
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Join {
    /// Once every member is terminal (completed or dead-lettered): the default.
    #[default]
    All,
    /// As soon as one member completes: `AtLeast(1)`.
    Any,
    /// As soon as `k` members completed (a quorum); the stage fails the execution as soon
    /// as so many members are dead-lettered that `k` can no longer be reached.
    AtLeast(u32),
}

impl Join {
    /// The successes that fire the group, for a quorum (`None`: [`Join::All`]).
    pub fn quorum(self) -> Option<u32> {
        match self {
            Join::All => None,
            Join::Any => Some(1),
            Join::AtLeast(k) => Some(k),
        }
    }

    pub(crate) fn is_all(&self) -> bool {
        *self == Join::All
    }
}

impl std::fmt::Display for Join {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Join::All => f.write_str("all"),
            Join::Any => f.write_str("any"),
            Join::AtLeast(k) => write!(f, "at_least({k})"),
        }
    }
}

/// Why a stage's join rule is refused, if it is.
pub(super) fn check(stage: &Stage) -> Result<(), &'static str> {
    let Some(k) = stage.join.quorum() else {
        return Ok(());
    };
    if !matches!(stage.kind, StageKind::Parallel { .. } | StageKind::Map) {
        return Err("only a parallel or a map stage can have a join rule other than all");
    }
    if k == 0 {
        return Err("at_least(0) would fire before anything ran: ask for 1 or more");
    }
    if k > i32::MAX as u32 {
        return Err("at_least(k) takes at most 2147483647");
    }
    if let StageKind::Parallel { branches } = &stage.kind {
        if k as usize > branches.len() {
            return Err("at_least(k) asks for more successes than the block has branches");
        }
    }
    if stage.fan_in == Some(FanInStrategy::Striped) {
        return Err(
            "a quorum is counted on the group's own row, which striping spreads over many: \
             choose FanInStrategy::Countdown or RowLock for this stage",
        );
    }
    Ok(())
}

/// The fan-in strategy a quorum stage's group uses: its own, else the default, except
/// that a striped default gives way to a countdown (a quorum counts on one row).
pub(crate) fn strategy_for(stage: &Stage, default: FanInStrategy) -> FanInStrategy {
    let strategy = stage.fan_in.unwrap_or(default);
    if stage.join.quorum().is_some() && strategy == FanInStrategy::Striped {
        FanInStrategy::Countdown
    } else {
        strategy
    }
}
