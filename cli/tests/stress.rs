//! A small stress run in the test suite: every in-process fault kind on, worker
//! processes killed with SIGKILL, and the harness's invariant checks must all pass.

use std::process::Command;

/// Runs `confluo stress` on `DATABASE_URL`, or (unset) on the throwaway server `stress`
/// starts itself.
fn stress(args: &[&str], database: &str) -> (bool, String) {
    let mut command = Command::new(env!("CARGO_BIN_EXE_confluo"));
    if let Ok(url) = std::env::var("DATABASE_URL") {
        command.args(["--database-url", &url]);
    }
    let output = command
        .args(["stress", "--database", database])
        .args(args)
        .output()
        .expect("run confluo stress");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr);
    (output.status.success(), format!("{stdout}\n{stderr}"))
}

/// The count the summary gives for a fault kind.
fn injected(out: &str, fault: &str) -> u64 {
    out.lines()
        .find(|l| l.trim_start().starts_with(fault) && l.contains("  "))
        .and_then(|l| l.split_whitespace().last())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

#[test]
fn small_stress_run_with_every_fault_keeps_every_invariant_acknowledging_in_batches() {
    let (ok, out) = stress(
        &[
            "--executions",
            "24",
            "--width",
            "150",
            "--processes",
            "2",
            "--all-faults",
            "--kill-worker-every-ms",
            "700",
            "--lease-ms",
            "1500",
            "--timeout",
            "300",
        ],
        "confluo_stress_test_multi",
    );
    assert!(ok, "{out}");
    assert!(out.contains("PASSED: every invariant holds"), "{out}");
    for fault in [
        "error",
        "panic",
        "replayed completion",
        "zombie completion",
        "connection killed",
        "worker process killed",
    ] {
        assert!(injected(&out, fault) > 0, "no {fault} injected:\n{out}");
    }
}

#[test]
fn small_in_process_stress_run_on_the_striped_countdown_acknowledging_singly() {
    let (ok, out) = stress(
        &[
            "--ack-window-ms",
            "0",
            "--executions",
            "10",
            "--width",
            "300",
            "--workers",
            "3",
            "--strategy",
            "striped",
            "--all-faults",
            "--timeout",
            "300",
        ],
        "confluo_stress_test_striped",
    );
    assert!(ok, "{out}");
    assert!(out.contains("PASSED: every invariant holds"), "{out}");
}

/// Many worker processes on small pools and no listener: the budget of connections a
/// fleet needs is its pools, and the run keeps every invariant.
#[test]
fn many_worker_processes_on_pools_of_two_without_listeners_keep_every_invariant() {
    let (ok, out) = stress(
        &[
            "--executions",
            "16",
            "--width",
            "100",
            "--processes",
            "8",
            "--worker-connections",
            "2",
            "--no-listen",
            "--all-faults",
            "--kill-worker-every-ms",
            "1000",
            "--lease-ms",
            "1500",
            "--timeout",
            "300",
        ],
        "confluo_stress_test_fleet",
    );
    assert!(ok, "{out}");
    assert!(out.contains("PASSED: every invariant holds"), "{out}");
    let peak: u64 = out
        .lines()
        .find(|l| l.trim_start().starts_with("server connections, peak"))
        .and_then(|l| l.split_whitespace().nth(3))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no peak of connections in the summary:\n{out}"));
    // 8 pools of 2 (16), the harness's own pool of 6 (the sampling connection among
    // them), the replaying, zombie and cancelling clients' pools of 2: 28 at most. One
    // listener per worker would make it 36.
    assert!(peak > 0 && peak <= 30, "peak {peak} connections:\n{out}");
}
