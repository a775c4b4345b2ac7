//! Round trips per completion, measured rather than assumed: the completions of one block
//! go through a forwarding proxy that counts, per connection, each time the client speaks
//! again after the server answered (a turn). Pipelined messages (sqlx sends Parse, Bind,
//! Execute and Sync together) are one turn; `BEGIN`, `COMMIT`, the pool's ping before
//! handing out a connection, and retries after a deadlock all count.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use anyhow::Context;
use sqlx::postgres::PgConnectOptions;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A proxy on a local port in front of the server of `upstream`.
pub struct CountingProxy {
    counts: Arc<Counts>,
    port: u16,
}

#[derive(Default)]
struct Counts {
    turns: AtomicU64,
    pings: AtomicU64,
}

impl CountingProxy {
    pub async fn start(upstream: &PgConnectOptions) -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let counts = Arc::new(Counts::default());
        let target = Upstream::of(upstream);
        let counter = counts.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let (counter, target) = (counter.clone(), target.clone());
                tokio::spawn(async move {
                    if let Ok(server) = target.connect().await {
                        forward(client, server, counter).await;
                    }
                });
            }
        });
        Ok(CountingProxy { counts, port })
    }

    /// `upstream`'s options pointed at the proxy, over TCP. Options that name a Unix
    /// socket (a throwaway server's) cannot just be given another host: sqlx connects to
    /// `socket` whenever it is set, so they are rebuilt without it. The socket trusts, so
    /// the user and database are all they need.
    pub fn options(&self, upstream: &PgConnectOptions) -> PgConnectOptions {
        let options = match upstream.get_socket() {
            None => upstream.clone(),
            Some(_) => PgConnectOptions::new_without_pgpass()
                .username(upstream.get_username())
                .database(upstream.get_database().unwrap_or("postgres")),
        };
        options.host("127.0.0.1").port(self.port)
    }

    pub fn reset(&self) {
        self.counts.turns.store(0, Ordering::SeqCst);
        self.counts.pings.store(0, Ordering::SeqCst);
    }

    /// Round trips since the last reset, and how many of them were the pool's pings.
    pub fn turns(&self) -> (u64, u64) {
        (
            self.counts.turns.load(Ordering::SeqCst),
            self.counts.pings.load(Ordering::SeqCst),
        )
    }
}

#[derive(Clone)]
enum Upstream {
    Tcp(String),
    #[cfg(unix)]
    Socket(std::path::PathBuf),
}

impl Upstream {
    fn of(options: &PgConnectOptions) -> Upstream {
        let (host, port) = (options.get_host(), options.get_port());
        #[cfg(unix)]
        if let Some(dir) = options.get_socket() {
            return Upstream::Socket(dir.join(format!(".s.PGSQL.{port}")));
        }
        #[cfg(unix)]
        if host.starts_with('/') {
            return Upstream::Socket(format!("{host}/.s.PGSQL.{port}").into());
        }
        Upstream::Tcp(format!("{host}:{port}"))
    }

    async fn connect(&self) -> anyhow::Result<Box<dyn Stream>> {
        Ok(match self {
            Upstream::Tcp(addr) => {
                let stream = TcpStream::connect(addr).await.context("proxy upstream")?;
                stream.set_nodelay(true)?;
                Box::new(stream)
            }
            #[cfg(unix)]
            Upstream::Socket(path) => Box::new(tokio::net::UnixStream::connect(path).await?),
        })
    }
}

trait Stream: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Stream for T {}

/// Copies both ways; a client read that follows a server answer (or opens the
/// connection) is a new turn.
async fn forward(client: TcpStream, server: Box<dyn Stream>, counts: Arc<Counts>) {
    let (turns, pings) = (&counts.turns, &counts.pings);
    let _ = client.set_nodelay(true);
    let (mut client_read, mut client_write) = tokio::io::split(client);
    let (mut server_read, mut server_write) = tokio::io::split(server);
    let server_spoke_last = Arc::new(AtomicBool::new(true));
    let spoke = server_spoke_last.clone();
    let upstream = async move {
        let mut buf = vec![0u8; 64 * 1024];
        while let Ok(n @ 1..) = client_read.read(&mut buf).await {
            if spoke.swap(false, Ordering::SeqCst) {
                turns.fetch_add(1, Ordering::SeqCst);
                // A lone Sync message is the pool testing the connection (sqlx pings it
                // when handing it out and again when it is returned).
                if buf[..n] == [b'S', 0, 0, 0, 4] {
                    pings.fetch_add(1, Ordering::SeqCst);
                }
            }
            if server_write.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
        let _ = server_write.shutdown().await;
    };
    let downstream = async move {
        let mut buf = vec![0u8; 64 * 1024];
        while let Ok(n @ 1..) = server_read.read(&mut buf).await {
            server_spoke_last.store(true, Ordering::SeqCst);
            if client_write.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
        let _ = client_write.shutdown().await;
    };
    tokio::join!(upstream, downstream);
}
