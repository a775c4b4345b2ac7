//! Dependency fan-in at run time ([`Stage::after`](crate::Stage::after)): what happens
//! when a node of the workflow's list finishes (its flow has nowhere further to go inside
//! it). Each stage that waits for it alone is entered with its output; each that waits for
//! several counts it down in its join row (`store::joins`), in this same transaction, and
//! the arrival that brings the count to zero enters it, with an object of its
//! dependencies' outputs by name. A node nothing waits for is the last stage: the
//! execution completes. Always inside the caller's transaction, which holds the
//! execution's lock: two dependencies finishing at once are two transactions taking that
//! lock in turn, so exactly one of them sees zero.

use serde_json::{Map, Value};
use sqlx::PgConnection;

use super::{enter, Drive, Entered, Input, NodeEnd};
use crate::definition::Workflow;
use crate::engine::Engine;
use crate::error::Result;
use crate::fanin::FanInStrategy;
use crate::ids::{ExecutionId, GroupId};
use crate::store::groups::MemberSource;
use crate::store::{executions, fan_in, groups, joins};

/// Enters every stage an execution starts with: those that wait for nothing (the first,
/// and those [`at_start`](crate::Stage::at_start)), each with the execution input, until
/// one ends the execution.
pub(crate) async fn start(
    engine: &Engine,
    conn: &mut PgConnection,
    workflow: &Workflow,
    execution_id: ExecutionId,
    drive: Drive,
) -> Result<Entered> {
    let mut entered = Entered::default();
    for &root in workflow.plan().roots() {
        let more = enter(engine, conn, execution_id, workflow, root, None, drive).await?;
        if entered.absorb(more) {
            break;
        }
    }
    Ok(entered)
}

/// Goes on after stage `index` fired, passing `input` on: straight to the stage after it,
/// or, when its node's flow ends there, to what waits for the node ([`finish`]).
pub(crate) async fn advance(
    engine: &Engine,
    conn: &mut PgConnection,
    workflow: &Workflow,
    execution_id: ExecutionId,
    index: usize,
    input: Option<Input>,
    drive: Drive,
) -> Result<Entered> {
    let plan = workflow.plan();
    match plan.next(index) {
        Some(next) => enter(engine, conn, execution_id, workflow, next, input, drive).await,
        None => {
            let end = NodeEnd {
                execution_id,
                node: plan.node(index),
                input,
                branch_group: None,
            };
            finish(engine, conn, workflow, end, drive).await
        }
    }
}

/// A node's flow ended: enters each stage that waits for it (directly, or through its
/// countdown when it waits for several), or completes the execution after its last
/// stage. Stops at the first entry that ends the execution.
pub(super) async fn finish(
    engine: &Engine,
    conn: &mut PgConnection,
    workflow: &Workflow,
    end: NodeEnd,
    drive: Drive,
) -> Result<Entered> {
    let plan = workflow.plan();
    let passed = end.input.map(|i| i.group).or(end.branch_group);
    let dependents = plan.dependents(end.node);
    if dependents.is_empty() {
        let output = passed.expect("an execution reaches its end through a group");
        let stages = workflow.stage_count() as i32;
        executions::complete(conn, end.execution_id, stages, output).await?;
        return Ok(Entered::ended());
    }
    let name = plan.get(end.node).expect("a node is a stage").stage.name();
    let mut entered = Entered::default();
    for &waiting in dependents {
        let needs = plan.dependencies(waiting).len();
        let more = if needs == 1 {
            let at = enter(
                engine,
                conn,
                end.execution_id,
                workflow,
                waiting,
                end.input,
                drive,
            );
            Box::pin(at).await?
        } else {
            let id = end.execution_id;
            let remaining =
                match fan_in::join_arrival(conn, id, waiting, needs, name, passed).await? {
                    Some(remaining) => remaining,
                    // This node had arrived already (a repair driving it again): enter the
                    // stage only if everything has arrived and nobody entered it.
                    None if groups::entered(conn, id, waiting).await? => continue,
                    None => joins::remaining(conn, id, waiting).await?.unwrap_or(1),
                };
            if remaining > 0 {
                continue;
            }
            enter_join(conn, workflow, id, waiting, drive.default_fan_in).await?
        };
        if entered.absorb(more) {
            break;
        }
    }
    Ok(entered)
}

/// Enters the stage `index`, which waits for several: its input is the object of its
/// dependencies' outputs by stage name, read now and stored with its tasks.
async fn enter_join(
    conn: &mut PgConnection,
    workflow: &Workflow,
    execution_id: ExecutionId,
    index: usize,
    default_fan_in: FanInStrategy,
) -> Result<Entered> {
    let mut input = Map::new();
    for (name, group) in joins::arrived(conn, execution_id, index).await? {
        let output = match group {
            Some(group) => groups::output(&mut *conn, group).await?,
            None => executions::input(conn, execution_id).await?,
        };
        input.insert(name, output);
    }
    let stage = workflow
        .stage_at(index)
        .expect("the plan numbers every stage");
    let fan_in = crate::definition::strategy_for(stage, default_fan_in);
    let group: GroupId = GroupId::new();
    let input = Value::Object(input);
    let source = MemberSource::Given(&input);
    groups::create_stage(
        conn,
        execution_id,
        group,
        workflow,
        index,
        -1,
        source,
        fan_in,
    )
    .await?;
    Ok(Entered::group(group))
}
