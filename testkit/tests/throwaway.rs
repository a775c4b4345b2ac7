//! The throwaway server is reachable by its owner only, and does not outlive the process
//! that started it, even one killed by SIGKILL.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use confluo_testkit::server::LocalPostgres;
use sqlx::Connection;

/// Where the machine has no server binaries there is nothing to test; where it has them
/// (CI: /usr/lib/postgresql), the server must start.
fn binaries_installed() -> bool {
    std::path::Path::new("/usr/lib/postgresql").exists()
}

#[tokio::test]
async fn listens_on_a_private_socket_only() {
    if !binaries_installed() {
        eprintln!("skipped: no PostgreSQL server binaries on this machine");
        return;
    }
    let local = LocalPostgres::start().await.expect("a throwaway server");
    let mut conn = sqlx::PgConnection::connect_with(&local.options())
        .await
        .expect("the socket answers its owner");
    let listen: String = sqlx::query_scalar("SHOW listen_addresses")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(listen, "", "no TCP listener");
    conn.close().await.unwrap();
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", local.port())).is_err(),
        "nothing answers on 127.0.0.1:{}",
        local.port()
    );
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(local.dir()).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o700, "the socket's directory is private");
    assert!(local.tcp_options("127.0.0.1").is_none());
    // The URL child processes are given reaches the same socket.
    let options: sqlx::postgres::PgConnectOptions = local.url().parse().expect("a valid URL");
    let conn = sqlx::PgConnection::connect_with(&options)
        .await
        .expect("the URL connects through the socket");
    conn.close().await.unwrap();
}

/// Run as a child by the test below: starts a server, says where, and waits to be killed.
#[tokio::test]
async fn holder() {
    if std::env::var_os("CONFLUO_TESTKIT_HOLD").is_none() {
        return;
    }
    let local = LocalPostgres::start().await.expect("a throwaway server");
    println!("DIR {}", local.dir().display());
    tokio::time::sleep(Duration::from_secs(600)).await;
    drop(local);
}

#[test]
fn a_sigkilled_owner_leaves_no_server_behind() {
    if !binaries_installed() {
        eprintln!("skipped: no PostgreSQL server binaries on this machine");
        return;
    }
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "holder", "--nocapture", "--test-threads", "1"])
        .env("CONFLUO_TESTKIT_HOLD", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    use std::io::BufRead;
    let stdout = child.stdout.take().unwrap();
    let dir = std::io::BufReader::new(stdout)
        .lines()
        .map_while(Result::ok)
        .find_map(|line| {
            line.split_once("DIR ")
                .map(|(_, dir)| dir.trim().to_owned())
        })
        .expect("the holder names its server's directory");
    let pid_file = std::path::Path::new(&dir).join("data/postmaster.pid");
    assert!(pid_file.exists(), "the server runs");
    let postmaster: u32 = std::fs::read_to_string(&pid_file)
        .unwrap()
        .lines()
        .next()
        .unwrap()
        .parse()
        .unwrap();
    child.kill().unwrap(); // SIGKILL: no Drop runs
    child.wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    while (std::path::Path::new(&format!("/proc/{postmaster}")).exists()
        || std::path::Path::new(&dir).exists())
        && Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        !std::path::Path::new(&format!("/proc/{postmaster}")).exists(),
        "the server (pid {postmaster}) stopped after its owner was killed"
    );
    assert!(!std::path::Path::new(&dir).exists(), "{dir} was removed");
}
