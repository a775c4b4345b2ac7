//! The queue's depth over the last hour, sampled by the server every [`EVERY`] (so that a
//! dashboard opened now charts the hour before it, as every other viewer does).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use chrono::{DateTime, Utc};
use confluo::Engine;
use serde::Serialize;
use utoipa::ToSchema;

/// How often the depth is sampled.
pub(crate) const EVERY: Duration = Duration::from_secs(15);

/// Samples kept: an hour's.
const KEPT: usize = 240;

/// One sample of the queue's depth.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub(crate) struct DepthSample {
    /// When it was taken.
    at: DateTime<Utc>,
    /// Tasks due.
    due: u64,
    /// Tasks in backoff.
    scheduled: u64,
    /// Tasks running.
    running: u64,
}

/// The samples, oldest first.
#[derive(Debug, Default)]
pub(crate) struct QueueHistory(Mutex<VecDeque<DepthSample>>);

impl QueueHistory {
    /// The samples, oldest first.
    pub(crate) fn samples(&self) -> Vec<DepthSample> {
        self.0
            .lock()
            .expect("not poisoned")
            .iter()
            .cloned()
            .collect()
    }

    /// Samples `engine`'s queue every [`EVERY`] on the current runtime, for as long as
    /// the history is in use (its last `Arc` dropped, the sampler ends). Outside a tokio
    /// runtime there is no sampling, and the history stays empty.
    pub(crate) fn start(engine: Engine) -> Arc<QueueHistory> {
        let history = Arc::new(QueueHistory::default());
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(sample(engine, Arc::downgrade(&history)));
        }
        history
    }
}

async fn sample(engine: Engine, history: Weak<QueueHistory>) {
    let mut every = tokio::time::interval(EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        let Some(history) = history.upgrade() else {
            return;
        };
        match engine.queue_depth().await {
            Ok(depth) => {
                let mut samples = history.0.lock().expect("not poisoned");
                samples.push_back(DepthSample {
                    at: Utc::now(),
                    due: depth.due,
                    scheduled: depth.scheduled,
                    running: depth.running,
                });
                while samples.len() > KEPT {
                    samples.pop_front();
                }
            }
            Err(error) => tracing::debug!(%error, "the queue's depth could not be sampled"),
        }
    }
}
