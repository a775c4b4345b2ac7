//! Test databases: one fresh database per test, cloned from a migrated template, so tests
//! run in parallel without seeing each other's rows.
//!
//! The server is `DATABASE_URL` when set; otherwise a throwaway server of the test
//! binary's own, started from the machine's PostgreSQL binaries (removed when the binary
//! exits; the user's own server is never touched); otherwise a PostgreSQL 16 container
//! through testcontainers when a Docker engine answers; otherwise the test fails with a
//! message saying how to provide one.
#![allow(dead_code, unreachable_pub)]

pub mod family;

use std::hash::{Hash, Hasher};
use std::str::FromStr;
use std::sync::OnceLock;
use std::time::Duration;

use confluo::Engine;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, PgConnection, PgPool};

/// An engine on the database of `pool`: on `pool` itself, or, when this run goes through
/// PgBouncer (`CONFLUO_TEST_PGBOUNCER`), on a pool of the same size through it, told so
/// (`transaction_pooler`). The tests' own SQL keeps `pool`, a direct one.
pub fn engine(pool: PgPool) -> Engine {
    engine_builder(pool).build()
}

/// [`Engine::builder`], as [`engine`] says.
pub fn engine_builder(pool: PgPool) -> confluo::EngineBuilder {
    match pgbouncer() {
        Some(bouncer) => {
            let database = pool
                .connect_options()
                .get_database()
                .expect("a test pool names its database")
                .to_owned();
            let through = PgPoolOptions::new()
                .max_connections(pool.options().get_max_connections())
                .acquire_timeout(Duration::from_secs(60))
                .connect_lazy_with(bouncer.clone().database(&database));
            Engine::builder(through).transaction_pooler()
        }
        None => Engine::builder(pool),
    }
}

/// A database of its own for one test; dropped (with its connections) when the test ends.
pub struct TestDb {
    pub engine: Engine,
    pub pool: PgPool,
    pub name: String,
    /// This test's share of the server's connections, given back after the database is
    /// dropped (fields drop after `Drop::drop`).
    _share: tokio::sync::OwnedSemaphorePermit,
    options: PgConnectOptions,
    admin: PgConnectOptions,
}

impl TestDb {
    /// A fresh migrated database with a pool of `max_connections`. With
    /// `CONFLUO_TEST_ISOLATION` set (e.g. `serializable`), the database's
    /// `default_transaction_isolation` is set to it, and the pool is built as the README
    /// says a service on such a database must build it (`confluo::read_committed`).
    pub async fn new(max_connections: u32) -> TestDb {
        let admin = admin_options();
        let share = connection_share(&admin, max_connections).await;
        let template = ensure_template(&admin).await;
        let name = format!("confluo_t_{}", uuid::Uuid::new_v4().simple());
        // Before the database exists: a bad CONFLUO_TEST_PGBOUNCER leaves nothing behind.
        let _ = pgbouncer();
        let mut options = admin.clone().database(&name);
        let mut conn = admin
            .connect()
            .await
            .expect("connect to the admin database");
        sqlx::query(&format!("CREATE DATABASE {name} TEMPLATE {template}"))
            .execute(&mut conn)
            .await
            .expect("create the test database");
        if let Ok(level) = std::env::var("CONFLUO_TEST_ISOLATION") {
            sqlx::query(&format!(
                "ALTER DATABASE {name} SET default_transaction_isolation = '{level}'"
            ))
            .execute(&mut conn)
            .await
            .expect("CONFLUO_TEST_ISOLATION: an isolation level, e.g. serializable");
        }
        conn.close().await.ok();
        if std::env::var_os("CONFLUO_TEST_ISOLATION").is_some() {
            options = confluo::read_committed(options);
        }
        let pool = PgPoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(Duration::from_secs(60))
            .connect_with(options.clone())
            .await
            .expect("connect to the test database");
        TestDb {
            engine: engine(pool.clone()),
            pool,
            name,
            _share: share,
            options,
            admin,
        }
    }

    /// Registers a workflow, failing the test if it is rejected.
    pub async fn register(&self, workflow: &confluo::Workflow) {
        self.engine
            .register(workflow)
            .await
            .expect("register the workflow");
    }

    /// Another pool on the same database (a "separate process").
    pub async fn new_pool(&self, max_connections: u32) -> PgPool {
        PgPoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(Duration::from_secs(60))
            .connect_with(self.options.clone())
            .await
            .expect("connect another pool")
    }

    /// A single connection of its own.
    pub async fn connection(&self) -> PgConnection {
        self.options.connect().await.expect("connect")
    }

    /// The URL-less options of this database.
    pub fn options(&self) -> PgConnectOptions {
        self.options.clone()
    }

    /// Options that reach this database directly, never through `CONFLUO_TEST_PGBOUNCER`.
    pub fn direct_options(&self) -> PgConnectOptions {
        self.admin.clone().database(&self.name)
    }

    /// How a worker of a test that needs notifications listens: on a connection like its
    /// pool's, or, behind PgBouncer, on a direct one (a `LISTEN` through a transaction
    /// pooler is lost as soon as its statement ends).
    pub fn listening(&self) -> confluo::Notifications {
        if Self::through_pgbouncer() {
            confluo::Notifications::Direct(Box::new(self.direct_options()))
        } else {
            confluo::Notifications::Pool
        }
    }

    /// Whether this run reaches the databases through PgBouncer (`CONFLUO_TEST_PGBOUNCER`).
    pub fn through_pgbouncer() -> bool {
        pgbouncer().is_some()
    }

    /// A fresh database (as [`new`](Self::new)) whose sessions default to `level` (e.g.
    /// `serializable`), set with `ALTER DATABASE`.
    pub async fn defaulting_to(level: &str, max_connections: u32) -> TestDb {
        let db = TestDb::new(max_connections).await;
        sqlx::query(&format!(
            "ALTER DATABASE {} SET default_transaction_isolation = '{level}'",
            db.name
        ))
        .execute(&db.pool)
        .await
        .expect("set the database's default isolation");
        db
    }

    /// A pool of `size` on this database that pins no isolation level, checked to have
    /// sessions at `level` (see [`defaulting_to`](Self::defaulting_to)).
    pub async fn unpinned_pool(&self, size: u32, level: &str) -> PgPool {
        let pool = PgPoolOptions::new()
            .max_connections(size)
            .connect_with(self.unpinned_options())
            .await
            .expect("connect to the test database");
        let found: String = sqlx::query_scalar("SHOW default_transaction_isolation")
            .fetch_one(&pool)
            .await
            .expect("read the default isolation");
        assert_eq!(found, level, "the sessions are not pinned");
        pool
    }

    /// The database's connect options, never pinned to an isolation level.
    pub fn unpinned_options(&self) -> PgConnectOptions {
        self.admin.clone().database(&self.name)
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let admin = self.admin.clone();
        let name = self.name.clone();
        let pool = self.pool.clone();
        // Drop runs inside the test's runtime; do the async clean-up on a thread of its own.
        let _ = on_own_thread(move || async move {
            // A connection being returned to the pool is pinged by a task of the test's
            // runtime, which this drop blocks (a current-thread runtime has no other
            // thread): do not wait for it; FORCE below ends it anyway.
            let _ = tokio::time::timeout(Duration::from_millis(500), pool.close()).await;
            if let Ok(mut conn) = admin.connect().await {
                let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                    .execute(&mut conn)
                    .await;
            }
        });
    }
}

/// Runs the future `task` makes to its end on a current-thread runtime of a thread of its
/// own, for synchronous code that may itself run on a test's runtime (a drop, a
/// `OnceLock`'s initializer). `Err` if it panicked.
fn on_own_thread<T, F, Fut>(task: F) -> std::thread::Result<T>
where
    T: Send + 'static,
    F: FnOnce() -> Fut + Send + 'static,
    Fut: std::future::Future<Output = T>,
{
    std::thread::spawn(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
            .block_on(task())
    })
    .join()
}

/// The PgBouncer of `CONFLUO_TEST_PGBOUNCER` (a PgBouncer in transaction mode in front of
/// the server of `DATABASE_URL`, e.g. `postgres://postgres@127.0.0.1:16432/postgres`, as
/// `.ci/pgbouncer` starts one), checked once to be one (its admin console answers `SHOW
/// VERSION`), so that a run meant to go through it cannot go around it. The engines'
/// pools go through it ([`engine`]); databases are created, checked and dropped directly.
fn pgbouncer() -> Option<&'static PgConnectOptions> {
    static BOUNCER: OnceLock<Option<PgConnectOptions>> = OnceLock::new();
    BOUNCER
        .get_or_init(|| {
            let url = std::env::var("CONFLUO_TEST_PGBOUNCER").ok()?;
            let options = PgConnectOptions::from_str(&url)
                .expect("CONFLUO_TEST_PGBOUNCER is not a valid PostgreSQL URL");
            let console = options.clone().database("pgbouncer");
            let version = on_own_thread(move || async move {
                let mut conn = console.connect().await?;
                // The admin console speaks the simple query protocol only.
                let rows = sqlx::raw_sql("SHOW VERSION").fetch_all(&mut conn).await?;
                conn.close().await.ok();
                Ok::<_, sqlx::Error>(rows.len())
            })
            .expect("the PgBouncer check panicked");
            match version {
                Ok(rows) if rows > 0 => Some(options),
                other => panic!(
                    "CONFLUO_TEST_PGBOUNCER={url}: no PgBouncer admin console answers there \
                     ({other:?}); start one (see .ci/run) or unset it"
                ),
            }
        })
        .as_ref()
}

/// Connections a test may open besides its pool: other pools (`new_pool`, "separate
/// processes"), single connections, each worker's listener, the drop of its database.
const CONNECTIONS_BESIDES_THE_POOL: u32 = 20;

/// Waits for this test's share of the connections the test process may have open at once,
/// so that the suite fits a stock `max_connections = 100` whatever `--test-threads` says:
/// tests that would go past it wait for others to end. The budget is what the server
/// allows (`max_connections` less its reserved slots and the connections already open
/// when the first test starts, less a margin), or `CONFLUO_TEST_CONNECTIONS`. Test
/// binaries run one after another, so one process's budget is the suite's.
async fn connection_share(
    admin: &PgConnectOptions,
    pool_size: u32,
) -> tokio::sync::OwnedSemaphorePermit {
    static BUDGET: OnceLock<(std::sync::Arc<tokio::sync::Semaphore>, u32)> = OnceLock::new();
    let (budget, total) = match BUDGET.get() {
        Some(b) => b,
        None => {
            let total = match std::env::var("CONFLUO_TEST_CONNECTIONS") {
                Ok(n) => n.parse().expect("CONFLUO_TEST_CONNECTIONS: a number"),
                Err(_) => server_budget(admin).await,
            };
            BUDGET.get_or_init(|| {
                (
                    std::sync::Arc::new(tokio::sync::Semaphore::new(total as usize)),
                    total,
                )
            })
        }
    };
    let share = (pool_size + CONNECTIONS_BESIDES_THE_POOL).min(*total);
    budget
        .clone()
        .acquire_many_owned(share)
        .await
        .expect("the budget never closes")
}

/// What the server lets this process open: `max_connections`, less the reserved slots,
/// less what is open now, less a margin of 5 (at least 10).
async fn server_budget(admin: &PgConnectOptions) -> u32 {
    let mut conn = admin
        .connect()
        .await
        .expect("cannot connect to the PostgreSQL server named by DATABASE_URL; is it running?");
    let room = confluo_testkit::ConnectionRoom::of(&mut conn)
        .await
        .expect("read max_connections");
    conn.close().await.ok();
    // PgBouncer may open up to its cap of server connections besides.
    let bouncer = pgbouncer_server_connections().unwrap_or(0);
    (room.free() - 5 - bouncer).max(10) as u32
}

/// PgBouncer's admin console (its `pgbouncer` database), when this run goes through it.
pub fn pgbouncer_console() -> Option<PgConnectOptions> {
    Some(pgbouncer()?.clone().database("pgbouncer"))
}

/// The most server connections the PgBouncer of `CONFLUO_TEST_PGBOUNCER` opens
/// (`max_user_connections`, as `.ci/pgbouncer` sets it), if one is used.
fn pgbouncer_server_connections() -> Option<i64> {
    let console = pgbouncer_console()?;
    on_own_thread(move || async move {
        use sqlx::Row;
        let mut conn = console.connect().await.ok()?;
        let rows = sqlx::raw_sql("SHOW CONFIG")
            .fetch_all(&mut conn)
            .await
            .ok()?;
        conn.close().await.ok();
        rows.iter()
            .find(|row| row.try_get::<String, _>(0).ok().as_deref() == Some("max_user_connections"))
            .and_then(|row| row.try_get::<String, _>(1).ok()?.parse().ok())
    })
    .ok()
    .flatten()
}

fn admin_options() -> PgConnectOptions {
    static URL: OnceLock<String> = OnceLock::new();
    let url = URL.get_or_init(|| match std::env::var("DATABASE_URL") {
        Ok(url) => url,
        Err(_) => confluo_testkit::server::process_local_url()
            .map_err(|e| format!("{e:#}"))
            .or_else(|local| container_url().map_err(|docker| (local, docker)))
            .unwrap_or_else(|(local, docker)| {
                panic!(
                    "confluo's tests need PostgreSQL, and none could be found or started.\n  \
                     Set DATABASE_URL, e.g. \
                     DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres cargo test\n  \
                     or install PostgreSQL's server binaries (apt install postgresql), for \
                     a throwaway server: {local}\n  \
                     or make a Docker engine reachable, for a container: {docker}"
                )
            }),
    });
    PgConnectOptions::from_str(url).expect("DATABASE_URL is not a valid PostgreSQL URL")
}

/// Starts one PostgreSQL 16 container for the whole test binary (kept until the process
/// exits).
fn container_url() -> Result<String, String> {
    use testcontainers::runners::SyncRunner;
    use testcontainers::ImageExt;
    use testcontainers_modules::postgres::Postgres;
    static CONTAINER: OnceLock<testcontainers::Container<Postgres>> = OnceLock::new();
    std::thread::spawn(|| {
        if CONTAINER.get().is_none() {
            let container = Postgres::default()
                .with_tag("16-alpine")
                .start()
                .map_err(|e| format!("no container: {e}"))?;
            let _ = CONTAINER.set(container);
        }
        let c = CONTAINER.get().expect("set above");
        let host = c.get_host().map_err(|e| e.to_string())?;
        let port = c.get_host_port_ipv4(5432).map_err(|e| e.to_string())?;
        Ok(format!(
            "postgres://postgres:postgres@{host}:{port}/postgres"
        ))
    })
    .join()
    .map_err(|_| "starting the container panicked".to_owned())?
}

/// Creates (once per migration set) a migrated template database, under an advisory lock
/// so that concurrent tests and test binaries build it once.
async fn ensure_template(admin: &PgConnectOptions) -> String {
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .expect("migrations folder")
        .map(|e| e.expect("dir entry").path())
        .collect();
    files.sort();
    for f in files {
        std::fs::read(&f).expect("read migration").hash(&mut hasher);
    }
    let template = format!("confluo_template_{:016x}", hasher.finish());

    let mut conn = admin
        .connect()
        .await
        .expect("cannot connect to the PostgreSQL server named by DATABASE_URL; is it running?");
    sqlx::query("SELECT pg_advisory_lock(hashtext('confluo.test-template'))")
        .execute(&mut conn)
        .await
        .expect("advisory lock");
    let exists: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
            .bind(&template)
            .fetch_one(&mut conn)
            .await
            .expect("look up template");
    if !exists {
        let building = format!("{template}_building");
        sqlx::query(&format!("DROP DATABASE IF EXISTS {building} WITH (FORCE)"))
            .execute(&mut conn)
            .await
            .expect("drop half-built template");
        sqlx::query(&format!("CREATE DATABASE {building}"))
            .execute(&mut conn)
            .await
            .expect("create template");
        {
            let pool = PgPoolOptions::new()
                .max_connections(2)
                .connect_with(admin.clone().database(&building))
                .await
                .expect("connect template");
            Engine::new(pool.clone())
                .migrate()
                .await
                .expect("migrate template");
            pool.close().await;
        }
        sqlx::query(&format!("ALTER DATABASE {building} RENAME TO {template}"))
            .execute(&mut conn)
            .await
            .expect("publish template");
    }
    sqlx::query("SELECT pg_advisory_unlock(hashtext('confluo.test-template'))")
        .execute(&mut conn)
        .await
        .expect("advisory unlock");
    conn.close().await.ok();
    template
}

/// Runs `f` until it returns true or `timeout` passes.
pub async fn eventually<F, Fut>(timeout: Duration, mut f: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if f().await {
            return true;
        }
        if tokio::time::Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Completes `tasks` (each with `output`) on connections of their own while `rival` runs
/// on another, all released at the same instant by a barrier; returns the completions'
/// outcomes, in order, and what `rival` returned. Each side takes its connection before
/// the barrier, so none waits for the pool once released.
pub async fn race_completions<R, Fut>(
    engine: &Engine,
    tasks: Vec<confluo::ClaimedTask>,
    output: serde_json::Value,
    rival: R,
) -> (Vec<confluo::Outcome>, Fut::Output)
where
    R: FnOnce(Engine) -> Fut,
    Fut: std::future::Future + Send + 'static,
    Fut::Output: Send + 'static,
{
    use std::sync::Arc;
    let barrier = Arc::new(tokio::sync::Barrier::new(tasks.len() + 1));
    let mut finishers = Vec::new();
    for task in tasks {
        let (engine, barrier, output) = (engine.clone(), barrier.clone(), output.clone());
        finishers.push(tokio::spawn(async move {
            drop(engine.pool().acquire().await.unwrap());
            barrier.wait().await;
            engine.complete(&task, output).await.unwrap()
        }));
    }
    let rival = {
        let (pool, barrier, rival) = (
            engine.pool().clone(),
            barrier.clone(),
            rival(engine.clone()),
        );
        tokio::spawn(async move {
            drop(pool.acquire().await.unwrap());
            barrier.wait().await;
            rival.await
        })
    };
    let mut outcomes = Vec::new();
    for f in finishers {
        outcomes.push(f.await.unwrap());
    }
    (outcomes, rival.await.unwrap())
}

/// How many of `outcomes` fired their group.
pub fn fired(outcomes: &[confluo::Outcome]) -> usize {
    outcomes
        .iter()
        .filter(|o| matches!(o, confluo::Outcome::Completed { fired: true }))
        .count()
}

/// The strategies that must keep every invariant.
pub const STRATEGIES: [confluo::FanInStrategy; 3] = [
    confluo::FanInStrategy::Countdown,
    confluo::FanInStrategy::Striped,
    confluo::FanInStrategy::RowLock,
];

/// How long a test waits for an execution.
pub const WAIT: Duration = Duration::from_secs(120);

/// Retries fast: a few milliseconds of backoff.
pub fn fast_retry(attempts: u32) -> confluo::RetryPolicy {
    confluo::RetryPolicy::exponential(attempts)
        .backoff(Duration::from_millis(10), Duration::from_millis(50))
}

/// A worker polling every 50 ms, 8 handlers at once, built by `build`. Its acknowledgement
/// window is the library's default (batched), or `CONFLUO_TEST_ACK_WINDOW_MS` when set
/// (`0`: every ending acknowledged on its own), so the suite runs either way. It runs no
/// auditor's round unless `build` asks (`tests/auditor.rs`): a test's own `doctor` must
/// see what went wrong, not find it moved on.
pub async fn quick_worker(
    engine: &confluo::Engine,
    build: impl FnOnce(confluo::WorkerBuilder) -> confluo::WorkerBuilder,
) -> confluo::Worker {
    let mut worker = engine
        .worker()
        .poll_interval(Duration::from_millis(50))
        .audit_every(None)
        .concurrency(8);
    if let Some(ms) = test_ack_window_ms() {
        worker = worker.ack_window(Duration::from_millis(ms));
    }
    build(worker).start().await.unwrap()
}

/// `CONFLUO_TEST_ACK_WINDOW_MS`, if set.
pub fn test_ack_window_ms() -> Option<u64> {
    std::env::var("CONFLUO_TEST_ACK_WINDOW_MS").ok().map(|v| {
        v.parse()
            .expect("CONFLUO_TEST_ACK_WINDOW_MS: a number of milliseconds")
    })
}

/// Claims (as worker "test", under a 60 s lease) until `n` tasks are in hand: a task made
/// claimable by another transaction may be missed by a claim whose snapshot predates it.
pub async fn claim_n(engine: &confluo::Engine, n: usize) -> Vec<confluo::ClaimedTask> {
    let mut tasks = Vec::new();
    for _ in 0..200 {
        tasks.extend(
            engine
                .claim("test", n - tasks.len(), Duration::from_secs(60))
                .await
                .unwrap(),
        );
        if tasks.len() == n {
            return tasks;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("claimed {} of {n} tasks", tasks.len());
}

/// How many groups of stage `stage` the execution has, and how many of them fired.
pub async fn groups_of(db: &TestDb, id: confluo::ExecutionId, stage: &str) -> (i64, i64) {
    sqlx::query_as(
        "SELECT count(*), count(fired_at) FROM confluo.stage_group
          WHERE execution_id = $1 AND stage_name = $2",
    )
    .bind(id)
    .bind(stage)
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

/// A real stall of `workflow` (a map of the naive re-count over its input, then a step):
/// two members completing together on connections of their own, released by a barrier,
/// until neither fires. Returns the stalled execution; the others are cancelled.
pub async fn naive_stall(db: &TestDb, workflow: &str) -> confluo::ExecutionId {
    use std::sync::Arc;
    loop {
        let id = db.engine.start(workflow, &[1, 2]).await.unwrap();
        let tasks = claim_n(&db.engine, 2).await;
        let barrier = Arc::new(tokio::sync::Barrier::new(2));
        let mut handles = Vec::new();
        for task in tasks {
            let (engine, barrier) = (db.engine.clone(), barrier.clone());
            handles.push(tokio::spawn(async move {
                drop(engine.pool().acquire().await.unwrap());
                barrier.wait().await;
                engine.complete(&task, serde_json::json!(1)).await.unwrap()
            }));
        }
        let mut outcomes = Vec::new();
        for h in handles {
            outcomes.push(h.await.unwrap());
        }
        if fired(&outcomes) == 0 {
            return id;
        }
        // Not this time: clear the dispatched step away and try again.
        db.engine.cancel(id).await.unwrap();
    }
}
