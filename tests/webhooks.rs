//! Webhooks through the outbox, against a real PostgreSQL and a local receiver: an end is
//! announced once per end, signed, with its idempotency key; a receiver that is down, slow
//! and answering 500s gets it at least once; a delivery loop that dies mid-attempt leaves
//! it to another; an end whose transaction rolls back announces nothing; private targets
//! are refused unless allowed.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{eventually, quick_worker, TestDb};
use confluo::{Engine, ExecutionId, ExecutionStatus, Notification, StartOptions, Workflow};
use hmac::Mac;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// What the receiver does with the next request.
#[derive(Clone, Copy, Debug)]
enum Answer {
    Status(u16),
    /// Holds the connection open without answering.
    Hang,
}

/// One request as received.
#[derive(Debug, Clone)]
struct Received {
    headers: Vec<(String, String)>,
    body: Value,
}

impl Received {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// A minimal HTTP/1.1 receiver: answers each request with the next scripted answer (200
/// once the script is used up) and records what it got.
#[derive(Clone)]
struct Receiver {
    url: String,
    port: u16,
    script: Arc<Mutex<Vec<Answer>>>,
    got: Arc<Mutex<Vec<Received>>>,
}

impl Receiver {
    /// A receiver on a port of its own, listening at once unless `down`.
    async fn start(
        script: Vec<Answer>,
        down: bool,
    ) -> (Receiver, Option<tokio::task::JoinHandle<()>>) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        drop(listener);
        let receiver = Receiver {
            url: format!("http://127.0.0.1:{port}/hooks/confluo"),
            port,
            script: Arc::new(Mutex::new(script.into_iter().rev().collect())),
            got: Arc::new(Mutex::new(Vec::new())),
        };
        let task = (!down).then(|| receiver.listen());
        (receiver, task)
    }

    fn listen(&self) -> tokio::task::JoinHandle<()> {
        let me = self.clone();
        let listener = std::net::TcpListener::bind(("127.0.0.1", self.port)).unwrap();
        listener.set_nonblocking(true).unwrap();
        let listener = tokio::net::TcpListener::from_std(listener).unwrap();
        tokio::spawn(async move {
            loop {
                let (stream, _) = listener.accept().await.unwrap();
                let me = me.clone();
                tokio::spawn(async move { me.serve(stream).await });
            }
        })
    }

    async fn serve(&self, mut stream: tokio::net::TcpStream) {
        let mut buffer = Vec::new();
        let mut chunk = [0u8; 4096];
        let (head, body_start, length) = loop {
            let n = match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            buffer.extend_from_slice(&chunk[..n]);
            if let Some(end) = buffer.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&buffer[..end]).into_owned();
                let length = head
                    .lines()
                    .find_map(|l| {
                        let (n, v) = l.split_once(':')?;
                        n.eq_ignore_ascii_case("content-length")
                            .then(|| v.trim().parse().ok())?
                    })
                    .unwrap_or(0usize);
                break (head, end + 4, length);
            }
        };
        while buffer.len() < body_start + length {
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buffer.extend_from_slice(&chunk[..n]),
            }
        }
        let headers = head
            .lines()
            .skip(1)
            .filter_map(|l| l.split_once(':'))
            .map(|(n, v)| (n.trim().to_owned(), v.trim().to_owned()))
            .collect();
        let body = serde_json::from_slice(&buffer[body_start..body_start + length]).unwrap();
        self.got.lock().unwrap().push(Received { headers, body });
        let answer = self
            .script
            .lock()
            .unwrap()
            .pop()
            .unwrap_or(Answer::Status(200));
        match answer {
            Answer::Hang => tokio::time::sleep(Duration::from_secs(3600)).await,
            Answer::Status(status) => {
                let response = format!(
                    "HTTP/1.1 {status} X\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok"
                );
                let _ = stream.write_all(response.as_bytes()).await;
            }
        }
    }

    fn received(&self) -> Vec<Received> {
        self.got.lock().unwrap().clone()
    }
}

async fn notifications(engine: &Engine, id: ExecutionId) -> Vec<Notification> {
    engine.notifications(id).await.unwrap()
}

async fn delivered(engine: &Engine, id: ExecutionId, count: usize) -> bool {
    let all = notifications(engine, id).await;
    all.len() == count && all.iter().all(|n| n.status == "delivered")
}

fn verify(secret: &[u8], received: &Received) {
    let header = received.header("confluo-signature").expect("signed");
    let (t, v1) = header
        .strip_prefix("t=")
        .and_then(|rest| rest.split_once(",v1="))
        .expect("t=...,v1=...");
    let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(secret).unwrap();
    mac.update(format!("{t}.{}", received.body).as_bytes());
    let hex: String = mac
        .finalize()
        .into_bytes()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(v1, hex, "the signature does not verify");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_end_is_announced_once_signed_with_its_idempotency_key() {
    let db = TestDb::new(8).await;
    let (receiver, _task) = Receiver::start(vec![], false).await;
    let (other, _other_task) = Receiver::start(vec![], false).await;
    db.register(
        &Workflow::new("hooked", 1)
            .step("charge")
            .callback(&receiver.url),
    )
    .await;
    let worker = quick_worker(&db.engine, |w| {
        w.handler("hooked", "charge", |_| async { Ok(json!("charged")) })
    })
    .await;
    let delivery = db
        .engine
        .webhooks()
        .secret("s3cret")
        .allow_private_targets()
        .poll_interval(Duration::from_millis(20))
        .start();

    // The workflow's callback; an execution's own overrides it.
    let first = db.engine.start("hooked", &1).await.unwrap();
    let second = db
        .engine
        .start_with("hooked", &2, StartOptions::new().callback(&other.url))
        .await
        .unwrap()
        .id;
    for id in [first, second] {
        let done = db.engine.wait(id, Duration::from_secs(30)).await.unwrap();
        assert_eq!(done.status, ExecutionStatus::Completed);
    }
    assert!(eventually(Duration::from_secs(30), || delivered(&db.engine, first, 1)).await);
    assert!(eventually(Duration::from_secs(30), || delivered(&db.engine, second, 1)).await);
    let got = receiver.received();
    assert_eq!(got.len(), 1, "{got:?}");
    let notification = &notifications(&db.engine, first).await[0];
    assert_eq!(notification.event, "execution.completed");
    assert_eq!(notification.attempts, 1);
    assert_eq!(notification.last_status, Some(200));
    assert_eq!(
        got[0].header("confluo-idempotency-key"),
        Some(notification.id.to_string().as_str())
    );
    assert_eq!(got[0].header("confluo-event"), Some("execution.completed"));
    assert_eq!(got[0].body["event"], "execution.completed");
    assert_eq!(got[0].body["execution"]["execution_id"], first.to_string());
    assert_eq!(got[0].body["execution"]["status"], "completed");
    assert_eq!(got[0].body["execution"]["output"], "charged");
    verify(b"s3cret", &got[0]);
    assert_eq!(other.received().len(), 1);
    assert_eq!(
        other.received()[0].body["execution"]["execution_id"],
        second.to_string()
    );

    // A cancel is an end too; a cancel of an ended execution announces nothing more.
    worker.shutdown().await;
    let third = db.engine.start("hooked", &3).await.unwrap();
    assert!(db.engine.cancel(third).await.unwrap());
    assert!(!db.engine.cancel(third).await.unwrap());
    assert!(eventually(Duration::from_secs(30), || delivered(&db.engine, third, 1)).await);
    assert_eq!(
        notifications(&db.engine, third).await[0].event,
        "execution.cancelled"
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(receiver.received().len(), 2);
    delivery.shutdown().await;

    // No callback, no notification (the trigger does not even run).
    db.register(&Workflow::new("quiet", 1).step("charge")).await;
    let quiet = db.engine.start("quiet", &5).await.unwrap();
    assert!(db.engine.cancel(quiet).await.unwrap());
    assert!(notifications(&db.engine, quiet).await.is_empty());

    // Delivered (or without a webhook), they can be purged.
    let later = chrono::Utc::now() + chrono::Duration::minutes(1);
    assert_eq!(db.engine.purge(later, 100).await.unwrap(), 4);

    // A malformed callback is refused before anything starts.
    let refused = db
        .engine
        .start_with(
            "hooked",
            &4,
            StartOptions::new().callback("ftp://example.com/x"),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(refused, confluo::Error::InvalidCallback { .. }),
        "{refused}"
    );
    assert!(refused.to_string().contains("http://"), "{refused}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_down_then_failing_then_slow_gets_it_at_least_once() {
    let db = TestDb::new(8).await;
    // Down at first; then two 500s and one answer that never comes; then 200.
    let script = vec![Answer::Status(500), Answer::Status(500), Answer::Hang];
    let (receiver, _) = Receiver::start(script, true).await;
    db.register(
        &Workflow::new("flaky", 1)
            .step("one")
            .callback(&receiver.url),
    )
    .await;
    let id = db.engine.start("flaky", &0).await.unwrap();
    assert!(db.engine.cancel(id).await.unwrap());
    let delivery = db
        .engine
        .webhooks()
        .allow_private_targets()
        .timeout(Duration::from_millis(500))
        .backoff(Duration::from_millis(20), Duration::from_millis(100))
        .poll_interval(Duration::from_millis(20))
        .start();
    // Refused connections while it is down.
    assert!(
        eventually(Duration::from_secs(30), || async {
            notifications(&db.engine, id).await[0].attempts >= 2
        })
        .await
    );
    let down = notifications(&db.engine, id).await.remove(0);
    assert_eq!(down.status, "pending");
    assert_eq!(down.last_status, None);
    assert!(down.last_error.is_some(), "{down:?}");
    let _listening = receiver.listen();
    assert!(eventually(Duration::from_secs(60), || delivered(&db.engine, id, 1)).await);
    delivery.shutdown().await;
    let n = notifications(&db.engine, id).await.remove(0);
    let got = receiver.received();
    // Two 500s, the hung one, the delivered one: every copy with the same key.
    assert_eq!(got.len(), 4, "{got:?}");
    assert!(got
        .iter()
        .all(|r| r.header("confluo-idempotency-key") == Some(n.id.to_string().as_str())));
    assert!(n.attempts >= 6, "{n:?}");
    assert_eq!(n.last_status, Some(200));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_loop_dying_mid_attempt_leaves_it_to_another() {
    let db = TestDb::new(8).await;
    let (receiver, _task) = Receiver::start(vec![Answer::Hang], false).await;
    db.register(&Workflow::new("dies", 1).step("one").callback(&receiver.url))
        .await;
    let id = db.engine.start("dies", &0).await.unwrap();
    assert!(db.engine.cancel(id).await.unwrap());
    // A loop on a runtime of its own, shut down abruptly (as a killed process stops)
    // once the receiver has the request and has not answered.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let engine = db.engine.clone();
    let _dying = runtime.spawn(async move {
        engine
            .webhooks()
            .allow_private_targets()
            .timeout(Duration::from_secs(1))
            .poll_interval(Duration::from_millis(20))
            .start()
    });
    assert!(
        eventually(Duration::from_secs(30), || async {
            receiver.received().len() == 1
        })
        .await
    );
    runtime.shutdown_background();
    let cut_off = notifications(&db.engine, id).await.remove(0);
    assert_eq!((cut_off.status.as_str(), cut_off.attempts), ("pending", 1));
    // Another loop tries it once the cut-off attempt's time (its timeout and 5 s) is up.
    let delivery = db
        .engine
        .webhooks()
        .allow_private_targets()
        .poll_interval(Duration::from_millis(50))
        .start();
    assert!(eventually(Duration::from_secs(30), || delivered(&db.engine, id, 1)).await);
    delivery.shutdown().await;
    let got = receiver.received();
    assert_eq!(got.len(), 2);
    assert_eq!(
        got[0].header("confluo-idempotency-key"),
        got[1].header("confluo-idempotency-key")
    );
    assert_eq!(notifications(&db.engine, id).await[0].attempts, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_end_that_rolls_back_announces_nothing() {
    let db = TestDb::new(8).await;
    db.register(
        &Workflow::new("undone", 1)
            .step("one")
            .callback("https://hooks.example.com/x"),
    )
    .await;
    let id = db.engine.start("undone", &0).await.unwrap();
    // A constraint checked at commit that fails the cancel's transaction after it wrote
    // the execution's end (and so the trigger's notification).
    let mut conn = db.connection().await;
    sqlx::raw_sql(
        "CREATE FUNCTION public.refuse_cancel() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN RAISE EXCEPTION 'refused at commit'; END $$;
         CREATE CONSTRAINT TRIGGER refuse_cancel AFTER UPDATE ON confluo.execution
             DEFERRABLE INITIALLY DEFERRED FOR EACH ROW
             WHEN (NEW.status = 'cancelled') EXECUTE FUNCTION public.refuse_cancel();",
    )
    .execute(&mut conn)
    .await
    .unwrap();
    let error = db.engine.cancel(id).await.unwrap_err();
    assert!(error.to_string().contains("refused at commit"), "{error}");
    assert_eq!(
        db.engine.status(id).await.unwrap(),
        ExecutionStatus::Running
    );
    assert!(notifications(&db.engine, id).await.is_empty());
    sqlx::raw_sql("DROP TRIGGER refuse_cancel ON confluo.execution")
        .execute(&mut conn)
        .await
        .unwrap();
    assert!(db.engine.cancel(id).await.unwrap());
    let written = notifications(&db.engine, id).await;
    assert_eq!(written.len(), 1);
    assert_eq!(
        (written[0].event.as_str(), written[0].status.as_str()),
        ("execution.cancelled", "pending")
    );
    // Its webhook is pending: purge keeps the execution (and so the notification) while
    // the notification is younger than the cutoff.
    let later = chrono::Utc::now() + chrono::Duration::minutes(1);
    let recently = chrono::Utc::now() - chrono::Duration::seconds(30);
    tokio::time::sleep(Duration::from_millis(20)).await;
    // (purge takes executions that finished before the cutoff: make it one that did.)
    sqlx::query(
        "UPDATE confluo.execution SET finished_at = now() - interval '1 hour' WHERE id = $1",
    )
    .bind(id)
    .execute(&mut conn)
    .await
    .unwrap();
    assert_eq!(db.engine.purge(recently, 100).await.unwrap(), 0);
    assert_eq!(notifications(&db.engine, id).await.len(), 1);
    // Pending for longer than the whole window: no loop delivers it; it goes.
    assert_eq!(db.engine.purge(later, 100).await.unwrap(), 1);
    assert!(notifications(&db.engine, id).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn private_targets_are_refused_unless_allowed() {
    let db = TestDb::new(8).await;
    let (receiver, _task) = Receiver::start(vec![], false).await;
    let by_name = receiver.url.replace("127.0.0.1", "localhost");
    db.register(&Workflow::new("inside", 1).step("one")).await;
    let mut ids = Vec::new();
    for url in [
        receiver.url.as_str(),
        by_name.as_str(),
        "http://169.254.169.254/latest/meta-data",
    ] {
        let id = db
            .engine
            .start_with("inside", &0, StartOptions::new().callback(url))
            .await
            .unwrap()
            .id;
        assert!(db.engine.cancel(id).await.unwrap());
        ids.push(id);
    }
    let delivery = db
        .engine
        .webhooks()
        .max_attempts(1)
        .poll_interval(Duration::from_millis(20))
        .start();
    for &id in &ids {
        assert!(
            eventually(Duration::from_secs(30), || async {
                notifications(&db.engine, id).await[0].status == "failed"
            })
            .await
        );
        let n = notifications(&db.engine, id).await.remove(0);
        let error = n.last_error.unwrap();
        assert!(error.contains("refused"), "{}: {error}", n.url);
        assert!(error.contains("allow_private_targets"), "{error}");
    }
    delivery.shutdown().await;
    assert!(
        receiver.received().is_empty(),
        "a refused target was reached"
    );

    // Once allowed, a failed notification is sent again on request, once.
    let failed = notifications(&db.engine, ids[0]).await.remove(0);
    assert!(db.engine.retry_notification(failed.id).await.unwrap());
    assert!(
        !db.engine.retry_notification(failed.id).await.unwrap(),
        "it is pending now"
    );
    let delivery = db
        .engine
        .webhooks()
        .allow_private_targets()
        .poll_interval(Duration::from_millis(20))
        .start();
    assert!(eventually(Duration::from_secs(30), || delivered(&db.engine, ids[0], 1)).await);
    delivery.shutdown().await;
    assert_eq!(receiver.received().len(), 1);
    assert_eq!(notifications(&db.engine, ids[0]).await[0].attempts, 1);
}
