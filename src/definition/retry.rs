//! Retry policies: how often and how late a failed attempt is retried.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::duration_ms;

/// How often and how late a failed attempt is retried.
///
/// The policy is copied onto every task row when the task is created, so it survives
/// restarts and applies the same on every worker.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct RetryPolicy {
    /// Attempts in all, the first included (1 = no retry).
    pub max_attempts: u32,
    /// Delay before the second attempt, in milliseconds; doubled for each later attempt.
    pub initial_backoff_ms: u64,
    /// Upper bound of the delay, in milliseconds.
    pub max_backoff_ms: u64,
    /// Fraction of the delay drawn at random and taken off (0 = none, 1 = full jitter),
    /// so that a burst of failures does not retry in lockstep.
    pub jitter: f64,
}

impl Default for RetryPolicy {
    /// Three attempts, 1 s then 2 s apart (at most 60 s), 20 % jitter.
    fn default() -> Self {
        RetryPolicy {
            max_attempts: 3,
            initial_backoff_ms: 1_000,
            max_backoff_ms: 60_000,
            jitter: 0.2,
        }
    }
}

impl RetryPolicy {
    /// No retries: the first failure dead-letters the task.
    pub fn none() -> Self {
        RetryPolicy {
            max_attempts: 1,
            ..Self::default()
        }
    }

    /// `max_attempts` attempts with the default exponential backoff.
    pub fn exponential(max_attempts: u32) -> Self {
        RetryPolicy {
            max_attempts,
            ..Self::default()
        }
    }

    /// Sets the first delay and the cap of the exponential backoff.
    pub fn backoff(mut self, initial: Duration, max: Duration) -> Self {
        self.initial_backoff_ms = duration_ms(initial);
        self.max_backoff_ms = duration_ms(max);
        self
    }

    /// Sets the jitter fraction, 0.0 to 1.0.
    pub fn jitter(mut self, jitter: f64) -> Self {
        self.jitter = jitter;
        self
    }
}
