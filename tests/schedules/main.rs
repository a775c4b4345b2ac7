//! The proof of `design.md` section 1, made executable: K members of a group finish
//! together (completed, or some dead-lettered), and the explorer drives their transactions
//! statement by statement, over separate connections, in every order (K = 2 and 3) or in
//! random orders (K = 5).
//! `naive` must stall on some schedule; every other strategy must dispatch exactly once
//! on every schedule. A signal wait decided by signals, its timeout and its entry must
//! likewise be decided once on every schedule (K = 2), or on random ones (K = 3).
//!
//! `cargo test --test schedules -- --nocapture` prints the table the README quotes.

#[path = "../common/mod.rs"]
mod common;
mod explorer;
mod gate;

use common::TestDb;
use confluo::{FanInStrategy, Join};
use explorer::{End, Explorer, Summary};

/// Refuses to explore more schedules than this (a guard against an explosion).
const LIMIT: usize = 20_000;

async fn explore(strategy: FanInStrategy, ends: &[End], sample: Option<usize>) -> Summary {
    explore_join(strategy, ends, sample, Join::All).await
}

async fn explore_join(
    strategy: FanInStrategy,
    ends: &[End],
    sample: Option<usize>,
    join: Join,
) -> Summary {
    let k = ends.len();
    let db = TestDb::new(4).await;
    let explorer = Explorer::new(db.pool.clone(), &db.options(), strategy, ends, join).await;
    let summary = match sample {
        None => explorer.exhaustive(LIMIT).await,
        Some(n) => explorer.random(n, 0x5eed + k as u64).await,
    };
    let mixed = match ends {
        e if e.contains(&End::DeadLetter) => "+dead".to_owned(),
        e if e.iter().any(|e| *e != End::Complete) => format!(" {e:?}"),
        _ => String::new(),
    };
    let mixed = match join {
        Join::All => mixed,
        join => format!("{mixed} {join}"),
    };
    println!(
        "{strategy:<10} K={k}{mixed:<5} {:<6} schedules {:>5}  exactly once {:>5}  stalls {:>4}  double fires {:>3}",
        if sample.is_some() { "random" } else { "every" },
        summary.schedules,
        summary.exactly_once,
        summary.stalls,
        summary.double_fires
    );
    summary
}

/// Fails unless every schedule of `summary` dispatched once, with one arrival told it
/// decided, the exploration never diverged, and it found more than one schedule.
fn assert_exactly_once(what: &str, summary: &Summary) {
    assert_eq!(summary.diverged, 0, "a replayed schedule took another path");
    if let Some(run) = &summary.first_violation {
        panic!(
            "{what}: dispatched {} times, {} told they decided, on:\n{}",
            run.dispatched,
            run.fired,
            run.render()
        );
    }
    assert_eq!(summary.exactly_once, summary.schedules);
    assert!(
        summary.schedules > 1,
        "the explorer found a single schedule"
    );
}

async fn exactly_once_on_every_schedule(strategy: FanInStrategy) {
    use End::{Complete as C, DeadLetter as D};
    let cases: [(&[End], Option<usize>); 5] = [
        (&[C, C], None),
        (&[C, C, C], None),
        // Dead letters take the transactional path on every arrival.
        (&[C, D], None),
        (&[D, C, D], None),
        (&[C, C, D, C, C], Some(60)),
    ];
    // CONFLUO_TEST_QUICK: the two-finisher cases only (every schedule of them), for a
    // quick local run; CI explores them all.
    let quick = std::env::var_os("CONFLUO_TEST_QUICK").is_some();
    for (ends, sample) in cases {
        if quick && ends.len() > 2 {
            continue;
        }
        let summary = explore(strategy, ends, sample).await;
        assert_exactly_once(&format!("{strategy} with K={}", ends.len()), &summary);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn countdown_dispatches_exactly_once_on_every_schedule() {
    exactly_once_on_every_schedule(FanInStrategy::Countdown).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn striped_dispatches_exactly_once_on_every_schedule() {
    exactly_once_on_every_schedule(FanInStrategy::Striped).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn row_lock_dispatches_exactly_once_on_every_schedule() {
    exactly_once_on_every_schedule(FanInStrategy::RowLock).await;
}

/// Quorum joins (`any`, `at_least(2)`): members completing together, one dead-lettered
/// within the tolerance, must fire the map once on every schedule (K = 2), or on random
/// ones (K = 3); the members still open when it fires are cancelled, and their
/// finishers told so.
async fn quorums_exactly_once_on_every_schedule(strategy: FanInStrategy) {
    use End::{Complete as C, DeadLetter as D};
    // Every schedule of two arrivals; of three (the firing transaction's cancel adds
    // statements, and tens of thousands of orders), a sample.
    let cases: [(&[End], Join, Option<usize>); 5] = [
        (&[C, C], Join::Any, None),
        (&[C, D], Join::Any, None),
        (&[C, C, C], Join::Any, Some(60)),
        (&[C, C, C], Join::AtLeast(2), Some(60)),
        (&[C, D, C], Join::AtLeast(2), Some(60)),
    ];
    let quick = std::env::var_os("CONFLUO_TEST_QUICK").is_some();
    for (ends, join, sample) in cases {
        if quick && ends.len() > 2 {
            continue;
        }
        let summary = explore_join(strategy, ends, sample, join).await;
        assert_exactly_once(
            &format!("{strategy} {join} with K={}", ends.len()),
            &summary,
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn countdown_quorums_dispatch_exactly_once_on_every_schedule() {
    quorums_exactly_once_on_every_schedule(FanInStrategy::Countdown).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn row_lock_quorums_dispatch_exactly_once_on_every_schedule() {
    quorums_exactly_once_on_every_schedule(FanInStrategy::RowLock).await;
}

/// A signal wait decided by its signals, its timeout and its entry: every schedule
/// must enter what follows the wait exactly once, with exactly one arrival told it
/// decided (a signal received or kept, or the timeout).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn signal_waits_are_decided_exactly_once_on_every_schedule() {
    use End::{EnterWait as E, Signal as S, Timeout as T};
    let quick = std::env::var_os("CONFLUO_TEST_QUICK").is_some();
    // Every schedule of two arrivals; of three (about a thousand each), a sample.
    let cases: [(&[End], Option<usize>); 4] = [
        (&[S, T], None),
        (&[E, S], None),
        (&[S, S, T], Some(40)),
        (&[E, S, S], Some(40)),
    ];
    for strategy in [
        FanInStrategy::Countdown,
        FanInStrategy::Striped,
        FanInStrategy::RowLock,
    ] {
        for (ends, sample) in cases {
            if quick && ends.len() > 2 {
                continue;
            }
            // A wait's transactions hold more statements, and on a loaded machine a
            // replayed prefix now and then takes another path (a lock wait noticed late):
            // explore again, up to three times, before calling the exploration incomplete.
            // Every schedule run, diverged or not, is checked.
            let mut summary = explore(strategy, ends, sample).await;
            for _ in 0..2 {
                if summary.diverged == 0 || summary.first_violation.is_some() {
                    break;
                }
                println!("  {} diverged: exploring again", summary.diverged);
                summary = explore(strategy, ends, sample).await;
            }
            assert_exactly_once(&format!("{strategy} with {ends:?}"), &summary);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn naive_recount_stalls_on_some_schedule() {
    let ks: &[usize] = if std::env::var_os("CONFLUO_TEST_QUICK").is_some() {
        &[2]
    } else {
        &[2, 3]
    };
    for &k in ks {
        let ends = vec![End::Complete; k];
        let summary = explore(FanInStrategy::NaiveRecount, &ends, None).await;
        assert_eq!(summary.diverged, 0, "a replayed schedule took another path");
        let run = summary
            .first_violation
            .as_ref()
            .expect("naive re-counting stalls on some schedule");
        assert_eq!(run.dispatched, 0, "naive stalls, it does not double-fire");
        assert!(summary.stalls > 0 && summary.double_fires == 0);
        println!(
            "a schedule on which naive re-counting stalls (K={k}):\n{}",
            run.render()
        );
    }
}
