//! The guard in front of every route: the bearer token, when one is configured (the
//! health and readiness probes and the dashboard's files, which hold no data, excepted),
//! and the write switch; without a token, a guard against DNS rebinding (loopback
//! `Host` names only); and, token or not, a guard against cross-site writes (CSRF): a
//! write must come from the same origin (`Sec-Fetch-Site`, `Origin`) and carry what no
//! cross-site form can send without the browser asking first (a JSON content type, or
//! the [`CLIENT_HEADER`]).

use std::net::SocketAddr;

use axum::extract::{ConnectInfo, Request, State};
use axum::http::{header, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use subtle::ConstantTimeEq;

use crate::{ApiError, AppState};

/// A header any client of the API may send on a write instead of a JSON content type
/// (a write without a body: cancel, reprocess, retry). A cross-site page cannot set it
/// without a CORS preflight, which this server never answers.
pub const CLIENT_HEADER: &str = "x-confluo-client";

/// Paths a load balancer or orchestrator probes without credentials.
const PROBES: [&str; 2] = ["/api/v1/health", "/api/v1/ready"];

pub(crate) async fn guard(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let path = request.uri().path();
    let open = PROBES.contains(&path) || crate::dashboard::is_dashboard(path);
    if let Some(token) = &state.token {
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
    // Without a token the API answers this machine only: the real peer (not the listen
    // address, nor a `Host` header, which say nothing of who connected) must be loopback,
    // and not a proxy that says it forwards someone else's request (one that adds no
    // forwarding header cannot be told from a local client: behind a proxy, set a token).
    if state.token.is_none() && !state.open_beyond_loopback && !open {
        if let Some(refusal) = not_from_this_machine(&request) {
            return refusal.into_response();
        }
    }
    // Without a token the API is open to whoever reaches loopback, which a web page can
    // do by rebinding its own name to 127.0.0.1: only loopback names are answered then
    // (unless it was opened to anyone, rebinding included).
    if state.token.is_none() && !state.open_beyond_loopback && !loopback_host(&request) {
        return ApiError::new(
            StatusCode::FORBIDDEN,
            "host_not_allowed",
            "without a token this API answers only requests to localhost, 127.0.0.1 or \
             [::1] (a DNS-rebinding guard): use one of those, or set CONFLUO_API_TOKEN",
        )
        .into_response();
    }
    let reads = [Method::GET, Method::HEAD, Method::OPTIONS];
    if !reads.contains(request.method()) {
        if let Some(refusal) = cross_site(&request) {
            return refusal.into_response();
        }
    }
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

/// Headers a reverse proxy adds: a request that carries one was forwarded for someone
/// else, whatever the peer's address.
const FORWARDED: [&str; 3] = ["forwarded", "x-forwarded-for", "x-real-ip"];

/// Why a request must be refused by a server without a token, if it must: its peer is not
/// loopback, or is not known (the router was served without connect info), or it was
/// forwarded by a proxy.
fn not_from_this_machine(request: &Request) -> Option<ApiError> {
    let refuse = |why: String| {
        Some(ApiError::new(
            StatusCode::FORBIDDEN,
            "token_required",
            format!(
                "without a token this API answers only requests from this machine, and {why}: \
                 set a token (CONFLUO_API_TOKEN for `confluo serve`, Config::token)"
            ),
        ))
    };
    let peer = request
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|c| c.0);
    match peer {
        None => refuse(
            "this server cannot tell who connected (serve the router with \
             `into_make_service_with_connect_info::<SocketAddr>()`, as `confluo_serve::serve` does)"
                .to_owned(),
        ),
        Some(peer) if !peer.ip().is_loopback() => {
            refuse(format!("this request came from {}", peer.ip()))
        }
        Some(_) => match FORWARDED
            .iter()
            .find(|h| request.headers().contains_key(**h))
        {
            Some(header) => refuse(format!(
                "this one came through a proxy (it carries `{header}`): behind a proxy, \
                 every request needs the token"
            )),
            None => None,
        },
    }
}

/// Why a write must be refused as cross-site, if it must: a browser says it comes from
/// another site (`Sec-Fetch-Site`), or names another origin (`Origin`, or `null`), or it
/// carries neither a JSON content type nor [`CLIENT_HEADER`] (what a cross-site form,
/// which may only send `application/x-www-form-urlencoded`, `multipart/form-data` or
/// `text/plain` without a preflight, cannot add).
fn cross_site(request: &Request) -> Option<ApiError> {
    let headers = request.headers();
    let refuse = |why: &str| {
        Some(ApiError::new(
            StatusCode::FORBIDDEN,
            "cross_site_write",
            format!(
                "this write is refused as cross-site (CSRF): {why}; send writes from the \
                 dashboard's own origin, or from a client that sets `Content-Type: \
                 application/json` or the `{CLIENT_HEADER}` header"
            ),
        ))
    };
    if let Some(site) = headers.get("sec-fetch-site") {
        let site = site.to_str().unwrap_or("cross-site");
        if site != "same-origin" && site != "none" {
            return refuse(&format!("the browser says it comes from a {site} page"));
        }
    }
    // A browser that says same-origin has decided; otherwise the origin must name this
    // server as the request reached it (`Host`) or as a proxy says it was asked for
    // (`X-Forwarded-Host`: behind a proxy, `Host` is often the upstream's).
    let same_origin = headers
        .get("sec-fetch-site")
        .is_some_and(|s| s.as_bytes() == b"same-origin");
    if let (false, Some(origin)) = (same_origin, headers.get(header::ORIGIN)) {
        let origin = origin.to_str().unwrap_or("null");
        let same = [header::HOST.as_str(), "x-forwarded-host"]
            .into_iter()
            .filter_map(|h| headers.get(h).and_then(|v| v.to_str().ok()))
            .any(|host| {
                origin.split_once("://").is_some_and(|(scheme, rest)| {
                    matches!(scheme, "http" | "https") && rest.eq_ignore_ascii_case(host)
                })
            });
        if !same {
            return refuse(&format!("its origin {origin} is not this server's"));
        }
    }
    let json = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("application/json"));
    if !json && !headers.contains_key(CLIENT_HEADER) {
        return refuse("it has neither a JSON content type nor the client header");
    }
    None
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
