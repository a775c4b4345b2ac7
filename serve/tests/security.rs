//! The API's guards against a real PostgreSQL: the token beyond loopback, the write
//! switch, the DNS-rebinding guard without a token, the dashboard's files and their
//! policy, and readiness.

mod common;

use axum::body::Body;
use axum::http::{header, Method, Request, StatusCode};
use common::{assert_error, call, call_with, engine, local, loopback_peer};
use confluo::Workflow;
use confluo_serve::{Config, ServeError};
use http_body_util::BodyExt;
use serde_json::json;
use tower::ServiceExt;

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
                    .extension(loopback_peer())
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

/// A cross-site form cannot write, token or not: the request a page on another origin
/// sends (`Origin`, `Sec-Fetch-Site`, a form's content type) is refused, and the
/// execution it aimed at runs on; the dashboard's own calls and API clients go through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cross_site_writes_are_refused() {
    let engine = engine("confluo_serve_csrf").await;
    engine
        .register(&Workflow::new("csrf", 1).step("one"))
        .await
        .unwrap();
    let id = engine.start("csrf", &json!(null)).await.unwrap();
    let cancel = format!("/api/v1/executions/{id}/cancel");
    for config in [local(), local().token("s3cret")] {
        let app = confluo_serve::router(engine.clone(), &config).unwrap();
        let form = |origin: Option<&str>, site: Option<&str>, kind: &str| {
            let mut request = Request::post(cancel.as_str())
                .extension(loopback_peer())
                .header(header::HOST, "127.0.0.1:8080")
                .header(header::CONTENT_TYPE, kind)
                .header(header::AUTHORIZATION, "Bearer s3cret");
            if let Some(origin) = origin {
                request = request.header(header::ORIGIN, origin);
            }
            if let Some(site) = site {
                request = request.header("sec-fetch-site", site);
            }
            request.body(Body::from("a=1")).unwrap()
        };
        let refused = [
            // What a form on evil.example posts.
            form(
                Some("http://evil.example"),
                Some("cross-site"),
                "application/x-www-form-urlencoded",
            ),
            // An older browser: no Sec-Fetch-Site, another origin.
            form(Some("http://evil.example"), None, "text/plain"),
            // A sandboxed frame.
            form(Some("null"), None, "application/x-www-form-urlencoded"),
            // A page on another port of this machine is another site too.
            form(
                Some("http://127.0.0.1:9999"),
                Some("same-site"),
                "text/plain",
            ),
            // No origin named, but a form's content type and no client header.
            form(None, None, "multipart/form-data; boundary=x"),
        ];
        for request in refused {
            let response = app.clone().oneshot(request).await.unwrap();
            let status = response.status();
            let body = response.into_body().collect().await.unwrap().to_bytes();
            let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(status, StatusCode::FORBIDDEN, "{body}");
            assert_eq!(body["code"], "cross_site_write", "{body}");
        }
        assert_eq!(
            engine.status(id).await.unwrap(),
            confluo::ExecutionStatus::Running
        );
    }
    // Behind a proxy that sends the upstream's Host, the dashboard's write is told by its
    // browser's word (same-origin) or the proxy's (X-Forwarded-Host).
    let proxied = confluo_serve::router(engine.clone(), &local().token("s3cret")).unwrap();
    for (site, forwarded_host) in [
        (Some("same-origin"), None),
        (None, Some("confluo.example.com")),
    ] {
        let mut request = Request::post(format!(
            "/api/v1/executions/{}/cancel",
            uuid::Uuid::new_v4()
        ))
        .header(header::HOST, "127.0.0.1:8080")
        .header(header::ORIGIN, "https://confluo.example.com")
        .header(header::AUTHORIZATION, "Bearer s3cret")
        .header(confluo_serve::CLIENT_HEADER, "dashboard");
        if let Some(site) = site {
            request = request.header("sec-fetch-site", site);
        }
        if let Some(host) = forwarded_host {
            request = request.header("x-forwarded-host", host);
        }
        let response = proxied
            .clone()
            .oneshot(request.body(Body::empty()).unwrap())
            .await
            .unwrap();
        // Past the guard: that execution does not exist.
        assert_eq!(
            response.status(),
            StatusCode::NOT_FOUND,
            "{site:?} {forwarded_host:?}"
        );
    }
    // The dashboard's own call: same origin, the client header.
    let app = confluo_serve::router(engine.clone(), &local()).unwrap();
    let response = app
        .oneshot(
            Request::post(cancel.as_str())
                .extension(loopback_peer())
                .header(header::HOST, "127.0.0.1:8080")
                .header(header::ORIGIN, "http://127.0.0.1:8080")
                .header("sec-fetch-site", "same-origin")
                .header(confluo_serve::CLIENT_HEADER, "dashboard")
                .body(Body::empty())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(
        engine.status(id).await.unwrap(),
        confluo::ExecutionStatus::Cancelled
    );
}

/// Without a token, the API answers this machine only, judged by the real peer: not the
/// listen address (a router mounted on 0.0.0.0 with a loopback config), nor a loopback
/// `Host` (what a same-host reverse proxy sends by default). A peer beyond loopback, a
/// request a proxy forwarded, and a router served without connect info are refused;
/// the probes still answer; a token, or the loudly named opt-in, opens it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_token_only_this_machine_is_answered() {
    let engine = engine("confluo_serve_peer").await;
    let app = confluo_serve::router(engine.clone(), &local()).unwrap();
    let get = |peer: Option<[u8; 4]>, forwarded: Option<(&'static str, &'static str)>| {
        let mut request = Request::get("/api/v1/executions").header(header::HOST, "127.0.0.1:8080");
        if let Some(ip) = peer {
            request = request.extension(axum::extract::ConnectInfo(std::net::SocketAddr::from((
                ip, 50_000,
            ))));
        }
        if let Some((name, value)) = forwarded {
            request = request.header(name, value);
        }
        request.body(Body::empty()).unwrap()
    };
    let status_and_code = |app: axum::Router, request: Request<Body>| async move {
        let response = app.oneshot(request).await.unwrap();
        let status = response.status();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        let body: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
        (status, body["code"].as_str().unwrap_or_default().to_owned())
    };
    let refused = [
        get(Some([203, 0, 113, 7]), None),
        get(Some([10, 0, 0, 2]), None),
        get(
            Some([127, 0, 0, 1]),
            Some(("x-forwarded-for", "203.0.113.7")),
        ),
        get(Some([127, 0, 0, 1]), Some(("forwarded", "for=203.0.113.7"))),
        get(Some([127, 0, 0, 1]), Some(("x-real-ip", "203.0.113.7"))),
        get(None, None),
    ];
    for request in refused {
        let (status, code) = status_and_code(app.clone(), request).await;
        assert_eq!(
            (status, code.as_str()),
            (StatusCode::FORBIDDEN, "token_required")
        );
    }
    let (status, _) = status_and_code(app.clone(), get(Some([127, 0, 0, 1]), None)).await;
    assert_eq!(status, StatusCode::OK);
    // The probes answer anyone.
    let probe = Request::get("/api/v1/health")
        .extension(axum::extract::ConnectInfo(std::net::SocketAddr::from((
            [203, 0, 113, 7],
            50_000,
        ))))
        .body(Body::empty())
        .unwrap();
    assert_eq!(status_and_code(app.clone(), probe).await.0, StatusCode::OK);
    // A token lets a proxied request through; so does the opt-in, loudly named.
    let with_token = confluo_serve::router(engine.clone(), &local().token("s3cret")).unwrap();
    let mut request = get(
        Some([127, 0, 0, 1]),
        Some(("x-forwarded-for", "203.0.113.7")),
    );
    request
        .headers_mut()
        .insert(header::AUTHORIZATION, "Bearer s3cret".parse().unwrap());
    assert_eq!(status_and_code(with_token, request).await.0, StatusCode::OK);
    let open = confluo_serve::Config::new("0.0.0.0:8080".parse().unwrap())
        .insecure_open_to_anyone_without_a_token();
    let open = confluo_serve::router(engine.clone(), &open).unwrap();
    let mut remote = get(Some([203, 0, 113, 7]), None);
    remote
        .headers_mut()
        .insert(header::HOST, "10.0.0.5:8080".parse().unwrap());
    let (status, _) = status_and_code(open, remote).await;
    assert_eq!(status, StatusCode::OK);
}
