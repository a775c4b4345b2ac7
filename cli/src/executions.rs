//! `confluo inspect`, `list` and `cancel`: executions as tables or JSON.

use std::process::ExitCode;

use anyhow::Context;
use confluo::{Engine, Execution, ExecutionId, ExecutionStatus, ListFilter, StageProgress};

#[derive(clap::Args)]
pub struct InspectArgs {
    /// The execution's id.
    id: uuid::Uuid,
    #[command(flatten)]
    pub target: crate::DatabaseArg,
    /// Also list members per stage (those not completed first), with their status,
    /// attempts, duration and last error: 10 per stage, or `--members=N`.
    #[arg(long, num_args = 0..=1, default_missing_value = "10", require_equals = true)]
    members: Option<usize>,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
pub struct ListArgs {
    #[command(flatten)]
    pub target: crate::DatabaseArg,
    /// Only executions of this workflow.
    #[arg(long)]
    workflow: Option<String>,
    /// Only executions in this status: running, completed, failed, cancelled or timed_out.
    #[arg(long)]
    status: Option<ExecutionStatus>,
    /// Only the child workflows' executions this execution started.
    #[arg(long)]
    parent: Option<uuid::Uuid>,
    /// At most this many, newest first.
    #[arg(long, default_value_t = 50)]
    limit: usize,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
pub struct CancelArgs {
    /// The execution's id.
    id: uuid::Uuid,
    #[command(flatten)]
    pub target: crate::DatabaseArg,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

pub async fn inspect(engine: Engine, args: InspectArgs) -> anyhow::Result<ExitCode> {
    let execution = engine.execution(ExecutionId::from(args.id)).await?;
    let mut members = Vec::new();
    if let Some(limit) = args.members {
        for stage in &execution.stages {
            members.push(engine.members(execution.id, stage.index, limit).await?);
        }
    }
    if args.json {
        let mut value = serde_json::to_value(&execution)?;
        if args.members.is_some() {
            value["members"] = serde_json::to_value(&members)?;
        }
        println!("{}", serde_json::to_string_pretty(&value)?);
        return Ok(ExitCode::SUCCESS);
    }
    print!("{}", timeline(&execution));
    for (stage, members) in execution.stages.iter().zip(&members) {
        println!(
            "\n  stage {} {:?}: {} of {} members",
            stage.index,
            stage.name,
            members.len(),
            stage.width
        );
        for m in members {
            let took = match (m.started_at, m.finished_at) {
                (Some(s), Some(f)) => format!("{:.3} s", (f - s).as_seconds_f64()),
                (Some(_), None) => "running".to_owned(),
                _ => "-".to_owned(),
            };
            println!(
                "    {:>6} {:<16} {:<9} {:>2} attempt(s) {:>10}  {}  {}",
                format!("[{}]", m.item_index),
                m.handler,
                m.status,
                m.attempts,
                took,
                m.task_id,
                m.last_error.as_deref().unwrap_or("")
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// An execution as text: header, one line per stage, its dead letters.
pub fn timeline(e: &Execution) -> String {
    let mut out = format!(
        "execution {}\n  workflow {} v{}, {}, started {}",
        e.id, e.workflow, e.version, e.status, e.created_at
    );
    if let Some(deadline) = e.deadline {
        out += &format!(", deadline {deadline}");
    }
    if let Some(finished) = e.finished_at {
        out += &format!(
            ", finished {finished} ({:.1} s)",
            (finished - e.created_at).as_seconds_f64()
        );
    }
    if let Some(parent) = e.parent {
        out += &format!("\n  a child of execution {parent}");
    }
    if let Some(error) = &e.error {
        out += &format!("\n  error: {error}");
    }
    out += &format!(
        "\n\n  {:>3} {:<16} {:<8} {:>7} {:>9} {:>7} {:>7} {:>5} {:>9} {:>9} {:>8}  {:<12} {}\n",
        "#",
        "stage",
        "kind",
        "width",
        "completed",
        "running",
        "pending",
        "dead",
        "cancelled",
        "remaining",
        "attempts",
        "entered",
        "fired after"
    );
    for s in &e.stages {
        out += &format!(
            "  {:>3} {:<16} {:<8} {:>7} {:>9} {:>7} {:>7} {:>5} {:>9} {:>9} {:>8}  {:<12} {}\n",
            s.index,
            s.name,
            s.kind,
            s.width,
            s.completed,
            s.running,
            s.pending,
            s.dead,
            s.cancelled,
            s.remaining,
            s.attempts,
            s.entered_at.format("%H:%M:%S%.3f"),
            s.fired_at.map_or("-".to_owned(), |t| format!(
                "{:.3} s",
                (t - s.entered_at).as_seconds_f64()
            ))
        );
        if let Some(choice) = &s.branch {
            let arm = choice
                .arm
                .as_ref()
                .map_or("otherwise".to_owned(), |a| format!("arm {a:?}"));
            out += &format!("      took {arm} (selected value: {})\n", choice.value);
        }
        if let Some(k) = s.quorum {
            out += &format!("      {}\n", quorum_line(s, k));
        }
        match (s.kind.as_str(), s.wakes_at) {
            ("signal", Some(at)) => {
                out += &format!("      waits for signal {:?} until {at}\n", s.name)
            }
            ("signal", None) if s.pending > 0 => {
                out += &format!("      waits for signal {:?}\n", s.name)
            }
            (_, Some(at)) => out += &format!("      sleeps until {at}\n"),
            ("map_workflow", _) => {
                out += &format!(
                    "      one child execution per member: confluo list --parent {}\n",
                    e.id
                )
            }
            _ => {}
        }
    }
    if !e.dead_letters.is_empty() {
        out += &format!("\n  dead letters ({}):\n", e.dead_letters.len());
        for d in &e.dead_letters {
            let last = d.errors.last().map_or("", |a| a.error.as_str());
            out += &format!(
                "    task {} stage {} {}[{}]: {} attempts, last error: {last}\n",
                d.task_id, d.stage_index, d.handler, d.item_index, d.attempts
            );
        }
    }
    out
}

/// Where a stage joined `any` or `at_least(k)` stands: fired, waiting, or out of reach.
fn quorum_line(s: &StageProgress, k: u32) -> String {
    let join = if k == 1 {
        "any".to_owned()
    } else {
        format!("at_least({k})")
    };
    let state = if s.fired_at.is_some() {
        format!("fired with {} completed", s.completed)
    } else if s.dead > s.width.saturating_sub(k) {
        format!("out of reach: {} dead-lettered", s.dead)
    } else {
        format!(
            "waits for {} more to complete",
            k.saturating_sub(s.completed)
        )
    };
    format!("joins {join} of {}: {state}", s.width)
}

pub async fn list(engine: Engine, args: ListArgs) -> anyhow::Result<ExitCode> {
    let mut filter = ListFilter::new().limit(args.limit);
    if let Some(workflow) = args.workflow {
        filter = filter.workflow(workflow);
    }
    if let Some(status) = args.status {
        filter = filter.status(status);
    }
    if let Some(parent) = args.parent {
        filter = filter.parent(ExecutionId::from(parent));
    }
    let executions = engine.list(&filter).await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&executions)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "{:<36}  {:<20} {:>3}  {:<9} {:>5}  {:<32}",
        "id", "workflow", "v", "status", "stage", "started"
    );
    for e in &executions {
        println!(
            "{:<36}  {:<20} {:>3}  {:<9} {:>5}  {}",
            e.id, e.workflow, e.version, e.status, e.current_stage, e.created_at
        );
    }
    println!("{} executions", executions.len());
    Ok(ExitCode::SUCCESS)
}

pub async fn cancel(engine: Engine, args: CancelArgs) -> anyhow::Result<ExitCode> {
    let id = ExecutionId::from(args.id);
    let cancelled = engine.cancel(id).await?;
    let status = engine.status(id).await?;
    if args.json {
        let out = serde_json::json!({"id": id, "cancelled": cancelled, "status": status});
        println!("{out}");
    } else if cancelled {
        println!("cancelled {id}: its pending tasks will not run, nothing more is dispatched");
    } else {
        println!("{id} is {status}: nothing to cancel");
    }
    Ok(if cancelled {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

#[derive(clap::Args)]
pub struct PurgeArgs {
    #[command(flatten)]
    pub target: crate::DatabaseArg,
    /// Delete terminal executions that finished longer ago than this: e.g. 30d, 12h, 45m.
    #[arg(long, value_parser = parse_age)]
    older_than: chrono::Duration,
    /// Executions deleted per statement.
    #[arg(long, default_value_t = 1_000)]
    batch: usize,
    /// Say how many would be deleted, and delete nothing.
    #[arg(long)]
    dry_run: bool,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

/// `30d`, `12h`, `45m` or `90s`.
pub fn parse_age(s: &str) -> Result<chrono::Duration, String> {
    let (number, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
    let n: i64 = number
        .parse()
        .map_err(|_| format!("{s:?}: expected e.g. 30d, 12h, 45m"))?;
    let age = match unit {
        "d" => chrono::Duration::try_days(n),
        "h" => chrono::Duration::try_hours(n),
        "m" => chrono::Duration::try_minutes(n),
        "s" => chrono::Duration::try_seconds(n),
        _ => return Err(format!("{s:?}: the unit must be d, h, m or s")),
    };
    age.ok_or_else(|| format!("{s:?}: too long (at most about 106 751 991 days)"))
}

pub async fn purge(engine: Engine, args: PurgeArgs) -> anyhow::Result<ExitCode> {
    let cutoff = chrono::Utc::now()
        .checked_sub_signed(args.older_than)
        .with_context(|| {
            format!(
                "--older-than {} days reaches before the earliest date there is: nothing that \
                 old exists, so there is nothing to purge; give a shorter age",
                args.older_than.num_days()
            )
        })?;
    if args.dry_run {
        let would = engine.purgeable(cutoff).await?;
        if args.json {
            println!(
                "{}",
                serde_json::json!({"would_delete": would, "cutoff": cutoff, "dry_run": true})
            );
        } else {
            println!(
                "would delete {would} terminal executions that finished before {cutoff} \
                 (dry run: nothing deleted)"
            );
        }
        return Ok(ExitCode::SUCCESS);
    }
    let deleted = engine.purge(cutoff, args.batch).await?;
    if args.json {
        println!(
            "{}",
            serde_json::json!({"deleted": deleted, "cutoff": cutoff})
        );
    } else {
        println!("deleted {deleted} terminal executions that finished before {cutoff}");
    }
    Ok(ExitCode::SUCCESS)
}

#[derive(clap::Args)]
pub struct ArchiveArgs {
    #[command(flatten)]
    pub target: crate::DatabaseArg,
    /// Archive executions that ended longer ago than this: e.g. 1m, 12h, 0s.
    #[arg(long, value_parser = parse_age, default_value = "1m")]
    older_than: chrono::Duration,
    /// Executions archived per statement.
    #[arg(long, default_value_t = 100)]
    batch: usize,
    /// Say how many ended executions (and tasks) are still in the task table, and move
    /// nothing.
    #[arg(long)]
    dry_run: bool,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

pub async fn archive(engine: Engine, args: ArchiveArgs) -> anyhow::Result<ExitCode> {
    if args.dry_run {
        let waiting = engine.unarchived().await?;
        if args.json {
            println!(
                "{}",
                serde_json::json!({"executions": waiting.executions, "tasks": waiting.tasks,
                                   "dry_run": true})
            );
        } else {
            println!(
                "{} ended executions still have their {} tasks in the task table \
                 (dry run: nothing moved)",
                waiting.executions, waiting.tasks
            );
        }
        return Ok(ExitCode::SUCCESS);
    }
    // A negative or huge age cannot come out of `parse_age`; saturate anyway.
    let after = args.older_than.to_std().unwrap_or(std::time::Duration::MAX);
    let moved = engine.archive(after, args.batch).await?;
    if args.json {
        println!(
            "{}",
            serde_json::json!({"executions": moved.executions, "tasks": moved.tasks})
        );
    } else {
        println!(
            "moved the {} tasks of {} ended executions to the task history",
            moved.tasks, moved.executions
        );
    }
    Ok(ExitCode::SUCCESS)
}
