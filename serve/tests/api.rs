//! The HTTP API against a real PostgreSQL: executions started, listed, inspected and
//! cancelled; a dead letter reprocessed until its execution completes; JSON errors with
//! their statuses and codes; the token and the write switch; the OpenAPI document; and a
//! real socket with a graceful shutdown.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{header, Method, Request, StatusCode};
use axum::Router;
use confluo::{Engine, ExecutionId, ExecutionStatus, TaskError, Workflow};
use confluo_serve::{Config, ServeError};
use http_body_util::BodyExt;
use serde_json::{json, Value};
use tower::ServiceExt;

/// A fresh, migrated database of its own for each test.
async fn engine(database: &str) -> Engine {
    let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| {
        confluo_testkit::server::process_local_url()
            .expect("no DATABASE_URL, and no throwaway PostgreSQL could start")
    });
    let admin: sqlx::postgres::PgConnectOptions = url.parse().expect("a PostgreSQL URL");
    let options = confluo_testkit::fresh_database(&admin, database)
        .await
        .unwrap();
    let engine = confluo::ConnectBuilder::from_options(options)
        .max_connections(6)
        .connect()
        .await
        .unwrap();
    engine.migrate().await.unwrap();
    engine
}

fn local() -> Config {
    Config::new("127.0.0.1:0".parse().unwrap())
}

/// Sends one request; returns its status and JSON body (`null` when empty).
async fn call(app: &Router, method: Method, uri: &str, body: Option<Value>) -> (StatusCode, Value) {
    call_with(app, method, uri, body, None).await
}

async fn call_with(
    app: &Router,
    method: Method,
    uri: &str,
    body: Option<Value>,
    token: Option<&str>,
) -> (StatusCode, Value) {
    let mut request = Request::builder().method(method).uri(uri);
    if let Some(token) = token {
        request = request.header(header::AUTHORIZATION, format!("Bearer {token}"));
    }
    let request = match body {
        Some(body) => request
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from(body.to_string())),
        None => request.body(Body::empty()),
    }
    .unwrap();
    let response = app.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    let json = if bytes.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&bytes)
            .unwrap_or_else(|_| panic!("{uri}: not JSON: {}", String::from_utf8_lossy(&bytes)))
    };
    (status, json)
}

/// An error body: the status repeated, a code, a message.
fn assert_error(answer: &(StatusCode, Value), status: StatusCode, code: &str) {
    let (got, body) = answer;
    assert_eq!(*got, status, "{body}");
    assert_eq!(body["status"], status.as_u16(), "{body}");
    assert_eq!(body["code"], code, "{body}");
    assert!(
        body["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{body}"
    );
}

/// Start (idempotently), list, get, members and cancel; a step that fails permanently
/// once is a dead letter that fails its execution, and reprocessing it through the API
/// completes the execution.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn executions_and_dead_letters_through_the_api() {
    let engine = engine("confluo_serve_flow").await;
    engine
        .register(&Workflow::new("api", 1).step("charge"))
        .await
        .unwrap();
    let app = confluo_serve::router(engine.clone(), &local()).unwrap();

    let start = json!({"workflow": "api", "input": {"amount": 5}, "idempotency_key": "order-1"});
    let (status, first) = call(
        &app,
        Method::POST,
        "/api/v1/executions",
        Some(start.clone()),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED, "{first}");
    assert_eq!(first["created"], true);
    let (status, again) = call(&app, Method::POST, "/api/v1/executions", Some(start)).await;
    assert_eq!(status, StatusCode::OK, "{again}");
    assert_eq!(
        (again["id"].clone(), again["created"].clone()),
        (first["id"].clone(), json!(false))
    );
    let id = first["id"].as_str().unwrap().to_owned();

    let (status, listed) = call(
        &app,
        Method::GET,
        "/api/v1/executions?workflow=api&status=running",
        None,
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{listed}");
    assert_eq!(listed.as_array().unwrap().len(), 1, "{listed}");
    assert_eq!(listed[0]["id"], id.as_str());
    let (_, none) = call(
        &app,
        Method::GET,
        "/api/v1/executions?status=completed",
        None,
    )
    .await;
    assert_eq!(none, json!([]));

    let (status, got) = call(&app, Method::GET, &format!("/api/v1/executions/{id}"), None).await;
    assert_eq!(status, StatusCode::OK, "{got}");
    assert_eq!(got["status"], "running");
    assert_eq!(got["input"], json!({"amount": 5}));
    assert_eq!(got["stages"][0]["name"], "charge");
    assert_eq!(got["stages"][0]["remaining"], 1);
    let (status, members) = call(
        &app,
        Method::GET,
        &format!("/api/v1/executions/{id}/stages/0/members?limit=10"),
        None,
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{members}");
    assert_eq!(members["members"][0]["status"], "pending", "{members}");
    assert_eq!(members["next_after"], Value::Null, "{members}");

    // The first attempt fails for good; the reprocessed one succeeds.
    let failed_once = Arc::new(AtomicBool::new(false));
    let f = failed_once.clone();
    let worker = engine
        .worker()
        .poll_interval(Duration::from_millis(50))
        .handler("api", "charge", move |_| {
            let first = !f.swap(true, Ordering::SeqCst);
            async move {
                if first {
                    Err(TaskError::permanent("card declined"))
                } else {
                    Ok(json!("charged"))
                }
            }
        })
        .start()
        .await
        .unwrap();
    let execution = ExecutionId(id.parse().unwrap());
    let done = engine
        .wait(execution, Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(done.status, ExecutionStatus::Failed);

    let (status, dead) = call(
        &app,
        Method::GET,
        &format!("/api/v1/dead-letters?execution={id}"),
        None,
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{dead}");
    assert_eq!(dead.as_array().unwrap().len(), 1, "{dead}");
    let task = dead[0]["task_id"].as_str().unwrap().to_owned();
    let (status, shown) = call(
        &app,
        Method::GET,
        &format!("/api/v1/dead-letters/{task}"),
        None,
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{shown}");
    assert_eq!(shown["errors"][0]["error"], "card declined", "{shown}");
    // A step reads its stage's input when claimed: it has no input of its own.
    assert_eq!(shown["input"], Value::Null, "{shown}");
    assert_eq!(shown["stage"], "charge", "{shown}");

    let (status, reprocessed) = call(
        &app,
        Method::POST,
        &format!("/api/v1/dead-letters/{task}/reprocess"),
        None,
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{reprocessed}");
    assert_eq!(reprocessed["resumed"], true, "{reprocessed}");
    let done = engine
        .wait(execution, Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(done.status, ExecutionStatus::Completed);
    let (_, got) = call(&app, Method::GET, &format!("/api/v1/executions/{id}"), None).await;
    assert_eq!(got["output"], "charged", "{got}");
    // It is no dead letter any more.
    let again = call(
        &app,
        Method::POST,
        &format!("/api/v1/dead-letters/{task}/reprocess"),
        None,
    )
    .await;
    assert_error(&again, StatusCode::CONFLICT, "not_dead_lettered");

    // Stats and workers see the worker and the execution.
    let (status, stats) = call(&app, Method::GET, "/api/v1/stats", None).await;
    assert_eq!(status, StatusCode::OK, "{stats}");
    assert_eq!(stats["executions"]["completed"], 1, "{stats}");
    assert_eq!(stats["workers"]["alive"], 1, "{stats}");
    let (_, workers) = call(&app, Method::GET, "/api/v1/workers", None).await;
    assert_eq!(workers[0]["id"], worker.id(), "{workers}");
    assert_eq!(
        workers[0]["handlers"],
        json!([{"workflow": "api", "handler": "charge"}])
    );
    worker.shutdown().await;

    // Cancelling: once, then a conflict.
    let (_, second) = call(
        &app,
        Method::POST,
        "/api/v1/executions",
        Some(json!({"workflow": "api"})),
    )
    .await;
    let second = second["id"].as_str().unwrap().to_owned();
    let (status, cancelled) = call(
        &app,
        Method::POST,
        &format!("/api/v1/executions/{second}/cancel"),
        None,
    )
    .await;
    assert_eq!(
        (status, cancelled),
        (StatusCode::OK, json!({"cancelled": true}))
    );
    let again = call(
        &app,
        Method::POST,
        &format!("/api/v1/executions/{second}/cancel"),
        None,
    )
    .await;
    assert_error(&again, StatusCode::CONFLICT, "already_ended");
    let (_, workflows) = call(&app, Method::GET, "/api/v1/workflows", None).await;
    assert_eq!(workflows[0]["definition"]["name"], "api", "{workflows}");
}

/// Every failure is JSON with the status it is sent with and a code.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_are_json_with_a_status_and_a_code() {
    let engine = engine("confluo_serve_errors").await;
    engine
        .register(&Workflow::new("api", 1).map("item"))
        .await
        .unwrap();
    let app = confluo_serve::router(engine.clone(), &local()).unwrap();
    let unknown = ExecutionId::new();
    let cases: Vec<(Method, String, Option<Value>, StatusCode, &str)> = vec![
        (
            Method::GET,
            format!("/api/v1/executions/{unknown}"),
            None,
            StatusCode::NOT_FOUND,
            "execution_not_found",
        ),
        (
            Method::POST,
            format!("/api/v1/executions/{unknown}/cancel"),
            None,
            StatusCode::NOT_FOUND,
            "execution_not_found",
        ),
        (
            Method::GET,
            format!("/api/v1/executions/{unknown}/stages/0/members"),
            None,
            StatusCode::NOT_FOUND,
            "execution_not_found",
        ),
        (
            Method::GET,
            "/api/v1/executions/not-a-uuid".into(),
            None,
            StatusCode::BAD_REQUEST,
            "bad_request",
        ),
        (
            Method::GET,
            "/api/v1/executions?limit=0".into(),
            None,
            StatusCode::BAD_REQUEST,
            "bad_request",
        ),
        (
            Method::GET,
            "/api/v1/executions?limit=1001".into(),
            None,
            StatusCode::BAD_REQUEST,
            "bad_request",
        ),
        (
            Method::GET,
            "/api/v1/executions?status=sleeping".into(),
            None,
            StatusCode::BAD_REQUEST,
            "bad_request",
        ),
        (
            Method::GET,
            "/api/v1/executions?colour=red".into(),
            None,
            StatusCode::BAD_REQUEST,
            "bad_request",
        ),
        (
            Method::POST,
            "/api/v1/executions".into(),
            Some(json!({"input": 1})),
            StatusCode::BAD_REQUEST,
            "bad_request",
        ),
        (
            Method::POST,
            "/api/v1/executions".into(),
            Some(json!({"workflow": "nope"})),
            StatusCode::NOT_FOUND,
            "workflow_not_found",
        ),
        (
            Method::POST,
            "/api/v1/executions".into(),
            Some(json!({"workflow": "api", "version": 7})),
            StatusCode::NOT_FOUND,
            "workflow_not_found",
        ),
        // A map's input must be an array.
        (
            Method::POST,
            "/api/v1/executions".into(),
            Some(json!({"workflow": "api", "input": 3})),
            StatusCode::BAD_REQUEST,
            "invalid_input",
        ),
        (
            Method::POST,
            "/api/v1/executions".into(),
            Some(json!({"workflow": "api", "input": [], "deadline_seconds": -1})),
            StatusCode::BAD_REQUEST,
            "bad_request",
        ),
        (
            Method::GET,
            format!("/api/v1/dead-letters/{unknown}"),
            None,
            StatusCode::NOT_FOUND,
            "task_not_found",
        ),
        (
            Method::POST,
            "/api/v1/dead-letters/reprocess".into(),
            Some(json!({})),
            StatusCode::BAD_REQUEST,
            "bad_request",
        ),
        (
            Method::GET,
            format!("/api/v1/executions/{unknown}/notifications"),
            None,
            StatusCode::NOT_FOUND,
            "execution_not_found",
        ),
        (
            Method::GET,
            "/api/v1/notifications?status=lost".into(),
            None,
            StatusCode::BAD_REQUEST,
            "bad_request",
        ),
        (
            Method::POST,
            format!("/api/v1/notifications/{unknown}/retry"),
            None,
            StatusCode::CONFLICT,
            "not_failed",
        ),
        (
            Method::POST,
            "/api/v1/executions".into(),
            Some(json!({"workflow": "api", "input": [], "callback": "gopher://x"})),
            StatusCode::BAD_REQUEST,
            "invalid_callback",
        ),
        (
            Method::GET,
            "/api/v2/executions".into(),
            None,
            StatusCode::NOT_FOUND,
            "not_found",
        ),
        (
            Method::DELETE,
            "/api/v1/executions".into(),
            None,
            StatusCode::METHOD_NOT_ALLOWED,
            "method_not_allowed",
        ),
    ];
    for (method, uri, body, status, code) in cases {
        let answer = call(&app, method.clone(), &uri, body).await;
        assert!(
            answer.0 == status && answer.1["code"] == code,
            "{method} {uri}: expected {status} {code}, got {} {}",
            answer.0,
            answer.1
        );
        assert_error(&answer, status, code);
    }
    // A body that is not JSON at all.
    let request = Request::post("/api/v1/executions")
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from("{not json"))
        .unwrap();
    let response = app.clone().oneshot(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    // Nothing was started by any of it.
    assert_eq!(engine.execution_counts().await.unwrap().running, 0);
}

/// Beyond loopback a token is required; with one, every route but the probes needs it;
/// read-only turns the writes off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_token_and_the_write_switch() {
    let engine = engine("confluo_serve_auth").await;
    engine
        .register(&Workflow::new("api", 1).step("one"))
        .await
        .unwrap();
    let open = Config::new("0.0.0.0:8080".parse().unwrap());
    let refused = confluo_serve::router(engine.clone(), &open).unwrap_err();
    assert!(
        matches!(refused, ServeError::TokenRequired { .. }),
        "{refused}"
    );
    assert!(
        refused.to_string().contains("CONFLUO_API_TOKEN"),
        "{refused}"
    );
    assert!(matches!(
        confluo_serve::router(engine.clone(), &local().token("  ")).unwrap_err(),
        ServeError::EmptyToken
    ));

    let app = confluo_serve::router(engine.clone(), &open.token("s3cret")).unwrap();
    let (status, headers) = {
        let response = app
            .clone()
            .oneshot(
                Request::get("/api/v1/executions")
                    .body(Body::empty())
                    .unwrap(),
            )
            .await
            .unwrap();
        (response.status(), response.headers().clone())
    };
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert_eq!(headers[header::WWW_AUTHENTICATE], "Bearer");
    let wrong = call_with(&app, Method::GET, "/api/v1/executions", None, Some("s3cre")).await;
    assert_error(&wrong, StatusCode::UNAUTHORIZED, "unauthorized");
    let right = call_with(
        &app,
        Method::GET,
        "/api/v1/executions",
        None,
        Some("s3cret"),
    )
    .await;
    assert_eq!(right.0, StatusCode::OK, "{}", right.1);
    for probe in ["/api/v1/health", "/api/v1/ready"] {
        let (status, body) = call(&app, Method::GET, probe, None).await;
        assert_eq!(status, StatusCode::OK, "{probe}: {body}");
    }
    let start = json!({"workflow": "api"});
    let unauthorized = call(
        &app,
        Method::POST,
        "/api/v1/executions",
        Some(start.clone()),
    )
    .await;
    assert_error(&unauthorized, StatusCode::UNAUTHORIZED, "unauthorized");

    // Without a token, only loopback Host names are answered (DNS rebinding).
    let open_local = confluo_serve::router(engine.clone(), &local()).unwrap();
    for (host, allowed) in [
        ("localhost:8080", true),
        ("127.0.0.1:8080", true),
        ("[::1]:8080", true),
        ("evil.example:8080", false),
        ("localhost.evil.example", false),
    ] {
        let response = open_local
            .clone()
            .oneshot(
                Request::get("/api/v1/executions")
                    .header(header::HOST, host)
                    .body(Body::empty())
                    .unwrap(),
            )
            .await
            .unwrap();
        let expected = if allowed {
            StatusCode::OK
        } else {
            StatusCode::FORBIDDEN
        };
        assert_eq!(response.status(), expected, "Host: {host}");
    }
    // With a token, any Host (a reverse proxy's name) is fine.
    let response = app
        .clone()
        .oneshot(
            Request::get("/api/v1/executions")
                .header(header::HOST, "confluo.internal.example")
                .header(header::AUTHORIZATION, "Bearer s3cret")
                .body(Body::empty())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);

    let read_only = confluo_serve::router(engine.clone(), &local().read_only()).unwrap();
    let refused = call(&read_only, Method::POST, "/api/v1/executions", Some(start)).await;
    assert_error(&refused, StatusCode::FORBIDDEN, "writes_disabled");
    let reads = call(&read_only, Method::GET, "/api/v1/executions", None).await;
    assert_eq!(reads.0, StatusCode::OK);
    assert_eq!(engine.execution_counts().await.unwrap().running, 0);
}

/// The OpenAPI document lists every route the router answers, each with its methods.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openapi_document_describes_every_route() {
    let engine = engine("confluo_serve_openapi").await;
    let app = confluo_serve::router(engine, &local()).unwrap();
    let (status, document) = call(&app, Method::GET, "/api/v1/openapi.json", None).await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        document["openapi"].as_str().unwrap().starts_with("3."),
        "{document}"
    );
    let routes = [
        ("post", "/api/v1/executions"),
        ("get", "/api/v1/executions"),
        ("get", "/api/v1/executions/{id}"),
        ("post", "/api/v1/executions/{id}/cancel"),
        ("get", "/api/v1/executions/{id}/stages/{stage}/members"),
        ("get", "/api/v1/executions/{id}/notifications"),
        ("get", "/api/v1/tasks/{task}"),
        ("get", "/api/v1/notifications"),
        ("post", "/api/v1/notifications/{id}/retry"),
        ("get", "/api/v1/dead-letters"),
        ("get", "/api/v1/dead-letters/{task}"),
        ("post", "/api/v1/dead-letters/{task}/reprocess"),
        ("post", "/api/v1/dead-letters/reprocess"),
        ("get", "/api/v1/health"),
        ("get", "/api/v1/ready"),
        ("get", "/api/v1/openapi.json"),
        ("get", "/api/v1/workflows"),
        ("get", "/api/v1/workers"),
        ("get", "/api/v1/stats"),
    ];
    let paths = document["paths"].as_object().unwrap();
    let documented: usize = paths.values().map(|p| p.as_object().unwrap().len()).sum();
    assert_eq!(documented, routes.len(), "{:?}", paths.keys());
    for (method, path) in routes {
        assert!(
            paths[path][method].is_object(),
            "{method} {path} is not documented"
        );
    }
    let schemas = document["components"]["schemas"].as_object().unwrap();
    for schema in [
        "Execution",
        "StageProgress",
        "ApiError",
        "DeadLetterDetail",
        "WorkerInfo",
        "Stats",
    ] {
        assert!(
            schemas.contains_key(schema),
            "no schema {schema}: {:?}",
            schemas.keys()
        );
    }
}

/// Over a real socket, and a graceful shutdown that returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serves_a_socket_and_shuts_down() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let engine = engine("confluo_serve_socket").await;
    let second = engine.clone();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let config = Config::new(([127, 0, 0, 1], port).into());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        confluo_serve::serve(engine, &config, async {
            let _ = stopped.await;
        })
        .await
    });
    let mut stream = None;
    for _ in 0..100 {
        match tokio::net::TcpStream::connect(("127.0.0.1", port)).await {
            Ok(s) => {
                stream = Some(s);
                break;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
    let mut stream = stream.expect("the server listens");
    stream
        .write_all(b"GET /api/v1/ready HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).await.unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.contains(r#"{"status":"ready"}"#), "{answer}");
    stop.send(()).unwrap();
    let result = tokio::time::timeout(Duration::from_secs(10), server)
        .await
        .expect("the server stops once shutdown completes")
        .unwrap();
    assert!(result.is_ok(), "{result:?}");
    // A second server on a port in use says so.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let config = Config::new(taken.local_addr().unwrap());
    let error = confluo_serve::serve(second, &config, std::future::pending())
        .await
        .unwrap_err();
    assert!(matches!(error, ServeError::Bind { .. }), "{error}");
    assert!(error.to_string().contains("another process"), "{error}");
}

/// A wide map's members page by page, in item order, with and without a status filter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_page_by_page() {
    let engine = engine("confluo_serve_members").await;
    engine
        .register(
            &Workflow::new("wide", 1)
                .stage(confluo::Stage::map("item"))
                .step("sum"),
        )
        .await
        .unwrap();
    let worker = engine
        .worker()
        .concurrency(16)
        .handler("wide", "item", |t| async move {
            let item: u32 = t.input_as()?;
            if item % 50 == 49 {
                Err(TaskError::permanent(format!("item {item} is broken")))
            } else {
                Ok(json!(item))
            }
        })
        .handler("wide", "sum", |_| async { Ok(json!("summed")) })
        .start()
        .await
        .unwrap();
    let id = engine
        .start("wide", &(0..250).collect::<Vec<u32>>())
        .await
        .unwrap();
    let done = engine.wait(id, Duration::from_secs(60)).await.unwrap();
    assert_eq!(done.status, ExecutionStatus::Completed, "{done:?}");
    worker.shutdown().await;
    let app = confluo_serve::router(engine.clone(), &local()).unwrap();

    // The last hour's activity: every task by status, per minute, one hand-over.
    let (_, stats) = call(&app, Method::GET, "/api/v1/stats", None).await;
    let activity = &stats["activity"];
    assert_eq!(
        activity["tasks"],
        json!({"pending": 0, "running": 0, "completed": 246, "dead": 5, "cancelled": 0}),
        "{stats}"
    );
    let per_minute = activity["per_minute"].as_array().unwrap();
    let sum = |key: &str| -> u64 { per_minute.iter().map(|m| m[key].as_u64().unwrap()).sum() };
    assert_eq!((sum("completed"), sum("dead")), (246, 5), "{stats}");
    assert_eq!(activity["hand_over"]["groups"], 1, "{stats}");
    assert!(
        activity["hand_over"]["in_firing_transaction"].as_u64() <= Some(1),
        "{stats}"
    );
    let p50 = activity["hand_over"]["p50_ms"].as_f64().unwrap();
    assert!((0.0..60_000.0).contains(&p50), "{stats}");

    // The server samples the queue's depth from the router's start (then every 15 s).
    let mut history = Value::Null;
    for _ in 0..100 {
        history = call(&app, Method::GET, "/api/v1/stats", None).await.1["queue_history"].clone();
        if !history.as_array().unwrap().is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        (history[0]["due"].clone(), history[0]["running"].clone()),
        (json!(0), json!(0)),
        "{history}"
    );
    assert!(history[0]["at"].is_string(), "{history}");

    let base = format!("/api/v1/executions/{id}/stages/0/members");

    let mut seen = Vec::new();
    let mut after: Option<u64> = None;
    let mut pages = 0;
    loop {
        let uri = match after {
            Some(a) => format!("{base}?limit=100&after={a}"),
            None => format!("{base}?limit=100"),
        };
        let (status, page) = call(&app, Method::GET, &uri, None).await;
        assert_eq!(status, StatusCode::OK, "{page}");
        pages += 1;
        let members = page["members"].as_array().unwrap();
        seen.extend(members.iter().map(|m| m["item_index"].as_u64().unwrap()));
        match page["next_after"].as_u64() {
            Some(next) => {
                assert_eq!(Some(next), seen.last().copied(), "{page}");
                after = Some(next);
            }
            None => break,
        }
    }
    assert_eq!(pages, 3);
    assert_eq!(seen, (0..250).collect::<Vec<u64>>());

    let (_, dead) = call(&app, Method::GET, &format!("{base}?status=dead"), None).await;
    let dead: Vec<u64> = dead["members"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            assert_eq!(m["status"], "dead", "{m}");
            assert!(m["last_error"].as_str().unwrap().contains("is broken"));
            m["item_index"].as_u64().unwrap()
        })
        .collect();
    assert_eq!(dead, vec![49, 99, 149, 199, 249]);
    let (_, later) = call(
        &app,
        Method::GET,
        &format!("{base}?status=dead&after=149&limit=1"),
        None,
    )
    .await;
    assert_eq!(later["members"][0]["item_index"], 199, "{later}");
    assert_eq!(later["next_after"], 199, "{later}");
    // A member in full, whatever its status.
    let (_, first_page) = call(&app, Method::GET, &format!("{base}?limit=1"), None).await;
    let task = first_page["members"][0]["task_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let (status, member) = call(&app, Method::GET, &format!("/api/v1/tasks/{task}"), None).await;
    assert_eq!(status, StatusCode::OK, "{member}");
    assert_eq!(
        (
            member["status"].clone(),
            member["input"].clone(),
            member["output"].clone()
        ),
        (json!("completed"), json!(0), json!(0)),
        "{member}"
    );
    assert_eq!(member["errors"], json!([]), "{member}");
    let dead_task = dead_members_first_task(&app, &base).await;
    let (_, dead_member) = call(
        &app,
        Method::GET,
        &format!("/api/v1/tasks/{dead_task}"),
        None,
    )
    .await;
    assert_eq!(dead_member["status"], "dead", "{dead_member}");
    assert_eq!(
        dead_member["errors"][0]["error"], "item 49 is broken",
        "{dead_member}"
    );
    let unknown = call(
        &app,
        Method::GET,
        &format!("/api/v1/tasks/{}", ExecutionId::new()),
        None,
    )
    .await;
    assert_error(&unknown, StatusCode::NOT_FOUND, "task_not_found");

    let bad = call(&app, Method::GET, &format!("{base}?status=asleep"), None).await;
    assert_error(&bad, StatusCode::BAD_REQUEST, "bad_request");
    // A stage never entered has no members; an unknown execution is a 404.
    let (status, none) = call(
        &app,
        Method::GET,
        &format!("/api/v1/executions/{id}/stages/5/members"),
        None,
    )
    .await;
    assert_eq!(
        (status, none),
        (StatusCode::OK, json!({"members": [], "next_after": null}))
    );
}

/// The dashboard's three files, with their policy, even without the token (they hold no
/// data); nothing else outside the API.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_is_served_with_its_policy() {
    let engine = engine("confluo_serve_dashboard").await;
    let guarded = Config::new("0.0.0.0:8080".parse().unwrap()).token("s3cret");
    for config in [local(), guarded] {
        let app = confluo_serve::router(engine.clone(), &config).unwrap();
        for (path, kind, marker) in [
            ("/", "text/html", "<main id=\"view\">"),
            ("/ui/app.js", "text/javascript", "textContent"),
            ("/ui/app.css", "text/css", ".countdown"),
        ] {
            let response = app
                .clone()
                .oneshot(Request::get(path).body(Body::empty()).unwrap())
                .await
                .unwrap();
            assert_eq!(response.status(), StatusCode::OK, "{path}");
            let headers = response.headers().clone();
            assert!(
                headers[header::CONTENT_TYPE]
                    .to_str()
                    .unwrap()
                    .starts_with(kind),
                "{path}: {headers:?}"
            );
            let policy = headers[header::CONTENT_SECURITY_POLICY].to_str().unwrap();
            assert!(policy.contains("script-src 'self'"), "{policy}");
            assert!(policy.contains("frame-ancestors 'none'"), "{policy}");
            assert!(!policy.contains("unsafe"), "{policy}");
            let body = response.into_body().collect().await.unwrap().to_bytes();
            assert!(
                String::from_utf8_lossy(&body).contains(marker),
                "{path} lacks {marker}"
            );
        }
        let missing = call(&app, Method::GET, "/ui/other.js", None).await;
        assert!(
            missing.0 == StatusCode::NOT_FOUND || missing.0 == StatusCode::UNAUTHORIZED,
            "{missing:?}"
        );
    }
}

async fn dead_members_first_task(app: &Router, base: &str) -> String {
    let (_, page) = call(
        app,
        Method::GET,
        &format!("{base}?status=dead&limit=1"),
        None,
    )
    .await;
    page["members"][0]["task_id"].as_str().unwrap().to_owned()
}

/// Readiness reads no row: it says whether the schema is there, and says how to fix it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ready_says_when_the_schema_is_missing() {
    let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| {
        confluo_testkit::server::process_local_url()
            .expect("no DATABASE_URL, and no throwaway PostgreSQL could start")
    });
    let admin: sqlx::postgres::PgConnectOptions = url.parse().unwrap();
    let options = confluo_testkit::fresh_database(&admin, "confluo_serve_unmigrated")
        .await
        .unwrap();
    let engine = confluo::ConnectBuilder::from_options(options)
        .max_connections(2)
        .connect()
        .await
        .unwrap();
    let app = confluo_serve::router(engine.clone(), &local()).unwrap();
    let answer = call(&app, Method::GET, "/api/v1/ready", None).await;
    assert_error(&answer, StatusCode::SERVICE_UNAVAILABLE, "not_migrated");
    assert!(
        answer.1["message"]
            .as_str()
            .unwrap()
            .contains("confluo migrate"),
        "{}",
        answer.1
    );
    let (status, _) = call(&app, Method::GET, "/api/v1/health", None).await;
    assert_eq!(status, StatusCode::OK);
    engine.migrate().await.unwrap();
    let (status, body) = call(&app, Method::GET, "/api/v1/ready", None).await;
    assert_eq!((status, body), (StatusCode::OK, json!({"status": "ready"})));
}
