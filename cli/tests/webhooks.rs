//! A webhook across a SIGKILLed worker: the worker posts the notification of an ended
//! execution, the receiver holds the request without answering, the worker is killed;
//! another worker delivers it once the cut-off attempt's time is up. At least once, with
//! one idempotency key.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use confluo::StartOptions;

fn server_url() -> String {
    std::env::var("DATABASE_URL").unwrap_or_else(|_| {
        confluo_testkit::server::process_local_url()
            .expect("no DATABASE_URL, and no throwaway PostgreSQL could start")
    })
}

/// Reads one request's head and body; returns its idempotency key.
fn read_request(stream: &mut std::net::TcpStream) -> Option<String> {
    let mut buffer = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let n = stream.read(&mut chunk).ok()?;
        if n == 0 {
            return None;
        }
        buffer.extend_from_slice(&chunk[..n]);
        let text = String::from_utf8_lossy(&buffer).into_owned();
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let header = |name: &str| {
                head.lines().find_map(|l| {
                    let (n, v) = l.split_once(':')?;
                    n.eq_ignore_ascii_case(name).then(|| v.trim().to_owned())
                })
            };
            let length: usize = header("content-length")?.parse().ok()?;
            if body.len() >= length {
                return header("confluo-idempotency-key");
            }
        }
    }
}

/// A receiver whose first request is held open forever; later ones get a 200. Returns its
/// URL and the keys received.
fn receiver() -> (String, Arc<Mutex<Vec<String>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/hook", listener.local_addr().unwrap());
    let keys = Arc::new(Mutex::new(Vec::new()));
    let seen = keys.clone();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let Some(key) = read_request(&mut stream) else {
                continue;
            };
            let first = {
                let mut keys = seen.lock().unwrap();
                keys.push(key);
                keys.len() == 1
            };
            if first {
                held.push(stream); // never answered
            } else {
                let _ = stream.write_all(
                    b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
                );
            }
        }
    });
    (url, keys)
}

fn worker(url: &str) -> Child {
    Command::new(env!("CARGO_BIN_EXE_confluo"))
        .env("DATABASE_URL", url)
        .args(["worker", "--allow-private-webhooks", "--fail-every", "0"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_webhook_survives_a_sigkilled_worker() {
    let admin: sqlx::postgres::PgConnectOptions = server_url().parse().unwrap();
    let options = confluo_testkit::fresh_database(&admin, "confluo_cli_webhooks_test")
        .await
        .unwrap();
    let database_url = {
        let base = server_url();
        let (base, query) = base
            .split_once('?')
            .map_or((base.as_str(), None), |(b, q)| (b, Some(q)));
        let base = base.rsplit_once('/').map_or(base, |(b, _)| b);
        match query {
            Some(q) => format!("{base}/confluo_cli_webhooks_test?{q}"),
            None => format!("{base}/confluo_cli_webhooks_test"),
        }
    };
    let engine = confluo::ConnectBuilder::from_options(options)
        .max_connections(2)
        .connect()
        .await
        .unwrap();
    let (hook, keys) = receiver();
    let mut first = worker(&database_url);
    // The worker migrates and registers the demo workflow.
    let deadline = Instant::now() + Duration::from_secs(60);
    let id = loop {
        let options = StartOptions::new().callback(&hook);
        match engine.start_with("demo-orders", &5, options).await {
            Ok(started) => break started.id,
            Err(e) => {
                assert!(
                    Instant::now() < deadline,
                    "the worker never registered: {e}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    let done = engine.wait(id, Duration::from_secs(60)).await.unwrap();
    assert_eq!(done.status, confluo::ExecutionStatus::Completed);
    // The worker posted it and waits for an answer that does not come: kill it.
    let deadline = Instant::now() + Duration::from_secs(30);
    while keys.lock().unwrap().is_empty() {
        assert!(Instant::now() < deadline, "the worker never posted");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    first.kill().unwrap();
    first.wait().unwrap();
    let cut_off = engine.notifications(id).await.unwrap().remove(0);
    assert_eq!((cut_off.status.as_str(), cut_off.attempts), ("pending", 1));

    // Another worker delivers it once the cut-off attempt's time (10 s timeout + 5 s) is up.
    let mut second = worker(&database_url);
    let deadline = Instant::now() + Duration::from_secs(60);
    let delivered = loop {
        let n = engine.notifications(id).await.unwrap().remove(0);
        if n.status == "delivered" {
            break n;
        }
        assert!(Instant::now() < deadline, "never delivered: {n:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    second.kill().unwrap();
    second.wait().unwrap();
    assert_eq!(delivered.attempts, 2);
    let keys = keys.lock().unwrap().clone();
    assert_eq!(
        keys,
        vec![delivered.id.to_string(), delivered.id.to_string()]
    );
    engine.pool().close().await;
}
