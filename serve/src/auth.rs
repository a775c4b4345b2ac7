//! The guard in front of every route: the bearer token, when one is configured (the
//! health and readiness probes and the dashboard's files, which hold no data, excepted),
//! and the write switch; without a token, a guard against DNS rebinding (loopback
//! `Host` names only).

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
    // Without a token the API is open to whoever reaches loopback, which a web page can
    // do by rebinding its own name to 127.0.0.1: only loopback names are answered then.
    if state.token.is_none() && !loopback_host(&request) {
        return ApiError::new(
            StatusCode::FORBIDDEN,
            "host_not_allowed",
            "without a token this API answers only requests to localhost, 127.0.0.1 or \
             [::1] (a DNS-rebinding guard): use one of those, or set CONFLUO_API_TOKEN",
        )
        .into_response();
    }
    let reads = [Method::GET, Method::HEAD, Method::OPTIONS];
    if !state.writes && !reads.contains(request.method()) {
        return ApiError::new(
            StatusCode::FORBIDDEN,
            "writes_disabled",
            "this server is read-only (started with --read-only): starting, cancelling, \
             signalling and reprocessing are turned off",
        )
        .into_response();
    }
    next.run(request).await
}

/// Whether the request's `Host` (if any: a browser always sends one) names loopback.
fn loopback_host(request: &Request) -> bool {
    let Some(host) = request.headers().get(header::HOST) else {
        return true;
    };
    let Ok(host) = host.to_str() else {
        return false;
    };
    let name = match host.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or_default(),
        None => host.rsplit_once(':').map_or(host, |(name, _)| name),
    };
    name.eq_ignore_ascii_case("localhost")
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// Whether the request carries the token, compared in constant time.
fn bearer_matches(request: &Request, token: &str) -> bool {
    let Some(value) = request.headers().get(header::AUTHORIZATION) else {
        return false;
    };
    let Some(given) = value.to_str().ok().and_then(|v| v.strip_prefix("Bearer ")) else {
        return false;
    };
    given
        .trim()
        .as_bytes()
        .ct_eq(token.trim().as_bytes())
        .into()
}
