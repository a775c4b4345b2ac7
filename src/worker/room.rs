//! The room a worker has for tasks: `concurrency + local_queue` places, one taken per
//! claimed task until its ending is acknowledged or it is given back.
//!
//! Places are only ever taken without waiting, all at once: a claimer that waits for
//! room does not hold the places freed meanwhile (as a semaphore's queued
//! `acquire_many` would), so the room it waits for stays usable by the acknowledgers,
//! which claim the next stages their batches fire.

use tokio::sync::{Notify, Semaphore};

#[derive(Debug)]
pub(super) struct Room {
    places: Semaphore,
    freed: Notify,
}

impl Room {
    pub(super) fn new(places: usize) -> Room {
        Room {
            places: Semaphore::new(places),
            freed: Notify::new(),
        }
    }

    /// Takes as many free places as there are, up to `most`, if at least `least` are
    /// free; else none. Never waits.
    pub(super) fn try_take(&self, least: usize, most: usize) -> usize {
        loop {
            let free = self.places.available_permits();
            if free < least.max(1) {
                return 0;
            }
            let n = free.min(most);
            if let Ok(places) = self.places.try_acquire_many(n as u32) {
                places.forget();
                return n;
            }
            // Another taker was faster: look again.
        }
    }

    /// Waits until at least `least` places are free, then takes them as
    /// [`try_take`](Self::try_take) does.
    ///
    /// # Cancel safety
    /// Cancel safe: nothing is taken until it returns.
    pub(super) async fn take(&self, least: usize, most: usize) -> usize {
        loop {
            let freed = self.freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            let n = self.try_take(least, most);
            if n > 0 {
                return n;
            }
            freed.await;
        }
    }

    /// Places free now.
    pub(super) fn free(&self) -> usize {
        self.places.available_permits()
    }

    /// Gives `n` places back.
    pub(super) fn give_back(&self, n: usize) {
        if n > 0 {
            self.places.add_permits(n);
            self.freed.notify_waiters();
        }
    }
}
