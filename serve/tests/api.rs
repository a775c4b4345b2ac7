//! The HTTP API against a real PostgreSQL: executions started, listed, inspected and
//! cancelled; a dead letter reprocessed until its execution completes; JSON errors with
//! their statuses and codes; the OpenAPI document; and a real socket with a graceful
//! shutdown. (The guards: `security.rs`; members page by page: `members.rs`.)

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{header, Method, Request, StatusCode};
use common::{assert_error, call, engine, local};
use confluo::{ExecutionId, ExecutionStatus, TaskError, Workflow};
use confluo_serve::{Config, ServeError};
use serde_json::{json, Value};
use tower::ServiceExt;

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
    // The auditor workers run by themselves: nothing unrepaired on a healthy database.
    assert_eq!(stats["auditor"]["unrepaired"], json!([]), "{stats}");
    assert!(stats["auditor"]["rounds"].is_u64(), "{stats}");
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

/// A signal through the API: kept before its wait, a duplicate is harmless, an unknown
/// name and a payload the next stage cannot take are refused, an ended execution is a
/// conflict.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn signals_through_the_api() {
    let engine = engine("confluo_serve_signals").await;
    engine
        .register(
            &Workflow::new("approve", 1)
                .stage(confluo::Stage::signal("approval"))
                .map("each"),
        )
        .await
        .unwrap();
    let app = confluo_serve::router(engine.clone(), &local()).unwrap();
    let id = engine.start("approve", &json!(null)).await.unwrap();
    let url = format!("/api/v1/executions/{id}/signals/approval");
    let refused = call(&app, Method::POST, &url, Some(json!({"not": "a list"}))).await;
    assert_error(&refused, StatusCode::BAD_REQUEST, "invalid_signal");
    let unknown = call(
        &app,
        Method::POST,
        &format!("/api/v1/executions/{id}/signals/aproval"),
        Some(json!(1)),
    )
    .await;
    assert_error(&unknown, StatusCode::NOT_FOUND, "unknown_signal");
    let (status, received) = call(&app, Method::POST, &url, Some(json!([1, 2]))).await;
    assert_eq!(
        (status, received),
        (StatusCode::OK, json!({"outcome": "received"}))
    );
    let (status, again) = call(&app, Method::POST, &url, Some(json!([3]))).await;
    assert_eq!(
        (status, again),
        (StatusCode::OK, json!({"outcome": "already_received"}))
    );
    let (_, got) = call(&app, Method::GET, &format!("/api/v1/executions/{id}"), None).await;
    assert_eq!(got["stages"][1]["width"], 2, "{got}");
    assert!(engine.cancel(id).await.unwrap());
    let ended = call(&app, Method::POST, &url, Some(json!([1]))).await;
    assert_error(&ended, StatusCode::CONFLICT, "already_ended");
}

/// A parent's children through the API: listed with `?parent=`, each naming its parent;
/// cancelling the parent cancels them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn child_workflows_through_the_api() {
    let engine = engine("confluo_serve_children").await;
    engine
        .register(&Workflow::new("child", 1).step("work"))
        .await
        .unwrap();
    engine
        .register(&Workflow::new("parent", 1).map_workflow("each", "child"))
        .await
        .unwrap();
    let app = confluo_serve::router(engine.clone(), &local()).unwrap();
    let id = engine.start("parent", &json!([1, 2, 3])).await.unwrap();
    let list = format!("/api/v1/executions?parent={id}");
    let (status, children) = call(&app, Method::GET, &list, None).await;
    assert_eq!(status, StatusCode::OK);
    let children = children.as_array().unwrap().clone();
    assert_eq!(children.len(), 3, "{children:?}");
    let first = children[0]["id"].as_str().unwrap();
    let (_, child) = call(
        &app,
        Method::GET,
        &format!("/api/v1/executions/{first}"),
        None,
    )
    .await;
    assert_eq!(child["parent"], json!(id.to_string()), "{child}");
    let (_, parent) = call(&app, Method::GET, &format!("/api/v1/executions/{id}"), None).await;
    assert_eq!(parent["stages"][0]["kind"], "map_workflow", "{parent}");
    assert!(engine.cancel(id).await.unwrap());
    let (_, children) = call(&app, Method::GET, &format!("{list}&status=cancelled"), None).await;
    assert_eq!(children.as_array().unwrap().len(), 3, "{children}");
    let bad = call(&app, Method::GET, "/api/v1/executions?parent=nope", None).await;
    assert_error(&bad, StatusCode::BAD_REQUEST, "bad_request");
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
        .extension(common::loopback_peer())
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from("{not json"))
        .unwrap();
    let response = app.clone().oneshot(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    // Nothing was started by any of it.
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
        ("post", "/api/v1/executions/{id}/signals/{name}"),
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
        "AuditorStatus",
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
