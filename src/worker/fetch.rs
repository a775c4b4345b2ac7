//! Filling the local queue: one claim statement per refill, sized by the room the worker
//! has left; the leases of tasks waiting in the local queue; the notification listener;
//! housekeeping.

use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::{PgListener, PgPoolOptions};
use tokio::time::{sleep, Instant};

use super::{Notifications, Settings, State};
use crate::store;

/// Claims into the local queue until shutdown. A refill waits until the worker has room
/// for half its local queue (or for one task, without a local queue), then claims as
/// many as it has room for, up to the batch size: with a backlog, one claim statement
/// moves hundreds of tasks; with none, the claim returns what there is and the fetcher
/// waits for a notification or the poll interval. Never stops in the middle of a claim,
/// so that nothing it claimed is left unseen.
///
/// A worker runs [`CLAIMS_IN_FLIGHT`](super::CLAIMS_IN_FLIGHT) of these; the one that
/// `renews` also renews the leases of the waiting tasks.
pub(super) async fn fetch(state: Arc<State>, renews: bool) {
    let settings = &state.settings;
    let refill_at = (settings.local_queue / 2).min(settings.batch_size).max(1);
    let mut errors = 0u32;
    // Waiting tasks are renewed at least every second, which also finds those whose
    // execution stopped meanwhile: they are cancelled instead of run.
    let renew_every = (settings.lease / 3).min(Duration::from_secs(1));
    let mut next_renewal = Instant::now() + renew_every;
    loop {
        // Wait for room, renewing the waiting tasks' leases meanwhile; then take what is
        // free, up to the batch size. The places taken here come back one by one as the
        // tasks' endings are acknowledged (`Held`'s drop).
        let wanted = loop {
            if renews && Instant::now() >= next_renewal {
                renew_waiting(&state).await;
                next_renewal = Instant::now() + renew_every;
            }
            tokio::select! {
                _ = state.shutdown.cancelled() => return,
                n = state.room.take(refill_at, settings.batch_size) => break n,
                _ = tokio::time::sleep_until(next_renewal), if renews => {}
            }
        };
        let claimed = state
            .engine
            .claim_matching(
                &settings.id,
                wanted,
                settings.lease,
                Some(&state.keys),
                true,
            )
            .await;
        let got = match claimed {
            Ok(tasks) => {
                errors = 0;
                let got = tasks.len();
                state.hold(tasks);
                got
            }
            Err(error) => {
                errors += 1;
                tracing::warn!(%error, "claiming tasks failed");
                0
            }
        };
        state.room.give_back(wanted - got);
        if got == wanted {
            state.wake.notify_one(); // more may be waiting: the other fetcher may claim too
            continue;
        }
        let pause = if errors > 0 {
            (settings.poll_interval * errors).min(Duration::from_secs(5))
        } else {
            settings.poll_interval
        };
        // Renewals go on while the fetcher waits, however long the poll interval.
        let until = Instant::now() + pause;
        loop {
            tokio::select! {
                _ = state.shutdown.cancelled() => return,
                _ = state.wake.notified(), if errors == 0 => break,
                _ = tokio::time::sleep_until(until) => break,
                _ = tokio::time::sleep_until(next_renewal), if renews => {
                    renew_waiting(&state).await;
                    next_renewal = Instant::now() + renew_every;
                }
            }
        }
    }
}

/// Extends the leases of the tasks waiting in the local queue, and of the attempts started
/// since the last renewal (recording that they started), in one statement; marks the
/// waiting tasks whose execution stopped.
async fn renew_waiting(state: &State) {
    let mut held: Vec<_> = state
        .waiting
        .lock()
        .expect("waiting set poisoned")
        .iter()
        .map(|(id, w)| (*id, w.lease, false))
        .collect();
    held.extend(
        state
            .unreported
            .lock()
            .expect("unreported set poisoned")
            .iter()
            .map(|(id, lease)| (*id, *lease, true)),
    );
    if held.is_empty() {
        return;
    }
    match state.engine.renew_leases(&held, state.settings.lease).await {
        Ok(renewed) => {
            let mut unreported = state.unreported.lock().expect("unreported set poisoned");
            for (id, _) in &renewed {
                unreported.remove(id);
            }
            drop(unreported);
            let mut waiting = state.waiting.lock().expect("waiting set poisoned");
            for (id, _) in renewed.iter().filter(|(_, running)| !running) {
                if let Some(w) = waiting.get_mut(id) {
                    w.stopped = true;
                }
            }
        }
        Err(error) => {
            tracing::warn!(%error, tasks = held.len(), "renewing the local queue's leases failed")
        }
    }
}

/// How often a worker's housekeeping runs, and so its heartbeat: every half lease, at
/// most every 5 s.
pub(super) fn housekeeping_interval(settings: &Settings) -> Duration {
    (settings.lease / 2).min(Duration::from_secs(5))
}

/// Tells the registry what this worker runs and holds; registers again if its row is
/// gone. Failures are logged: the registry is for people, the tasks do not depend on it.
async fn heartbeat(state: &State) {
    let settings = &state.settings;
    // Saturating: a report, never a reason for housekeeping (and the reclaim) to stop.
    let running = settings
        .concurrency
        .saturating_sub(state.slots.available_permits());
    let held = (settings.concurrency + settings.local_queue).saturating_sub(state.room.free());
    match state
        .engine
        .worker_heartbeat(&settings.id, running, held)
        .await
    {
        Ok(true) => {}
        Ok(false) => {
            if let Err(error) = state.engine.register_worker(&state.registration()).await {
                tracing::warn!(%error, "registering the worker again failed");
            }
        }
        Err(error) => tracing::debug!(%error, "the worker's heartbeat failed"),
    }
}

/// Sends the registry heartbeat, reclaims expired leases, times out executions past their
/// deadline, cancels the children of stopped executions, archives ended executions'
/// tasks, offers to run the auditor's round and samples the queue depth, every half
/// lease (at most 5 s apart), until the worker shuts down. It returns between rounds,
/// never in the middle of a statement: a statement future dropped half-way leaves its
/// pooled connection to the next user with the exchange unfinished, and the shutdown's
/// last write to the registry must not be overtaken by it.
pub(super) async fn housekeeping(state: Arc<State>) {
    let every = housekeeping_interval(&state.settings);
    // A worker offers its first auditor's round one interval after it starts.
    let started = tokio::time::Instant::now();
    loop {
        heartbeat(&state).await;
        if let Err(error) = state.engine.reclaim_expired(100).await {
            tracing::warn!(%error, "reclaiming expired leases failed");
        }
        if let Err(error) = state.engine.time_out_expired(100).await {
            tracing::warn!(%error, "timing out executions past their deadline failed");
        }
        if let Err(error) = state.engine.cancel_orphans(10_000).await {
            tracing::warn!(%error, "cancelling the children of stopped executions failed");
        }
        if let Some(after) = state.settings.archive_after {
            state
                .engine
                .archive_round(after, Duration::from_millis(250))
                .await;
        }
        if let Some(audit_every) = state.settings.audit_every {
            if started.elapsed() >= audit_every {
                if let Err(error) = state
                    .engine
                    .audit_round(audit_every, crate::AUDIT_SLICE)
                    .await
                {
                    tracing::warn!(%error, "the auditor's round failed");
                }
            }
        }
        match state.engine.queue_depth().await {
            Ok(depth) => crate::metrics::queue_depth(&depth),
            Err(error) => tracing::debug!(%error, "sampling the queue depth failed"),
        }
        tokio::select! {
            _ = state.shutdown.cancelled() => return,
            _ = sleep(every) => {}
        }
    }
}

/// Wakes the fetcher on every notification; reconnects on error. Returns at once when
/// notifications are off.
pub(super) async fn listen(state: Arc<State>) {
    let pooled = state.engine.through_transaction_pooler();
    let options = match &state.settings.notifications {
        None if pooled => return,
        None | Some(Notifications::Pool) => (*state.engine.pool().connect_options()).clone(),
        Some(Notifications::Direct(options)) => (**options).clone(),
        Some(Notifications::Off) => return,
    };
    loop {
        let result = async {
            // A connection of its own, so that listening never takes a slot of the pool.
            let pool = PgPoolOptions::new()
                .max_connections(1)
                .max_lifetime(None)
                .idle_timeout(None)
                .connect_with(options.clone())
                .await?;
            let mut listener = PgListener::connect_with(&pool).await?;
            listener.listen(store::TASKS_CHANNEL).await?;
            loop {
                listener.recv().await?;
                state.wake.notify_one();
            }
        }
        .await;
        let error: sqlx::Error = match result {
            Ok(()) => return,
            Err(e) => e,
        };
        tracing::debug!(%error, "notification listener lost its connection; polling meanwhile");
        state.wake.notify_one();
        sleep(Duration::from_secs(1)).await;
    }
}
