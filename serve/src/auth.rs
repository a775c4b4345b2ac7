//! The guard in front of every route: the bearer token, when one is configured (the
//! health and readiness probes and the dashboard's files, which hold no data, excepted),
//! and the write switch.

use axum::extract::{Request, State};
use axum::http::{header, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use subtle::ConstantTimeEq;

use crate::{ApiError, AppState};

/// Paths a load balancer or orchestrator probes without credentials.
const PROBES: [&str; 2] = ["/api/v1/health", "/api/v1/ready"];

pub(crate) async fn guard(State(state): State<AppState>, request: Request, next: Next) -> Response {
    if let Some(token) = &state.token {
        let path = request.uri().path();
        let open = PROBES.contains(&path) || crate::dashboard::is_dashboard(path);
        if !open && !bearer_matches(&request, token) {
            return ApiError::new(
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "this API needs `Authorization: Bearer <token>` (the token `confluo serve` \
                 was started with, from CONFLUO_API_TOKEN)",
            )
            .into_response();
        }
    }
    let reads = [Method::GET, Method::HEAD, Method::OPTIONS];
    if !state.writes && !reads.contains(request.method()) {
        return ApiError::new(
            StatusCode::FORBIDDEN,
            "writes_disabled",
            "this server is read-only (started with --read-only): starting, cancelling and \
             reprocessing are turned off",
        )
        .into_response();
    }
    next.run(request).await
}

/// Whether the request carries the token, compared in constant time.
fn bearer_matches(request: &Request, token: &str) -> bool {
    let Some(value) = request.headers().get(header::AUTHORIZATION) else {
        return false;
    };
    let Some(given) = value.to_str().ok().and_then(|v| v.strip_prefix("Bearer ")) else {
        return false;
    };
    given.trim().as_bytes().ct_eq(token.as_bytes()).into()
}
