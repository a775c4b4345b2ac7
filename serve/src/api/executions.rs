//! Executions: start, list, get, cancel, signal; one stage's members, and one member in
//! full.

use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use confluo::{
    Execution, ExecutionId, ExecutionStatus, ExecutionSummary, ListFilter, MemberDetail,
    MemberFilter, MemberPage, MemberStatus, SignalOutcome, StartOptions, TaskId,
};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::{IntoParams, ToSchema};
use uuid::Uuid;

use super::{limit, Body, Params, PathOf};
use crate::{ApiError, AppState};

/// What to start.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct StartRequest {
    /// The workflow's name.
    #[schema(example = "orders")]
    workflow: String,
    /// The first stage's input (`null` when left out).
    #[serde(default)]
    #[schema(value_type = Object)]
    input: Value,
    /// The version to run; the latest registered one when left out.
    version: Option<i32>,
    /// Starting twice with the same key (per workflow) returns the first execution, and
    /// starts nothing.
    idempotency_key: Option<String>,
    /// Seconds the execution has to finish; past them it is timed out.
    deadline_seconds: Option<f64>,
    /// A URL to POST to when it ends (a webhook through the outbox), instead of its
    /// workflow's.
    #[schema(example = "https://hooks.example.com/confluo")]
    callback: Option<String>,
}

/// A started execution.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct StartResponse {
    /// The execution.
    id: ExecutionId,
    /// False when an earlier start with the same idempotency key created it.
    created: bool,
}

/// Starts an execution.
#[utoipa::path(
    post, path = "/api/v1/executions", tag = "executions",
    request_body = StartRequest,
    responses(
        (status = 201, description = "Started", body = StartResponse),
        (status = 200, description = "Started before with this idempotency key: nothing new", body = StartResponse),
        (status = 400, description = "Bad input", body = ApiError),
        (status = 404, description = "No such workflow (or version)", body = ApiError),
    )
)]
pub(crate) async fn start(
    State(state): State<AppState>,
    Body(request): Body<StartRequest>,
) -> Result<(StatusCode, Json<StartResponse>), ApiError> {
    let mut options = StartOptions::new();
    if let Some(version) = request.version {
        options = options.version(version);
    }
    if let Some(key) = request.idempotency_key {
        options = options.idempotency_key(key);
    }
    if let Some(url) = request.callback {
        options = options.callback(url);
    }
    if let Some(seconds) = request.deadline_seconds {
        let deadline = Duration::try_from_secs_f64(seconds)
            .ok()
            .filter(|d| !d.is_zero())
            .ok_or_else(|| {
                ApiError::bad_request(format!(
                    "deadline_seconds {seconds}: expected a positive number of seconds"
                ))
            })?;
        options = options.deadline(deadline);
    }
    let started = state
        .engine
        .start_with(&request.workflow, &request.input, options)
        .await?;
    let status = if started.created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((
        status,
        Json(StartResponse {
            id: started.id,
            created: started.created,
        }),
    ))
}

/// Which executions to list.
#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
pub(crate) struct ListQuery {
    /// Only this workflow's.
    workflow: Option<String>,
    /// Only those in this status: running, completed, failed, cancelled, timed_out.
    status: Option<String>,
    /// Only the child workflows' executions this execution started.
    parent: Option<Uuid>,
    /// At most this many (1 to 1000; 50 by default).
    limit: Option<usize>,
}

/// Lists executions, the newest first.
#[utoipa::path(
    get, path = "/api/v1/executions", tag = "executions",
    params(ListQuery),
    responses(
        (status = 200, description = "The newest first", body = [ExecutionSummary]),
        (status = 400, description = "Bad filter", body = ApiError),
    )
)]
pub(crate) async fn list(
    State(state): State<AppState>,
    Params(query): Params<ListQuery>,
) -> Result<Json<Vec<ExecutionSummary>>, ApiError> {
    let mut filter = ListFilter::new().limit(limit(query.limit, 50)?);
    if let Some(workflow) = query.workflow {
        filter = filter.workflow(workflow);
    }
    if let Some(status) = query.status {
        let status: ExecutionStatus = status
            .parse()
            .map_err(|e: confluo::UnknownStatus| ApiError::bad_request(e.to_string()))?;
        filter = filter.status(status);
    }
    if let Some(parent) = query.parent {
        filter = filter.parent(ExecutionId::from(parent));
    }
    Ok(Json(state.engine.list(&filter).await?))
}

/// One execution: status, output or error, every stage's countdown, dead letters.
#[utoipa::path(
    get, path = "/api/v1/executions/{id}", tag = "executions",
    params(("id" = Uuid, Path, description = "The execution")),
    responses(
        (status = 200, description = "The execution", body = Execution),
        (status = 404, description = "No such execution", body = ApiError),
    )
)]
pub(crate) async fn get(
    State(state): State<AppState>,
    PathOf(id): PathOf<Uuid>,
) -> Result<Json<Execution>, ApiError> {
    Ok(Json(state.engine.execution(ExecutionId(id)).await?))
}

/// What a cancel did.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct CancelResponse {
    /// Always true: a cancel that changes nothing answers 409.
    cancelled: bool,
}

/// Cancels a running execution: its pending tasks are cancelled, running handlers see
/// their cancellation, and nothing is dispatched after them.
#[utoipa::path(
    post, path = "/api/v1/executions/{id}/cancel", tag = "executions",
    params(("id" = Uuid, Path, description = "The execution")),
    responses(
        (status = 200, description = "Cancelled", body = CancelResponse),
        (status = 404, description = "No such execution", body = ApiError),
        (status = 409, description = "It had already ended", body = ApiError),
    )
)]
pub(crate) async fn cancel(
    State(state): State<AppState>,
    PathOf(id): PathOf<Uuid>,
) -> Result<Json<CancelResponse>, ApiError> {
    let id = ExecutionId(id);
    if state.engine.cancel(id).await? {
        return Ok(Json(CancelResponse { cancelled: true }));
    }
    let status = state.engine.status(id).await?;
    Err(ApiError::new(
        StatusCode::CONFLICT,
        "already_ended",
        format!("execution {id} is {status}: only a running execution can be cancelled"),
    ))
}

/// What a signal did.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct SignalResponse {
    /// `received` (the wait completed with the payload, and the execution went on),
    /// `kept` (the execution has not reached the wait yet: it receives it on arrival) or
    /// `already_received` (a signal of this name came before: this one changed nothing,
    /// so a duplicated delivery is harmless). A signal too late for its wait, or to an
    /// execution that has ended, answers 409.
    #[schema(example = "received")]
    outcome: &'static str,
}

/// Sends the signal `name` to an execution, for its `Stage::signal` wait of that name.
/// The request body is the payload (any JSON), the wait's output.
#[utoipa::path(
    post, path = "/api/v1/executions/{id}/signals/{name}", tag = "executions",
    params(
        ("id" = Uuid, Path, description = "The execution"),
        ("name" = String, Path, description = "The signal: the name of the wait stage"),
    ),
    request_body(content = Object, description = "The payload: any JSON"),
    responses(
        (status = 200, description = "Received, kept, or a duplicate", body = SignalResponse),
        (status = 400, description = "The payload cannot feed the next stage", body = ApiError),
        (status = 404, description = "No such execution, or no wait of that name", body = ApiError),
        (status = 409, description = "Too late for its wait, or the execution has ended", body = ApiError),
    )
)]
pub(crate) async fn signal(
    State(state): State<AppState>,
    PathOf((id, name)): PathOf<(Uuid, String)>,
    Body(payload): Body<Value>,
) -> Result<Json<SignalResponse>, ApiError> {
    let id = ExecutionId(id);
    let outcome = match state.engine.signal(id, &name, payload).await? {
        SignalOutcome::Received => "received",
        SignalOutcome::Kept => "kept",
        SignalOutcome::AlreadyReceived => "already_received",
        SignalOutcome::TooLate => {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                "signal_too_late",
                format!(
                    "execution {id} is past its wait for {name:?} (it timed out): nothing kept"
                ),
            ))
        }
        SignalOutcome::Ended(status) => {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                "already_ended",
                format!("execution {id} is {status}: nothing kept"),
            ))
        }
        other => {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                "signal_refused",
                format!("execution {id}: {other:?}"),
            ))
        }
    };
    Ok(Json(SignalResponse { outcome }))
}

/// Which page of members to list.
#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
pub(crate) struct MembersQuery {
    /// Only members after this item index: the previous page's `next_after`.
    after: Option<u32>,
    /// Only members in this status: pending, running, completed, dead, cancelled.
    status: Option<String>,
    /// At most this many (1 to 1000; 100 by default).
    limit: Option<usize>,
}

/// A stage's members page by page, in item order (a page costs what it returns, however
/// wide the stage).
#[utoipa::path(
    get, path = "/api/v1/executions/{id}/stages/{stage}/members", tag = "executions",
    params(
        ("id" = Uuid, Path, description = "The execution"),
        ("stage" = usize, Path, description = "The stage's position, from 0"),
        MembersQuery,
    ),
    responses(
        (status = 200, description = "A page of members, and where the next one starts", body = MemberPage),
        (status = 400, description = "Bad filter", body = ApiError),
        (status = 404, description = "No such execution", body = ApiError),
    )
)]
pub(crate) async fn members(
    State(state): State<AppState>,
    PathOf((id, stage)): PathOf<(Uuid, usize)>,
    Params(query): Params<MembersQuery>,
) -> Result<Json<MemberPage>, ApiError> {
    let id = ExecutionId(id);
    let mut filter = MemberFilter::new().limit(limit(query.limit, 100)?);
    if let Some(after) = query.after {
        filter = filter.after(after);
    }
    if let Some(status) = query.status {
        let status: MemberStatus = status
            .parse()
            .map_err(|e: confluo::UnknownMemberStatus| ApiError::bad_request(e.to_string()))?;
        filter = filter.status(status);
    }
    let page = state.engine.member_page(id, stage, &filter).await?;
    if page.members.is_empty() {
        state.engine.status(id).await?; // 404 for an unknown execution
    }
    Ok(Json(page))
}

/// One member (a task) in full: status, input, output, every attempt's error.
#[utoipa::path(
    get, path = "/api/v1/tasks/{task}", tag = "executions",
    params(("task" = Uuid, Path, description = "The task")),
    responses(
        (status = 200, description = "The member", body = MemberDetail),
        (status = 404, description = "No such task", body = ApiError),
    )
)]
pub(crate) async fn task(
    State(state): State<AppState>,
    PathOf(task): PathOf<Uuid>,
) -> Result<Json<MemberDetail>, ApiError> {
    Ok(Json(state.engine.member(TaskId(task)).await?))
}
