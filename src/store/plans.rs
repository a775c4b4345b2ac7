//! The plans PostgreSQL chooses for the hot statements, as `EXPLAIN` prints them: the
//! diagnostics behind [`Engine::claim_plan`](crate::Engine::claim_plan) and
//! [`Engine::completion_plan`](crate::Engine::completion_plan), and what the tests read to
//! show that no plan depends on the table's statistics.
//!
//! A statement confluo runs is prepared once per connection, and PostgreSQL plans it
//! twice over its life: with the values of its parameters for its first five runs (a
//! custom plan), then, unless that looked cheaper, once for any values (the generic plan,
//! which guesses that an array parameter holds 10 elements). Both are shown: an `EXPLAIN`
//! with bound parameters only ever shows the first.

use std::fmt;

use sqlx::{PgConnection, Row};

use super::begin_on;
use crate::error::Result;

/// A statement's custom and generic plans.
#[derive(Debug, Clone)]
pub(crate) struct Plans {
    pub custom: String,
    pub generic: String,
}

impl fmt::Display for Plans {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "custom plan:\n{}\n\ngeneric plan:\n{}",
            self.custom, self.generic
        )
    }
}

/// Both plans of `sql`, whose parameters are of the SQL types `types` (`["uuid[]",
/// "int8"]`) and take the values `args` (in PostgreSQL's text form, as [`array`] writes
/// arrays), in a transaction that changes nothing (`EXPLAIN` without `ANALYZE` executes
/// nothing). The statement is prepared under a unique name and explained as `EXECUTE`d
/// with each `plan_cache_mode`; an `EXPLAIN` with bound parameters would only show the
/// custom plan. `conn` should be a connection of its own, closed afterwards: the prepared
/// statement is deallocated before this returns, but not if it fails half-way (`PREPARE`
/// is not undone by a rollback).
///
/// # Cancel safety
/// Dropped, it may leave that prepared statement on `conn`; nothing is written.
pub(crate) async fn explain(
    conn: &mut PgConnection,
    sql: &str,
    types: &[&str],
    args: &[String],
) -> Result<Plans> {
    let mut tx = begin_on(conn).await?;
    let tag = format!("c{}", uuid::Uuid::new_v4().simple());
    let name = format!("confluo_explain_{tag}");
    sqlx::raw_sql(&format!("PREPARE {name} ({}) AS {sql}", types.join(", ")))
        .execute(&mut *tx)
        .await?;
    // Dollar-quoted under a tag no value can contain by chance.
    let values: Vec<String> = args
        .iter()
        .zip(types)
        .map(|(value, ty)| format!("${tag}${value}${tag}$::{ty}"))
        .collect();
    let execute = format!("EXPLAIN EXECUTE {name} ({})", values.join(", "));
    let mut plans = Vec::with_capacity(2);
    for mode in ["force_custom_plan", "force_generic_plan"] {
        let sql = format!("SET LOCAL plan_cache_mode = {mode}; {execute}");
        let rows = sqlx::raw_sql(&sql).fetch_all(&mut *tx).await?;
        plans.push(lines(&rows));
    }
    let generic = plans.pop().unwrap_or_default();
    let custom = plans.pop().unwrap_or_default();
    sqlx::raw_sql(&format!("DEALLOCATE {name}"))
        .execute(&mut *tx)
        .await?;
    tx.rollback().await?;
    Ok(Plans { custom, generic })
}

/// A one-dimensional array in PostgreSQL's text form, each element quoted.
pub(crate) fn array<T: fmt::Display>(items: impl IntoIterator<Item = T>) -> String {
    let quoted: Vec<String> = items
        .into_iter()
        .map(|item| {
            let text = item.to_string().replace('\\', "\\\\").replace('"', "\\\"");
            format!("\"{text}\"")
        })
        .collect();
    format!("{{{}}}", quoted.join(","))
}

fn lines(rows: &[sqlx::postgres::PgRow]) -> String {
    rows.iter()
        .map(|r| r.get::<String, _>(0))
        .collect::<Vec<_>>()
        .join("\n")
}
