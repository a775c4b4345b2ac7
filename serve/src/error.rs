//! Errors: the server's own ([`ServeError`]), and the API's answers ([`ApiError`]), which
//! are JSON with a status, a code a program can match on, and a message for a person.

use std::net::SocketAddr;

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;

/// Why the API could not be served.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServeError {
    /// Listening beyond loopback with no token would open the API to the network.
    #[error(
        "refusing to listen on {listen} without a token: anyone who can reach it could start \
         and cancel executions. Set a token (`confluo serve` reads CONFLUO_API_TOKEN), or \
         listen on 127.0.0.1"
    )]
    TokenRequired {
        /// The address asked for.
        listen: SocketAddr,
    },
    /// A token of only whitespace protects nothing.
    #[error("the API token is empty: set CONFLUO_API_TOKEN to a long random string")]
    EmptyToken,
    /// The address could not be bound.
    #[error("cannot listen on {listen}: {source} (is another process using the port?)")]
    Bind {
        /// The address asked for.
        listen: SocketAddr,
        /// What the system said.
        source: std::io::Error,
    },
    /// Accepting or serving connections failed.
    #[error("serving the API failed: {0}")]
    Io(std::io::Error),
}

/// An API error, as the JSON body `{"status", "code", "message"}` and its HTTP status.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct ApiError {
    /// The HTTP status, repeated in the body.
    pub status: u16,
    /// A stable, machine-readable code (`execution_not_found`, `invalid_input`, ...).
    pub code: &'static str,
    /// What went wrong and what to do, for a person.
    pub message: String,
}

impl ApiError {
    pub(crate) fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status: status.as_u16(),
            code,
            message: message.into(),
        }
    }

    pub(crate) fn bad_request(message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::BAD_REQUEST, "bad_request", message)
    }

    pub(crate) fn not_found(message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::NOT_FOUND, "not_found", message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut response = (status, Json(self)).into_response();
        if status == StatusCode::UNAUTHORIZED {
            response.headers_mut().insert(
                axum::http::header::WWW_AUTHENTICATE,
                axum::http::HeaderValue::from_static("Bearer"),
            );
        }
        response
    }
}

impl From<confluo::Error> for ApiError {
    fn from(error: confluo::Error) -> Self {
        use confluo::Error as E;
        let (status, code) = match &error {
            E::WorkflowNotFound { .. } => (StatusCode::NOT_FOUND, "workflow_not_found"),
            E::ExecutionNotFound(_) => (StatusCode::NOT_FOUND, "execution_not_found"),
            E::TaskNotFound(_) => (StatusCode::NOT_FOUND, "task_not_found"),
            E::UnknownSignal { .. } => (StatusCode::NOT_FOUND, "unknown_signal"),
            E::InvalidSignal { .. } => (StatusCode::BAD_REQUEST, "invalid_signal"),
            E::NotDeadLettered { .. } => (StatusCode::CONFLICT, "not_dead_lettered"),
            E::ExecutionNotResumable { .. } => (StatusCode::CONFLICT, "execution_not_resumable"),
            E::DeadlinePassed { .. } => (StatusCode::CONFLICT, "deadline_passed"),
            E::ResumeFailsAtOnce { .. } => (StatusCode::CONFLICT, "resume_fails_at_once"),
            E::ResumeMovesNothing { .. } => (StatusCode::CONFLICT, "resume_moves_nothing"),
            E::InvalidInput { .. } => (StatusCode::BAD_REQUEST, "invalid_input"),
            E::InvalidCallback { .. } => (StatusCode::BAD_REQUEST, "invalid_callback"),
            E::MapTooWide { .. } => (StatusCode::BAD_REQUEST, "map_too_wide"),
            E::Json(_) => (StatusCode::BAD_REQUEST, "invalid_json"),
            E::NotMigrated { .. } => (StatusCode::SERVICE_UNAVAILABLE, "not_migrated"),
            E::Connect(_) => (StatusCode::SERVICE_UNAVAILABLE, "database_unavailable"),
            E::Database(sqlx::Error::PoolTimedOut | sqlx::Error::Io(_)) => {
                (StatusCode::SERVICE_UNAVAILABLE, "database_unavailable")
            }
            _ => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
        };
        if status.is_server_error() {
            tracing::warn!(%error, code, "API request failed");
        }
        // A server error's text can name the database's host and port, a table, a
        // statement: it goes to the log above, and the client gets a stable answer.
        let message = match code {
            "not_migrated" => error.to_string(),
            "database_unavailable" => "PostgreSQL does not answer this server right now; \
                try again shortly (the server's log says why)"
                .to_owned(),
            _ if status.is_server_error() => "the server could not answer this request; its \
                log has the error, under the code `internal`"
                .to_owned(),
            _ => error.to_string(),
        };
        ApiError::new(status, code, message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_server_error_tells_the_client_nothing_of_the_database() {
        let leaky = "error returned from database: relation \"confluo.task\" is locked \
                     at 10.1.2.3:5432";
        for error in [
            confluo::Error::Database(sqlx::Error::Protocol(leaky.into())),
            confluo::Error::Database(sqlx::Error::Io(std::io::Error::other(leaky))),
        ] {
            let answer = ApiError::from(error);
            assert!(answer.status >= 500, "{answer:?}");
            assert!(!answer.message.contains("10.1.2.3"), "{answer:?}");
            assert!(!answer.message.contains("confluo.task"), "{answer:?}");
        }
    }
}
