//! A PostgreSQL server for `demo`, `stress` and `bench`: the configured one when it
//! answers; else a throwaway local server started from PostgreSQL's own binaries (on the
//! PATH or under /usr/lib/postgresql/*/bin, run as the `postgres` user when we are root,
//! its data removed at exit); else a testcontainers one where a Docker engine answers.
//! Each choice is said on stderr; with none available, the error says how to point the
//! command at a server.
//!
//! # The throwaway server's security
//! It trusts whoever connects, so it listens on no TCP port: only on a Unix socket inside
//! its temporary directory, which is mode 0700 (its owner, and root, can reach it; no
//! other local user can). The one exception is [`LocalPostgres::start_with_tls`], for
//! tests of TLS: it also listens on 127.0.0.1, where it accepts only TLS connections that
//! give a random password (scram-sha-256). A watchdog beside the server stops it and
//! removes its directory within a second of the process that started it dying, even by
//! SIGKILL, when no `Drop` runs.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, Connection};

/// The server a command runs against; a throwaway one is stopped and removed on drop.
pub enum Server {
    /// The configured server.
    Configured(Box<PgConnectOptions>),
    /// A local server of our own.
    Local(LocalPostgres),
    /// A container of our own.
    Container(Box<Container>),
}

/// A testcontainers PostgreSQL, removed on drop (with the `docker` feature).
#[cfg_attr(not(feature = "docker"), allow(dead_code))]
pub struct Container {
    options: PgConnectOptions,
    #[cfg(feature = "docker")]
    _container: testcontainers::ContainerAsync<testcontainers_modules::postgres::Postgres>,
}

impl Server {
    /// The configured server if it answers, else a throwaway one.
    pub async fn pick(configured: Option<&PgConnectOptions>) -> anyhow::Result<Server> {
        let why = match configured {
            None => "no database configured (--database-url, DATABASE_URL)".to_owned(),
            Some(options) => match reachable(options).await {
                // The server answered and refused (authentication, missing database):
                // a throwaway server would only hide the mistake.
                Err(error) if answered(&error) => {
                    return Err(error.context(format!(
                        "PostgreSQL at {}:{} refused the connection",
                        options.get_host(),
                        options.get_port()
                    )))
                }
                Ok(()) => {
                    eprintln!(
                        "using PostgreSQL at {}:{}",
                        options.get_host(),
                        options.get_port()
                    );
                    return Ok(Server::Configured(Box::new(options.clone())));
                }
                Err(error) => format!(
                    "PostgreSQL at {}:{} does not answer ({error})",
                    options.get_host(),
                    options.get_port()
                ),
            },
        };
        eprintln!("{why}: starting a throwaway PostgreSQL");
        let local = match LocalPostgres::start().await {
            Ok(local) => {
                eprintln!(
                    "started a throwaway PostgreSQL from {} on a Unix socket only (data in \
                     {}, removed at exit)",
                    local.bin.display(),
                    local.dir.path().display()
                );
                return Ok(Server::Local(local));
            }
            Err(error) => error,
        };
        let container = match start_container().await {
            Ok(container) => {
                eprintln!(
                    "started a throwaway PostgreSQL container on {}:{} (removed at exit)",
                    container.options.get_host(),
                    container.options.get_port()
                );
                return Ok(Server::Container(Box::new(container)));
            }
            Err(error) => error,
        };
        bail!(
            "{why}, and no throwaway server could be started:\n  \
             local server binaries: {local:#}\n  \
             Docker: {container:#}\n\
             Point the command at a server with --database-url or DATABASE_URL, e.g.\n  \
             DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres, or install PostgreSQL's \
             server (e.g. apt install postgresql) or start a Docker engine."
        )
    }

    /// Options to connect to the server's maintenance database as a superuser.
    pub fn admin(&self) -> PgConnectOptions {
        match self {
            Server::Configured(options) => (**options).clone(),
            Server::Local(local) => local.options(),
            Server::Container(container) => container.options.clone(),
        }
    }

    /// A URL for child processes (stress workers), password included: give it to them
    /// through the environment (`DATABASE_URL`), never on a command line, where `ps`
    /// shows it to every local user.
    pub fn url(&self, configured_url: &str) -> String {
        match self {
            Server::Configured(_) => configured_url.to_owned(),
            Server::Local(local) => local.url(),
            Server::Container(container) => format!(
                "postgres://postgres:postgres@{}:{}/postgres",
                container.options.get_host(),
                container.options.get_port()
            ),
        }
    }
}

/// Whether a connection error came from a server that answered (rather than from no
/// server at all: refused, unreachable, timed out).
fn answered(error: &anyhow::Error) -> bool {
    matches!(
        error.downcast_ref::<sqlx::Error>(),
        Some(sqlx::Error::Database(_) | sqlx::Error::Tls(_) | sqlx::Error::Configuration(_))
    )
}

async fn reachable(options: &PgConnectOptions) -> anyhow::Result<()> {
    let conn = tokio::time::timeout(Duration::from_secs(5), options.connect())
        .await
        .context("timed out")??;
    conn.close().await?;
    Ok(())
}

/// A PostgreSQL server run from the machine's binaries in a temporary directory, behind
/// a watchdog (see the module's docs).
pub struct LocalPostgres {
    bin: PathBuf,
    port: u16,
    dir: tempfile::TempDir,
    /// The watchdog shell; the server is its child.
    child: Child,
    /// The postgres user's (uid, gid) when we are root: the server runs as it.
    user: Option<(u32, u32)>,
    /// The password of TCP connections, when the server listens on 127.0.0.1.
    password: Option<String>,
}

/// The watchdog: runs the server (`$3...`) in the background and, once the process that
/// started it (`$1`) is gone, stops it fast and removes the directory `$2`. A TERM makes
/// it stop the server too.
const WATCHDOG: &str = r#"parent=$1; dir=$2; shift 2
"$@" &
pg=$!
trap 'kill -INT "$pg" 2>/dev/null' TERM
while [ -d "/proc/$parent" ] && kill -0 "$pg" 2>/dev/null; do sleep 0.2; done
if ! [ -d "/proc/$parent" ]; then
  kill -INT "$pg" 2>/dev/null
  wait "$pg"
  rm -rf "$dir"
  exit 0
fi
wait "$pg""#;

impl LocalPostgres {
    /// Initializes a cluster in a fresh temporary directory and starts it, listening on a
    /// Unix socket in that directory only.
    pub async fn start() -> anyhow::Result<LocalPostgres> {
        LocalPostgres::launch(None).await
    }

    /// As [`start`](Self::start), and also listening on 127.0.0.1 for TLS connections
    /// only, with the certificate and key given (PEM), as `postgres` with the random
    /// password of [`tcp_options`](Self::tcp_options).
    pub async fn start_with_tls(cert_pem: &str, key_pem: &str) -> anyhow::Result<LocalPostgres> {
        LocalPostgres::launch(Some((cert_pem, key_pem))).await
    }

    async fn launch(tls: Option<(&str, &str)>) -> anyhow::Result<LocalPostgres> {
        let bin = server_binaries().context("no PostgreSQL server binaries (initdb, postgres)")?;
        // PostgreSQL refuses to run as root: then it runs as the postgres user.
        let user = if is_root() {
            Some(
                postgres_user()
                    .context("running as root, and no `postgres` user to run the server as")?,
            )
        } else {
            None
        };
        // Mode 0700: the socket inside is reachable by its owner (and root) only.
        let dir = tempfile::Builder::new()
            .prefix("confluo-pg-")
            .tempdir()
            .context("creating a temporary directory")?;
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700))
                .context("making the temporary directory private")?;
        }
        let give = |path: &Path| -> anyhow::Result<()> {
            if let Some((uid, gid)) = user {
                std::os::unix::fs::chown(path, Some(uid), Some(gid))
                    .with_context(|| format!("giving {} to the postgres user", path.display()))?;
            }
            Ok(())
        };
        give(dir.path())?;
        let data = dir.path().join("data");
        let mut initdb = command(user, &bin.join("initdb"));
        initdb.args([
            "-D",
            &path(&data),
            "-U",
            "postgres",
            "-A",
            "trust",
            "-E",
            "UTF8",
            "--no-sync",
        ]);
        run(&mut initdb).context("initdb failed")?;
        let port = free_port()?;
        let mut settings = vec![
            "max_connections=300".to_owned(),
            format!("unix_socket_directories={}", path(dir.path())),
        ];
        let password = match tls {
            None => {
                settings.push("listen_addresses=".to_owned());
                None
            }
            Some((cert, key)) => {
                use std::os::unix::fs::PermissionsExt;
                let (cert_file, key_file) =
                    (dir.path().join("server.crt"), dir.path().join("server.key"));
                std::fs::write(&cert_file, cert)?;
                std::fs::write(&key_file, key)?;
                std::fs::set_permissions(&key_file, std::fs::Permissions::from_mode(0o600))?;
                give(&cert_file)?;
                give(&key_file)?;
                // The socket trusts (its directory guards it); TCP takes TLS and the
                // password, and nothing else.
                std::fs::write(
                    data.join("pg_hba.conf"),
                    "local all all trust\n\
                     hostssl all all 127.0.0.1/32 scram-sha-256\n\
                     host all all 0.0.0.0/0 reject\n\
                     host all all ::/0 reject\n",
                )?;
                settings.extend([
                    "listen_addresses=127.0.0.1".to_owned(),
                    "ssl=on".to_owned(),
                    format!("ssl_cert_file={}", path(&cert_file)),
                    format!("ssl_key_file={}", path(&key_file)),
                    "password_encryption=scram-sha-256".to_owned(),
                ]);
                Some(random_password()?)
            }
        };
        let log = std::fs::File::create(dir.path().join("server.log"))?;
        let mut watchdog = command(user, Path::new("/bin/sh"));
        // A process group of its own: a signal to ours (Ctrl-C, `timeout`, a job
        // control kill) reaches us, and the watchdog then cleans up after us, rather than
        // the server dying with us before the watchdog sees us go.
        std::os::unix::process::CommandExt::process_group(&mut watchdog, 0);
        watchdog
            .args(["-c", WATCHDOG, "confluo-pg-watchdog"])
            .arg(std::process::id().to_string())
            .arg(dir.path())
            .arg(bin.join("postgres"))
            .args(["-D", &path(&data), "-p", &port.to_string()])
            .args(settings.iter().flat_map(|s| ["-c", s.as_str()]))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        let child = watchdog.spawn().context("starting postgres")?;
        let mut local = LocalPostgres {
            bin,
            port,
            dir,
            child,
            user,
            password: None,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = local.child.try_wait()? {
                let log = std::fs::read_to_string(local.dir.path().join("server.log"))
                    .unwrap_or_default();
                bail!("postgres exited ({status}):\n{log}");
            }
            if reachable(&local.options()).await.is_ok() {
                break;
            }
            if Instant::now() > deadline {
                bail!("postgres did not accept connections within 30 s");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        if let Some(password) = password {
            let mut conn = local.options().connect().await?;
            sqlx::query(&format!("ALTER USER postgres PASSWORD '{password}'"))
                .execute(&mut conn)
                .await?;
            conn.close().await?;
            local.password = Some(password);
        }
        Ok(local)
    }

    /// Options to connect as the superuser `postgres`, through the socket.
    pub fn options(&self) -> PgConnectOptions {
        PgConnectOptions::new()
            .socket(self.dir.path())
            .port(self.port)
            .username("postgres")
            .database("postgres")
    }

    /// The same as a URL, for child processes: the socket's directory is the host,
    /// percent-encoded (as sqlx writes it).
    pub fn url(&self) -> String {
        let host: String = path(self.dir.path())
            .bytes()
            .map(|b| match b {
                b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' => char::from(b).to_string(),
                other => format!("%{other:02X}"),
            })
            .collect();
        format!("postgres://postgres@{host}:{}/postgres", self.port)
    }

    /// For a server started [`with TLS`](Self::start_with_tls): options to connect over
    /// TCP to `host` (which must resolve to 127.0.0.1) with the password, without a TLS
    /// mode (the caller sets it). `None` for a socket-only server.
    pub fn tcp_options(&self, host: &str) -> Option<PgConnectOptions> {
        let password = self.password.as_ref()?;
        Some(
            PgConnectOptions::new()
                .host(host)
                .port(self.port)
                .username("postgres")
                .password(password)
                .database("postgres"),
        )
    }

    /// The password of TCP connections (TLS servers only).
    pub fn password(&self) -> Option<&str> {
        self.password.as_deref()
    }

    /// The TCP port (TLS servers), also the number in the socket's name.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The temporary directory: the socket, the data and the server's log.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for LocalPostgres {
    fn drop(&mut self) {
        // A fast shutdown through pg_ctl works whoever the server runs as; the watchdog
        // exits with the server.
        let data = self.dir.path().join("data");
        let mut stop = command(self.user, &self.bin.join("pg_ctl"));
        stop.args(["stop", "-D", &path(&data), "-m", "fast", "-w"])
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if !stop.status().is_ok_and(|s| s.success()) {
            // The watchdog stops the server on TERM.
            let _ = Command::new("kill")
                .args(["-TERM", &self.child.id().to_string()])
                .status();
        }
        let _ = self.child.wait();
        // The temporary directory is removed when `dir` drops, right after this.
    }
}

/// The URL of a throwaway server shared by the whole process (for test binaries): started
/// on first use, stopped and removed by its watchdog when the process exits.
pub fn process_local_url() -> anyhow::Result<String> {
    static LOCAL: std::sync::OnceLock<Result<LocalPostgres, String>> = std::sync::OnceLock::new();
    let local = LOCAL.get_or_init(|| {
        // A runtime of its own, on a thread of its own: callers may be inside one.
        std::thread::spawn(|| {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| e.to_string())?;
            runtime
                .block_on(LocalPostgres::start())
                .map_err(|e| format!("{e:#}"))
        })
        .join()
        .unwrap_or_else(|_| Err("starting the server panicked".to_owned()))
    });
    match local {
        Ok(local) => Ok(local.url()),
        Err(error) => bail!("{error}"),
    }
}

/// 32 random hex digits, from the kernel.
fn random_password() -> anyhow::Result<String> {
    use std::io::Read;
    let mut bytes = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .context("reading /dev/urandom")?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// `program`, run as `user` (uid, gid) when given.
fn command(user: Option<(u32, u32)>, program: &Path) -> Command {
    use std::os::unix::process::CommandExt;
    let mut c = Command::new(program);
    if let Some((uid, gid)) = user {
        c.uid(uid).gid(gid).env("HOME", "/tmp");
    }
    c
}

/// The postgres user's uid and gid, from `id`.
fn postgres_user() -> anyhow::Result<(u32, u32)> {
    let id = |flag: &str| -> anyhow::Result<u32> {
        let out = Command::new("id").args([flag, "postgres"]).output()?;
        anyhow::ensure!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
        Ok(String::from_utf8_lossy(&out.stdout).trim().parse()?)
    };
    Ok((id("-u")?, id("-g")?))
}

fn run(command: &mut Command) -> anyhow::Result<()> {
    let out = command.output()?;
    if !out.status.success() {
        bail!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

fn path(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

/// The directory holding `initdb`, `postgres` and `pg_ctl`: found through the PATH (a
/// symlinked `initdb` leads to the real directory), else the newest of Debian's
/// /usr/lib/postgresql/<version>/bin.
fn server_binaries() -> Option<PathBuf> {
    let complete = |dir: &Path| {
        ["initdb", "postgres", "pg_ctl"]
            .iter()
            .all(|b| dir.join(b).is_file())
    };
    let on_path = std::env::var_os("PATH").into_iter().flat_map(|p| {
        std::env::split_paths(&p)
            .filter_map(|dir| std::fs::canonicalize(dir.join("initdb")).ok())
            .filter_map(|initdb| initdb.parent().map(Path::to_path_buf))
            .collect::<Vec<_>>()
    });
    let mut debian: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| Some((e.file_name().to_str()?.parse().ok()?, e.path().join("bin"))))
        .collect();
    debian.sort();
    on_path
        .chain(debian.into_iter().rev().map(|(_, dir)| dir))
        .find(|dir| complete(dir))
}

fn is_root() -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

fn free_port() -> anyhow::Result<u16> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    Ok(listener.local_addr()?.port())
}

#[cfg(not(feature = "docker"))]
async fn start_container() -> anyhow::Result<Container> {
    bail!(
        "built without the `docker` feature (which brings testcontainers and its gRPC stack): \
         rebuild with `--features docker` to use a container"
    )
}

#[cfg(feature = "docker")]
async fn start_container() -> anyhow::Result<Container> {
    use testcontainers::runners::AsyncRunner;
    use testcontainers::ImageExt;
    let container = tokio::time::timeout(
        Duration::from_secs(180),
        testcontainers_modules::postgres::Postgres::default()
            .with_tag("16-alpine")
            .start(),
    )
    .await
    .context("the container did not start within 180 s")?
    .context("no Docker engine answered")?;
    let host = container.get_host().await?.to_string();
    let port = container.get_host_port_ipv4(5432).await?;
    Ok(Container {
        options: PgConnectOptions::new()
            .host(&host)
            .port(port)
            .username("postgres")
            .password("postgres")
            .database("postgres"),
        _container: container,
    })
}

/// Drops and creates the database `name` on the server of `admin`: a command's own
/// database, so that it never mixes with an application's tables.
pub async fn fresh_database(
    admin: &PgConnectOptions,
    name: &str,
) -> anyhow::Result<PgConnectOptions> {
    create_database(admin, name, true).await
}

/// Creates the database `name` on the server of `admin` unless it exists.
pub async fn existing_database(
    admin: &PgConnectOptions,
    name: &str,
) -> anyhow::Result<PgConnectOptions> {
    create_database(admin, name, false).await
}

async fn create_database(
    admin: &PgConnectOptions,
    name: &str,
    fresh: bool,
) -> anyhow::Result<PgConnectOptions> {
    anyhow::ensure!(
        name.starts_with(|c: char| c.is_ascii_lowercase() || c == '_')
            && name
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'),
        "{name:?}: a database name here must be lowercase letters, digits and underscores, \
         not starting with a digit"
    );
    // From the maintenance database: the URL's own may be the one dropped.
    let mut conn = admin
        .clone()
        .database("postgres")
        .connect()
        .await
        .context("cannot reach PostgreSQL")?;
    if fresh {
        sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
            .execute(&mut conn)
            .await?;
    }
    let exists: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
            .bind(name)
            .fetch_one(&mut conn)
            .await?;
    if !exists {
        sqlx::query(&format!("CREATE DATABASE {name}"))
            .execute(&mut conn)
            .await?;
    }
    conn.close().await?;
    Ok(admin.clone().database(name))
}
