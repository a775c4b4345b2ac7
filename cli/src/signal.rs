//! `confluo signal`: sends a signal to an execution's wait.

use std::process::ExitCode;

use anyhow::Context;
use confluo::{Engine, ExecutionId, SignalOutcome};

#[derive(clap::Args)]
pub struct Args {
    /// The execution's id.
    id: uuid::Uuid,
    /// The signal's name: the name of the `Stage::signal` stage that waits for it.
    name: String,
    /// The payload, as JSON (the wait's output, what the next stage receives).
    #[arg(default_value = "null")]
    payload: String,
    #[command(flatten)]
    pub target: crate::DatabaseArg,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

/// Exits 0 when the signal was received or kept, 1 when it changed nothing.
pub async fn run(engine: Engine, args: Args) -> anyhow::Result<ExitCode> {
    let payload: serde_json::Value = serde_json::from_str(&args.payload).with_context(|| {
        format!(
            "the payload {:?} is not JSON: quote a string as '\"yes\"', or give an object \
             such as '{{\"approved\": true}}'",
            args.payload
        )
    })?;
    let id = ExecutionId::from(args.id);
    let outcome = engine.signal(id, &args.name, payload).await?;
    if args.json {
        let out = serde_json::json!({"id": id, "name": args.name, "result": outcome});
        println!("{out}");
    } else {
        let name = &args.name;
        match outcome {
            SignalOutcome::Received => {
                println!("{id} received signal {name:?}: its wait completed, and it goes on")
            }
            SignalOutcome::Kept => println!(
                "{id} has not reached its wait for {name:?} yet: the signal is kept, and \
                 received when it does"
            ),
            SignalOutcome::AlreadyReceived => println!(
                "{id} already has a signal {name:?}: this one changed nothing (the first \
                 payload stands)"
            ),
            SignalOutcome::TooLate => {
                println!("{id} is past its wait for {name:?} (it timed out): nothing kept")
            }
            SignalOutcome::Ended(status) => println!("{id} is {status}: nothing kept"),
            _ => println!("{id}: {outcome:?}"),
        }
    }
    Ok(match outcome {
        SignalOutcome::Received | SignalOutcome::Kept => ExitCode::SUCCESS,
        _ => ExitCode::from(1),
    })
}
