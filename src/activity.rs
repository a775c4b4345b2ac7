//! What happened lately ([`Engine::activity`]): tasks by status, members finished per
//! minute, and the fan-in's hand-over time, as a dashboard charts them.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::engine::Engine;
use crate::error::Result;
use crate::store::activity;

/// Tasks by status, as [`Engine::activity`] counts them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[non_exhaustive]
pub struct TaskCounts {
    /// Waiting to be claimed, or in backoff.
    pub pending: u64,
    /// Claimed, under a lease.
    pub running: u64,
    /// Succeeded.
    pub completed: u64,
    /// Dead letters.
    pub dead: u64,
    /// Cancelled with their execution.
    pub cancelled: u64,
}

/// Members that finished in one minute.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[non_exhaustive]
pub struct MinuteActivity {
    /// The minute's start.
    pub minute: DateTime<Utc>,
    /// Tasks that completed in it.
    pub completed: u64,
    /// Tasks dead-lettered in it.
    pub dead: u64,
}

/// How long fired groups took to hand over to their next stage: from the firing to the
/// first claim of a member of the next stage. A worker whose acknowledgement fired a group
/// claims the next stage in that same transaction (the hand-off): those count 0, and
/// [`in_firing_transaction`](Self::in_firing_transaction) says how many they were; the
/// rest waited for a worker's claim. (The database sees claims, not handler runs: the
/// time a claimed task waits in a worker's local queue is not in it.)
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[non_exhaustive]
pub struct HandOver {
    /// Groups fired in the window whose next stage was claimed.
    pub groups: u64,
    /// Of those, how many had their next stage claimed in the firing transaction.
    pub in_firing_transaction: u64,
    /// The median, in milliseconds.
    pub p50_ms: Option<f64>,
    /// The 95th percentile, in milliseconds.
    pub p95_ms: Option<f64>,
    /// The longest, in milliseconds.
    pub max_ms: Option<f64>,
}

/// What happened lately, as [`Engine::activity`] returns it.
#[derive(Debug, Clone, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[non_exhaustive]
pub struct Activity {
    /// Every task by status (those still in the table: purged ones are gone).
    pub tasks: TaskCounts,
    /// Members finished per minute within the window, oldest first; minutes with none are
    /// left out.
    pub per_minute: Vec<MinuteActivity>,
    /// The fan-in's hand-over time within the window.
    pub hand_over: HandOver,
}

impl Engine {
    /// Tasks by status, members finished per minute over the last `window`, and how long
    /// groups fired in it took to hand over to their next stage.
    ///
    /// It reads the task table in one sequential pass and the group table in another
    /// (no index serves "finished lately" without costing every completion an index
    /// write): poll it every few seconds, not in a loop.
    ///
    /// # Errors
    /// [`Error::Database`](crate::Error::Database).
    ///
    /// # Cancel safety
    /// Reads only: dropping it changes nothing.
    pub async fn activity(&self, window: Duration) -> Result<Activity> {
        let secs = window.as_secs_f64();
        let mut conn = self.pool().acquire().await?;
        let rows = activity::tasks_by_status_and_minute(&mut conn, secs).await?;
        let (groups, in_firing, p50, p95, max) =
            activity::hand_over_seconds(&mut conn, secs).await?;
        let mut tasks = TaskCounts::default();
        let mut per_minute: Vec<MinuteActivity> = Vec::new();
        for (status, minute, n) in rows {
            let n = n as u64;
            match status.as_str() {
                "pending" => tasks.pending += n,
                "running" => tasks.running += n,
                "completed" => tasks.completed += n,
                "dead" => tasks.dead += n,
                "cancelled" => tasks.cancelled += n,
                _ => {}
            }
            let Some(minute) = minute else { continue };
            if !matches!(status.as_str(), "completed" | "dead") {
                continue;
            }
            let at = match per_minute.iter().position(|m| m.minute == minute) {
                Some(at) => at,
                None => {
                    per_minute.push(MinuteActivity {
                        minute,
                        completed: 0,
                        dead: 0,
                    });
                    per_minute.len() - 1
                }
            };
            if status == "completed" {
                per_minute[at].completed += n;
            } else {
                per_minute[at].dead += n;
            }
        }
        per_minute.sort_by_key(|m| m.minute);
        let ms = |s: Option<f64>| s.map(|s| s * 1000.0);
        Ok(Activity {
            tasks,
            per_minute,
            hand_over: HandOver {
                groups: groups as u64,
                in_firing_transaction: in_firing as u64,
                p50_ms: ms(p50),
                p95_ms: ms(p95),
                max_ms: ms(max),
            },
        })
    }
}
