//! The `workflow` table: registered definitions.

use chrono::{DateTime, Utc};
use sqlx::types::Json;
use sqlx::PgPool;

use crate::definition::Workflow;
use crate::error::{Error, Result};

/// Stores a definition; registering the same one again is a no-op, a different one under
/// the same name and version is a conflict.
pub(crate) async fn register(pool: &PgPool, workflow: &Workflow) -> Result<()> {
    let inserted = super::query(
        "INSERT INTO confluo.workflow (name, version, definition) VALUES ($1, $2, $3)
         ON CONFLICT (name, version) DO NOTHING",
    )
    .bind(workflow.name())
    .bind(workflow.version())
    .bind(Json(workflow))
    .execute(pool)
    .await?
    .rows_affected();
    if inserted == 1 {
        return Ok(());
    }
    let stored = load(pool, workflow.name(), Some(workflow.version())).await?;
    if &stored == workflow {
        Ok(())
    } else {
        Err(Error::DefinitionConflict {
            name: workflow.name().to_owned(),
            version: workflow.version(),
        })
    }
}

/// Loads one version, or the latest when `version` is `None`.
pub(crate) async fn load<'e, E>(executor: E, name: &str, version: Option<i32>) -> Result<Workflow>
where
    E: super::Executor<'e>,
{
    let row: Option<(Json<Workflow>,)> = super::query_as(
        "SELECT definition FROM confluo.workflow
          WHERE name = $1 AND ($2::int IS NULL OR version = $2)
          ORDER BY version DESC LIMIT 1",
    )
    .bind(name)
    .bind(version)
    .fetch_optional(executor)
    .await?;
    row.map(|(Json(wf),)| wf)
        .ok_or_else(|| Error::WorkflowNotFound {
            name: name.to_owned(),
            version,
        })
}

/// The latest registered version of `name`.
pub(crate) async fn latest_version<'e, E>(executor: E, name: &str) -> Result<i32>
where
    E: super::Executor<'e>,
{
    let version: Option<i32> =
        super::query_scalar("SELECT max(version) FROM confluo.workflow WHERE name = $1")
            .bind(name)
            .fetch_one(executor)
            .await?;
    version.ok_or_else(|| Error::WorkflowNotFound {
        name: name.to_owned(),
        version: None,
    })
}

/// Every registered version of every workflow (or of `name`), by name, newest version
/// first, with when it was registered.
pub(crate) async fn all<'e, E>(
    executor: E,
    name: Option<&str>,
) -> Result<Vec<(Workflow, DateTime<Utc>)>>
where
    E: super::Executor<'e>,
{
    let rows: Vec<(Json<Workflow>, DateTime<Utc>)> = super::query_as(
        "SELECT definition, created_at FROM confluo.workflow
          WHERE $1::text IS NULL OR name = $1
          ORDER BY name, version DESC",
    )
    .bind(name)
    .fetch_all(executor)
    .await?;
    Ok(rows.into_iter().map(|(Json(w), at)| (w, at)).collect())
}
