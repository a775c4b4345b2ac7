//! Stage transitions: entering a stage (creating its group and members) and firing a
//! group whose countdown reached zero. Always inside the caller's transaction.

use sqlx::PgConnection;

use crate::definition::{StageKind, Workflow};
use crate::engine::Engine;
use crate::error::Result;
use crate::fanin::FanInStrategy;
use crate::ids::{ExecutionId, GroupId};
use crate::store::{executions, groups, groups::MemberSource};

/// Fires a group whose countdown reached zero: dispatches the next stage, or completes
/// the execution after the last one. Returns whether it dispatched (false when the
/// execution has stopped, or the group had fired already).
pub(crate) async fn fire(
    engine: &Engine,
    conn: &mut PgConnection,
    execution_id: ExecutionId,
    group_id: GroupId,
    stage_index: i32,
) -> Result<bool> {
    transition(engine, conn, execution_id, group_id, stage_index, false).await
}

/// Re-drives an execution whose group fired but whose next stage was never entered (an
/// auditor repair, which has checked under the execution's lock that it is running and
/// stalled). Returns whether it advanced.
pub(crate) async fn advance_after_fired(
    engine: &Engine,
    conn: &mut PgConnection,
    execution_id: ExecutionId,
    group_id: GroupId,
    stage_index: i32,
) -> Result<bool> {
    transition(engine, conn, execution_id, group_id, stage_index, true).await
}

/// Locks the execution and sets the group's fired marker (a second guard behind every
/// strategy's decision); then, if this caller set it (or `redrive`), enters the next
/// stage, or completes the execution after its last.
async fn transition(
    engine: &Engine,
    conn: &mut PgConnection,
    execution_id: ExecutionId,
    group_id: GroupId,
    stage_index: i32,
    redrive: bool,
) -> Result<bool> {
    let Some(execution) = executions::lock_and_mark_fired(conn, execution_id, group_id).await?
    else {
        return Ok(false);
    };
    if !(execution.fired || redrive) {
        return Ok(false);
    }
    let workflow = engine
        .definition(
            &mut *conn,
            &execution.workflow_name,
            execution.workflow_version,
        )
        .await?;
    let index = stage_index as usize;
    let kind = workflow.stages()[index].kind().as_str();
    enter(
        conn,
        execution_id,
        &workflow,
        index + 1,
        Some((group_id, kind)),
        execution.fan_in.parse()?,
    )
    .await?;
    Ok(true)
}

/// Enters stage `index`, fed by `previous` (its group and kind; `None` for the first
/// stage). Its group uses the stage's fan-in strategy, else `default_fan_in`. An empty
/// map fires at once and the next stage is entered in the same transaction; past the
/// last stage the execution completes.
pub(crate) async fn enter(
    conn: &mut PgConnection,
    execution_id: ExecutionId,
    workflow: &Workflow,
    mut index: usize,
    mut previous: Option<(GroupId, &'static str)>,
    default_fan_in: FanInStrategy,
) -> Result<()> {
    loop {
        let Some(stage) = workflow.stages().get(index) else {
            let (group, _) = previous.expect("a validated workflow has at least one stage");
            executions::complete(conn, execution_id, index as i32, group).await?;
            return Ok(());
        };
        let source = match (stage.kind(), previous) {
            (StageKind::Map, None) => MemberSource::ExecutionInput,
            (StageKind::Map, Some((group, "step"))) => MemberSource::StepOutput(group),
            (StageKind::Map, Some((group, _))) => MemberSource::GroupOutputs(group),
            _ => MemberSource::Handlers,
        };
        let group_id = GroupId::new();
        let fan_in = stage.fan_in_strategy().unwrap_or(default_fan_in);
        let width = groups::create_stage(
            conn,
            execution_id,
            group_id,
            workflow,
            index,
            source,
            fan_in,
        )
        .await?;
        if width > 0 {
            return Ok(());
        }
        groups::mark_fired(conn, group_id).await?;
        previous = Some((group_id, stage.kind().as_str()));
        index += 1;
    }
}
