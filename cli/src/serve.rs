//! `confluo serve`: the HTTP API (`confluo-serve`) on a configured database, or on a
//! throwaway PostgreSQL when none is configured; `--demo` also runs the demo workflow
//! in the same process, so that there is something to watch.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use confluo::Engine;
use sqlx::postgres::PgConnectOptions;

use crate::server::Server;

/// Where the token comes from: never a flag, which `ps` would show to every local user.
const TOKEN_ENV: &str = "CONFLUO_API_TOKEN";

#[derive(clap::Args)]
pub struct Args {
    /// Listen on this address. Beyond loopback, a bearer token must be set in the
    /// environment: CONFLUO_API_TOKEN.
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    /// Turns the write endpoints (start, cancel, reprocess) off: they answer 403.
    #[arg(long)]
    read_only: bool,
    /// Also runs the demo workflow here: two workers, and a new map of --demo-width
    /// members whenever the last one has ended, in the database `confluo_demo` (unless
    /// --database says otherwise).
    #[arg(long)]
    demo: bool,
    /// Members of each demo execution's map.
    #[arg(long, default_value_t = 5_000, requires = "demo")]
    demo_width: u64,
    #[command(flatten)]
    webhooks: crate::worker::WebhookArgs,
    #[command(flatten)]
    pooler: crate::route::PoolerArgs,
    #[command(flatten)]
    target: crate::DatabaseArg,
}

pub async fn run(database_url: Option<&str>, args: Args) -> anyhow::Result<ExitCode> {
    use tokio::signal::unix::{signal, SignalKind};
    // Installed first, so that a signal during start-up is not fatal.
    let mut term = signal(SignalKind::terminate())?;
    let mut interrupt = signal(SignalKind::interrupt())?;

    let mut config = confluo_serve::Config::new(args.listen);
    if let Some(token) = std::env::var_os(TOKEN_ENV) {
        let token = token
            .into_string()
            .map_err(|_| anyhow::anyhow!("{TOKEN_ENV} is not valid UTF-8"))?;
        config = config.token(token);
    }
    if args.read_only {
        config = config.read_only();
    }
    config.check()?;

    // A configured server must answer (an empty dashboard in front of the wrong database
    // would look fine); with none, a throwaway one.
    let server = match database_url {
        Some(url) => Server::Configured(Box::new(crate::parse_url(url)?)),
        None => Server::pick(None).await?,
    };
    let throwaway = !matches!(server, Server::Configured(_));
    let options = database_options(&server, &args).await?;
    let route = if throwaway {
        crate::route::Route::direct(options)
    } else {
        // The direct URL, if any, names the same database.
        let database = options.get_database().map(str::to_owned);
        crate::route::Route::new(options, &args.pooler, database.as_deref())?
    };
    let engine = route.engine(8, "confluo-serve").await?;
    route.migrate(&engine).await?;
    let webhooks = args.webhooks.start(&engine)?;
    let demo = if args.demo {
        Some(Demo::start(&engine, &route, args.demo_width).await?)
    } else {
        None
    };

    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let serving = tokio::spawn({
        let engine = engine.clone();
        async move {
            confluo_serve::serve(engine, &config, async {
                let _ = stopped.await;
            })
            .await
        }
    });
    eprintln!(
        "serving the API on http://{}/api/v1 ({}{}); Ctrl-C (or SIGTERM) stops it",
        args.listen,
        if args.read_only {
            "read-only"
        } else {
            "read-write"
        },
        if throwaway {
            ", on a throwaway PostgreSQL: its data goes when this command ends"
        } else {
            ""
        }
    );
    let mut serving = serving;
    let stopped_by_itself = tokio::select! {
        // The server stopped by itself: it could not bind, or serving failed.
        result = &mut serving => Some(result?),
        _ = interrupt.recv() => None,
        _ = term.recv() => None,
    };
    let result = match stopped_by_itself {
        Some(result) => result,
        None => {
            // Dropping `stop` completes the shutdown future: the server stops accepting,
            // and the requests in flight finish (within 30 s) before anything they use
            // (the throwaway server included) goes away.
            drop(stop);
            match tokio::time::timeout(Duration::from_secs(30), &mut serving).await {
                Ok(joined) => joined?,
                Err(_) => {
                    eprintln!("requests still running after 30 s: stopping anyway");
                    Ok(())
                }
            }
        }
    };
    if let Some(demo) = demo {
        demo.stop().await;
    }
    if let Some(webhooks) = webhooks {
        webhooks.shutdown().await;
    }
    result?;
    eprintln!("stopped");
    Ok(ExitCode::SUCCESS)
}

/// The database to serve: `--database`, else the demo's with `--demo`, else the URL's.
/// Only the demo's own database is created when missing; `--database` alone names an
/// existing one, as on every other command (and through a pooler, this process may not
/// create anything).
async fn database_options(server: &Server, args: &Args) -> anyhow::Result<PgConnectOptions> {
    let name = match (&args.target.database, args.demo) {
        (Some(name), false) => return Ok(server.admin().database(name)),
        (Some(name), true) => name.clone(),
        (None, true) => "confluo_demo".to_owned(),
        (None, false) => return Ok(server.admin()),
    };
    confluo_testkit::existing_database(&server.admin(), &name).await
}

/// How long each demo member takes: 5 000 members on two workers of 32 then take about
/// eight seconds, long enough to watch their countdown.
const DEMO_PACE: Duration = Duration::from_millis(100);

/// The demo running beside the API: workers, and a loop that starts an execution
/// whenever the last one ended.
struct Demo {
    workers: Vec<confluo::Worker>,
    starter: tokio::task::JoinHandle<()>,
}

impl Demo {
    async fn start(
        engine: &Engine,
        route: &crate::route::Route,
        width: u64,
    ) -> anyhow::Result<Demo> {
        crate::demo::register_unless_there(engine).await?;
        let mut workers = Vec::new();
        for i in 0..2 {
            let id = format!("confluo-serve-{}-{i}", std::process::id());
            workers.push(crate::demo::start_worker(route, &id, 500, DEMO_PACE).await?);
        }
        let engine = engine.clone();
        let starter = tokio::spawn(async move {
            loop {
                if let Err(error) = run_one(&engine, width).await {
                    tracing::warn!(%error, "the demo could not run an execution; trying again");
                }
                tokio::time::sleep(Duration::from_secs(3)).await;
            }
        });
        eprintln!(
            "demo: maps of {width} members of the workflow {:?}, one after another",
            crate::demo::WORKFLOW
        );
        Ok(Demo { workers, starter })
    }

    async fn stop(self) {
        self.starter.abort();
        let mut stopping = tokio::task::JoinSet::new();
        for worker in self.workers {
            stopping.spawn(worker.shutdown());
        }
        while stopping.join_next().await.is_some() {}
    }
}

/// Starts one demo execution and waits for its end.
async fn run_one(engine: &Engine, width: u64) -> anyhow::Result<()> {
    let id = engine.start(crate::demo::WORKFLOW, &width).await?;
    tracing::info!(%id, width, "demo execution started");
    engine.wait(id, Duration::from_secs(3600)).await?;
    Ok(())
}
