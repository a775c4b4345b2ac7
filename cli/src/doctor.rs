//! `confluo doctor`: the auditor, as a table or JSON.

use std::process::ExitCode;

use confluo::{Diagnosis, Engine};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub target: crate::DatabaseArg,
    /// Re-drive what is found (idempotent; safe while workers run).
    #[arg(long)]
    repair: bool,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

pub async fn run(engine: Engine, args: Args) -> anyhow::Result<ExitCode> {
    if args.repair {
        let repairs = engine.repair().await?;
        if args.json {
            println!("{}", serde_json::to_string_pretty(&repairs)?);
        } else {
            print!("{}", table(&repairs.found));
            println!(
                "repaired: {} counters re-counted, {} groups fired, {} executions moved on, {} \
                 signals received, {} child ends reported, {} orphaned children cancelled",
                repairs.counters_fixed,
                repairs.groups_fired,
                repairs.executions_advanced,
                repairs.signals_received,
                repairs.children_reported,
                repairs.orphans_cancelled
            );
        }
        return Ok(ExitCode::SUCCESS);
    }
    let diagnosis = engine.doctor().await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&diagnosis)?);
    } else {
        print!("{}", table(&diagnosis));
    }
    Ok(if diagnosis.is_healthy() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

fn table(d: &Diagnosis) -> String {
    if d.is_healthy() {
        return "healthy: every counter matches its members, every finished group fired, \
                no running execution is stuck, every signal reached its wait, every child's \
                end reached its parent\n"
            .to_owned();
    }
    let mut out = format!(
        "{:<20} {:<38} {:>5}  detail\n",
        "finding", "execution", "stage"
    );
    for m in &d.counter_mismatches {
        let what = match m.stripe {
            Some(s) => format!("stripe {s} of group {}", m.group_id),
            None => format!("group {}", m.group_id),
        };
        out += &format!(
            "{:<20} {:<38} {:>5}  {what}: counter {} but {} open\n",
            "counter mismatch", m.execution_id, m.stage_index, m.counter, m.expected
        );
    }
    for g in &d.unfired_groups {
        out += &format!(
            "{:<20} {:<38} {:>5}  group {}: every member terminal, never fired\n",
            "unfired group", g.execution_id, g.stage_index, g.group_id
        );
    }
    for g in &d.stalled_executions {
        out += &format!(
            "{:<20} {:<38} {:>5}  group {} fired, nothing after it\n",
            "stalled execution", g.execution_id, g.stage_index, g.group_id
        );
    }
    for s in &d.unreceived_signals {
        out += &format!(
            "{:<20} {:<38} {:>5}  signal {:?} kept while its wait is pending\n",
            "unreceived signal", s.execution_id, "-", s.name
        );
    }
    for c in &d.unreported_children {
        out += &format!(
            "{:<20} {:<38} {:>5}  ended, but its member {} in the parent still waits\n",
            "unreported child", c.execution_id, "-", c.member
        );
    }
    for id in &d.orphaned_children {
        out += &format!(
            "{:<20} {:<38} {:>5}  runs, but its parent has ended\n",
            "orphaned child", id, "-"
        );
    }
    out + &format!(
        "{} findings; `confluo doctor --repair` re-drives them\n",
        d.len()
    )
}
