//! `confluo`: the command line of the confluo workflow engine.
//!
//! ```sh
//! confluo migrate
//! confluo list --status failed
//! confluo inspect <execution>
//! confluo cancel <execution>
//! confluo signal <execution> approval '{"approved": true}'
//! confluo dead-letters list|show <task>|reprocess <task>...
//! confluo doctor [--repair] [--json]
//! confluo demo --width 10000
//! confluo worker --metrics 127.0.0.1:9464
//! confluo serve --demo
//! confluo bench --quick
//! confluo stress --executions 200 --width 1000 --processes 3 --all-faults
//! ```

mod bench;
mod dead_letters;
mod demo;
mod doctor;
mod executions;
mod route;
mod serve;
mod signal;
use confluo_testkit as server;
mod stress;
mod worker;
mod workers;

use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use confluo::Engine;
use sqlx::postgres::PgConnectOptions;

#[derive(Parser)]
#[command(
    name = "confluo",
    version,
    about = "Durable workflows on PostgreSQL with exactly-once fan-in"
)]
struct Cli {
    /// PostgreSQL to use, e.g. postgres://postgres@127.0.0.1:5432/postgres
    #[arg(long, global = true, env = "DATABASE_URL", hide_env_values = true)]
    database_url: Option<String>,

    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Applies confluo's migrations (idempotent; safe from several processes).
    Migrate(MigrateArgs),
    /// A timeline of one execution: its stages and their members, progress, dead letters.
    Inspect(executions::InspectArgs),
    /// Executions, newest first, filtered by workflow and status.
    List(executions::ListArgs),
    /// Cancels an execution: its pending tasks never run, nothing more is dispatched.
    Cancel(executions::CancelArgs),
    /// Sends a signal to an execution, for its `Stage::signal` wait of that name; kept if
    /// the execution has not reached the wait yet. Exits 1 if it changed nothing.
    Signal(signal::Args),
    /// Dead-lettered tasks: list them, show one, reprocess them.
    #[command(name = "dead-letters")]
    DeadLetters(dead_letters::Args),
    /// Deletes terminal executions older than a cutoff, in bounded batches.
    Purge(executions::PurgeArgs),
    /// Moves the tasks of ended executions out of the task table that workers claim from
    /// into the task history (workers do it on their own a minute after an execution
    /// ends; this is for a backlog, or a deployment whose workers do not).
    Archive(executions::ArchiveArgs),
    /// The worker registry: every worker with its host, pid, handlers, concurrency, what
    /// it runs and holds, and whether it is alive, lost (no heartbeat) or stopped.
    Workers(workers::Args),
    /// Finds what should never exist: groups whose counter disagrees with their members,
    /// groups with every member terminal that never fired, running executions with
    /// nothing left to run. Exits 1 when it finds something (and did not repair it).
    Doctor(doctor::Args),
    /// Runs a wide map and its fan-in with real workers, in a database of its own, and
    /// checks that the fan-in fired exactly once. Starts a throwaway PostgreSQL when none
    /// is configured or reachable.
    Demo(demo::Args),
    /// Runs many wide executions under injected faults, then checks the invariants in the
    /// database. Exits 1 on any violation. Starts a throwaway PostgreSQL when none is
    /// configured or reachable.
    Stress(stress::Args),
    /// Benchmarks the fan-in strategies side by side against the no-fan-in floor:
    /// throughput, latency, round trips, stalls and double fires. Starts a throwaway
    /// PostgreSQL when none is configured or reachable.
    Bench(bench::Args),
    /// Runs workers for the demo workflow until Ctrl-C or SIGTERM, with an optional
    /// Prometheus endpoint (`--metrics 127.0.0.1:9464`).
    Worker(worker::Args),
    /// Serves the HTTP API (JSON under /api/v1, its OpenAPI document at
    /// /api/v1/openapi.json) until Ctrl-C or SIGTERM. Starts a throwaway PostgreSQL when
    /// none is configured; `--demo` runs the demo workflow beside it.
    Serve(serve::Args),
    /// Runs a stress worker (spawned by `stress --processes`).
    #[command(hide = true)]
    StressWorker(stress::WorkerArgs),
}

fn main() -> std::process::ExitCode {
    quiet_on_a_closed_pipe();
    let cli = Cli::parse();
    // Under `stress` the engine's warnings (reclaimed leases, lost connections) are the
    // injected faults doing their work: only errors are shown, unless RUST_LOG says more.
    let quiet = matches!(
        cli.command,
        Command::Stress(_) | Command::StressWorker(_) | Command::Bench(_)
    );
    let filter = match std::env::var("RUST_LOG") {
        Ok(directives) if !directives.trim().is_empty() => directives,
        // sqlx warns of slow statements with their whole text: entering a 100 000-wide
        // stage is one such statement, by design.
        _ => if quiet { "error" } else { "warn,sqlx=error" }.to_owned(),
    };
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
        .with_writer(std::io::stderr)
        .init();
    let runtime = tokio::runtime::Runtime::new().expect("a tokio runtime");
    // On Ctrl-C, SIGTERM or SIGHUP the command's future is dropped, which stops and
    // removes a throwaway server. The handlers are installed before the command starts
    // (biased: polled first). A worker handles its signals itself, to shut down gracefully.
    let graceful = matches!(
        cli.command,
        Command::Worker(_) | Command::StressWorker(_) | Command::Serve(_)
    );
    let interruptible = async {
        use tokio::signal::unix::{signal, SignalKind};
        let (mut term, mut hangup) = (
            signal(SignalKind::terminate())?,
            signal(SignalKind::hangup())?,
        );
        tokio::select! {
            biased;
            _ = tokio::signal::ctrl_c(), if !graceful => Err(Interrupted.into()),
            _ = term.recv(), if !graceful => Err(Interrupted.into()),
            _ = hangup.recv(), if !graceful => Err(Interrupted.into()),
            result = run(cli) => result,
        }
    };
    match runtime.block_on(interruptible) {
        Ok(code) => code,
        Err(error) if error.is::<Interrupted>() => {
            eprintln!("interrupted");
            std::process::ExitCode::from(130)
        }
        Err(error) => {
            eprintln!("error: {error:#}");
            std::process::ExitCode::from(2)
        }
    }
}

/// `confluo demo | head -1`: once the reader has gone, the next `println!` panics on the
/// broken pipe. Exit quietly then, with the status a shell gives a process killed by
/// SIGPIPE (128 + 13), as other command-line tools do; other panics are reported as usual.
fn quiet_on_a_closed_pipe() {
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let message = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied())
            .unwrap_or_default();
        if message.contains("failed printing to stdout") && message.contains("Broken pipe") {
            std::process::exit(141);
        }
        report(info);
    }));
}

/// `--database NAME`, on every command that reads or writes an existing database.
#[derive(clap::Args)]
pub struct DatabaseArg {
    /// A database on the server of --database-url other than the URL's own: e.g. the
    /// `confluo_demo` that `demo` writes to.
    #[arg(long, global = true)]
    pub database: Option<String>,
}

#[derive(clap::Args)]
struct MigrateArgs {
    #[command(flatten)]
    target: DatabaseArg,
}

impl Command {
    /// The `--database` of a command that uses an existing database.
    fn database(&self) -> Option<&str> {
        match self {
            Command::Migrate(a) => a.target.database.as_deref(),
            Command::Inspect(a) => a.target.database.as_deref(),
            Command::List(a) => a.target.database.as_deref(),
            Command::Cancel(a) => a.target.database.as_deref(),
            Command::Signal(a) => a.target.database.as_deref(),
            Command::DeadLetters(a) => a.target.database.as_deref(),
            Command::Purge(a) => a.target.database.as_deref(),
            Command::Archive(a) => a.target.database.as_deref(),
            Command::Doctor(a) => a.target.database.as_deref(),
            Command::Workers(a) => a.target.database.as_deref(),
            _ => None,
        }
    }
}

/// A signal asked the command to stop.
#[derive(Debug)]
struct Interrupted;

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("interrupted")
    }
}

impl std::error::Error for Interrupted {}

async fn run(cli: Cli) -> anyhow::Result<std::process::ExitCode> {
    // These bring a throwaway server when none is configured or reachable.
    if matches!(
        cli.command,
        Command::Demo(_) | Command::Stress(_) | Command::Bench(_)
    ) {
        let configured = cli.database_url.as_deref().map(parse_url).transpose()?;
        let server = server::Server::pick(configured.as_ref()).await?;
        return match cli.command {
            Command::Demo(args) => {
                let throwaway = !matches!(server, server::Server::Configured(_));
                demo::run(server.admin(), args, throwaway).await
            }
            Command::Bench(args) => bench::run(server.admin(), args).await,
            Command::Stress(args) => {
                let url = server.url(cli.database_url.as_deref().unwrap_or_default());
                stress::run(server.admin(), &url, args).await
            }
            _ => unreachable!(),
        };
    }
    // This one brings a throwaway server when none is configured (but never replaces a
    // configured one that does not answer).
    if let Command::Serve(args) = cli.command {
        return serve::run(cli.database_url.as_deref(), args).await;
    }
    let mut options = database(cli.database_url.as_deref())?;
    if let Some(name) = cli.command.database() {
        options = options.database(name);
    }
    match cli.command {
        Command::Migrate(_) => {
            let engine = connect(&options, 2).await?;
            engine.migrate().await?;
            println!("migrations applied");
            Ok(std::process::ExitCode::SUCCESS)
        }
        Command::Inspect(args) => executions::inspect(connect(&options, 2).await?, args).await,
        Command::List(args) => executions::list(connect(&options, 2).await?, args).await,
        Command::Cancel(args) => executions::cancel(connect(&options, 2).await?, args).await,
        Command::Signal(args) => signal::run(connect(&options, 2).await?, args).await,
        Command::DeadLetters(args) => dead_letters::run(connect(&options, 2).await?, args).await,
        Command::Purge(args) => executions::purge(connect(&options, 2).await?, args).await,
        Command::Archive(args) => executions::archive(connect(&options, 2).await?, args).await,
        Command::Worker(args) => worker::run(options, args).await,
        Command::Doctor(args) => doctor::run(connect(&options, 4).await?, args).await,
        Command::Workers(args) => workers::run(connect(&options, 2).await?, args).await,
        Command::Demo(_) | Command::Stress(_) | Command::Bench(_) | Command::Serve(_) => {
            unreachable!("handled above")
        }
        Command::StressWorker(args) => stress::worker_process(options, args).await,
    }
}

/// The database to use: `--database-url`, else `DATABASE_URL`.
fn database(url: Option<&str>) -> anyhow::Result<PgConnectOptions> {
    let url = url.context(
        "no database: pass --database-url or set DATABASE_URL \
         (e.g. postgres://postgres@127.0.0.1:5432/postgres)",
    )?;
    parse_url(url)
}

fn parse_url(url: &str) -> anyhow::Result<PgConnectOptions> {
    url.parse().map_err(|error: sqlx::Error| {
        // sqlx's configuration error repeats its cause: say it once. Never the URL (it
        // may hold a password).
        let reason = match &error {
            sqlx::Error::Configuration(inner) => inner.to_string(),
            other => other.to_string(),
        };
        anyhow::anyhow!(
            "the database URL is not valid ({reason}): write it as \
             postgres://user:password@host:port/database"
        )
    })
}

/// An engine on a pool of `connections`, failing at once, naming the server and why,
/// when it cannot be reached.
async fn connect(options: &PgConnectOptions, connections: u32) -> anyhow::Result<Engine> {
    Ok(confluo::ConnectBuilder::from_options(options.clone())
        .max_connections(connections)
        .application_name("confluo-cli")
        .acquire_timeout(Duration::from_secs(10))
        .connect()
        .await?)
}
