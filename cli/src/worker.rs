//! `confluo worker`: a long-running worker process for the demo workflow, with a
//! Prometheus endpoint. Start several against one database and run
//! `confluo demo --workers 0` to watch them share the work.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use confluo::Engine;
use metrics_exporter_prometheus::PrometheusBuilder;
use sqlx::postgres::PgConnectOptions;

#[derive(clap::Args)]
pub struct Args {
    /// Serve Prometheus metrics on this address, e.g. 127.0.0.1:9464 (GET /metrics).
    #[arg(long)]
    metrics: Option<SocketAddr>,
    /// Worker loops in this process, each with a pool of its own.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..))]
    workers: u16,
    /// Every N-th item of the demo map fails for good (0: none).
    #[arg(long, default_value_t = 1_000)]
    fail_every: u64,
    /// The database to work in (on the configured server).
    #[arg(long)]
    database: Option<String>,
    #[command(flatten)]
    webhooks: WebhookArgs,
    #[command(flatten)]
    pooler: crate::route::PoolerArgs,
}

/// Delivering the webhooks that announce executions' ends (`worker` and `serve` both do,
/// sharing the outbox).
#[derive(clap::Args)]
pub struct WebhookArgs {
    /// Deliver no webhooks from this process.
    #[arg(long)]
    no_webhooks: bool,
    /// Post webhooks to loopback, private and link-local addresses too (refused by
    /// default: a callback URL comes from whoever starts an execution).
    #[arg(long)]
    allow_private_webhooks: bool,
}

/// Where the webhook signing secret comes from: never a flag, which `ps` shows.
const WEBHOOK_SECRET_ENV: &str = "CONFLUO_WEBHOOK_SECRET";

impl WebhookArgs {
    /// Starts delivering, unless turned off; signed with `CONFLUO_WEBHOOK_SECRET` when set.
    pub fn start(
        &self,
        engine: &Engine,
    ) -> anyhow::Result<Option<confluo::webhooks::WebhookDelivery>> {
        if self.no_webhooks {
            return Ok(None);
        }
        let mut builder = engine.webhooks();
        match std::env::var(WEBHOOK_SECRET_ENV) {
            Ok(secret) if !secret.trim().is_empty() => builder = builder.secret(secret.trim()),
            Ok(_) => anyhow::bail!("{WEBHOOK_SECRET_ENV} is empty: set a long random secret, or unset it to send unsigned webhooks"),
            Err(_) => tracing::info!("{WEBHOOK_SECRET_ENV} is not set: webhooks go unsigned"),
        }
        if self.allow_private_webhooks {
            builder = builder.allow_private_targets();
        }
        Ok(Some(builder.start()))
    }
}

/// Installs the Prometheus recorder and its HTTP listener on `addr`.
pub fn serve_metrics(addr: SocketAddr) -> anyhow::Result<()> {
    PrometheusBuilder::new()
        .with_http_listener(addr)
        .install()
        .map_err(|e| anyhow::anyhow!("cannot serve metrics on {addr}: {e}"))?;
    confluo::metrics::describe();
    eprintln!("metrics: http://{addr}/metrics");
    Ok(())
}

pub async fn run(options: PgConnectOptions, args: Args) -> anyhow::Result<ExitCode> {
    use tokio::signal::unix::{signal, SignalKind};
    // Installed first, so that a signal during start-up is not fatal.
    let mut term = signal(SignalKind::terminate())?;
    let mut interrupt = signal(SignalKind::interrupt())?;
    let route = crate::route::Route::new(options, &args.pooler, args.database.as_deref())?;
    if let Some(addr) = args.metrics {
        serve_metrics(addr)?;
    }
    let engine = route.engine(2, "confluo-worker").await?;
    route.migrate(&engine).await?;
    crate::demo::register_unless_there(&engine).await?;
    let webhooks = args.webhooks.start(&engine)?;
    let mut workers = Vec::new();
    for i in 0..args.workers {
        let id = format!("confluo-worker-{}-{i}", std::process::id());
        workers
            .push(crate::demo::start_worker(&route, &id, args.fail_every, Duration::ZERO).await?);
    }
    eprintln!(
        "{} worker(s) serving {:?}{}; Ctrl-C (or SIGTERM) stops them gracefully",
        workers.len(),
        crate::demo::WORKFLOW,
        if route.through_pooler() {
            " through a transaction pooler"
        } else {
            ""
        }
    );
    tokio::select! {
        _ = interrupt.recv() => {}
        _ = term.recv() => {}
    }
    eprintln!("stopping: finishing what runs (a second signal exits at once)");
    tokio::spawn(async move {
        tokio::select! {
            _ = interrupt.recv() => {}
            _ = term.recv() => {}
        }
        std::process::exit(130);
    });
    // All at once: each stops claiming, then waits out its grace period.
    let mut stopping = tokio::task::JoinSet::new();
    for worker in workers {
        stopping.spawn(worker.shutdown());
    }
    if let Some(webhooks) = webhooks {
        stopping.spawn(webhooks.shutdown());
    }
    while stopping.join_next().await.is_some() {}
    eprintln!("stopped");
    Ok(ExitCode::SUCCESS)
}
