//! What the API tests share: a fresh database per test, a loopback configuration, one
//! request sent through the router, and the shape of an error.
#![allow(dead_code)]

use axum::body::Body;
use axum::http::{header, Method, Request, StatusCode};
use axum::Router;
use confluo::Engine;
use confluo_serve::Config;
use http_body_util::BodyExt;
use serde_json::Value;
use tower::ServiceExt;

/// A fresh, migrated database of its own for each test.
pub async fn engine(database: &str) -> Engine {
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

pub fn local() -> Config {
    Config::new("127.0.0.1:0".parse().unwrap())
}

/// What axum's connect info says of a client on this machine.
pub fn loopback_peer() -> axum::extract::ConnectInfo<std::net::SocketAddr> {
    axum::extract::ConnectInfo(([127, 0, 0, 1], 40_000).into())
}

/// Sends one request; returns its status and JSON body (`null` when empty).
pub async fn call(
    app: &Router,
    method: Method,
    uri: &str,
    body: Option<Value>,
) -> (StatusCode, Value) {
    call_with(app, method, uri, body, None).await
}

pub async fn call_with(
    app: &Router,
    method: Method,
    uri: &str,
    body: Option<Value>,
    token: Option<&str>,
) -> (StatusCode, Value) {
    // As `confluo_serve::serve` serves it: the peer known, here this machine.
    let mut request = Request::builder()
        .method(method)
        .uri(uri)
        .extension(loopback_peer());
    if let Some(token) = token {
        request = request.header(header::AUTHORIZATION, format!("Bearer {token}"));
    }
    let request = match body {
        Some(body) => request
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from(body.to_string())),
        // A client of the API names itself on a write without a body (the CSRF guard).
        None => request
            .header("x-confluo-client", "test")
            .body(Body::empty()),
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
pub fn assert_error(answer: &(StatusCode, Value), status: StatusCode, code: &str) {
    let (got, body) = answer;
    assert_eq!(*got, status, "{body}");
    assert_eq!(body["status"], status.as_u16(), "{body}");
    assert_eq!(body["code"], code, "{body}");
    assert!(
        body["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{body}"
    );
}
