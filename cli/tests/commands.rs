//! The CLI's everyday commands against a real database: list, inspect, cancel, doctor,
//! and clear errors for unknown ids, bad flags and unreachable servers.

use std::process::{Command, Output};

use confluo::{Engine, Join, Stage, Workflow};
use sqlx::ConnectOptions;

fn server_url() -> String {
    std::env::var("DATABASE_URL").unwrap_or_else(|_| {
        confluo_testkit::server::process_local_url()
            .expect("no DATABASE_URL, and no throwaway PostgreSQL could start")
    })
}

/// `url` with its database replaced by `database`.
fn with_database(url: &str, database: &str) -> String {
    let (base, query) = url
        .split_once('?')
        .map_or((url, None), |(b, q)| (b, Some(q)));
    let base = base.rsplit_once('/').map_or(base, |(b, _)| b);
    match query {
        Some(q) => format!("{base}/{database}?{q}"),
        None => format!("{base}/{database}"),
    }
}

fn confluo(url: &str, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_confluo"))
        .args(["--database-url", url])
        .args(args)
        .output()
        .expect("run confluo")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// A fresh empty database on the test server; returns an admin connection and its URL.
async fn fresh_database(database: &str) -> (sqlx::PgConnection, String) {
    let mut admin = server_url()
        .parse::<sqlx::postgres::PgConnectOptions>()
        .unwrap()
        .connect()
        .await
        .expect("DATABASE_URL reachable");
    sqlx::query(&format!("DROP DATABASE IF EXISTS {database} WITH (FORCE)"))
        .execute(&mut admin)
        .await
        .unwrap();
    sqlx::query(&format!("CREATE DATABASE {database}"))
        .execute(&mut admin)
        .await
        .unwrap();
    (admin, with_database(&server_url(), database))
}

#[tokio::test]
async fn list_inspect_cancel_and_doctor() {
    let database = "confluo_cli_commands_test";
    let (mut admin, url) = fresh_database(database).await;

    let migrated = confluo(&url, &["migrate"]);
    assert!(migrated.status.success(), "{}", text(&migrated));
    let engine = Engine::connect(&url).await.unwrap();
    engine
        .register(
            &Workflow::new("orders", 1)
                .step("charge")
                .stage(Stage::map("ship")),
        )
        .await
        .unwrap();
    let first = engine
        .start("orders", &serde_json::json!({"n": 1}))
        .await
        .unwrap();
    let second = engine
        .start("orders", &serde_json::json!({"n": 2}))
        .await
        .unwrap();

    let listed = confluo(&url, &["list", "--workflow", "orders"]);
    assert!(listed.status.success(), "{}", text(&listed));
    let out = text(&listed);
    assert!(
        out.contains(&first.to_string()) && out.contains(&second.to_string()),
        "{out}"
    );
    assert!(out.contains("2 executions"), "{out}");

    let inspected = confluo(&url, &["inspect", &first.to_string()]);
    assert!(inspected.status.success(), "{}", text(&inspected));
    let out = text(&inspected);
    assert!(
        out.contains("orders v1, running") && out.contains("charge"),
        "{out}"
    );

    let json = confluo(&url, &["inspect", &first.to_string(), "--json"]);
    let value: serde_json::Value = serde_json::from_slice(&json.stdout).expect("JSON");
    assert_eq!(value["status"], "running");

    let cancelled = confluo(&url, &["cancel", &first.to_string()]);
    assert!(cancelled.status.success(), "{}", text(&cancelled));
    let again = confluo(&url, &["cancel", &first.to_string()]);
    assert_eq!(again.status.code(), Some(1), "{}", text(&again));
    assert!(text(&again).contains("is cancelled"), "{}", text(&again));
    let again = confluo(&url, &["cancel", &first.to_string(), "--json"]);
    let value: serde_json::Value = serde_json::from_slice(&again.stdout).expect("JSON");
    assert_eq!(
        (value["cancelled"].clone(), value["status"].clone()),
        (false.into(), "cancelled".into())
    );

    let only_running = confluo(&url, &["list", "--status", "running", "--json"]);
    let value: serde_json::Value = serde_json::from_slice(&only_running.stdout).expect("JSON");
    assert_eq!(value.as_array().map(Vec::len), Some(1));
    assert_eq!(value[0]["id"], second.to_string());

    // The cancelled one's task leaves the task table, and it reads the same.
    let waiting = confluo(&url, &["archive", "--dry-run"]);
    assert!(
        text(&waiting).contains("1 ended executions still have their 1 tasks"),
        "{}",
        text(&waiting)
    );
    let too_young = confluo(&url, &["archive", "--older-than", "1h", "--json"]);
    let value: serde_json::Value = serde_json::from_slice(&too_young.stdout).expect("JSON");
    assert_eq!(value["executions"], 0, "{}", text(&too_young));
    let archived = confluo(&url, &["archive", "--older-than", "0s"]);
    assert!(
        text(&archived).contains("moved the 1 tasks of 1 ended executions"),
        "{}",
        text(&archived)
    );
    let inspected = confluo(&url, &["inspect", &first.to_string(), "--json"]);
    let value: serde_json::Value = serde_json::from_slice(&inspected.stdout).expect("JSON");
    assert_eq!(value["stages"][0]["cancelled"], 1, "{value}");

    // Retention: only terminal executions older than the cutoff go.
    let kept = confluo(&url, &["purge", "--older-than", "1h"]);
    assert!(text(&kept).contains("deleted 0"), "{}", text(&kept));
    sqlx::query(
        "UPDATE confluo.execution SET finished_at = now() - interval '2 days' WHERE id = $1",
    )
    .bind(first)
    .execute(engine.pool())
    .await
    .unwrap();
    let dry = confluo(&url, &["purge", "--older-than", "1d", "--dry-run"]);
    assert!(
        text(&dry).contains("would delete 1 ") && text(&dry).contains("nothing deleted"),
        "{}",
        text(&dry)
    );
    let purged = confluo(
        &url,
        &["purge", "--older-than", "1d", "--batch", "1", "--json"],
    );
    let value: serde_json::Value = serde_json::from_slice(&purged.stdout).expect("JSON");
    assert_eq!(value["deleted"], 1, "{}", text(&purged));
    let left = confluo(&url, &["list", "--json"]);
    let value: serde_json::Value = serde_json::from_slice(&left.stdout).expect("JSON");
    assert_eq!(
        value.as_array().map(Vec::len),
        Some(1),
        "the running one stays"
    );
    let bad_age = confluo(&url, &["purge", "--older-than", "soon"]);
    assert!(
        text(&bad_age).contains("expected e.g. 30d"),
        "{}",
        text(&bad_age)
    );

    // A stage's join rule, and where it stands.
    engine
        .register(
            &Workflow::new("quotes", 1)
                .stage(Stage::parallel("ask", ["a", "b", "c"]).join(Join::Any))
                .step("buy"),
        )
        .await
        .unwrap();
    let quote = engine
        .start("quotes", &serde_json::json!(null))
        .await
        .unwrap();
    let inspected = confluo(&url, &["inspect", &quote.to_string()]);
    assert!(
        text(&inspected).contains("joins any of 3: waits for 1 more to complete"),
        "{}",
        text(&inspected)
    );
    let inspected = confluo(&url, &["inspect", &quote.to_string(), "--json"]);
    let value: serde_json::Value = serde_json::from_slice(&inspected.stdout).expect("JSON");
    assert_eq!(value["stages"][0]["quorum"], 1, "{value}");

    let doctor = confluo(&url, &["doctor"]);
    assert!(doctor.status.success(), "{}", text(&doctor));
    assert!(text(&doctor).contains("healthy"));

    // Clear errors.
    let unknown = confluo(&url, &["inspect", "7c3f1e2a-0000-4000-8000-000000000000"]);
    assert_eq!(unknown.status.code(), Some(2));
    assert!(text(&unknown).contains("not found"), "{}", text(&unknown));
    let bad_id = confluo(&url, &["inspect", "not-a-uuid"]);
    assert!(!bad_id.status.success());
    assert!(text(&bad_id).contains("invalid value"), "{}", text(&bad_id));
    let bad_status = confluo(&url, &["list", "--status", "sleeping"]);
    assert!(
        text(&bad_status).contains("unknown execution status"),
        "{}",
        text(&bad_status)
    );
    // No panics: an age beyond any duration, one reaching before the earliest date, a
    // reader that went away.
    let too_long = confluo(&url, &["purge", "--older-than", "99999999999999d"]);
    assert_eq!(too_long.status.code(), Some(2), "{}", text(&too_long));
    assert!(text(&too_long).contains("too long"), "{}", text(&too_long));
    let too_old = confluo(&url, &["purge", "--older-than", "106751990d"]);
    assert_eq!(too_old.status.code(), Some(2), "{}", text(&too_old));
    assert!(
        text(&too_old).contains("nothing to purge"),
        "{}",
        text(&too_old)
    );
    let mut closed = Command::new(env!("CARGO_BIN_EXE_confluo"))
        .args(["--database-url", &url, "list"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(closed.stdout.take()); // the reader is gone before the first line
    let closed = closed.wait_with_output().unwrap();
    assert_eq!(
        closed.status.code(),
        Some(141),
        "{}",
        String::from_utf8_lossy(&closed.stderr)
    );
    assert!(
        closed.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&closed.stderr)
    );

    let unreachable = confluo("postgres://postgres@127.0.0.1:1/postgres", &["list"]);
    assert_eq!(unreachable.status.code(), Some(2));
    assert!(
        text(&unreachable)
            .contains("cannot connect to PostgreSQL at 127.0.0.1:1/postgres: connection refused"),
        "{}",
        text(&unreachable)
    );

    engine.pool().close().await;
    sqlx::query(&format!("DROP DATABASE IF EXISTS {database} WITH (FORCE)"))
        .execute(&mut admin)
        .await
        .unwrap();
}

#[tokio::test]
async fn dead_letters_list_show_and_reprocess() {
    use confluo::RetryPolicy;
    use std::time::Duration;
    let database = "confluo_cli_dead_letters_test";
    let (mut admin, url) = fresh_database(database).await;
    let engine = Engine::connect(&url).await.unwrap();
    engine.migrate().await.unwrap();
    engine
        .register(
            &Workflow::new("charge", 1)
                .stage(Stage::step("charge").retry(RetryPolicy::none()))
                .step("receipt"),
        )
        .await
        .unwrap();
    let id = engine
        .start("charge", &serde_json::json!({"cents": 500}))
        .await
        .unwrap();
    let task = engine
        .claim("test", 1, Duration::from_secs(60))
        .await
        .unwrap()
        .remove(0);
    engine.fail(&task, "card declined", true).await.unwrap();

    let listed = confluo(&url, &["dead-letters", "list"]);
    assert!(listed.status.success(), "{}", text(&listed));
    let out = text(&listed);
    assert!(
        out.contains(&task.id().to_string())
            && out.contains("card declined")
            && out.contains("failed"),
        "{out}"
    );
    let shown = confluo(
        &url,
        &["dead-letters", "show", &task.id().to_string(), "--json"],
    );
    let value: serde_json::Value = serde_json::from_slice(&shown.stdout).expect("JSON");
    assert_eq!(value["errors"][0]["error"], "card declined");
    assert_eq!(value["execution_id"], id.to_string());

    // The timeline with its members: status, attempts, the last error.
    let members = confluo(&url, &["inspect", &id.to_string(), "--members"]);
    let out = text(&members);
    assert!(
        out.contains("stage 0 \"charge\": 1 of 1 members")
            && out.contains("dead")
            && out.contains("card declined"),
        "{out}"
    );
    let members = confluo(&url, &["inspect", &id.to_string(), "--members=5", "--json"]);
    let value: serde_json::Value = serde_json::from_slice(&members.stdout).expect("JSON");
    assert_eq!(value["members"][0][0]["status"], "dead");
    assert_eq!(value["stages"][0]["attempts"], 1);

    let reprocessed = confluo(&url, &["dead-letters", "reprocess", &task.id().to_string()]);
    assert!(reprocessed.status.success(), "{}", text(&reprocessed));
    assert!(
        text(&reprocessed).contains(&format!("execution {id} resumed")),
        "{}",
        text(&reprocessed)
    );
    assert_eq!(
        engine.status(id).await.unwrap(),
        confluo::ExecutionStatus::Running
    );
    let again = confluo(&url, &["dead-letters", "reprocess", &task.id().to_string()]);
    assert_eq!(again.status.code(), Some(1), "{}", text(&again));
    assert!(
        text(&again).contains("is pending, not dead-lettered"),
        "{}",
        text(&again)
    );
    let none = confluo(&url, &["dead-letters", "reprocess", "--all"]);
    assert!(text(&none).contains("0 reprocessed"), "{}", text(&none));
    let unknown = confluo(
        &url,
        &[
            "dead-letters",
            "show",
            "7c3f1e2a-0000-4000-8000-000000000000",
        ],
    );
    assert_eq!(unknown.status.code(), Some(2));
    assert!(text(&unknown).contains("not found"), "{}", text(&unknown));

    // Deadlines: a timed-out execution is listed as such.
    let late = engine
        .start_with(
            "charge",
            &serde_json::json!({}),
            confluo::StartOptions::new().deadline(Duration::from_millis(1)),
        )
        .await
        .unwrap()
        .id;
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(engine.time_out_expired(10).await.unwrap(), vec![late]);
    let timed_out = confluo(&url, &["list", "--status", "timed_out", "--json"]);
    let value: serde_json::Value = serde_json::from_slice(&timed_out.stdout).expect("JSON");
    assert_eq!(value[0]["id"], late.to_string());
    let inspected = confluo(&url, &["inspect", &late.to_string()]);
    assert!(text(&inspected).contains("timed_out") && text(&inspected).contains("deadline"));

    engine.pool().close().await;
    sqlx::query(&format!("DROP DATABASE IF EXISTS {database} WITH (FORCE)"))
        .execute(&mut admin)
        .await
        .unwrap();
}

#[test]
fn demo_runs_on_the_configured_server_or_a_throwaway_one() {
    let configured = confluo(
        &server_url(),
        &[
            "demo",
            "--width",
            "200",
            "--database",
            "confluo_cli_demo_test",
        ],
    );
    assert!(configured.status.success(), "{}", text(&configured));
    let out = text(&configured);
    assert!(out.contains("using PostgreSQL at"), "{out}");
    assert!(out.contains("dispatched: exactly once"), "{out}");
    // It says how to look at the run again, and those commands find it.
    let inspect = out
        .lines()
        .find_map(|l| l.trim().strip_prefix("confluo inspect "))
        .expect("the demo prints an inspect command");
    let args: Vec<&str> = std::iter::once("inspect")
        .chain(inspect.split_whitespace())
        .collect();
    let again = confluo(&server_url(), &args);
    assert!(again.status.success(), "{}", text(&again));
    assert!(text(&again).contains("completed"), "{}", text(&again));
    let dead = out
        .lines()
        .find_map(|l| l.trim().strip_prefix("confluo dead-letters "))
        .expect("the demo prints a dead-letters command");
    let args: Vec<&str> = std::iter::once("dead-letters")
        .chain(dead.split_whitespace())
        .collect();
    let listed = confluo(&server_url(), &args);
    assert!(listed.status.success(), "{}", text(&listed));

    // With no server configured, a throwaway one (or a clear message where none can start).
    let throwaway = Command::new(env!("CARGO_BIN_EXE_confluo"))
        .args(["demo", "--width", "100"])
        .env_remove("DATABASE_URL")
        .output()
        .unwrap();
    let out = text(&throwaway);
    // Where the server binaries are installed, the throwaway server must work.
    let binaries = std::path::Path::new("/usr/lib/postgresql").exists();
    assert!(
        throwaway.status.success() || !binaries,
        "PostgreSQL's binaries are installed, yet: {out}"
    );
    if throwaway.status.success() {
        assert!(out.contains("started a throwaway PostgreSQL"), "{out}");
        assert!(out.contains("dispatched: exactly once"), "{out}");
        let dir = out
            .split("data in ")
            .nth(1)
            .and_then(|rest| rest.split(',').next())
            .expect("the data directory is named");
        assert!(
            !std::path::Path::new(dir).exists(),
            "{dir} is removed at exit"
        );
    } else {
        assert!(
            out.contains("no throwaway server could be started") && out.contains("DATABASE_URL"),
            "{out}"
        );
    }
    // A deadline shorter than the work: the execution is timed out by the worker's sweep.
    let late = confluo(
        &server_url(),
        &[
            "demo",
            "--width",
            "50000",
            "--workers",
            "1",
            "--deadline",
            "1s",
            "--database",
            "confluo_cli_demo_test",
        ],
    );
    assert_eq!(late.status.code(), Some(1), "{}", text(&late));
    let out = text(&late);
    assert!(
        out.contains("timed_out") && out.contains("passed its deadline"),
        "{out}"
    );

    // More workers than the server has connections for: refused before any starts.
    let crowded = confluo(
        &server_url(),
        &[
            "demo",
            "--width",
            "10",
            "--workers",
            "10000",
            "--database",
            "confluo_cli_demo_test",
        ],
    );
    assert_eq!(crowded.status.code(), Some(2), "{}", text(&crowded));
    let out = text(&crowded);
    assert!(
        out.contains("--workers 10000 needs 50000 connections")
            && out.contains("raise max_connections"),
        "{out}"
    );

    let unreachable = confluo(
        "postgres://postgres@127.0.0.1:1/postgres",
        &[
            "demo",
            "--width",
            "10",
            "--database",
            "confluo_cli_demo_test",
        ],
    );
    assert!(
        text(&unreachable).contains("127.0.0.1:1 does not answer"),
        "{}",
        text(&unreachable)
    );
}

/// `confluo bench` on the throwaway server it starts when none is configured: every
/// phase, the round trips through the counting proxy included, must reach the server's
/// Unix socket (the proxy once tried the socket's directory with its own port).
#[test]
fn bench_runs_on_a_throwaway_server() {
    if !std::path::Path::new("/usr/lib/postgresql").exists() {
        eprintln!("skipped: no PostgreSQL binaries to start a throwaway server from");
        return;
    }
    let out_dir = tempfile::tempdir().unwrap();
    let run = Command::new(env!("CARGO_BIN_EXE_confluo"))
        .args([
            "bench",
            "--widths",
            "20",
            "--finishers",
            "2",
            "--budget",
            "0.5",
        ])
        .args(["--strategies", "floor,countdown", "--out"])
        .arg(out_dir.path())
        .env_remove("DATABASE_URL")
        .output()
        .unwrap();
    let out = text(&run);
    assert!(run.status.success(), "{out}");
    assert!(out.contains("started a throwaway PostgreSQL"), "{out}");
    let results = std::fs::read_to_string(out_dir.path().join("results.json")).unwrap();
    assert!(results.contains("countdown"), "{results}");
}

#[test]
fn no_database_configured_says_how_to_point_at_one() {
    let out = Command::new(env!("CARGO_BIN_EXE_confluo"))
        .arg("list")
        .env_remove("DATABASE_URL")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out).contains("--database-url or set DATABASE_URL"),
        "{}",
        text(&out)
    );
}

/// GET `path` from `addr` over plain HTTP/1.0; the body.
fn http_get(addr: &str, path: &str) -> std::io::Result<String> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr)?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    Ok(response)
}

/// Starts a demo execution of `width` members once the worker process has migrated and
/// registered the demo workflow, and waits for it to complete.
async fn run_a_demo_execution(engine: &Engine, worker: &mut std::process::Child, width: u64) {
    use std::time::Duration;
    let id = loop {
        match engine.start("demo-orders", &width).await {
            Ok(id) => break id,
            Err(_) if worker.try_wait().unwrap().is_none() => {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            Err(e) => panic!("the worker exited: {e}"),
        }
    };
    let done = engine.wait(id, Duration::from_secs(60)).await.unwrap();
    assert_eq!(done.status, confluo::ExecutionStatus::Completed);
}

/// Sends SIGTERM, expects a clean exit; the process's stderr.
fn stop_gracefully(worker: std::process::Child) -> String {
    let killed = Command::new("kill")
        .args(["-TERM", &worker.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let out = worker.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{stderr}");
    stderr
}

#[tokio::test(flavor = "multi_thread")]
async fn a_worker_process_serves_prometheus_metrics_and_stops_gracefully() {
    use std::time::Duration;
    let database = "confluo_cli_worker_test";
    let (mut admin, url) = fresh_database(database).await;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    let mut worker = Command::new(env!("CARGO_BIN_EXE_confluo"))
        .args(["--database-url", &url, "worker", "--metrics", &addr])
        .args(["--fail-every", "5"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let engine = Engine::connect(&url).await.unwrap();
    run_a_demo_execution(&engine, &mut worker, 20).await;

    // Counters move right after each commit: poll until the last ones show.
    let mut metrics = String::new();
    for _ in 0..100 {
        metrics = http_get(&addr, "/metrics").expect("the metrics endpoint answers");
        if metrics.contains("confluo_groups_fired_total 3") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for expected in [
        "confluo_tasks_total{outcome=\"completed\"}",
        "confluo_tasks_total{outcome=\"dead_lettered\"} 4",
        "confluo_tasks_total{outcome=\"retry_scheduled\"}",
        "confluo_groups_fired_total 3",
        "confluo_tasks_claimed_total",
        "confluo_claim_duration_seconds",
        "confluo_task_wait_seconds",
        "confluo_handler_duration_seconds",
        "handler=\"process\"",
        "confluo_fan_in_seconds",
        "confluo_queue_depth{state=\"due\"}",
    ] {
        assert!(metrics.contains(expected), "no {expected} in:\n{metrics}");
    }

    // SIGTERM: a graceful stop.
    assert!(stop_gracefully(worker).contains("stopped"));

    engine.pool().close().await;
    sqlx::query(&format!("DROP DATABASE IF EXISTS {database} WITH (FORCE)"))
        .execute(&mut admin)
        .await
        .unwrap();
}

/// `confluo worker --transaction-pooler --direct-url`: its pools go through the pooler
/// (PgBouncer when `CONFLUO_TEST_PGBOUNCER` names one, else the server itself, which
/// the pooler's statements work on too), its migrations and `LISTEN` over the direct URL.
#[tokio::test(flavor = "multi_thread")]
async fn a_worker_process_behind_a_transaction_pooler_migrates_over_the_direct_url() {
    let database = "confluo_cli_pooled_worker_test";
    let (mut admin, direct) = fresh_database(database).await;
    let pooled = match std::env::var("CONFLUO_TEST_PGBOUNCER") {
        Ok(bouncer) => with_database(&bouncer, database),
        Err(_) => direct.clone(),
    };
    // The direct URL without the pooler flag is refused, saying what it needs.
    let lone = confluo(&pooled, &["worker", "--direct-url", &direct]);
    assert!(!lone.status.success());
    assert!(
        text(&lone).contains("--transaction-pooler"),
        "{}",
        text(&lone)
    );
    let mut worker = Command::new(env!("CARGO_BIN_EXE_confluo"))
        .args(["--database-url", &pooled, "worker", "--transaction-pooler"])
        .args(["--fail-every", "0"])
        .env("CONFLUO_DIRECT_URL", &direct)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let engine = Engine::connect(&direct).await.unwrap();
    run_a_demo_execution(&engine, &mut worker, 50).await;
    let stderr = stop_gracefully(worker);
    assert!(stderr.contains("through a transaction pooler"), "{stderr}");
    assert!(!stderr.contains("not migrating"), "{stderr}");

    engine.pool().close().await;
    sqlx::query(&format!("DROP DATABASE IF EXISTS {database} WITH (FORCE)"))
        .execute(&mut admin)
        .await
        .unwrap();
}
