//! How a long-running process (`confluo worker`, `confluo serve`) reaches PostgreSQL:
//! directly, or through a pooler in transaction mode (PgBouncer), with a direct URL for
//! what such a pooler cannot carry: migrations and `LISTEN` (README, "Behind PgBouncer").

use std::time::Duration;

use confluo::{Engine, Notifications};
use sqlx::postgres::PgConnectOptions;

/// The flags that send a process's pools through a transaction pooler.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct PoolerArgs {
    /// The database URL is a pooler in transaction mode (PgBouncer's `pool_mode =
    /// transaction`): every statement is prepared unnamed, inside a transaction, and
    /// nothing listens on it. Migrations and notifications need --direct-url; without it
    /// this process does not migrate (run `confluo migrate` against the server) and its
    /// workers poll.
    #[arg(long)]
    pub transaction_pooler: bool,
    /// With --transaction-pooler: a URL that reaches PostgreSQL itself, not through the
    /// pooler, for migrations and for one `LISTEN` connection per worker (--database
    /// applies to it too).
    #[arg(
        long,
        env = "CONFLUO_DIRECT_URL",
        value_name = "URL",
        requires = "transaction_pooler"
    )]
    pub direct_url: Option<String>,
}

/// Where a process's pools connect, and how its workers hear of new tasks.
#[derive(Clone, Debug)]
pub struct Route {
    /// The URL's options: the server, or the pooler.
    options: PgConnectOptions,
    /// Whether `options` is a transaction pooler.
    pooler: bool,
    /// A direct connection to the server, behind a pooler.
    direct: Option<PgConnectOptions>,
}

impl Route {
    /// Straight to the server.
    pub fn direct(options: PgConnectOptions) -> Route {
        Route {
            options,
            pooler: false,
            direct: None,
        }
    }

    /// As the flags say; `database` (the `--database` flag) names the database on both
    /// URLs.
    pub fn new(
        options: PgConnectOptions,
        flags: &PoolerArgs,
        database: Option<&str>,
    ) -> anyhow::Result<Route> {
        let direct = match &flags.direct_url {
            None => None,
            Some(url) => {
                let direct = crate::parse_url(url)
                    .map_err(|e| anyhow::anyhow!("--direct-url (CONFLUO_DIRECT_URL): {e}"))?;
                Some(match database {
                    Some(name) => direct.database(name),
                    None => direct,
                })
            }
        };
        Ok(Route {
            options: match database {
                Some(name) => options.database(name),
                None => options,
            },
            pooler: flags.transaction_pooler,
            direct,
        })
    }

    /// An engine on a pool of `connections` (through the pooler, if there is one), failing
    /// at once, naming the server and why, when it cannot be reached.
    pub async fn engine(&self, connections: u32, application: &str) -> anyhow::Result<Engine> {
        let mut builder = confluo::ConnectBuilder::from_options(self.options.clone())
            .max_connections(connections)
            .application_name(application)
            .acquire_timeout(Duration::from_secs(30));
        if self.pooler {
            builder = builder.transaction_pooler();
        }
        Ok(builder.connect().await?)
    }

    /// Applies the migrations on `engine`'s server, or, behind a pooler, over the direct
    /// URL; with neither, says that it did not and goes on.
    pub async fn migrate(&self, engine: &Engine) -> anyhow::Result<()> {
        if !self.pooler {
            return Ok(engine.migrate().await?);
        }
        match &self.direct {
            Some(direct) => {
                let engine = crate::connect(direct, 1).await?;
                engine.migrate().await?;
                engine.pool().close().await;
            }
            None => eprintln!(
                "not migrating: behind a transaction pooler, migrations need a direct \
                 connection (--direct-url, or `confluo migrate` against the server)"
            ),
        }
        Ok(())
    }

    /// How a worker on this route hears of new tasks: as the library defaults (`LISTEN`
    /// on a connection like its pool's; polling behind a pooler), or, behind a pooler
    /// with a direct URL, `LISTEN` on that.
    pub fn notifications(&self, application: &str) -> Option<Notifications> {
        match (&self.direct, self.pooler) {
            (Some(direct), true) => Some(Notifications::Direct(Box::new(confluo::read_committed(
                direct.clone().application_name(application),
            )))),
            _ => None,
        }
    }

    /// Whether the pools go through a pooler, for what the process prints.
    pub fn through_pooler(&self) -> bool {
        self.pooler
    }
}
