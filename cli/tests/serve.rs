//! `confluo serve` as a process: it serves the API with its demo running until SIGTERM,
//! then stops gracefully; it refuses to listen beyond loopback without a token.

use std::io::{Read, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn server_url() -> String {
    std::env::var("DATABASE_URL").unwrap_or_else(|_| {
        confluo_testkit::server::process_local_url()
            .expect("no DATABASE_URL, and no throwaway PostgreSQL could start")
    })
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// GET `path` over HTTP/1.0: the status line's code and the body.
fn get(addr: &str, path: &str) -> std::io::Result<(u16, String)> {
    let mut stream = std::net::TcpStream::connect(addr)?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let status = response
        .get(9..12)
        .and_then(|s| s.parse().ok())
        .unwrap_or_default();
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Ok((status, body))
}

#[test]
fn serve_runs_the_demo_until_sigterm() {
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let mut serve = Command::new(env!("CARGO_BIN_EXE_confluo"))
        .env("DATABASE_URL", server_url())
        .args(["serve", "--listen", &addr, "--demo", "--demo-width", "200"])
        .args(["--database", "confluo_cli_serve_test"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The demo's executions complete one after another; the API counts them.
    let deadline = Instant::now() + Duration::from_secs(90);
    let stats = loop {
        assert!(
            serve.try_wait().unwrap().is_none(),
            "serve exited: {:?}",
            serve.wait_with_output().unwrap()
        );
        if let Ok((200, body)) = get(&addr, "/api/v1/stats") {
            let stats: serde_json::Value = serde_json::from_str(&body).unwrap();
            if stats["executions"]["completed"].as_u64() >= Some(1) {
                break stats;
            }
        }
        assert!(Instant::now() < deadline, "no demo execution completed");
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(stats["workers"]["alive"], 2, "{stats}");
    let (status, ready) = get(&addr, "/api/v1/ready").unwrap();
    assert_eq!((status, ready.as_str()), (200, r#"{"status":"ready"}"#));

    let killed = Command::new("kill")
        .args(["-TERM", &serve.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let out = serve.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("stopped"), "{stderr}");
    assert!(
        get(&addr, "/api/v1/health").is_err(),
        "still listening after it stopped"
    );
}

#[test]
fn serve_refuses_the_network_without_a_token() {
    let out = Command::new(env!("CARGO_BIN_EXE_confluo"))
        .env("DATABASE_URL", server_url())
        .env_remove("CONFLUO_API_TOKEN")
        .args(["serve", "--listen", &format!("0.0.0.0:{}", free_port())])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("CONFLUO_API_TOKEN"), "{stderr}");
    // With one, it would serve; an empty one is refused too.
    let out = Command::new(env!("CARGO_BIN_EXE_confluo"))
        .env("DATABASE_URL", server_url())
        .env("CONFLUO_API_TOKEN", " ")
        .args(["serve", "--listen", &format!("0.0.0.0:{}", free_port())])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("token is empty"), "{stderr}");
}

/// `--database` names an existing database: a missing one is an error, never created
/// (the demo's own database apart).
#[test]
fn serve_creates_no_database_it_is_pointed_at() {
    for _ in 0..2 {
        let mut serve = Command::new(env!("CARGO_BIN_EXE_confluo"))
            .env("DATABASE_URL", server_url())
            .args(["serve", "--listen", &format!("127.0.0.1:{}", free_port())])
            .args(["--database", "confluo_cli_no_such_database"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // It must stop by itself; one that serves (having created the database) is
        // killed and fails the test.
        let deadline = Instant::now() + Duration::from_secs(30);
        while serve.try_wait().unwrap().is_none() {
            if Instant::now() > deadline {
                serve.kill().unwrap();
                panic!("serve kept running on a database it should not have found");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let out = serve.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{stderr}");
        assert!(stderr.contains("does not exist"), "{stderr}");
    }
}
