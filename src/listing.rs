//! Listing executions (the newest first, filtered by workflow and status), counting them,
//! listing registered workflows, and deleting old terminal executions.

use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::definition::Workflow;
use crate::engine::Engine;
use crate::error::Result;
use crate::execution::ExecutionStatus;
use crate::ids::ExecutionId;
use crate::store::{executions, tasks, workflows};

/// Which executions [`Engine::list`] returns.
///
/// ```
/// use confluo::{ExecutionStatus, ListFilter};
/// let filter = ListFilter::new().workflow("orders").status(ExecutionStatus::Failed).limit(20);
/// # let _ = filter;
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ListFilter {
    /// Only executions of this workflow.
    pub workflow: Option<String>,
    /// Only executions in this status.
    pub status: Option<ExecutionStatus>,
    /// Only the child workflows' executions this execution started
    /// ([`Stage::map_workflow`](crate::Stage::map_workflow)).
    pub parent: Option<ExecutionId>,
    /// At most this many (default 50).
    pub limit: usize,
}

impl Default for ListFilter {
    fn default() -> Self {
        ListFilter {
            workflow: None,
            status: None,
            parent: None,
            limit: 50,
        }
    }
}

impl ListFilter {
    /// Every execution, 50 at most.
    pub fn new() -> Self {
        Self::default()
    }

    /// Only executions of `workflow`.
    pub fn workflow(mut self, workflow: impl Into<String>) -> Self {
        self.workflow = Some(workflow.into());
        self
    }

    /// Only executions in `status`.
    pub fn status(mut self, status: ExecutionStatus) -> Self {
        self.status = Some(status);
        self
    }

    /// Only the children `parent` started (its [`Stage::map_workflow`](crate::Stage::map_workflow)
    /// stages' executions).
    pub fn parent(mut self, parent: ExecutionId) -> Self {
        self.parent = Some(parent);
        self
    }

    /// At most `limit` executions.
    pub fn limit(mut self, limit: usize) -> Self {
        self.limit = limit;
        self
    }
}

/// One execution in a listing.
#[derive(Debug, Clone, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[non_exhaustive]
pub struct ExecutionSummary {
    /// The execution.
    pub id: ExecutionId,
    /// Its workflow.
    pub workflow: String,
    /// The workflow version it is pinned to.
    pub version: i32,
    /// Where it stands.
    pub status: ExecutionStatus,
    /// The stage it is at (the number of stages once completed).
    pub current_stage: usize,
    /// Why it failed, if it did.
    pub error: Option<String>,
    /// When it started.
    pub created_at: DateTime<Utc>,
    /// When it ended, if it did.
    pub finished_at: Option<DateTime<Utc>>,
}

/// How many tasks wait and run, as [`Engine::queue_depth`] counts them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[non_exhaustive]
pub struct QueueDepth {
    /// Pending and due: claimable now.
    pub due: u64,
    /// Pending but not yet due (waiting out a retry's backoff).
    pub scheduled: u64,
    /// Claimed and running.
    pub running: u64,
}

/// How many executions are in each status, as [`Engine::execution_counts`] counts them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[non_exhaustive]
pub struct ExecutionCounts {
    /// Running (not yet at a terminal status).
    pub running: u64,
    /// Completed.
    pub completed: u64,
    /// Failed.
    pub failed: u64,
    /// Cancelled.
    pub cancelled: u64,
    /// Timed out (past their deadline).
    pub timed_out: u64,
}

/// A registered workflow version, as [`Engine::workflows`] lists it.
#[derive(Debug, Clone, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[non_exhaustive]
pub struct RegisteredWorkflow {
    /// The definition: name, version and stages, as registered.
    #[cfg_attr(feature = "openapi", schema(value_type = Object))]
    pub definition: Workflow,
    /// When this version was registered.
    pub registered_at: DateTime<Utc>,
}

impl Engine {
    /// Tasks due, scheduled and running, over every workflow. Workers sample it into the
    /// `confluo_queue_depth` gauge (see [`metrics`](crate::metrics)).
    ///
    /// # Errors
    /// [`Error::Database`](crate::Error::Database).
    ///
    /// # Cancel safety
    /// Reads only: dropping it changes nothing.
    pub async fn queue_depth(&self) -> Result<QueueDepth> {
        let mut conn = self.pool().acquire().await?;
        let row = tasks::queue_depth(&mut conn).await?;
        Ok(QueueDepth {
            due: row.due as u64,
            scheduled: row.scheduled as u64,
            running: row.running as u64,
        })
    }

    /// How many executions are in each status, over every workflow.
    ///
    /// # Errors
    /// [`Error::Database`](crate::Error::Database).
    ///
    /// # Cancel safety
    /// Reads only: dropping it changes nothing.
    pub async fn execution_counts(&self) -> Result<ExecutionCounts> {
        let mut counts = ExecutionCounts::default();
        for (status, n) in executions::count_by_status(self.pool()).await? {
            let n = n as u64;
            match ExecutionStatus::parse(&status) {
                ExecutionStatus::Running => counts.running += n,
                ExecutionStatus::Completed => counts.completed += n,
                ExecutionStatus::Failed => counts.failed += n,
                ExecutionStatus::Cancelled => counts.cancelled += n,
                ExecutionStatus::TimedOut => counts.timed_out += n,
            }
        }
        Ok(counts)
    }

    /// Every registered version of every workflow (of `name` only, when given), by name,
    /// the newest version first.
    ///
    /// # Errors
    /// [`Error::Database`](crate::Error::Database).
    ///
    /// # Cancel safety
    /// Reads only: dropping it changes nothing.
    pub async fn workflows(&self, name: Option<&str>) -> Result<Vec<RegisteredWorkflow>> {
        Ok(workflows::all(self.pool(), name)
            .await?
            .into_iter()
            .map(|(definition, registered_at)| RegisteredWorkflow {
                definition,
                registered_at,
            })
            .collect())
    }

    /// Executions matching `filter`, the newest first.
    ///
    /// # Errors
    /// [`Error::Database`](crate::Error::Database).
    ///
    /// # Cancel safety
    /// Reads only: dropping it changes nothing.
    pub async fn list(&self, filter: &ListFilter) -> Result<Vec<ExecutionSummary>> {
        let rows = executions::list(
            self.pool(),
            filter.workflow.as_deref(),
            filter.status.map(ExecutionStatus::as_str),
            filter.parent,
            i64::try_from(filter.limit).unwrap_or(i64::MAX),
        )
        .await?;
        Ok(rows
            .into_iter()
            .map(|r| ExecutionSummary {
                id: r.id,
                workflow: r.workflow_name,
                version: r.workflow_version,
                status: ExecutionStatus::parse(&r.status),
                current_stage: r.current_stage as usize,
                error: r.error,
                created_at: r.created_at,
                finished_at: r.finished_at,
            })
            .collect())
    }

    /// Deletes terminal executions (completed, failed, cancelled, timed out) that finished before
    /// `cutoff`, with their groups and tasks, `batch` at a time (each batch a statement of
    /// its own, so no long lock and no huge transaction); returns how many. Running
    /// executions are never touched, nor those whose end's webhook is still pending (they
    /// go once it is delivered or given up on), unless the notification itself is older
    /// than `cutoff`: with no delivery loop running it would never be, and the execution
    /// would be kept forever.
    ///
    /// ```no_run
    /// # async fn run(engine: confluo::Engine) -> confluo::Result<()> {
    /// let week_ago = chrono::Utc::now() - chrono::Duration::days(7);
    /// let deleted = engine.purge(week_ago, 1_000).await?;
    /// # let _ = deleted; Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`Error::Database`](crate::Error::Database); what was deleted before stays deleted.
    ///
    /// # Cancel safety
    /// Each batch is a transaction of its own: dropped, the batches deleted so far stay
    /// deleted, the one in progress is not.
    pub async fn purge(&self, cutoff: DateTime<Utc>, batch: usize) -> Result<u64> {
        self.purge_batches(cutoff, batch).await
    }

    /// How many executions [`purge`](Self::purge) would delete with this cutoff now:
    /// terminal ones that finished before it (a dry run).
    ///
    /// # Errors
    /// [`Error::Database`](crate::Error::Database).
    ///
    /// # Cancel safety
    /// Reads only: dropping it changes nothing.
    pub async fn purgeable(&self, cutoff: DateTime<Utc>) -> Result<u64> {
        Ok(executions::purgeable(self.pool(), cutoff).await?.max(0) as u64)
    }

    async fn purge_batches(&self, cutoff: DateTime<Utc>, batch: usize) -> Result<u64> {
        let batch = i64::try_from(batch.max(1)).unwrap_or(i64::MAX);
        let mut deleted = 0;
        loop {
            let n = executions::purge(self.pool(), cutoff, batch).await?;
            deleted += n;
            if n < batch as u64 {
                return Ok(deleted);
            }
        }
    }
}
