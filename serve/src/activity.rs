//! The last hour's activity, read at most every [`FRESH_FOR`] however many dashboards
//! poll it: it costs a pass over the task table.

use std::time::{Duration, Instant};

use confluo::{Activity, Engine};
use tokio::sync::Mutex;

/// How long one reading is served again.
pub(crate) const FRESH_FOR: Duration = Duration::from_secs(3);

/// The window read.
pub(crate) const WINDOW: Duration = Duration::from_secs(3600);

/// The latest reading and when it was taken.
#[derive(Debug, Default)]
pub(crate) struct Cached(Mutex<Option<(Instant, Activity)>>);

impl Cached {
    /// A reading at most [`FRESH_FOR`] old. Requests that arrive while one is being
    /// taken wait for it rather than start their own.
    pub(crate) async fn read(&self, engine: &Engine) -> confluo::Result<Activity> {
        let mut latest = self.0.lock().await;
        if let Some((at, activity)) = latest.as_ref() {
            if at.elapsed() < FRESH_FOR {
                return Ok(activity.clone());
            }
        }
        let activity = engine.activity(WINDOW).await?;
        *latest = Some((Instant::now(), activity.clone()));
        Ok(activity)
    }
}
