//! Stage transitions: entering a stage (creating its group and members) and firing a
//! group whose countdown reached zero. Always inside the caller's transaction.

use std::collections::{HashMap, HashSet};

use sqlx::PgConnection;

use crate::definition::{StageKind, Workflow};
use crate::engine::Engine;
use crate::error::Result;
use crate::fanin::FanInStrategy;
use crate::ids::{ExecutionId, GroupId};
use crate::store::{executions, fan_in, groups, groups::MemberSource};

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

/// What [`fire_many`] did.
#[derive(Debug, Default)]
pub(crate) struct Fired {
    /// The groups it fired (the others had fired already, or their execution stopped).
    pub groups: HashSet<GroupId>,
    /// The groups of the stages it entered that have members to run.
    pub entered: Vec<GroupId>,
}

/// [`fire`] for many groups that reached zero in one transaction (a batch of
/// acknowledgements), with one statement to lock their executions and set their fired
/// markers, and one to complete the executions whose last stage they were. Each entry is
/// `(execution, group, stage_index)`. `nowait`: the caller has not locked the executions
/// first, so their locks are asked for without waiting (see [`crate::store::locks`]).
pub(crate) async fn fire_many(
    engine: &Engine,
    conn: &mut PgConnection,
    arrivals: &[(ExecutionId, GroupId, i32)],
    nowait: bool,
) -> Result<Fired> {
    let executions: Vec<ExecutionId> = arrivals.iter().map(|a| a.0).collect();
    let groups: Vec<GroupId> = arrivals.iter().map(|a| a.1).collect();
    let stage_of: HashMap<GroupId, i32> = arrivals.iter().map(|a| (a.1, a.2)).collect();
    let rows = fan_in::lock_and_mark_fired_many(conn, &executions, &groups, nowait).await?;
    let mut fired = Fired::default();
    let (mut completed, mut stages, mut outputs) = (Vec::new(), Vec::new(), Vec::new());
    for row in rows.into_iter().filter(|r| r.fired) {
        fired.groups.insert(row.group_id);
        let workflow = engine
            .definition(&mut *conn, &row.workflow_name, row.workflow_version)
            .await?;
        let index = stage_of[&row.group_id] as usize;
        if index + 1 == workflow.stages().len() {
            completed.push(row.execution_id);
            stages.push(index as i32 + 1);
            outputs.push(row.group_id);
            continue;
        }
        let kind = workflow.stages()[index].kind().as_str();
        let entered = enter(
            conn,
            row.execution_id,
            &workflow,
            index + 1,
            Some((row.group_id, kind)),
            row.fan_in.parse()?,
        )
        .await?;
        fired.entered.extend(entered);
    }
    if !completed.is_empty() {
        executions::complete_many(conn, &completed, &stages, &outputs).await?;
    }
    Ok(fired)
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
    let Some(execution) = fan_in::lock_and_mark_fired(conn, execution_id, group_id).await? else {
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
/// last stage the execution completes. Returns the group of the stage it entered with
/// members (`None`: the execution completed).
pub(crate) async fn enter(
    conn: &mut PgConnection,
    execution_id: ExecutionId,
    workflow: &Workflow,
    mut index: usize,
    mut previous: Option<(GroupId, &'static str)>,
    default_fan_in: FanInStrategy,
) -> Result<Option<GroupId>> {
    loop {
        let Some(stage) = workflow.stages().get(index) else {
            let (group, _) = previous.expect("a validated workflow has at least one stage");
            executions::complete(conn, execution_id, index as i32, group).await?;
            return Ok(None);
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
            return Ok(Some(group_id));
        }
        fan_in::mark_fired(conn, group_id).await?;
        previous = Some((group_id, stage.kind().as_str()));
        index += 1;
    }
}

/// Enters the first stage of many new executions of `workflow` (the caller's
/// transaction created them): a step or parallel first stage in one statement for all of
/// them; a map (whose members come from each input, and which may be empty and advance
/// at once) or a striped stage per execution, through [`enter`].
pub(crate) async fn enter_first_stage_many(
    conn: &mut PgConnection,
    workflow: &Workflow,
    executions: &[ExecutionId],
    default_fan_in: FanInStrategy,
) -> Result<()> {
    if executions.is_empty() {
        return Ok(());
    }
    let stage = &workflow.stages()[0];
    let fan_in = stage.fan_in_strategy().unwrap_or(default_fan_in);
    if matches!(stage.kind(), StageKind::Map) || fan_in == FanInStrategy::Striped {
        for &id in executions {
            enter(conn, id, workflow, 0, None, default_fan_in).await?;
        }
        return Ok(());
    }
    groups::create_first_stages(conn, executions, workflow, fan_in).await
}
