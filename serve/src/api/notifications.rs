//! Webhook notifications: how the announcements of executions' ends are being delivered.

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use confluo::{ExecutionId, Notification};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};
use uuid::Uuid;

use super::{limit, Params, PathOf};
use crate::{ApiError, AppState};

/// An execution's notifications, oldest first: one per end, with its delivery state.
#[utoipa::path(
    get, path = "/api/v1/executions/{id}/notifications", tag = "notifications",
    params(("id" = Uuid, Path, description = "The execution")),
    responses(
        (status = 200, description = "Its notifications", body = [Notification]),
        (status = 404, description = "No such execution", body = ApiError),
    )
)]
pub(crate) async fn of_execution(
    State(state): State<AppState>,
    PathOf(id): PathOf<Uuid>,
) -> Result<Json<Vec<Notification>>, ApiError> {
    let id = ExecutionId(id);
    let found = state.engine.notifications(id).await?;
    if found.is_empty() {
        state.engine.status(id).await?; // 404 for an unknown execution
    }
    Ok(Json(found))
}

/// Which notifications to list.
#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
pub(crate) struct ListQuery {
    /// Only those in this state: pending, delivered or failed.
    status: Option<String>,
    /// At most this many (1 to 1000; 50 by default).
    limit: Option<usize>,
}

/// Notifications, the newest first: e.g. `?status=failed` for the receivers given up on.
#[utoipa::path(
    get, path = "/api/v1/notifications", tag = "notifications",
    params(ListQuery),
    responses(
        (status = 200, description = "The newest first", body = [Notification]),
        (status = 400, description = "Bad filter", body = ApiError),
    )
)]
pub(crate) async fn list(
    State(state): State<AppState>,
    Params(query): Params<ListQuery>,
) -> Result<Json<Vec<Notification>>, ApiError> {
    if let Some(status) = &query.status {
        if !["pending", "delivered", "failed"].contains(&status.as_str()) {
            return Err(ApiError::bad_request(format!(
                "status {status:?}: expected pending, delivered or failed"
            )));
        }
    }
    let limit = limit(query.limit, 50)?;
    Ok(Json(
        state
            .engine
            .notifications_in(query.status.as_deref(), limit)
            .await?,
    ))
}

/// What a retry did.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct RetryResponse {
    /// Always true: a notification that was not failed answers 409.
    retried: bool,
}

/// Sends a failed notification again, with a fresh attempt budget, now.
#[utoipa::path(
    post, path = "/api/v1/notifications/{id}/retry", tag = "notifications",
    params(("id" = Uuid, Path, description = "The notification")),
    responses(
        (status = 200, description = "Queued again", body = RetryResponse),
        (status = 409, description = "It is not failed (pending, delivered, or unknown)", body = ApiError),
    )
)]
pub(crate) async fn retry(
    State(state): State<AppState>,
    PathOf(id): PathOf<Uuid>,
) -> Result<Json<RetryResponse>, ApiError> {
    if state.engine.retry_notification(id).await? {
        return Ok(Json(RetryResponse { retried: true }));
    }
    Err(ApiError::new(
        StatusCode::CONFLICT,
        "not_failed",
        format!("notification {id} is not failed (it is pending, delivered, or unknown): only a failed one is sent again"),
    ))
}
