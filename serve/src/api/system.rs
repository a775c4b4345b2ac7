//! What is not one execution: health and readiness, workflows, workers, stats, and the
//! OpenAPI document.

use axum::extract::State;
use axum::Json;
use confluo::{
    Activity, AuditorStatus, ExecutionCounts, QueueDepth, RegisteredWorkflow, WorkerInfo,
    WorkerState,
};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, OpenApi, ToSchema};

use super::Params;
use crate::{ApiDoc, ApiError, AppState};

/// A probe's answer.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct Health {
    /// `ok` (the process answers) or `ready` (and PostgreSQL answers, migrated).
    status: &'static str,
}

/// Liveness: the process answers. Needs no token.
#[utoipa::path(
    get, path = "/api/v1/health", tag = "system",
    responses((status = 200, description = "The process answers", body = Health))
)]
pub(crate) async fn health() -> Json<Health> {
    Json(Health { status: "ok" })
}

/// Readiness: PostgreSQL answers and confluo's schema is there. Needs no token.
#[utoipa::path(
    get, path = "/api/v1/ready", tag = "system",
    responses(
        (status = 200, description = "Ready", body = Health),
        (status = 503, description = "PostgreSQL does not answer, or is not migrated", body = ApiError),
    )
)]
pub(crate) async fn ready(State(state): State<AppState>) -> Result<Json<Health>, ApiError> {
    state.engine.ready().await?;
    Ok(Json(Health { status: "ready" }))
}

/// The API's OpenAPI 3.1 document.
#[utoipa::path(
    get, path = "/api/v1/openapi.json", tag = "system",
    responses((status = 200, description = "This document"))
)]
pub(crate) async fn openapi() -> Json<utoipa::openapi::OpenApi> {
    Json(ApiDoc::openapi())
}

/// Which workflows to list.
#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
pub(crate) struct WorkflowsQuery {
    /// Only the versions of this workflow.
    name: Option<String>,
}

/// Registered workflows, every version, by name, the newest version first.
#[utoipa::path(
    get, path = "/api/v1/workflows", tag = "system",
    params(WorkflowsQuery),
    responses((status = 200, description = "By name, newest version first", body = [RegisteredWorkflow]))
)]
pub(crate) async fn workflows(
    State(state): State<AppState>,
    Params(query): Params<WorkflowsQuery>,
) -> Result<Json<Vec<RegisteredWorkflow>>, ApiError> {
    Ok(Json(state.engine.workflows(query.name.as_deref()).await?))
}

/// Workers seen in the last hour: alive, lost (no heartbeat for three intervals) or
/// stopped.
#[utoipa::path(
    get, path = "/api/v1/workers", tag = "system",
    responses((status = 200, description = "Workers", body = [WorkerInfo]))
)]
pub(crate) async fn workers(
    State(state): State<AppState>,
) -> Result<Json<Vec<WorkerInfo>>, ApiError> {
    Ok(Json(state.engine.workers().await?))
}

/// Where things stand.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct Stats {
    /// Executions by status.
    executions: ExecutionCounts,
    /// Tasks due, scheduled (in backoff) and running.
    queue: QueueDepth,
    /// Workers by state.
    workers: WorkerCounts,
    /// Over the last hour: tasks by status, members finished per minute, the fan-in's
    /// hand-over time (read at most every few seconds, however many ask).
    activity: Activity,
    /// The queue's depth over the last hour, sampled by the server every 15 s, oldest first.
    queue_history: Vec<crate::history::DepthSample>,
    /// The auditor that workers run by themselves: when its last round ran, what its
    /// rounds found and repaired, and what they could not repair (empty when healthy).
    auditor: AuditorStatus,
}

/// Workers by state.
#[derive(Debug, Default, Serialize, ToSchema)]
pub(crate) struct WorkerCounts {
    /// Heartbeating.
    alive: u64,
    /// Silent for three heartbeat intervals.
    lost: u64,
    /// Stopped cleanly.
    stopped: u64,
}

/// Executions by status, the queue's depth, workers by state, and over the last hour:
/// tasks by status, throughput per minute and the fan-in's hand-over time.
#[utoipa::path(
    get, path = "/api/v1/stats", tag = "system",
    responses((status = 200, description = "Counts", body = Stats))
)]
pub(crate) async fn stats(State(state): State<AppState>) -> Result<Json<Stats>, ApiError> {
    let engine = &state.engine;
    let (executions, queue, workers, activity, auditor) = tokio::try_join!(
        engine.execution_counts(),
        engine.queue_depth(),
        engine.workers(),
        state.activity.read(engine),
        engine.auditor(),
    )?;
    let mut counts = WorkerCounts::default();
    for worker in workers {
        match worker.state {
            WorkerState::Alive => counts.alive += 1,
            WorkerState::Lost => counts.lost += 1,
            _ => counts.stopped += 1,
        }
    }
    Ok(Json(Stats {
        executions,
        queue,
        workers: counts,
        activity,
        queue_history: state.queue_history.samples(),
        auditor,
    }))
}
