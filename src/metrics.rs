//! Metrics, recorded through the [`metrics`](https://docs.rs/metrics) facade: with no
//! recorder installed they cost next to nothing; install one (e.g.
//! `metrics-exporter-prometheus`, as `confluo worker --metrics` does) to export them.
//!
//! | name | kind | labels | what |
//! |---|---|---|---|
//! | `confluo_tasks_total` | counter | `outcome` | acknowledged attempts: `completed`, `retry_scheduled`, `dead_lettered`, `cancelled`, `already_recorded`, `lease_lost` |
//! | `confluo_groups_fired_total` | counter | | groups whose last arrival dispatched the next stage (or completed the execution) |
//! | `confluo_tasks_claimed_total` | counter | | tasks handed to workers |
//! | `confluo_claim_duration_seconds` | histogram | | one claim statement, round trip included |
//! | `confluo_task_wait_seconds` | histogram | | from due (`run_at`) to claimed |
//! | `confluo_handler_duration_seconds` | histogram | `workflow`, `handler`, `ending` | one attempt's handler run: `ok`, `error`, `panic`, `timeout`, `lease_lost`, `stopped` |
//! | `confluo_fan_in_seconds` | histogram | | the call that fired a group: its last write, the next stage's dispatch and the commit |
//! | `confluo_queue_depth` | gauge | `state` | tasks `due`, `scheduled` (in backoff) and `running`, sampled by workers' housekeeping |
//! | `confluo_audit_findings_total` | counter | `kind` | what the auditor's rounds found: `counter_mismatch`, `unfired_group`, `stalled_execution`, `unreceived_signal`, `unreported_child`, `orphaned_child` |
//! | `confluo_audit_repairs_total` | counter | | repairs the auditor's rounds made |
//! | `confluo_audit_unrepaired` | gauge | | what the last round found and could not repair (0 on a healthy database) |
//!
//! ```
//! confluo::metrics::describe(); // names, units and help texts, for the installed recorder
//! ```

use std::time::Instant;

use metrics::{counter, describe_counter, describe_gauge, describe_histogram, histogram, Unit};

/// Acknowledged attempts, by `outcome`.
pub const TASKS: &str = "confluo_tasks_total";
/// Groups fired.
pub const GROUPS_FIRED: &str = "confluo_groups_fired_total";
/// Tasks claimed.
pub const TASKS_CLAIMED: &str = "confluo_tasks_claimed_total";
/// Duration of one claim statement.
pub const CLAIM_DURATION: &str = "confluo_claim_duration_seconds";
/// Time from due to claimed.
pub const TASK_WAIT: &str = "confluo_task_wait_seconds";
/// Duration of one handler run, by `workflow`, `handler` and `ending`.
pub const HANDLER_DURATION: &str = "confluo_handler_duration_seconds";
/// Duration of a call that fired a group.
pub const FAN_IN: &str = "confluo_fan_in_seconds";
/// Tasks due, scheduled and running, by `state`.
pub const QUEUE_DEPTH: &str = "confluo_queue_depth";

/// What the auditor's rounds found, by `kind`.
pub const AUDIT_FINDINGS: &str = "confluo_audit_findings_total";
/// Repairs the auditor's rounds made.
pub const AUDIT_REPAIRS: &str = "confluo_audit_repairs_total";
/// What the last round could not repair.
pub const AUDIT_UNREPAIRED: &str = "confluo_audit_unrepaired";

/// Describes every metric (unit and help text) to the installed recorder. Optional:
/// metrics are recorded either way.
pub fn describe() {
    describe_counter!(TASKS, "Acknowledged task attempts, by outcome");
    describe_counter!(
        GROUPS_FIRED,
        "Groups whose last arrival dispatched the next stage"
    );
    describe_counter!(TASKS_CLAIMED, "Tasks handed to workers");
    describe_histogram!(CLAIM_DURATION, Unit::Seconds, "One claim statement");
    describe_histogram!(TASK_WAIT, Unit::Seconds, "From due to claimed");
    describe_histogram!(HANDLER_DURATION, Unit::Seconds, "One handler run");
    describe_histogram!(
        FAN_IN,
        Unit::Seconds,
        "The call that fired a group: last write, dispatch of the next stage, commit"
    );
    describe_gauge!(QUEUE_DEPTH, "Tasks due, scheduled (in backoff) and running");
    describe_counter!(AUDIT_FINDINGS, "What the auditor's rounds found, by kind");
    describe_counter!(AUDIT_REPAIRS, "Repairs the auditor's rounds made");
    describe_gauge!(
        AUDIT_UNREPAIRED,
        "What the auditor's last round found and could not repair"
    );
}

/// Counts what an auditor's round found, by kind.
pub(crate) fn audit_findings(found: &crate::Diagnosis) {
    let kinds = [
        ("counter_mismatch", found.counter_mismatches.len()),
        ("unfired_group", found.unfired_groups.len()),
        ("stalled_execution", found.stalled_executions.len()),
        ("unreceived_signal", found.unreceived_signals.len()),
        ("unreported_child", found.unreported_children.len()),
        ("orphaned_child", found.orphaned_children.len()),
    ];
    for (kind, n) in kinds {
        if n > 0 {
            counter!(AUDIT_FINDINGS, "kind" => kind).increment(n as u64);
        }
    }
}

/// Records an auditor's round: its repairs, and what it left unrepaired.
pub(crate) fn audit_round(repaired: usize, unrepaired: usize) {
    counter!(AUDIT_REPAIRS).increment(repaired as u64);
    metrics::gauge!(AUDIT_UNREPAIRED).set(unrepaired as f64);
}

/// Records an acknowledgement's outcome (its `outcome` label, and whether it fired a
/// group); `started` is when its call began.
pub(crate) fn acknowledged(label: &'static str, fired: bool, started: Instant) {
    counter!(TASKS, "outcome" => label).increment(1);
    if fired {
        counter!(GROUPS_FIRED).increment(1);
        histogram!(FAN_IN).record(started.elapsed().as_secs_f64());
    }
}

/// Records a claim: its duration, and how long each claimed task had been due.
pub(crate) fn claimed(started: Instant, waited_seconds: impl Iterator<Item = f64>) {
    histogram!(CLAIM_DURATION).record(started.elapsed().as_secs_f64());
    let wait = histogram!(TASK_WAIT);
    let mut n = 0;
    for w in waited_seconds {
        wait.record(w.max(0.0));
        n += 1;
    }
    counter!(TASKS_CLAIMED).increment(n);
}

/// Records one handler run.
pub(crate) fn handler_ran(workflow: &str, handler: &str, ending: &'static str, seconds: f64) {
    histogram!(
        HANDLER_DURATION,
        "workflow" => workflow.to_owned(),
        "handler" => handler.to_owned(),
        "ending" => ending
    )
    .record(seconds);
}

/// Records the queue's depth.
pub(crate) fn queue_depth(depth: &crate::QueueDepth) {
    metrics::gauge!(QUEUE_DEPTH, "state" => "due").set(depth.due as f64);
    metrics::gauge!(QUEUE_DEPTH, "state" => "scheduled").set(depth.scheduled as f64);
    metrics::gauge!(QUEUE_DEPTH, "state" => "running").set(depth.running as f64);
}
