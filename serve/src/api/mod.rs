//! The routes under `/api/v1`, and the extractors that turn malformed requests into the
//! API's JSON errors.

pub(crate) mod dead_letters;
pub(crate) mod executions;
pub(crate) mod notifications;
pub(crate) mod system;

use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::extract::{FromRequest, FromRequestParts};
use axum::routing::{get, post};
use axum::Router;

use crate::{ApiError, AppState};

/// Every route, behind the guard (token, write switch): the API, and the dashboard.
pub(crate) fn routes(state: AppState) -> Router {
    let api = Router::new()
        .route("/health", get(system::health))
        .route("/ready", get(system::ready))
        .route("/openapi.json", get(system::openapi))
        .route("/workflows", get(system::workflows))
        .route("/workers", get(system::workers))
        .route("/stats", get(system::stats))
        .route("/executions", get(executions::list).post(executions::start))
        .route("/executions/{id}", get(executions::get))
        .route("/executions/{id}/cancel", post(executions::cancel))
        .route("/executions/{id}/signals/{name}", post(executions::signal))
        .route(
            "/executions/{id}/stages/{stage}/members",
            get(executions::members),
        )
        .route("/tasks/{task}", get(executions::task))
        .route(
            "/executions/{id}/notifications",
            get(notifications::of_execution),
        )
        .route("/notifications", get(notifications::list))
        .route("/notifications/{id}/retry", post(notifications::retry))
        .route("/dead-letters", get(dead_letters::list))
        .route(
            "/dead-letters/reprocess",
            post(dead_letters::reprocess_matching),
        )
        .route("/dead-letters/{task}", get(dead_letters::show))
        .route(
            "/dead-letters/{task}/reprocess",
            post(dead_letters::reprocess),
        );
    Router::new()
        .route("/", get(crate::dashboard::index))
        .route("/ui/app.js", get(crate::dashboard::script))
        .route("/ui/app.css", get(crate::dashboard::style))
        .nest("/api/v1", api)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            crate::auth::guard,
        ))
        .layer(axum::extract::DefaultBodyLimit::max(crate::MAX_BODY_BYTES))
        .with_state(state)
}

async fn not_found(uri: axum::http::Uri) -> ApiError {
    ApiError::not_found(format!(
        "no route {}: the API is under /api/v1 (its OpenAPI document: /api/v1/openapi.json)",
        uri.path()
    ))
}

async fn method_not_allowed(method: axum::http::Method, uri: axum::http::Uri) -> ApiError {
    ApiError::new(
        axum::http::StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        format!(
            "{method} is not allowed on {}: see /api/v1/openapi.json",
            uri.path()
        ),
    )
}

/// A JSON body, or a 400 saying what is wrong with it.
#[derive(FromRequest)]
#[from_request(via(axum::Json), rejection(ApiError))]
pub(crate) struct Body<T>(pub(crate) T);

/// Query parameters, or a 400.
#[derive(FromRequestParts)]
#[from_request(via(axum::extract::Query), rejection(ApiError))]
pub(crate) struct Params<T>(pub(crate) T);

/// Path parameters, or a 400 (a malformed id) / 404.
#[derive(FromRequestParts)]
#[from_request(via(axum::extract::Path), rejection(ApiError))]
pub(crate) struct PathOf<T>(pub(crate) T);

impl From<JsonRejection> for ApiError {
    fn from(rejection: JsonRejection) -> Self {
        ApiError::bad_request(format!("the request body: {}", rejection.body_text()))
    }
}

impl From<QueryRejection> for ApiError {
    fn from(rejection: QueryRejection) -> Self {
        ApiError::bad_request(rejection.body_text())
    }
}

impl From<PathRejection> for ApiError {
    fn from(rejection: PathRejection) -> Self {
        ApiError::bad_request(format!(
            "{} (ids are UUIDs, stages are numbers from 0)",
            rejection.body_text()
        ))
    }
}

/// `limit`, or `default`, checked to be 1 to [`MAX_LIMIT`].
pub(crate) fn limit(limit: Option<usize>, default: usize) -> Result<usize, ApiError> {
    match limit.unwrap_or(default) {
        n @ 1..=MAX_LIMIT => Ok(n),
        n => Err(ApiError::bad_request(format!(
            "limit {n}: expected 1 to {MAX_LIMIT} (page with the filters instead)"
        ))),
    }
}

/// The most rows one request returns.
pub(crate) const MAX_LIMIT: usize = 1000;
