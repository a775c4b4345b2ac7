//! Stage transitions: entering a stage (creating its group and members, or deciding a
//! conditional branch) and firing a group whose countdown reached zero. Always inside the
//! caller's transaction, which holds the execution's lock.

use std::collections::{HashMap, HashSet};

use sqlx::PgConnection;

use crate::definition::{decide, timeout_input, Decision, Source, StageKind, Workflow};
use crate::engine::Engine;
use crate::error::Result;
use crate::fanin::FanInStrategy;
use crate::ids::{ExecutionId, GroupId};
use crate::store::groups::{MemberSource, Wake};
use crate::store::{audit, children, executions, fan_in, groups, signals};

mod nodes;

/// How stages are entered: the fan-in strategy of a stage that names none (the
/// execution's default), and whether this is the auditor re-driving a stalled execution.
/// A repair steps over every stage entered already (its group exists): into the arm a
/// branch took, and no further past anything else, whose own group the repair drives in
/// turn, or which is still running.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Drive {
    pub default_fan_in: FanInStrategy,
    pub repair: bool,
}

impl Drive {
    /// The engine moving an execution on.
    pub(crate) fn run(default_fan_in: FanInStrategy) -> Drive {
        Drive {
            default_fan_in,
            repair: false,
        }
    }
}

/// Enters every stage an execution starts with ([`nodes::start`]).
pub(crate) async fn start(
    engine: &Engine,
    conn: &mut PgConnection,
    workflow: &Workflow,
    execution_id: ExecutionId,
    default_fan_in: FanInStrategy,
) -> Result<Entered> {
    nodes::start(
        engine,
        conn,
        workflow,
        execution_id,
        Drive::run(default_fan_in),
    )
    .await
}

/// What entering stages did: the groups entered with members, and whether the execution
/// ended (completed after its last stage, or failed on the way).
#[derive(Debug, Default)]
pub(crate) struct Entered {
    pub groups: Vec<GroupId>,
    pub ended: bool,
}

impl Entered {
    fn group(group: GroupId) -> Entered {
        Entered {
            groups: vec![group],
            ended: false,
        }
    }

    fn ended() -> Entered {
        Entered {
            groups: Vec::new(),
            ended: true,
        }
    }

    /// Adds what a further entry did; whether the execution has ended (enter no more).
    fn absorb(&mut self, more: Entered) -> bool {
        self.groups.extend(more.groups);
        self.ended |= more.ended;
        self.ended
    }
}

/// The end of a node's flow: what it passes on (`input`, else the last branch passed,
/// else the execution input).
#[derive(Clone, Copy, Debug)]
struct NodeEnd {
    execution_id: ExecutionId,
    node: usize,
    input: Option<Input>,
    branch_group: Option<GroupId>,
}

/// The group whose output a stage receives: its id, kind and stage index.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Input {
    pub group: GroupId,
    pub kind: &'static str,
    pub stage: i32,
}

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
    // Executions that ended while this batch advanced another of their groups (a
    // dependency's stage failing them): their other groups go no further.
    let mut ended = HashSet::new();
    for row in rows.into_iter().filter(|r| r.fired) {
        fired.groups.insert(row.group_id);
        if ended.contains(&row.execution_id) {
            continue;
        }
        let workflow = engine
            .definition(&mut *conn, &row.workflow_name, row.workflow_version)
            .await?;
        let index = stage_of[&row.group_id] as usize;
        cancel_unjoined(conn, &workflow, row.group_id, index).await?;
        let input = input_after(conn, &workflow, row.group_id, index).await?;
        if workflow.plan().ends_after(index) {
            completed.push(row.execution_id);
            stages.push(workflow.stage_count() as i32);
            outputs.push(input.map_or(row.group_id, |i| i.group));
            continue;
        }
        let entered = nodes::advance(
            engine,
            conn,
            &workflow,
            row.execution_id,
            index,
            input,
            Drive::run(row.fan_in.parse()?),
        )
        .await?;
        if entered.ended {
            ended.insert(row.execution_id);
        }
        fired.entered.extend(entered.groups);
    }
    if !completed.is_empty() {
        executions::complete_many(conn, &completed, &stages, &outputs).await?;
    }
    Ok(fired)
}

/// Moves a stalled execution on (the auditor, which holds its lock and has checked that
/// it runs and is stalled): enters again what it starts with, then drives every fired
/// group but a branch's again, in stage order, until one ends the execution; all as a
/// repair ([`Drive`]), which enters only what was never entered. A branch's group is not
/// driven itself (that would take the branch's input on past its arm): the repair steps
/// into the arm it took from whatever leads to the branch.
pub(crate) async fn redrive(
    engine: &Engine,
    conn: &mut PgConnection,
    execution_id: ExecutionId,
    stalled: &audit::StalledRow,
) -> Result<()> {
    let workflow = engine
        .definition(&mut *conn, &stalled.workflow_name, stalled.workflow_version)
        .await?;
    let drive = Drive {
        default_fan_in: stalled.fan_in.parse()?,
        repair: true,
    };
    if nodes::start(engine, conn, &workflow, execution_id, drive)
        .await?
        .ended
    {
        return Ok(());
    }
    for (group, stage) in audit::redrivable_groups(conn, execution_id).await? {
        if !transition(engine, conn, execution_id, group, stage, true).await? {
            break;
        }
    }
    Ok(())
}

/// Locks the execution and sets the group's fired marker (a second guard behind every
/// strategy's decision); then, if this caller set it (or `redrive`, while the execution
/// runs), enters the next stage, or completes the execution after its last. Returns
/// whether it went on.
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
    // A repair drives a fired group again, but only while the execution runs: an earlier
    // group it drove may have ended it.
    if !(execution.fired || redrive && execution.running) {
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
    if execution.fired {
        cancel_unjoined(conn, &workflow, group_id, index).await?;
    }
    let input = input_after(conn, &workflow, group_id, index).await?;
    if workflow.plan().ends_after(index) {
        // The last stage: its output (or, for a sleep, what it received; the sleep's own
        // group stands for the execution input) is the execution's.
        let output = input.map_or(group_id, |i| i.group);
        let stages = workflow.stage_count() as i32;
        executions::complete(conn, execution_id, stages, output).await?;
        return Ok(true);
    }
    let drive = Drive {
        default_fan_in: execution.fan_in.parse()?,
        repair: redrive,
    };
    nodes::advance(engine, conn, &workflow, execution_id, index, input, drive).await?;
    Ok(true)
}

/// Cancels what is left of a quorum group that fired ([`fan_in::cancel_unjoined`]); a
/// group of join `all` has nothing left.
async fn cancel_unjoined(
    conn: &mut PgConnection,
    workflow: &Workflow,
    group: GroupId,
    index: usize,
) -> Result<()> {
    let quorum = workflow
        .stage_at(index)
        .is_some_and(|s| s.join_rule().quorum().is_some());
    if quorum {
        fan_in::cancel_unjoined(conn, group).await?;
    }
    Ok(())
}

/// What comes after stage `index`'s group receives: the group's output, or, after a
/// sleep, what the sleep received (`None`: the execution input).
async fn input_after(
    conn: &mut PgConnection,
    workflow: &Workflow,
    group: GroupId,
    index: usize,
) -> Result<Option<Input>> {
    let kind = workflow.stage_at(index).map(|s| s.kind());
    if !matches!(kind, Some(StageKind::Sleep { .. })) {
        return Ok(Some(Input {
            group,
            kind: kind.map_or("step", StageKind::as_str),
            stage: index as i32,
        }));
    }
    Ok(groups::input_group(conn, group)
        .await?
        .map(|(group, kind, stage)| Input {
            group,
            kind: stored_kind(&kind),
            stage,
        }))
}

/// Where a branch fed by `input` takes its value from (`None`: the execution input).
fn source_of(input: Option<Input>) -> Source {
    match input {
        Some(_) => Source::PreviousOutput,
        None => Source::ExecutionInput,
    }
}

/// A kind as stored on a group, as [`StageKind::as_str`] names it.
fn stored_kind(kind: &str) -> &'static str {
    match kind {
        "parallel" => "parallel",
        "map" => "map",
        "branch" => "branch",
        "sleep" => "sleep",
        "signal" => "signal",
        "map_workflow" => "map_workflow",
        _ => "step",
    }
}

/// Enters stage `index` of the plan, fed by `input` (`None`: the execution input), as
/// `drive` says ([`Drive`]). Its group uses the stage's fan-in strategy, else the
/// execution's default. A branch records its
/// choice and goes on to its arm's first stage; a sleep's task is due at its wake time; a
/// signal wait receives the signal kept for it, if it came first, and goes on; a stage
/// with no members (an empty map) fires at once, and the execution goes on to what
/// follows it; all in the caller's transaction. An unmatched branch without `otherwise`,
/// a sleep whose input holds no time, or a map whose input (reached through a branch or a
/// sleep) is not an array it can take, fails the execution with the reason recorded on
/// it. When the flow of the stage's node ends (a stage that
/// fired at once, an empty arm), what waits for the node is entered in turn
/// ([`nodes::finish`]). Returns the groups of the stages it entered with members, and
/// whether the execution ended.
pub(crate) async fn enter(
    engine: &Engine,
    conn: &mut PgConnection,
    execution_id: ExecutionId,
    workflow: &Workflow,
    index: usize,
    mut input: Option<Input>,
    drive: Drive,
) -> Result<Entered> {
    let mut node = workflow.plan().node(index);
    let mut index = Some(index);
    // The last branch passed: the output of an execution that ran no stage since.
    let mut branch_group = None;
    loop {
        let Some(at) = index else {
            // The node's flow ends here: what waits for it is entered, or the execution
            // completes after its last stage.
            let after = NodeEnd {
                execution_id,
                node,
                input,
                branch_group,
            };
            return Box::pin(nodes::finish(engine, conn, workflow, after, drive)).await;
        };
        let slot = workflow
            .plan()
            .get(at)
            .expect("the plan numbers every stage");
        node = slot.node;
        let stage = &slot.stage;
        if drive.repair {
            if let Some(entered) = groups::entered_group(conn, execution_id, at).await? {
                // Entered already: a repair goes on into the arm a branch took (deciding
                // again on the same input takes the same arm), and stops at anything else.
                let StageKind::Branch {
                    by,
                    arms,
                    otherwise,
                } = stage.kind()
                else {
                    return Ok(Entered::default());
                };
                let value = input_value(conn, execution_id, input).await?;
                let Decision::Take(arm, _) = decide(
                    stage.name(),
                    by,
                    arms,
                    otherwise.is_some(),
                    &value,
                    source_of(input),
                ) else {
                    return Ok(Entered::default());
                };
                branch_group = Some(entered);
                index = slot.entries[arm.unwrap_or(arms.len())];
                continue;
            }
        }
        let fan_in = crate::definition::strategy_for(stage, drive.default_fan_in);
        let input_stage = input.map_or(-1, |i| i.stage);
        if let StageKind::Branch {
            by,
            arms,
            otherwise,
        } = stage.kind()
        {
            let value = input_value(conn, execution_id, input).await?;
            match decide(
                stage.name(),
                by,
                arms,
                otherwise.is_some(),
                &value,
                source_of(input),
            ) {
                Decision::Take(arm, choice) => {
                    let group = GroupId::new();
                    groups::create_branch(
                        conn,
                        execution_id,
                        group,
                        at,
                        stage.name(),
                        input_stage,
                        fan_in,
                        &choice,
                    )
                    .await?;
                    branch_group = Some(group);
                    index = slot.entries[arm.unwrap_or(arms.len())];
                }
                Decision::Unmatched(error) => {
                    executions::stop(conn, execution_id, "failed", Some(&error)).await?;
                    return Ok(Entered::ended());
                }
            }
            continue;
        }
        // What a signal wait's timeout handler reads.
        let wait = match stage.kind() {
            StageKind::Signal {
                timeout_ms,
                on_timeout,
            } => Some(timeout_input(stage.name(), *timeout_ms, on_timeout)),
            _ => None,
        };
        let source = match (stage.kind(), input) {
            (k, None) if k.maps() => MemberSource::ExecutionInput,
            (k, Some(i)) if k.maps() && one_output(i.kind) => MemberSource::StepOutput(i.group),
            (k, Some(i)) if k.maps() => MemberSource::GroupOutputs(i.group),
            (StageKind::Sleep { for_ms, until }, _) => {
                match wake(conn, execution_id, stage.name(), *for_ms, until, input).await? {
                    Ok(wake) => MemberSource::Timer(wake),
                    Err(error) => {
                        executions::stop(conn, execution_id, "failed", Some(&error)).await?;
                        return Ok(Entered::ended());
                    }
                }
            }
            (StageKind::Signal { timeout_ms, .. }, _) => MemberSource::Signal(
                timeout_ms.map_or(Wake::Never, |ms| {
                    Wake::After(i64::try_from(ms).unwrap_or(i64::MAX))
                }),
                wait.as_ref().expect("a signal wait has its timeout input"),
            ),
            _ => MemberSource::Handlers,
        };
        // `start` and a step's acknowledgement check a map's input when the map comes
        // right after them; through a branch or a sleep nothing did: check it here.
        let checked = match input {
            Some(i) => i.kind == "step" && workflow.plan().next(i.stage as usize) == Some(at),
            None => at == 0,
        };
        if !checked {
            if let Some(error) =
                groups::unmappable(conn, execution_id, stage.name(), source).await?
            {
                executions::stop(conn, execution_id, "failed", Some(&error)).await?;
                return Ok(Entered::ended());
            }
        }
        let group_id = GroupId::new();
        let width = groups::create_stage(
            conn,
            execution_id,
            group_id,
            workflow,
            at,
            input_stage,
            source,
            fan_in,
        )
        .await?;
        if let Some(error) = short_of_quorum(stage, width) {
            executions::stop(conn, execution_id, "failed", Some(&error)).await?;
            return Ok(Entered::ended());
        }
        if wait.is_some() {
            // A signal that came before its stage was kept: received now, as it would
            // have been had it come after. The execution's lock, held here and by
            // `Engine::signal`, keeps the two from missing each other.
            let Some(payload) = signals::payload(conn, execution_id, stage.name()).await? else {
                return Ok(Entered::group(group_id));
            };
            let received = signals::hand_over(conn, execution_id, stage.name(), &payload).await?;
            debug_assert!(received.is_some(), "the wait entered here is pending");
        } else if let (StageKind::MapWorkflow { workflow, version }, true) =
            (stage.kind(), width > 0)
        {
            let started = start_children(
                engine,
                conn,
                group_id,
                stage.name(),
                workflow,
                *version,
                drive.default_fan_in,
            );
            if let Err(error) = Box::pin(started).await? {
                executions::stop(conn, execution_id, "failed", Some(&error)).await?;
                return Ok(Entered::ended());
            }
            return Ok(Entered::group(group_id));
        } else if width > 0 {
            return Ok(Entered::group(group_id));
        }
        fan_in::mark_fired(conn, group_id).await?;
        input = Some(Input {
            group: group_id,
            kind: stage.kind().as_str(),
            stage: at as i32,
        });
        index = slot.next;
    }
}

/// Starts the children of the map of child workflows `stage` just entered (group
/// `group`, with members): one execution of `workflow` (at `version`, else its latest)
/// per member, each entering its first stage, in the caller's transaction. `Err` with the
/// reason the parent fails when the workflow is gone or a member's input cannot start it.
async fn start_children(
    engine: &Engine,
    conn: &mut PgConnection,
    group: GroupId,
    stage: &str,
    workflow: &str,
    version: Option<i32>,
    fan_in: FanInStrategy,
) -> Result<std::result::Result<(), String>> {
    let child = match engine.definition_to_start(conn, workflow, version).await {
        Ok(child) => child,
        Err(crate::Error::WorkflowNotFound { .. }) => {
            return Ok(Err(format!(
                "stage {stage:?} maps over workflow {workflow}, which is not registered"
            )))
        }
        Err(e) => return Err(e),
    };
    let version = child.version();
    let first = &child.stages()[0];
    if first.kind().maps() {
        let max = crate::MAX_MAP_WIDTH as i64;
        if let Some((item, found)) = children::unfit_input(conn, group, max).await? {
            return Ok(Err(format!(
                "stage {stage:?} cannot start workflow {workflow} v{version} for item {item}: its \
                 first stage {:?} maps over its input, which must be a JSON array of at most \
                 {max} elements, and the item is {found}",
                first.name()
            )));
        }
    }
    let ids = children::start(conn, group, None, &child, fan_in).await?;
    enter_first_stage_many(engine, conn, &child, &ids, fan_in).await?;
    Ok(Ok(()))
}

/// Why stage `stage`, entered with `width` members, can never fire, if it cannot: its
/// join needs more successes than it has members (a map over a short array).
fn short_of_quorum(stage: &crate::definition::Stage, width: i32) -> Option<String> {
    let k = stage.join_rule().quorum()?;
    (i64::from(width) < i64::from(k)).then(|| {
        format!(
            "stage {:?} joins {} but was entered with {width} member(s), so it can never \
             fire: give it at least {k} elements, or lower its join rule",
            stage.name(),
            stage.join_rule()
        )
    })
}

/// Whether a group of this kind has one member whose output is the group's (a step, a
/// signal wait), rather than a block's aggregate.
fn one_output(kind: &str) -> bool {
    kind == "step" || kind == "signal"
}

/// The value a stage receives from `input` (`None`: the execution input), as a branch
/// or a `sleep_until` reads it to decide.
async fn input_value(
    conn: &mut PgConnection,
    execution_id: ExecutionId,
    input: Option<Input>,
) -> Result<serde_json::Value> {
    match input {
        Some(i) => groups::output(conn, i.group).await,
        None => executions::input(conn, execution_id).await,
    }
}

/// When the sleep `stage` wakes: `for_ms` after now, or at the time `until` selects in
/// its input; `Err` with the reason the execution fails when that is not a time.
async fn wake(
    conn: &mut PgConnection,
    execution_id: ExecutionId,
    stage: &str,
    for_ms: Option<u64>,
    until: &Option<String>,
    input: Option<Input>,
) -> Result<std::result::Result<Wake, String>> {
    let Some(pointer) = until else {
        let ms = i64::try_from(for_ms.unwrap_or(0)).unwrap_or(i64::MAX);
        return Ok(Ok(Wake::After(ms)));
    };
    let value = input_value(conn, execution_id, input).await?;
    let selected = value.pointer(pointer);
    Ok(match selected.and_then(|v| v.as_str()) {
        Some(text) => match chrono::DateTime::parse_from_rfc3339(text) {
            Ok(at) => Ok(Wake::At(at.with_timezone(&chrono::Utc))),
            Err(e) => Err(format!(
                "sleep stage {stage:?} found {text:?} at {pointer:?}, which is not an RFC 3339 \
                 time ({e}): make the stage before it return one, such as \
                 \"2027-01-31T09:00:00Z\""
            )),
        },
        None => Err(format!(
            "sleep stage {stage:?} found {} at {pointer:?} in its input, where it needs an \
             RFC 3339 time such as \"2027-01-31T09:00:00Z\"",
            selected.map_or("nothing".to_owned(), |v| v.to_string())
        )),
    })
}

/// Enters the first stage of many new executions of `workflow` (the caller's
/// transaction created them): a step or parallel first stage in one statement for all of
/// them; a map (whose members come from each input, and which may be empty and advance
/// at once), a branch (which decides on each input) or a striped stage per execution,
/// through [`enter`].
pub(crate) async fn enter_first_stage_many(
    engine: &Engine,
    conn: &mut PgConnection,
    workflow: &Workflow,
    executions: &[ExecutionId],
    default_fan_in: FanInStrategy,
) -> Result<()> {
    if executions.is_empty() {
        return Ok(());
    }
    let stage = &workflow.stages()[0];
    let fan_in = crate::definition::strategy_for(stage, default_fan_in);
    if !matches!(stage.kind(), StageKind::Step | StageKind::Parallel { .. })
        || fan_in == FanInStrategy::Striped
        || workflow.plan().roots().len() > 1
    {
        for &id in executions {
            nodes::start(engine, conn, workflow, id, Drive::run(default_fan_in)).await?;
        }
        return Ok(());
    }
    groups::create_first_stages(conn, executions, workflow, fan_in).await
}
