//! The dashboard in a real browser: Debian's headless Chromium, driven over WebDriver
//! (chromedriver) by fantoccini. A map is started from the page's form; its countdown is
//! watched on the page going from its width to zero while the test lets members finish a
//! few at a time; the step after it fails for good, and the dead letter is reprocessed by
//! clicking the page's button until the page shows the execution completed, and both
//! ends' webhook notifications.
//!
//! Without chromedriver on the machine the test says so and passes, unless
//! `CONFLUO_REQUIRE_BROWSER=1` (which `.ci/run` sets, after installing Chromium): then it
//! fails. `CONFLUO_DASHBOARD_SCREENSHOT=path` keeps a screenshot taken mid-countdown (the
//! README's `docs/dashboard.png` comes from it).

mod common;

use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use confluo::{ExecutionId, TaskError, Workflow};
use fantoccini::{Client, ClientBuilder, Locator};
use serde_json::json;

const WIDTH: usize = 40;

/// chromedriver, killed on drop.
struct Driver(Child);

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn find(binary: &str) -> Option<std::path::PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|dir| std::path::Path::new(dir).join(binary))
        .find(|p| p.is_file())
}

/// Headless Chromium through a chromedriver of our own.
async fn browser() -> Option<(Driver, Client)> {
    let required = std::env::var("CONFLUO_REQUIRE_BROWSER").is_ok_and(|v| v == "1");
    let (Some(chromedriver), Some(chromium)) = (
        find("chromedriver"),
        find("chromium").or_else(|| find("chromium-browser")),
    ) else {
        assert!(
            !required,
            "CONFLUO_REQUIRE_BROWSER=1 but chromedriver or chromium is not on the PATH \
             (apt-get install chromium chromium-driver)"
        );
        eprintln!(
            "SKIPPED: no chromedriver and chromium on the PATH (apt-get install chromium \
             chromium-driver); CONFLUO_REQUIRE_BROWSER=1 makes this a failure"
        );
        return None;
    };
    let port = free_port();
    let driver = Driver(
        Command::new(chromedriver)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("chromedriver starts"),
    );
    let mut capabilities = serde_json::Map::new();
    capabilities.insert(
        "goog:chromeOptions".into(),
        json!({
            "binary": chromium,
            "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                     "--disable-dev-shm-usage", "--window-size=1400,1100"],
        }),
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let connector = hyper_util::client::legacy::connect::HttpConnector::new();
        match ClientBuilder::new(connector)
            .capabilities(capabilities.clone())
            .connect(&format!("http://127.0.0.1:{port}"))
            .await
        {
            Ok(client) => return Some((driver, client)),
            Err(error) if Instant::now() < deadline => {
                let _ = error;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(error) => panic!("no WebDriver session: {error}"),
        }
    }
}

/// The text of the first element matching `css`, or `None` when there is none yet.
async fn text(client: &Client, css: &str) -> Option<String> {
    match client.find(Locator::Css(css)).await {
        Ok(element) => element.text().await.ok(),
        Err(_) => None,
    }
}

/// Waits until the element matching `css` has a text for which `done` holds; returns
/// the texts seen on the way (each distinct one once).
async fn watch(client: &Client, css: &str, done: impl Fn(&str) -> bool) -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut seen: Vec<String> = Vec::new();
    loop {
        if let Some(t) = text(client, css).await {
            if seen.last() != Some(&t) {
                seen.push(t.clone());
            }
            if done(&t) {
                return seen;
            }
        }
        assert!(
            Instant::now() < deadline,
            "{css}: never done; saw {seen:?}; page: {}",
            text(client, "main").await.unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_shows_a_countdown_and_reprocesses_a_dead_letter() {
    let Some((_driver, client)) = browser().await else {
        return;
    };
    let engine = common::engine("confluo_serve_browser").await;
    engine
        .register(
            &Workflow::new("browser", 1)
                .stage(confluo::Stage::map("item"))
                // The first output is 0: an empty arm, straight on to `finish`.
                .stage(
                    confluo::Stage::branch("route")
                        .by("/outputs/0")
                        .on("0", Vec::<confluo::Stage>::new())
                        .otherwise(Vec::<confluo::Stage>::new()),
                )
                .step("finish")
                // No delivery loop runs here: the page shows the notifications pending.
                .callback("https://hooks.example.com/browser"),
        )
        .await
        .unwrap();
    // Members wait for the test's permits, so that the page can be watched counting down.
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let failed_once = Arc::new(AtomicBool::new(false));
    let worker = {
        let gate = gate.clone();
        let failed_once = failed_once.clone();
        engine
            .worker()
            .concurrency(WIDTH)
            .handler("browser", "item", move |t| {
                let gate = gate.clone();
                async move {
                    gate.acquire().await.expect("the gate stays open").forget();
                    let item: u64 = t.input_as()?;
                    Ok::<_, TaskError>(json!(item))
                }
            })
            .handler("browser", "finish", move |_| {
                let first = !failed_once.swap(true, Ordering::SeqCst);
                async move {
                    if first {
                        Err(TaskError::permanent("the ledger is closed"))
                    } else {
                        Ok(json!("finished"))
                    }
                }
            })
            .start()
            .await
            .unwrap()
    };
    let port = free_port();
    let config = confluo_serve::Config::new(([127, 0, 0, 1], port).into());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn({
        let engine = engine.clone();
        async move {
            confluo_serve::serve(engine, &config, async {
                let _ = stopped.await;
            })
            .await
        }
    });
    let base = format!("http://127.0.0.1:{port}");

    // Start it from the page's form.
    client.goto(&format!("{base}/")).await.unwrap();
    // The overview says where the auditor workers run by themselves stands.
    let auditor = watch(&client, "#auditor", |t| t.starts_with("Auditor:")).await;
    assert!(
        auditor.last().unwrap().contains("0 unrepaired"),
        "{auditor:?}"
    );
    client
        .wait()
        .for_element(Locator::Css("#start-workflow option[value=browser]"))
        .await
        .unwrap();
    client
        .find(Locator::Css("#start-workflow"))
        .await
        .unwrap()
        .select_by_value("browser")
        .await
        .unwrap();
    let items: Vec<usize> = (0..WIDTH).collect();
    client
        .find(Locator::Css("#start-input"))
        .await
        .unwrap()
        .send_keys(&serde_json::to_string(&items).unwrap())
        .await
        .unwrap();
    client
        .find(Locator::Css("#start-button"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    // The page goes to the new execution.
    let deadline = Instant::now() + Duration::from_secs(30);
    let id = loop {
        let url = client.current_url().await.unwrap();
        if let Some(id) = url.fragment().and_then(|f| f.strip_prefix("/executions/")) {
            break ExecutionId(id.parse().unwrap());
        }
        assert!(Instant::now() < deadline, "the page stayed on {url}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(engine.execution(id).await.unwrap().workflow, "browser");

    // Nothing has finished: the countdown shows the width.
    let seen = watch(&client, "#countdown-0", |t| t == WIDTH.to_string()).await;
    assert_eq!(seen.last().unwrap(), &WIDTH.to_string());
    // Let members through a few at a time, while the page is watched.
    let releasing = tokio::spawn({
        let gate = gate.clone();
        async move {
            for _ in 0..(WIDTH / 5) {
                gate.add_permits(5);
                tokio::time::sleep(Duration::from_millis(700)).await;
            }
        }
    });
    let screenshot = std::env::var_os("CONFLUO_DASHBOARD_SCREENSHOT");
    let mut shot = screenshot.is_some();
    let mut seen: Vec<u64> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while seen.last() != Some(&0) {
        if let Some(n) = text(&client, "#countdown-0")
            .await
            .and_then(|t| t.parse().ok())
        {
            if seen.last() != Some(&n) {
                seen.push(n);
            }
            if shot && n < WIDTH as u64 / 2 {
                let png = client.screenshot().await.unwrap();
                std::fs::write(screenshot.as_ref().unwrap(), png).unwrap();
                shot = false;
            }
        }
        assert!(
            Instant::now() < deadline,
            "the countdown stopped at {seen:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    releasing.await.unwrap();
    // It went down live, through values in between, never up.
    assert!(
        seen.iter().any(|&n| n > 0 && n < WIDTH as u64),
        "the page jumped straight to 0: {seen:?}"
    );
    assert!(seen.windows(2).all(|w| w[0] > w[1]), "{seen:?}");

    // The step after it failed for good: the page shows it, and its dead letter.
    watch(&client, "h1 .status", |t| t == "failed").await;
    client
        .wait()
        .for_element(Locator::Css("button[data-reprocess]"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    watch(&client, "h1 .status", |t| t == "completed").await;
    let output = watch(&client, "#output", |t| t.contains("finished")).await;
    assert!(output.last().unwrap().contains("finished"));
    // Each end (the failure, then the completion) wrote a notification, shown pending.
    let hooks = watch(&client, "#notifications", |t| {
        t.contains("execution.failed") && t.contains("execution.completed")
    })
    .await;
    assert!(hooks.last().unwrap().contains("pending"), "{hooks:?}");
    let done = engine.execution(id).await.unwrap();
    assert_eq!(done.status, confluo::ExecutionStatus::Completed);
    assert_eq!(done.output, Some(json!("finished")));
    // The branch's row says which arm it took, and the value that chose it.
    let branch = watch(&client, "tr[data-stage=\"1\"] td.branch", |t| {
        t.contains("took \"0\"")
    })
    .await;
    assert_eq!(branch.last().unwrap(), "branch: took \"0\"");

    // The other pages render what the API holds.
    client.goto(&format!("{base}/#/workers")).await.unwrap();
    let workers = watch(&client, "[data-worker] .status", |t| t == "alive").await;
    assert_eq!(workers.last().unwrap(), "alive");
    client
        .goto(&format!("{base}/#/dead-letters"))
        .await
        .unwrap();
    watch(&client, "main table tbody", |t| {
        t.contains("no dead letters")
    })
    .await;

    client.close().await.unwrap();
    worker.shutdown().await;
    stop.send(()).unwrap();
    server.await.unwrap().unwrap();
}

/// With a token configured, the page asks for it, and with it reads the API.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_asks_for_the_token() {
    let Some((_driver, client)) = browser().await else {
        return;
    };
    let engine = common::engine("confluo_serve_browser_token").await;
    let port = free_port();
    let config = confluo_serve::Config::new(([127, 0, 0, 1], port).into()).token("s3cret-token");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        confluo_serve::serve(engine, &config, async {
            let _ = stopped.await;
        })
        .await
    });
    client
        .goto(&format!("http://127.0.0.1:{port}/"))
        .await
        .unwrap();
    // The API answered 401: the dialog is open.
    client
        .wait()
        .for_element(Locator::Css("#token-dialog[open]"))
        .await
        .unwrap();
    let input = client.find(Locator::Css("#token-input")).await.unwrap();
    input.send_keys("s3cret-token").await.unwrap();
    client
        .find(Locator::Css("#token-form button"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    // With it, the counts load.
    let running = watch(&client, "#stat-running", |t| t == "0").await;
    assert_eq!(running.last().unwrap(), "0");
    assert!(client
        .find(Locator::Css("#token-dialog[open]"))
        .await
        .is_err());
    client.close().await.unwrap();
    stop.send(()).unwrap();
    server.await.unwrap().unwrap();
}
