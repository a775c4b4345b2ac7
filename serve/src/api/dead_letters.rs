//! Dead letters: list, show, reprocess one, reprocess those matching a filter.

use axum::extract::State;
use axum::Json;
use confluo::{
    DeadLetterDetail, DeadLetterFilter, DeadLetterSummary, ExecutionId, Reprocessed, TaskId,
};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};
use uuid::Uuid;

use super::{limit, Body, Params, PathOf};
use crate::{ApiError, AppState};

/// Which dead letters to list.
#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
pub(crate) struct ListQuery {
    /// Only this workflow's.
    workflow: Option<String>,
    /// Only this execution's.
    execution: Option<Uuid>,
    /// At most this many (1 to 1000; 50 by default).
    limit: Option<usize>,
}

fn filter(workflow: Option<String>, execution: Option<Uuid>, limit: usize) -> DeadLetterFilter {
    let mut filter = DeadLetterFilter::new().limit(limit);
    if let Some(workflow) = workflow {
        filter = filter.workflow(workflow);
    }
    if let Some(execution) = execution {
        filter = filter.execution(ExecutionId(execution));
    }
    filter
}

/// Lists dead letters, the most recent first.
#[utoipa::path(
    get, path = "/api/v1/dead-letters", tag = "dead letters",
    params(ListQuery),
    responses(
        (status = 200, description = "The most recent first", body = [DeadLetterSummary]),
        (status = 400, description = "Bad filter", body = ApiError),
    )
)]
pub(crate) async fn list(
    State(state): State<AppState>,
    Params(query): Params<ListQuery>,
) -> Result<Json<Vec<DeadLetterSummary>>, ApiError> {
    let filter = filter(query.workflow, query.execution, limit(query.limit, 50)?);
    Ok(Json(state.engine.dead_letters(&filter).await?))
}

/// One dead letter, with its input and every attempt's error.
#[utoipa::path(
    get, path = "/api/v1/dead-letters/{task}", tag = "dead letters",
    params(("task" = Uuid, Path, description = "The dead-lettered task")),
    responses(
        (status = 200, description = "The dead letter", body = DeadLetterDetail),
        (status = 404, description = "No such task", body = ApiError),
        (status = 409, description = "The task is not dead-lettered", body = ApiError),
    )
)]
pub(crate) async fn show(
    State(state): State<AppState>,
    PathOf(task): PathOf<Uuid>,
) -> Result<Json<DeadLetterDetail>, ApiError> {
    Ok(Json(state.engine.dead_letter(TaskId(task)).await?))
}

/// Puts a dead letter back in the queue, with its attempts counted from 0 again; a failed
/// execution it failed resumes.
#[utoipa::path(
    post, path = "/api/v1/dead-letters/{task}/reprocess", tag = "dead letters",
    params(("task" = Uuid, Path, description = "The dead-lettered task")),
    responses(
        (status = 200, description = "Back in the queue", body = Reprocessed),
        (status = 404, description = "No such task", body = ApiError),
        (status = 409, description = "Not dead-lettered, or its execution cannot resume", body = ApiError),
    )
)]
pub(crate) async fn reprocess(
    State(state): State<AppState>,
    PathOf(task): PathOf<Uuid>,
) -> Result<Json<Reprocessed>, ApiError> {
    Ok(Json(state.engine.reprocess(TaskId(task)).await?))
}

/// Which dead letters to reprocess: a workflow's, an execution's, or both.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct ReprocessFilter {
    /// Only this workflow's.
    workflow: Option<String>,
    /// Only this execution's.
    execution: Option<Uuid>,
    /// At most this many (1 to 1000; 100 by default), the most recent first.
    limit: Option<usize>,
}

/// What a reprocess by filter did, task by task.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct ReprocessReport {
    /// Those put back in the queue.
    reprocessed: Vec<Reprocessed>,
    /// Those that could not be, and why.
    failed: Vec<ReprocessFailure>,
}

/// A dead letter a reprocess by filter could not put back.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct ReprocessFailure {
    /// The task.
    task_id: TaskId,
    /// Why.
    error: ApiError,
}

/// Reprocesses the dead letters matching a filter, one by one (each its own transaction:
/// one that cannot be reprocessed does not stop the others).
#[utoipa::path(
    post, path = "/api/v1/dead-letters/reprocess", tag = "dead letters",
    request_body = ReprocessFilter,
    responses(
        (status = 200, description = "Task by task", body = ReprocessReport),
        (status = 400, description = "No filter, or a bad one", body = ApiError),
    )
)]
pub(crate) async fn reprocess_matching(
    State(state): State<AppState>,
    Body(request): Body<ReprocessFilter>,
) -> Result<Json<ReprocessReport>, ApiError> {
    if request.workflow.is_none() && request.execution.is_none() {
        return Err(ApiError::bad_request(
            "name a workflow, an execution or both: reprocessing every dead letter at once is \
             not offered",
        ));
    }
    let filter = filter(
        request.workflow,
        request.execution,
        limit(request.limit, 100)?,
    );
    let mut report = ReprocessReport {
        reprocessed: Vec::new(),
        failed: Vec::new(),
    };
    for dead in state.engine.dead_letters(&filter).await? {
        match state.engine.reprocess(dead.task_id).await {
            Ok(done) => report.reprocessed.push(done),
            Err(error) => report.failed.push(ReprocessFailure {
                task_id: dead.task_id,
                error: error.into(),
            }),
        }
    }
    Ok(Json(report))
}
