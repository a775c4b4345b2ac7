//! A stage's members: the most urgent first ([`Engine::members`]), or page by page in
//! item order, filtered by status ([`Engine::member_page`]), however wide the group.

use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::execution::AttemptError;
use crate::ids::{ExecutionId, TaskId};
use crate::store::members::{self, MemberListRow};
use serde_json::Value;

/// One member of a stage, as [`Engine::members`] and [`Engine::member_page`] list it.
#[derive(Debug, Clone, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[non_exhaustive]
pub struct MemberSummary {
    /// The task.
    pub task_id: TaskId,
    /// Its position in the group.
    pub item_index: u32,
    /// Its handler (stage or branch name).
    pub handler: String,
    /// `pending`, `running`, `completed`, `dead` or `cancelled`.
    pub status: String,
    /// Attempts made (since its last reprocessing).
    pub attempts: u32,
    /// Times it was reprocessed.
    pub reprocessed: u32,
    /// When its latest attempt started.
    pub started_at: Option<DateTime<Utc>>,
    /// When it became terminal.
    pub finished_at: Option<DateTime<Utc>>,
    /// The last attempt's error, if any failed.
    pub last_error: Option<String>,
}

impl From<MemberListRow> for MemberSummary {
    fn from(r: MemberListRow) -> Self {
        MemberSummary {
            task_id: r.id,
            item_index: r.item_index as u32,
            handler: r.handler,
            status: r.status,
            attempts: r.attempt as u32,
            reprocessed: r.reprocessed as u32,
            started_at: r.started_at,
            finished_at: r.finished_at,
            last_error: r.last_error,
        }
    }
}

/// A member's status, to filter a [`MemberFilter`] by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum MemberStatus {
    /// Waiting to be claimed (or in backoff before a retry).
    Pending,
    /// Claimed, under a lease.
    Running,
    /// Succeeded.
    Completed,
    /// Failed for good: a dead letter.
    Dead,
    /// Cancelled with its execution.
    Cancelled,
}

impl MemberStatus {
    /// Its name as stored: `pending`, `running`, `completed`, `dead` or `cancelled`.
    pub fn as_str(self) -> &'static str {
        match self {
            MemberStatus::Pending => "pending",
            MemberStatus::Running => "running",
            MemberStatus::Completed => "completed",
            MemberStatus::Dead => "dead",
            MemberStatus::Cancelled => "cancelled",
        }
    }
}

/// A name that is not one of the member statuses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown member status {0:?} (pending, running, completed, dead or cancelled)")]
pub struct UnknownMemberStatus(pub String);

impl std::str::FromStr for MemberStatus {
    type Err = UnknownMemberStatus;

    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        match s {
            "pending" => Ok(MemberStatus::Pending),
            "running" => Ok(MemberStatus::Running),
            "completed" => Ok(MemberStatus::Completed),
            "dead" => Ok(MemberStatus::Dead),
            "cancelled" | "canceled" => Ok(MemberStatus::Cancelled),
            other => Err(UnknownMemberStatus(other.to_owned())),
        }
    }
}

impl std::fmt::Display for MemberStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Which page of a stage's members [`Engine::member_page`] returns.
///
/// ```
/// use confluo::{MemberFilter, MemberStatus};
/// // The dead members of a wide map, 100 at a time from item 5 000 on.
/// let filter = MemberFilter::new().status(MemberStatus::Dead).after(4_999).limit(100);
/// # let _ = filter;
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct MemberFilter {
    /// Only members after this item index (the previous page's
    /// [`next_after`](MemberPage::next_after)).
    pub after: Option<u32>,
    /// Only members in this status.
    pub status: Option<MemberStatus>,
    /// At most this many (default 100).
    pub limit: usize,
}

impl Default for MemberFilter {
    fn default() -> Self {
        MemberFilter {
            after: None,
            status: None,
            limit: 100,
        }
    }
}

impl MemberFilter {
    /// The first 100 members.
    pub fn new() -> Self {
        Self::default()
    }

    /// Only members after item `index`.
    pub fn after(mut self, index: u32) -> Self {
        self.after = Some(index);
        self
    }

    /// Only members in `status`.
    pub fn status(mut self, status: MemberStatus) -> Self {
        self.status = Some(status);
        self
    }

    /// At most `limit` members.
    pub fn limit(mut self, limit: usize) -> Self {
        self.limit = limit;
        self
    }
}

/// One page of a stage's members, in item order.
#[derive(Debug, Clone, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[non_exhaustive]
pub struct MemberPage {
    /// The members, by item index.
    pub members: Vec<MemberSummary>,
    /// Where the next page starts ([`MemberFilter::after`]); `None` on the last page.
    pub next_after: Option<u32>,
}

/// One member in full, as [`Engine::member`] returns it.
#[derive(Debug, Clone, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[non_exhaustive]
pub struct MemberDetail {
    /// What a listing shows of it.
    #[serde(flatten)]
    pub summary: MemberSummary,
    /// Its execution.
    pub execution_id: ExecutionId,
    /// Its stage's position, from 0.
    pub stage_index: usize,
    /// Its own input (a map element); `None` when it reads its stage's input.
    #[cfg_attr(feature = "openapi", schema(value_type = Option<Object>))]
    pub input: Option<Value>,
    /// What it returned, once completed.
    #[cfg_attr(feature = "openapi", schema(value_type = Option<Object>))]
    pub output: Option<Value>,
    /// Every attempt's error, oldest first (since its last reprocessing, and before).
    pub errors: Vec<AttemptError>,
}

impl Engine {
    /// One member by its task id: status, input, output and every attempt's error,
    /// whatever its status (a dead letter's view, [`Engine::dead_letter`], is only for
    /// dead ones).
    ///
    /// # Errors
    /// [`Error::TaskNotFound`]; [`Error::Json`] for an errors column this build cannot
    /// read; [`Error::Database`](crate::Error::Database).
    ///
    /// # Cancel safety
    /// Reads only: dropping it changes nothing.
    pub async fn member(&self, task: TaskId) -> Result<MemberDetail> {
        let mut conn = self.pool().acquire().await?;
        let row = members::detail(&mut conn, task)
            .await?
            .ok_or(Error::TaskNotFound(task))?;
        Ok(MemberDetail {
            summary: row.member.into(),
            execution_id: row.execution_id,
            stage_index: row.stage_index.max(0) as usize,
            input: row.input.map(|j| j.0),
            output: row.output.map(|j| j.0),
            errors: serde_json::from_value(row.errors.0)?,
        })
    }

    /// Up to `limit` members of stage `stage_index` of an execution: those not completed
    /// first (running, pending, dead, cancelled), then in item order.
    ///
    /// # Errors
    /// [`Error::Database`](crate::Error::Database).
    ///
    /// # Cancel safety
    /// Reads only: dropping it changes nothing.
    pub async fn members(
        &self,
        execution: ExecutionId,
        stage_index: usize,
        limit: usize,
    ) -> Result<Vec<MemberSummary>> {
        let mut conn = self.pool().acquire().await?;
        let rows = members::urgent_first(
            &mut conn,
            execution,
            i32::try_from(stage_index).unwrap_or(i32::MAX),
            i64::try_from(limit).unwrap_or(i64::MAX),
        )
        .await?;
        Ok(rows.into_iter().map(MemberSummary::from).collect())
    }

    /// One page of stage `stage_index`'s members, in item order, as `filter` says: walk
    /// a 100 000-member map page by page, each page costing what it returns. An
    /// execution or a stage that does not exist (or was not entered yet) has no members.
    ///
    /// # Errors
    /// [`Error::Database`](crate::Error::Database).
    ///
    /// # Cancel safety
    /// Reads only: dropping it changes nothing.
    pub async fn member_page(
        &self,
        execution: ExecutionId,
        stage_index: usize,
        filter: &MemberFilter,
    ) -> Result<MemberPage> {
        let mut conn = self.pool().acquire().await?;
        let limit = filter.limit.max(1);
        let mut rows = members::page(
            &mut conn,
            execution,
            i32::try_from(stage_index).unwrap_or(i32::MAX),
            filter.after.map(|a| i32::try_from(a).unwrap_or(i32::MAX)),
            filter.status.map(MemberStatus::as_str),
            i64::try_from(limit).map_or(i64::MAX, |l| l.saturating_add(1)),
        )
        .await?;
        // One row more than asked says whether a next page exists.
        let more = rows.len() > limit;
        rows.truncate(limit);
        let next_after = more
            .then(|| rows.last().map(|r| r.item_index as u32))
            .flatten();
        Ok(MemberPage {
            members: rows.into_iter().map(MemberSummary::from).collect(),
            next_after,
        })
    }
}
