//! Fan-in: deciding, in the very transaction that records a member's terminal status,
//! whether that member was the last of its group.
//!
//! A strategy records the terminal transition and reports the group's countdown; the one
//! transaction that sees zero fires the group and dispatches the next stage before it
//! commits ([`crate::dispatch`]).

use serde_json::Value;
use sqlx::PgConnection;

use crate::error::Result;
use crate::ids::{LeaseToken, TaskId};
use crate::store::tasks::{CountdownRow, FailedRow};

mod countdown;

/// How the last arrival of a group is detected.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum FanInStrategy {
    /// A countdown row per group, decremented by every terminal arrival in the statement
    /// that writes the member's status; the caller that sees zero fires. O(1) per
    /// completion, no lock on the execution row.
    #[default]
    Countdown,
}

impl FanInStrategy {
    /// Completes a running attempt and counts it towards its group.
    /// `None`: the attempt no longer holds its lease, or was already acknowledged.
    pub(crate) async fn complete(
        self,
        conn: &mut PgConnection,
        id: TaskId,
        token: LeaseToken,
        output: &Value,
    ) -> Result<Option<CountdownRow>> {
        match self {
            FanInStrategy::Countdown => countdown::complete(conn, id, token, output).await,
        }
    }

    /// Records a failed attempt; a terminal one (dead or cancelled) counts towards its group.
    pub(crate) async fn fail(
        self,
        conn: &mut PgConnection,
        id: TaskId,
        token: LeaseToken,
        error: &str,
        permanent: bool,
        only_if_expired: bool,
    ) -> Result<Option<FailedRow>> {
        match self {
            FanInStrategy::Countdown => {
                countdown::fail(conn, id, token, error, permanent, only_if_expired).await
            }
        }
    }
}
