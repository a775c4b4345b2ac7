//! The dashboard: one HTML page, its script and its style sheet, compiled into the
//! binary (no build step, nothing to install), served at `/` and under `/ui/`. The page
//! holds no data and needs no token: it reads the API with the token the user gives it.

use axum::http::header;
use axum::response::{IntoResponse, Response};

const INDEX: &str = include_str!("../dashboard/index.html");
const SCRIPT: &str = include_str!("../dashboard/app.js");
const STYLE: &str = include_str!("../dashboard/app.css");

/// Paths the dashboard's files are served at (the token guard lets them through).
pub(crate) fn is_dashboard(path: &str) -> bool {
    matches!(path, "/" | "/ui/app.js" | "/ui/app.css")
}

/// Scripts and styles from this origin only, no framing, no sniffing: the page renders
/// API values as text, and this keeps it so even if a value slipped into HTML.
fn file(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (
                header::CONTENT_SECURITY_POLICY,
                "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; \
                 img-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
            ),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::REFERRER_POLICY, "no-referrer"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}

pub(crate) async fn index() -> Response {
    file("text/html; charset=utf-8", INDEX)
}

pub(crate) async fn script() -> Response {
    file("text/javascript; charset=utf-8", SCRIPT)
}

pub(crate) async fn style() -> Response {
    file("text/css; charset=utf-8", STYLE)
}
