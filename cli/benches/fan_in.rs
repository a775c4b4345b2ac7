//! The fan-in benchmark where a Rust user looks for it: `cargo bench` runs `confluo bench`
//! (the fan-in strategies side by side against the no-fan-in floor), built in the bench
//! profile, with the same arguments and the same server: `DATABASE_URL` when it answers,
//! else a throwaway PostgreSQL.
//!
//! ```sh
//! cargo bench -p confluo-cli --bench fan_in -- --quick        # width 1 000, 8 finishers
//! cargo bench -p confluo-cli --bench fan_in -- --budget 20    # the full matrix
//! cargo bench --workspace -- --quick                          # and the end-to-end one
//! ```
//!
//! `cargo fanin-bench` (the alias in `.cargo/config.toml`) is the same with the naive
//! strategy compiled in.

use std::process::{Command, ExitCode};

fn main() -> ExitCode {
    // cargo passes `--bench` to every benchmark; `confluo bench` does not take it.
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    // From the workspace root, as `cargo fanin-bench` runs: its results go to the
    // workspace's `target/fanin-bench/`, not under `cli/` (cargo runs a benchmark in its
    // package's directory).
    let workspace = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
    let status = Command::new(env!("CARGO_BIN_EXE_confluo"))
        .current_dir(workspace)
        .arg("bench")
        .args(&args)
        .status();
    match status {
        Ok(status) if status.success() => ExitCode::SUCCESS,
        Ok(status) => {
            eprintln!("confluo bench ended with {status}");
            ExitCode::FAILURE
        }
        Err(error) => {
            eprintln!("could not run {}: {error}", env!("CARGO_BIN_EXE_confluo"));
            ExitCode::FAILURE
        }
    }
}
