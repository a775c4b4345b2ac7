//! The OpenAPI document, generated from the handlers' annotations and the result types'
//! schemas (confluo's `openapi` feature).

use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityScheme};
use utoipa::{Modify, OpenApi};

use crate::api::{dead_letters, executions, notifications, system};

/// The API's OpenAPI document: `ApiDoc::openapi()`, served at `/api/v1/openapi.json`.
#[derive(Debug, OpenApi)]
#[openapi(
    info(
        title = "confluo",
        description = "Durable workflows on PostgreSQL with exactly-once fan-in: executions, \
                       dead letters, workflows, workers and stats. Errors are \
                       `{status, code, message}`.",
    ),
    paths(
        executions::start,
        executions::list,
        executions::get,
        executions::cancel,
        executions::signal,
        executions::members,
        executions::task,
        notifications::of_execution,
        notifications::list,
        notifications::retry,
        dead_letters::list,
        dead_letters::show,
        dead_letters::reprocess,
        dead_letters::reprocess_matching,
        system::health,
        system::ready,
        system::openapi,
        system::workflows,
        system::workers,
        system::stats,
    ),
    modifiers(&BearerToken),
    tags(
        (name = "executions", description = "Start, list, inspect, cancel and signal executions"),
        (name = "dead letters", description = "Members that kept failing, and reprocessing them"),
        (name = "notifications", description = "Webhooks announcing executions' ends, and their delivery"),
        (name = "system", description = "Probes, workflows, workers and stats"),
    )
)]
pub struct ApiDoc;

/// The bearer token scheme, required when the server has a token.
struct BearerToken;

impl Modify for BearerToken {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(Http::new(HttpAuthScheme::Bearer)),
        );
        openapi.security = Some(vec![utoipa::openapi::security::SecurityRequirement::new(
            "bearer",
            Vec::<String>::new(),
        )]);
    }
}
