//! A gate in front of one database connection: a proxy that parses the PostgreSQL wire
//! protocol and, when armed, holds each statement the client sends until the explorer
//! releases it. The engine's own code runs unmodified behind it; the explorer only
//! decides which connection's next statement reaches the server next.
//!
//! Turns that cannot affect another transaction pass without being held: the pool's
//! connection test (a lone Sync), `BEGIN` with or without its isolation level (under
//! READ COMMITTED the snapshot is taken by the first statement, not by `BEGIN`), and
//! preparing a statement (Parse/Describe
//! without Execute).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use sqlx::postgres::{PgConnectOptions, PgSslMode};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;

/// What the connection behind a gate is doing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Turn {
    /// Nothing sent and nothing held: the client is computing, or has nothing to say.
    Idle,
    /// A statement is held at the gate, waiting for the explorer (its SQL, shortened).
    Held(String),
    /// Sent to the server, which has not answered yet (running, or waiting on a lock).
    InFlight,
}

#[derive(Default)]
struct State {
    armed: bool,
    held: Option<String>,
    release: bool,
    in_flight: bool,
}

pub struct Gate {
    state: Arc<Mutex<State>>,
    changed: Arc<Notify>,
    port: u16,
}

impl Gate {
    /// A gate listening on a local port, forwarding to `upstream` (over TCP, or to the
    /// Unix socket of a throwaway server).
    pub async fn start(upstream: &PgConnectOptions) -> Gate {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind a port");
        let port = listener.local_addr().unwrap().port();
        let target = Upstream::of(upstream);
        let state = Arc::new(Mutex::new(State::default()));
        let changed = Arc::new(Notify::new());
        let (s, c) = (state.clone(), changed.clone());
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let server = target.connect().await;
                tokio::spawn(forward(client, server, s.clone(), c.clone()));
            }
        });
        Gate {
            state,
            changed,
            port,
        }
    }

    /// `upstream` pointed at the gate (without TLS, so that the gate can read the protocol).
    pub fn options(&self, upstream: &PgConnectOptions) -> PgConnectOptions {
        if upstream.get_socket().is_some() || upstream.get_host().starts_with('/') {
            // A throwaway server's socket (trusted, no password): options set on a socket
            // cannot be pointed at TCP, so build them again.
            let mut options = PgConnectOptions::new()
                .host("127.0.0.1")
                .port(self.port)
                .username(upstream.get_username())
                .ssl_mode(PgSslMode::Disable);
            if let Some(database) = upstream.get_database() {
                options = options.database(database);
            }
            if std::env::var_os("CONFLUO_TEST_ISOLATION").is_some() {
                options = confluo::read_committed(options);
            }
            return options;
        }
        upstream
            .clone()
            .host("127.0.0.1")
            .port(self.port)
            .ssl_mode(PgSslMode::Disable)
    }

    /// While armed, statements are held until [`release`](Self::release)d.
    pub fn arm(&self, armed: bool) {
        let mut state = self.state.lock().unwrap();
        state.armed = armed;
        if !armed && state.held.is_some() {
            state.release = true;
        }
        drop(state);
        self.changed.notify_waiters();
    }

    pub fn turn(&self) -> Turn {
        let state = self.state.lock().unwrap();
        match (&state.held, state.in_flight) {
            (Some(sql), _) if !state.release => Turn::Held(sql.clone()),
            (Some(_), _) | (None, true) => Turn::InFlight,
            (None, false) => Turn::Idle,
        }
    }

    /// Lets the held statement through.
    pub fn release(&self) {
        let mut state = self.state.lock().unwrap();
        assert!(state.held.is_some(), "nothing is held");
        state.release = true;
        drop(state);
        self.changed.notify_waiters();
    }
}

/// One protocol message: its type byte (0 for the untyped startup message) and body.
struct Message {
    kind: u8,
    body: Vec<u8>,
    raw: Vec<u8>,
}

/// Reads whole messages off `buf`, refilled from `read`.
async fn next_message<R: AsyncReadExt + Unpin>(
    read: &mut R,
    buf: &mut Vec<u8>,
    typed: bool,
) -> Option<Message> {
    let header = if typed { 5 } else { 4 };
    loop {
        if buf.len() >= header {
            let at = usize::from(typed);
            let len = u32::from_be_bytes(buf[at..at + 4].try_into().unwrap()) as usize;
            let total = at + len;
            if buf.len() >= total {
                let raw: Vec<u8> = buf.drain(..total).collect();
                return Some(Message {
                    kind: if typed { raw[0] } else { 0 },
                    body: raw[header..].to_vec(),
                    raw,
                });
            }
        }
        let mut chunk = [0u8; 16 * 1024];
        match read.read(&mut chunk).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

fn cstr(bytes: &[u8]) -> (String, &[u8]) {
    let end = bytes.iter().position(|b| *b == 0).unwrap_or(bytes.len());
    (
        String::from_utf8_lossy(&bytes[..end]).into_owned(),
        bytes.get(end + 1..).unwrap_or(&[]),
    )
}

/// The SQL of a statement, on one line and shortened.
fn shorten(sql: &str) -> String {
    let line = sql.split_whitespace().collect::<Vec<_>>().join(" ");
    if line.len() > 70 {
        format!(
            "{}...",
            &line[..line.char_indices().nth(67).map_or(line.len(), |c| c.0)]
        )
    } else {
        line
    }
}

/// Where the gate forwards to.
#[derive(Clone)]
enum Upstream {
    Tcp(String),
    Socket(std::path::PathBuf),
}

trait Stream: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send> Stream for T {}

impl Upstream {
    fn of(options: &PgConnectOptions) -> Upstream {
        let (host, port) = (options.get_host(), options.get_port());
        // A socket directory given as the URL's (percent-encoded) host is `get_socket`.
        if let Some(dir) = options.get_socket() {
            Upstream::Socket(dir.join(format!(".s.PGSQL.{port}")))
        } else if host.starts_with('/') {
            Upstream::Socket(format!("{host}/.s.PGSQL.{port}").into())
        } else {
            Upstream::Tcp(format!("{host}:{port}"))
        }
    }

    async fn connect(&self) -> Box<dyn Stream> {
        match self {
            Upstream::Tcp(addr) => {
                let stream = TcpStream::connect(addr).await.expect("connect upstream");
                let _ = stream.set_nodelay(true);
                Box::new(stream)
            }
            Upstream::Socket(path) => Box::new(
                tokio::net::UnixStream::connect(path)
                    .await
                    .expect("connect upstream"),
            ),
        }
    }
}

async fn forward(
    client: TcpStream,
    server: Box<dyn Stream>,
    state: Arc<Mutex<State>>,
    changed: Arc<Notify>,
) {
    let _ = client.set_nodelay(true);
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = tokio::io::split(server);

    let (up_state, up_changed) = (state.clone(), changed.clone());
    let upstream = async move {
        let mut buf = Vec::new();
        // The startup message has no type byte.
        let Some(startup) = next_message(&mut client_read, &mut buf, false).await else {
            return;
        };
        if server_write.write_all(&startup.raw).await.is_err() {
            return;
        }
        let mut prepared: HashMap<String, String> = HashMap::new();
        let mut turn: Vec<Message> = Vec::new();
        while let Some(message) = next_message(&mut client_read, &mut buf, true).await {
            // Sync, a simple query, Terminate, or an authentication answer ends a turn.
            let ends_turn = matches!(message.kind, b'S' | b'Q' | b'X' | b'p');
            turn.push(message);
            if !ends_turn {
                continue;
            }
            let (summary, local) = describe(&turn, &mut prepared);
            if !local {
                hold(&up_state, &up_changed, summary).await;
            }
            {
                let mut s = up_state.lock().unwrap();
                s.in_flight = turn.last().map(|m| m.kind) != Some(b'X');
            }
            let bytes: Vec<u8> = turn.drain(..).flat_map(|m| m.raw).collect();
            if server_write.write_all(&bytes).await.is_err() {
                return;
            }
        }
    };
    let downstream = async move {
        let mut buf = Vec::new();
        while let Some(message) = next_message(&mut server_read, &mut buf, true).await {
            if client_write.write_all(&message.raw).await.is_err() {
                return;
            }
            if message.kind == b'Z' {
                state.lock().unwrap().in_flight = false;
                changed.notify_waiters();
            }
        }
    };
    tokio::join!(upstream, downstream);
}

/// Holds a turn while the gate is armed, until released.
async fn hold(state: &Mutex<State>, changed: &Notify, summary: String) {
    {
        let mut s = state.lock().unwrap();
        if !s.armed {
            return;
        }
        s.held = Some(summary);
        s.release = false;
    }
    changed.notify_waiters();
    loop {
        let notified = changed.notified();
        {
            let mut s = state.lock().unwrap();
            if s.release || !s.armed {
                s.held = None;
                s.release = false;
                return;
            }
        }
        notified.await;
    }
}

/// What a client turn does, and whether it is local (cannot affect other transactions).
fn describe(turn: &[Message], prepared: &mut HashMap<String, String>) -> (String, bool) {
    let mut sql = None;
    let mut executes = false;
    for m in turn {
        match m.kind {
            b'P' => {
                let (name, rest) = cstr(&m.body);
                let (query, _) = cstr(rest);
                prepared.insert(name, query.clone());
                sql = Some(query);
            }
            b'B' => {
                let (_portal, rest) = cstr(&m.body);
                let (name, _) = cstr(rest);
                if let Some(q) = prepared.get(&name) {
                    sql = Some(q.clone());
                }
            }
            b'E' => executes = true,
            b'Q' => {
                let (query, _) = cstr(&m.body);
                // `BEGIN` and `BEGIN ISOLATION LEVEL READ COMMITTED` (confluo's) alike.
                let begin = query
                    .trim()
                    .get(..5)
                    .is_some_and(|w| w.eq_ignore_ascii_case("BEGIN"));
                return (shorten(&query), begin);
            }
            _ => {}
        }
    }
    match (sql, executes) {
        (Some(q), true) => (shorten(&q), false),
        // A lone Sync (the pool's test), a Terminate, or preparing a statement.
        (q, _) => (q.map(|q| shorten(&q)).unwrap_or_default(), true),
    }
}
