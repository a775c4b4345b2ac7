//! Delivering webhooks (the `webhooks` feature): a loop that posts the outbox's
//! notifications, written when executions end (see
//! [`StartOptions::callback`](crate::StartOptions::callback)), with retries and backoff, an
//! idempotency key and an HMAC-SHA256 signature, refusing loopback, private and link-local
//! targets unless allowed.
//!
//! ```no_run
//! # async fn run(engine: confluo::Engine) -> confluo::Result<()> {
//! let delivery = engine.webhooks().secret("a long random secret").start();
//! // ... until the process stops:
//! delivery.shutdown().await;
//! # Ok(()) }
//! ```
//!
//! # What a receiver gets
//! A `POST` with a JSON body `{"id", "event", "created_at", "execution": {"execution_id",
//! "workflow", "version", "status", "error", "finished_at", "output"}}`; `output` is there
//! for a completed execution, read when posting, up to [`MAX_OUTPUT_BYTES`] of JSON (`null`
//! beyond: `GET /api/v1/executions/{id}` or [`Engine::execution`](crate::Engine::execution)
//! has it)
//! and the headers `Confluo-Event`, `Confluo-Idempotency-Key` (the notification's id: the
//! same on every attempt, so a receiver drops what it has seen), `Confluo-Attempt`, and with
//! a secret `Confluo-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256 of "<t>.<body>">`.
//! A 2xx answer delivers it; anything else, or no answer within the timeout, is retried
//! with exponential backoff until the attempts run out (then it is `failed`). Redirects
//! are not followed.
//!
//! # At least once
//! A claim moves the notification's next attempt past the attempt's timeout before
//! posting, so that if this process dies mid-attempt (after the receiver got it, perhaps)
//! any delivery loop tries it again once that time has passed. Only the attempt that
//! claimed a notification records its outcome.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use hmac::{Hmac, Mac};
use http_body_util::Full;
use hyper::body::Bytes;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::engine::Engine;
use crate::store::notifications::{self, NotificationRow};

mod guard;

use guard::{is_public, refused, CheckedResolver};

type Https = hyper_rustls::HttpsConnector<HttpConnector<CheckedResolver>>;

/// Builds a [`WebhookDelivery`]: [`Engine::webhooks`].
#[derive(Clone)]
pub struct WebhookBuilder {
    engine: Engine,
    secret: Option<Arc<[u8]>>,
    allow_private: bool,
    timeout: Duration,
    max_attempts: u32,
    initial_backoff: Duration,
    max_backoff: Duration,
    poll: Duration,
    batch: usize,
}

impl std::fmt::Debug for WebhookBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WebhookBuilder")
            .field("secret", &self.secret.as_ref().map(|_| "<set>"))
            .field("allow_private", &self.allow_private)
            .field("timeout", &self.timeout)
            .field("max_attempts", &self.max_attempts)
            .finish_non_exhaustive()
    }
}

impl Engine {
    /// A webhook delivery loop for this engine's database, to [`start`](WebhookBuilder::start).
    /// Run one in each worker process (or one anywhere): they share the outbox without
    /// ever posting one notification twice at once.
    pub fn webhooks(&self) -> WebhookBuilder {
        WebhookBuilder {
            engine: self.clone(),
            secret: None,
            allow_private: false,
            timeout: Duration::from_secs(10),
            max_attempts: 12,
            initial_backoff: Duration::from_secs(1),
            max_backoff: Duration::from_secs(600),
            poll: Duration::from_secs(1),
            batch: 16,
        }
    }
}

impl WebhookBuilder {
    /// Signs every notification with this secret (`Confluo-Signature`). Without one they
    /// go unsigned.
    pub fn secret(mut self, secret: impl AsRef<[u8]>) -> Self {
        self.secret = Some(Arc::from(secret.as_ref()));
        self
    }

    /// Posts to loopback, private (RFC 1918, unique local) and link-local addresses too.
    /// Off by default: a callback URL comes from whoever starts an execution, and must not
    /// reach the services beside the worker (a cloud's metadata endpoint, a database).
    pub fn allow_private_targets(mut self) -> Self {
        self.allow_private = true;
        self
    }

    /// How long one attempt may take, connecting included (default 10 s; 1 ms to 1 h).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout.clamp(Duration::from_millis(1), Duration::from_secs(3600));
        self
    }

    /// Attempts before a notification is given up as `failed` (default 12, at least 1).
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts.max(1);
        self
    }

    /// The wait after the first failed attempt, doubled after each one up to `max`
    /// (default 1 s to 10 min; neither beyond a day).
    pub fn backoff(mut self, initial: Duration, max: Duration) -> Self {
        const DAY: Duration = Duration::from_secs(86_400);
        self.initial_backoff = initial.min(DAY);
        self.max_backoff = max.clamp(self.initial_backoff, DAY);
        self
    }

    /// How often the outbox is looked at when it had nothing due (default 1 s).
    pub fn poll_interval(mut self, poll: Duration) -> Self {
        self.poll = poll.max(Duration::from_millis(10));
        self
    }

    /// Starts the loop on the current tokio runtime.
    ///
    /// # Panics
    /// Outside a tokio runtime.
    pub fn start(self) -> WebhookDelivery {
        let stop = CancellationToken::new();
        let client = client(self.allow_private, self.timeout);
        let task = tokio::spawn(run(Arc::new(self), client, stop.clone()));
        WebhookDelivery { stop, task }
    }
}

/// A running delivery loop; [`shutdown`](Self::shutdown) stops it.
#[derive(Debug)]
pub struct WebhookDelivery {
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl WebhookDelivery {
    /// Stops claiming, and waits for the attempts in flight (each at most the timeout).
    ///
    /// # Cancel safety
    /// Dropping the future leaves the loop stopping in the background; attempts cut off
    /// are tried again by any loop once their timeout has passed.
    pub async fn shutdown(self) {
        self.stop.cancel();
        let _ = self.task.await;
    }
}

async fn run(
    config: Arc<WebhookBuilder>,
    client: Client<Https, Full<Bytes>>,
    stop: CancellationToken,
) {
    let lease_ms = i64::try_from(config.timeout.as_millis())
        .unwrap_or(i64::MAX / 2)
        .saturating_add(5_000);
    let mut attempts = tokio::task::JoinSet::new();
    while !stop.is_cancelled() {
        let room = config.batch.saturating_sub(attempts.len());
        let claimed = if room == 0 {
            Vec::new()
        } else {
            match notifications::claim_due(config.engine.pool(), room as i64, lease_ms).await {
                Ok(claimed) => claimed,
                Err(error) => {
                    tracing::warn!(%error, "webhooks: cannot read the outbox; trying again");
                    Vec::new()
                }
            }
        };
        let full = !claimed.is_empty() && claimed.len() == room;
        for row in claimed {
            attempts.spawn(attempt(config.clone(), client.clone(), row));
        }
        // A full batch: look again at once (or as soon as an attempt ends); else wait.
        let pause = if full { Duration::ZERO } else { config.poll };
        tokio::select! {
            _ = stop.cancelled() => break,
            Some(_) = attempts.join_next(), if room == 0 || !attempts.is_empty() => {}
            _ = tokio::time::sleep(pause) => {}
        }
    }
    while attempts.join_next().await.is_some() {}
}

/// One attempt at one notification, and its outcome recorded.
async fn attempt(
    config: Arc<WebhookBuilder>,
    client: Client<Https, Full<Bytes>>,
    row: NotificationRow,
) {
    let Some(claim) = row.claim else {
        return; // claim_due always sets one
    };
    // The whole attempt (reading the output included) within the timeout, so that it
    // ends before its lease does and nobody else posts it meanwhile.
    let outcome = tokio::time::timeout(config.timeout, post(&config, &client, &row))
        .await
        .unwrap_or_else(|_| {
            Err(Failure::new(format!(
                "no answer within {:?}",
                config.timeout
            )))
        });
    let pool = config.engine.pool();
    let recorded = match &outcome {
        Ok(status) => notifications::delivered(pool, row.id, claim, i32::from(*status)).await,
        Err(failure) => {
            let retry_in = (row.attempts < config.max_attempts as i32).then(|| {
                let doubled = config
                    .initial_backoff
                    .saturating_mul(1u32 << (row.attempts - 1).clamp(0, 20));
                i64::try_from(doubled.min(config.max_backoff).as_millis()).unwrap_or(i64::MAX)
            });
            tracing::debug!(id = %row.id, url = %row.url, attempt = row.attempts, error = %failure.error, "webhook attempt failed");
            notifications::attempt_failed(
                pool,
                row.id,
                claim,
                failure.status.map(i32::from),
                &failure.error,
                retry_in,
            )
            .await
        }
    };
    if let Err(error) = recorded {
        // The claim's lease runs out and the notification is tried again: at least once.
        tracing::warn!(%error, id = %row.id, "webhooks: cannot record an attempt's outcome");
    }
}

struct Failure {
    status: Option<u16>,
    error: String,
}

impl Failure {
    fn new(error: impl std::fmt::Display) -> Self {
        Failure {
            status: None,
            error: error.to_string(),
        }
    }
}

/// Posts `row`; its 2xx status, or why not.
async fn post(
    config: &WebhookBuilder,
    client: &Client<Https, Full<Bytes>>,
    row: &NotificationRow,
) -> Result<u16, Failure> {
    let uri: hyper::Uri = row
        .url
        .parse()
        .map_err(|e| Failure::new(format!("the URL does not parse: {e}")))?;
    let host = uri
        .host()
        .ok_or_else(|| Failure::new("the URL has no host"))?;
    // An address written in the URL is not resolved: check it here.
    if let Ok(ip) = host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .parse::<IpAddr>()
    {
        if !config.allow_private && !is_public(ip) {
            return Err(Failure::new(refused(ip)));
        }
    }
    let mut body = json!({
        "id": row.id,
        "event": row.event,
        "created_at": row.created_at,
        "execution": row.payload.0,
    });
    if row.event == "execution.completed" {
        let output = completed_output(&config.engine, row.execution_id).await?;
        body["execution"]["output"] = output;
    }
    let body = serde_json::to_vec(&body).map_err(Failure::new)?;
    let mut request = hyper::Request::post(uri)
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .header(
            hyper::header::USER_AGENT,
            concat!("confluo/", env!("CARGO_PKG_VERSION")),
        )
        .header("confluo-event", row.event.as_str())
        .header("confluo-idempotency-key", row.id.to_string())
        .header("confluo-attempt", row.attempts.to_string());
    if let Some(secret) = &config.secret {
        request = request.header(
            "confluo-signature",
            signature(secret, &body, SystemTime::now()),
        );
    }
    let request = request
        .body(Full::new(Bytes::from(body)))
        .map_err(Failure::new)?;
    let response = client
        .request(request)
        .await
        .map_err(|e| Failure::new(describe(&e)))?;
    let status = response.status().as_u16();
    // The answer's body is not read: a receiver could send gigabytes. Dropping it closes
    // the connection rather than returning it to the pool.
    drop(response);
    if (200..300).contains(&status) {
        Ok(status)
    } else {
        Err(Failure {
            status: Some(status),
            error: format!("the receiver answered {status}"),
        })
    }
}

/// The largest output a notification carries.
pub const MAX_OUTPUT_BYTES: usize = 256 * 1024;

/// A completed execution's output for its notification: `null` when it is larger than
/// [`MAX_OUTPUT_BYTES`] as JSON (the receiver reads it from the execution) or when the
/// execution was purged since.
async fn completed_output(
    engine: &Engine,
    id: crate::ExecutionId,
) -> Result<serde_json::Value, Failure> {
    let execution = match engine.execution(id).await {
        Ok(execution) => execution,
        Err(crate::Error::ExecutionNotFound(_)) => return Ok(serde_json::Value::Null),
        Err(error) => {
            return Err(Failure::new(format!(
                "cannot read the execution's output: {error}"
            )))
        }
    };
    let output = execution.output.unwrap_or_default();
    let size = serde_json::to_vec(&output).map_or(usize::MAX, |b| b.len());
    Ok(if size <= MAX_OUTPUT_BYTES {
        output
    } else {
        serde_json::Value::Null
    })
}

/// `t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>.<body>")>`.
pub(crate) fn signature(secret: &[u8], body: &[u8], now: SystemTime) -> String {
    let t = now.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let mut mac = Hmac::<sha2::Sha256>::new_from_slice(secret).expect("HMAC takes any key length");
    mac.update(t.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    let hex: String = mac
        .finalize()
        .into_bytes()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("t={t},v1={hex}")
}

/// The error's chain, which says what actually failed (refused, reset, TLS).
fn describe(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

fn client(allow_private: bool, timeout: Duration) -> Client<Https, Full<Bytes>> {
    let mut http = HttpConnector::new_with_resolver(CheckedResolver { allow_private });
    http.enforce_http(false);
    http.set_connect_timeout(Some(timeout));
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_webpki_roots()
        .https_or_http()
        .enable_http1()
        .wrap_connector(http);
    Client::builder(hyper_util::rt::TokioExecutor::new()).build(https)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signature_is_hmac_sha256_of_time_dot_body() {
        // printf '1700000000.{"a":1}' | openssl dgst -sha256 -hmac secret
        let at = UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        assert_eq!(
            signature(b"secret", br#"{"a":1}"#, at),
            "t=1700000000,v1=49f24e537407743fa4a0242bb63b94b9a47ee99cbbe071ccd8a22550ae411686"
        );
    }
}
