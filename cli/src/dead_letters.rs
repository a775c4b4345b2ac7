//! `confluo dead-letters list | show | reprocess`.

use std::process::ExitCode;

use confluo::{DeadLetterFilter, Engine, Error, ExecutionId, TaskId};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub target: crate::DatabaseArg,
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::Subcommand)]
enum Command {
    /// Dead-lettered tasks, the most recent first.
    List(ListArgs),
    /// One dead letter: where it sits, its input and every attempt's error.
    Show(ShowArgs),
    /// Puts dead letters back in the queue with a fresh attempt budget. A failed execution
    /// resumes; a member whose group already fired runs again without dispatching the next
    /// stage a second time.
    Reprocess(ReprocessArgs),
}

#[derive(clap::Args)]
struct Filter {
    /// Only dead letters of this workflow.
    #[arg(long)]
    workflow: Option<String>,
    /// Only dead letters of this execution.
    #[arg(long)]
    execution: Option<uuid::Uuid>,
    /// At most this many.
    #[arg(long, default_value_t = 50)]
    limit: usize,
}

impl Filter {
    fn to_filter(&self) -> DeadLetterFilter {
        let mut filter = DeadLetterFilter::new().limit(self.limit);
        if let Some(workflow) = &self.workflow {
            filter = filter.workflow(workflow.clone());
        }
        if let Some(execution) = self.execution {
            filter = filter.execution(ExecutionId::from(execution));
        }
        filter
    }
}

#[derive(clap::Args)]
struct ListArgs {
    #[command(flatten)]
    filter: Filter,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
struct ShowArgs {
    /// The task's id.
    task: uuid::Uuid,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
struct ReprocessArgs {
    /// The tasks to reprocess.
    #[arg(required_unless_present = "all", conflicts_with = "all")]
    tasks: Vec<uuid::Uuid>,
    /// Every dead letter matching the filter (newest first, up to --limit).
    #[arg(long)]
    all: bool,
    #[command(flatten)]
    filter: Filter,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

pub async fn run(engine: Engine, args: Args) -> anyhow::Result<ExitCode> {
    match args.command {
        Command::List(args) => list(engine, args).await,
        Command::Show(args) => show(engine, args).await,
        Command::Reprocess(args) => reprocess(engine, args).await,
    }
}

async fn list(engine: Engine, args: ListArgs) -> anyhow::Result<ExitCode> {
    let dead = engine.dead_letters(&args.filter.to_filter()).await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&dead)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "{:<36}  {:<36}  {:<16} {:<20} {:>5} {:>8}  {:<9}  last error",
        "task", "execution", "workflow", "stage[member]", "tries", "group", "execution"
    );
    for d in &dead {
        let member = format!("{}[{}]", d.handler, d.item_index);
        println!(
            "{:<36}  {:<36}  {:<16} {:<20} {:>5} {:>8}  {:<9}  {}",
            d.task_id,
            d.execution_id,
            d.workflow,
            member,
            d.attempts,
            if d.group_fired { "fired" } else { "waiting" },
            d.execution_status,
            one_line(d.last_error.as_deref().unwrap_or("-"), 80)
        );
    }
    println!("{} dead letters", dead.len());
    Ok(ExitCode::SUCCESS)
}

async fn show(engine: Engine, args: ShowArgs) -> anyhow::Result<ExitCode> {
    let d = engine.dead_letter(TaskId::from(args.task)).await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&d)?);
        return Ok(ExitCode::SUCCESS);
    }
    let s = &d.summary;
    println!("dead letter {}", s.task_id);
    println!(
        "  execution {} ({} v{}, {})",
        s.execution_id, s.workflow, s.version, s.execution_status
    );
    println!(
        "  stage {} {:?}, member {}[{}]; its group {}",
        s.stage_index,
        s.stage,
        s.handler,
        s.item_index,
        if s.group_fired {
            "has fired: the next stage ran with it listed as failed"
        } else {
            "waits for it"
        }
    );
    println!(
        "  dead since {}, after {} attempt(s); reprocessed {} time(s) before",
        s.dead_at.map_or("-".to_owned(), |t| t.to_string()),
        s.attempts,
        s.reprocessed
    );
    match &d.input {
        Some(input) => println!("  input: {}", one_line(&input.to_string(), 200)),
        None => println!("  input: the stage's input (read by reference)"),
    }
    println!("  errors:");
    for e in &d.errors {
        println!("    #{} at {}: {}", e.attempt, e.at, e.error);
    }
    Ok(ExitCode::SUCCESS)
}

async fn reprocess(engine: Engine, args: ReprocessArgs) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(
        args.all || (args.filter.workflow.is_none() && args.filter.execution.is_none()),
        "--workflow and --execution choose dead letters for --all; with task ids, leave them out"
    );
    let tasks: Vec<TaskId> = if args.all {
        engine
            .dead_letters(&args.filter.to_filter())
            .await?
            .into_iter()
            .map(|d| d.task_id)
            .collect()
    } else {
        args.tasks.into_iter().map(TaskId::from).collect()
    };
    let mut done = Vec::new();
    let mut refused = 0;
    for task in tasks {
        match engine.reprocess(task).await {
            Ok(r) => {
                if !args.json {
                    let mut line = format!("requeued {task}");
                    if r.requeued.len() > 1 {
                        line += &format!(" with {} other task(s)", r.requeued.len() - 1);
                    }
                    if r.resumed {
                        line += &format!("; execution {} resumed", r.execution_id);
                    }
                    if !r.restarted_children.is_empty() {
                        line += &format!(
                            "; {} child execution(s) started again",
                            r.restarted_children.len()
                        );
                    }
                    if r.group_fired {
                        line += "; its group already fired, so the next stage will not run again";
                    }
                    println!("{line}");
                }
                done.push(r);
            }
            Err(
                e @ (Error::NotDeadLettered { .. }
                | Error::ExecutionNotResumable { .. }
                | Error::DeadlinePassed { .. }
                | Error::TaskNotFound(_)),
            ) => {
                refused += 1;
                eprintln!("not reprocessed: {e}");
            }
            Err(e) => return Err(e.into()),
        }
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&done)?);
    } else {
        println!("{} reprocessed, {refused} refused", done.len());
    }
    Ok(if refused == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// `text` on one line, cut to `max` characters.
fn one_line(text: &str, max: usize) -> String {
    let line: String = text.split_whitespace().collect::<Vec<_>>().join(" ");
    if line.chars().count() <= max {
        line
    } else {
        line.chars().take(max - 1).chain(['…']).collect()
    }
}
