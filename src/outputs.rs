//! A block's outputs page by page: how the stage after a map of any width reads what
//! its members returned in bounded memory.
//!
//! The stage after a parallel or map block normally receives the whole block as its
//! input ([`MapResults`](crate::MapResults), [`ParallelResults`](crate::ParallelResults)),
//! aggregated when its task runs. Past a size
//! ([`WorkerBuilder::inline_block_input`](crate::WorkerBuilder::inline_block_input),
//! default [`DEFAULT_INLINE_BLOCK_INPUT`]) that aggregate is not built: the handler reads
//! the members with [`TaskContext::previous_block`](crate::TaskContext::previous_block)
//! instead, a page at a time.

use futures_util::stream::{self, Stream};
use serde_json::Value;

use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::ids::ExecutionId;
use crate::store::outputs;

/// The most members a map stage may have: a longer array as a map's input is refused
/// ([`Error::MapTooWide`] at start, a failed attempt for the step that returned it).
pub const MAX_MAP_WIDTH: usize = 1_000_000;

/// Default [`WorkerBuilder::inline_block_input`](crate::WorkerBuilder::inline_block_input):
/// 16 MiB of members' outputs as PostgreSQL stores them.
pub const DEFAULT_INLINE_BLOCK_INPUT: u64 = 16 * 1024 * 1024;

/// The members of one block stage of an execution, read page by page in item order;
/// from [`TaskContext::previous_block`](crate::TaskContext::previous_block) or
/// [`Engine::block_outputs`]. Each page is one indexed range read, so the cost of a page
/// does not grow with the width of the block, and memory is bounded by the page size.
///
/// ```no_run
/// # async fn demo(task: confluo::TaskContext) -> Result<(), confluo::TaskError> {
/// use futures_util::TryStreamExt;
///
/// let block = task.previous_block().expect("this stage follows a map");
/// let mut total = 0i64;
/// let mut members = std::pin::pin!(block.members(1_000));
/// while let Some(member) = members.try_next().await.map_err(confluo::TaskError::retryable)? {
///     if let Some(output) = member.output {
///         total += output.as_i64().unwrap_or(0);
///     }
/// }
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct BlockOutputs {
    engine: Engine,
    execution_id: ExecutionId,
    stage_index: usize,
}

/// One member of a block, with its output or its failure.
#[derive(Clone, Debug, PartialEq)]
pub struct BlockMember {
    /// Its position: the element index of a map, the branch index of a parallel block.
    pub index: u32,
    /// Its handler: the map's name, or the branch name.
    pub handler: String,
    /// `completed`, `dead` or `cancelled` once the block is over (`pending` or `running`
    /// while it runs).
    pub status: String,
    /// Attempts made.
    pub attempts: u32,
    /// What it returned, if it completed.
    pub output: Option<Value>,
    /// The last attempt's error, if one failed.
    pub error: Option<String>,
}

impl BlockOutputs {
    pub(crate) fn new(engine: Engine, execution_id: ExecutionId, stage_index: usize) -> Self {
        BlockOutputs {
            engine,
            execution_id,
            stage_index,
        }
    }

    /// The execution.
    pub fn execution_id(&self) -> ExecutionId {
        self.execution_id
    }

    /// The block's stage index.
    pub fn stage_index(&self) -> usize {
        self.stage_index
    }

    /// Up to `limit` members (at least 1) after item `after` (from the first with
    /// `None`), in item order. An empty page is the end.
    ///
    /// # Errors
    /// [`Error::Database`].
    ///
    /// # Cancel safety
    /// Reads only: dropping it changes nothing.
    pub async fn page(&self, after: Option<u32>, limit: u32) -> Result<Vec<BlockMember>> {
        let mut conn = self.engine.pool().acquire().await?;
        let after = after.map_or(-1, |a| i32::try_from(a).unwrap_or(i32::MAX));
        let rows = outputs::page(
            &mut conn,
            self.execution_id,
            self.stage_index as i32,
            after,
            i64::from(limit.max(1)),
        )
        .await?;
        Ok(rows
            .into_iter()
            .map(|r| BlockMember {
                index: r.item_index as u32,
                handler: r.handler,
                status: r.status,
                attempts: r.attempt as u32,
                output: r.output.map(|o| o.0),
                error: r.error,
            })
            .collect())
    }

    /// Every member in item order, read `page_size` at a time (at most one page is held).
    /// The stream ends after the last member, or after the first error.
    pub fn members(&self, page_size: u32) -> impl Stream<Item = Result<BlockMember>> + Send + '_ {
        let pages = stream::try_unfold(Some(None), move |next: Option<Option<u32>>| async move {
            let Some(after) = next else {
                return Ok::<_, Error>(None);
            };
            let page = self.page(after, page_size).await?;
            let next = match page.last() {
                Some(last) if page.len() as u32 >= page_size.max(1) => Some(Some(last.index)),
                Some(_) => None,
                None => return Ok(None),
            };
            Ok(Some((stream::iter(page.into_iter().map(Ok)), next)))
        });
        futures_util::TryStreamExt::try_flatten(pages)
    }
}

impl Engine {
    /// The members of stage `stage_index` of an execution with their outputs, page by page
    /// (for a service reading a wide map's results after the execution ended, say).
    ///
    /// # Errors
    /// [`Error::ExecutionNotFound`] if the execution has not entered that stage;
    /// [`Error::Database`].
    ///
    /// # Cancel safety
    /// Reads only: dropping it changes nothing.
    pub async fn block_outputs(
        &self,
        execution_id: ExecutionId,
        stage_index: usize,
    ) -> Result<BlockOutputs> {
        let mut conn = self.pool().acquire().await?;
        if !outputs::stage_entered(&mut conn, execution_id, stage_index as i32).await? {
            return Err(Error::ExecutionNotFound(execution_id));
        }
        Ok(BlockOutputs::new(self.clone(), execution_id, stage_index))
    }

    /// The input of a task whose input stage is the block `block_stage`, unless the
    /// block's outputs take more than `limit` bytes as stored: then
    /// [`Error::BlockInputTooLarge`].
    pub(crate) async fn block_input(
        &self,
        execution_id: ExecutionId,
        block_stage: usize,
        limit: u64,
    ) -> Result<Value> {
        let mut conn = self.pool().acquire().await?;
        let block = block_stage as i32;
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        match outputs::stage_output_within(&mut conn, execution_id, block, limit).await? {
            outputs::Bounded::Output(value) => Ok(value),
            outputs::Bounded::TooLarge { stored } => Err(Error::BlockInputTooLarge {
                stage: block as usize,
                stored: stored as u64,
                limit: limit as u64,
            }),
            outputs::Bounded::Missing => Err(Error::ExecutionNotFound(execution_id)),
        }
    }
}
