//! The `stage_group` table (countdown rows) and the creation of a stage's members.

use serde_json::Value;
use sqlx::types::Json;
use sqlx::PgConnection;

use crate::definition::{BranchChoice, Stage, StageKind, Workflow};
use crate::error::Result;
use crate::fanin::FanInStrategy;
use crate::ids::{ExecutionId, GroupId};

/// Where the members of a new stage come from.
#[derive(Clone, Copy, Debug)]
pub(crate) enum MemberSource<'a> {
    /// One member per handler name (a step's one, a parallel block's branches); each reads
    /// the stage input by reference when claimed.
    Handlers,
    /// One member per element of the execution input (a map as first stage).
    ExecutionInput,
    /// One member per element of a step's output array.
    StepOutput(GroupId),
    /// One member per successful output of a parallel or map group, in item order.
    GroupOutputs(GroupId),
    /// A sleep's one task, run by the workers' own handler, due at `Wake`.
    Timer(Wake),
    /// A signal wait's one task, completed by the signal, or at `Wake` by the workers'
    /// own handler, which reads the input given here (what to do on a timeout).
    Signal(Wake, &'a Value),
    /// One member per handler name, as `Handlers`, each with this input stored (a stage
    /// that waits for several: the object of their outputs).
    Given(&'a Value),
}

/// When a sleep's task is due.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Wake {
    /// This many milliseconds after the transaction's start (the database's clock).
    After(i64),
    /// At this time.
    At(chrono::DateTime<chrono::Utc>),
    /// Never (`infinity`): a signal wait without a timeout.
    Never,
}

/// A striped group has one stripe per this many members...
const MEMBERS_PER_STRIPE: i64 = 16;
/// ...and at most this many stripes...
const MAX_STRIPES: i64 = 256;
/// ...each taking runs of this many consecutive members in turn. Consecutive members are
/// claimed together and finish together, so with runs of one they land on different
/// stripes: at width 10 000 with 32 finishers, runs of 1 measured 0.96x the floor against
/// 0.70x for runs of 8 (single acknowledgements); runs of 8 suit batches of neighbours
/// better (0.58x against 0.45x with batches of 8), but single acknowledgements are what
/// workers send. Stored per group, so changing it never affects existing groups.
const STRIPE_RUN: i32 = 1;

/// The stage whose output is group `g`'s input (-1: the execution input), for groups
/// created before `input_stage` was recorded too (migration 0013).
pub(crate) fn input_stage_of(g: &str) -> String {
    format!("COALESCE({g}.input_stage, {g}.stage_index - 1)")
}

/// Creates a stage's countdown row (and stripes) and all its members in one statement, so
/// that the group is never visible without its tasks; in the same statement, records the
/// execution's current stage and, if there are members, wakes the workers (at commit).
/// `input_stage`: the stage whose output is its input (-1: the execution input). Returns
/// the width.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn create_stage(
    conn: &mut PgConnection,
    execution_id: ExecutionId,
    group_id: GroupId,
    workflow: &Workflow,
    stage_index: usize,
    input_stage: i32,
    source: MemberSource<'_>,
    fan_in: FanInStrategy,
) -> Result<i32> {
    let stage: &Stage = workflow
        .stage_at(stage_index)
        .expect("the plan numbers every stage it enters");
    let source_sql = match source {
        MemberSource::Handlers => {
            "SELECT s.h AS handler, NULL::jsonb AS input, s.o AS ord
               FROM unnest($14::text[]) WITH ORDINALITY AS s(h, o)"
        }
        MemberSource::ExecutionInput => {
            "SELECT COALESCE($25, $4)::text AS handler, e.value AS input, e.ord
               FROM confluo.execution x, jsonb_array_elements(x.input) WITH ORDINALITY AS e(value, ord)
              WHERE x.id = $2 AND $14::uuid IS NULL"
        }
        MemberSource::StepOutput(_) => {
            "SELECT COALESCE($25, $4)::text AS handler, e.value AS input, e.ord
               FROM confluo.task p, jsonb_array_elements(p.output) WITH ORDINALITY AS e(value, ord)
              WHERE p.group_id = $14::uuid"
        }
        MemberSource::GroupOutputs(_) => {
            "SELECT COALESCE($25, $4)::text AS handler, p.output AS input,
                    row_number() OVER (ORDER BY p.item_index) AS ord
               FROM confluo.task p
              WHERE p.group_id = $14::uuid AND p.status = 'completed'"
        }
        // Its input is not read: the stage after the sleep reads the sleep's input stage.
        MemberSource::Timer(_) => {
            "SELECT $14::text AS handler, 'null'::jsonb AS input, 1::int8 AS ord"
        }
        MemberSource::Signal(..) => "SELECT $14::text AS handler, $23::jsonb AS input, 1::int8 AS ord",
        MemberSource::Given(_) => {
            "SELECT s.h AS handler, $23::jsonb AS input, s.o AS ord
               FROM unnest($14::text[]) WITH ORDINALITY AS s(h, o)"
        }
    };
    let sql = format!(
        "WITH src AS MATERIALIZED ({source_sql}),
         k AS (
            SELECT count(*) AS n,
                   CASE WHEN $15 = 'striped'
                        THEN least($16, greatest(1, count(*) / $17))::int ELSE 1 END AS k
              FROM src
         ),
         g AS (
            INSERT INTO confluo.stage_group
                   (id, execution_id, stage_index, stage_name, kind, width, remaining, fan_in,
                    stripes, stripe_run, input_stage, quorum, needed, tolerable)
            SELECT $1, $2, $3, $4, $5, k.n,
                   CASE $15 WHEN 'countdown' THEN k.n WHEN 'striped' THEN least(k.n, k.k) END,
                   $15, k.k, $19, $20, $26::int, $26::int, k.n - $26::int
              FROM k
            RETURNING width
         ),
         s AS (
            INSERT INTO confluo.group_stripe (group_id, stripe, remaining)
            SELECT $1, confluo.stripe_of((src.ord - 1)::int, $19, k.k), count(*)
              FROM src, k
             WHERE $15 = 'striped'
             GROUP BY 2
         ),
         moved AS (
            UPDATE confluo.execution SET current_stage = $3, updated_at = now() WHERE id = $2
         ),
         t AS (
            INSERT INTO confluo.task
                   (id, execution_id, group_id, workflow_name, workflow_version, stage_index,
                    handler, item_index, input, priority, max_attempts, backoff_base_ms,
                    backoff_max_ms, backoff_jitter, timeout_ms, run_at)
            SELECT gen_random_uuid(), $2, $1, $6, $7, $3, src.handler, (src.ord - 1)::int,
                   src.input, $8, $9, $10, $11, $12, $13,
                   CASE WHEN $24 THEN 'infinity'::timestamptz
                        ELSE COALESCE($22, now() + COALESCE($21, 0) * interval '1 millisecond')
                   END
              FROM src
         )
         SELECT g.width FROM g
           LEFT JOIN LATERAL (SELECT pg_notify($18, '') WHERE g.width > 0) woken ON true"
    );
    let retry = stage.retry_policy();
    let query = super::query_scalar::<i32>(&sql)
        .bind(group_id)
        .bind(execution_id)
        .bind(stage_index as i32)
        .bind(stage.name())
        .bind(stage.kind().as_str())
        .bind(workflow.name())
        .bind(workflow.version())
        .bind(stage.claim_priority())
        .bind(retry.max_attempts as i32)
        .bind(retry.initial_backoff_ms as i64)
        .bind(retry.max_backoff_ms as i64)
        .bind(retry.jitter)
        .bind(stage.attempt_timeout().as_millis() as i64);
    // $14 is bound last: it depends on the source.
    let query = match source {
        MemberSource::Handlers | MemberSource::Given(_) => query.bind(stage.handler_names()),
        MemberSource::ExecutionInput => query.bind(None::<GroupId>),
        MemberSource::StepOutput(g) | MemberSource::GroupOutputs(g) => query.bind(g),
        MemberSource::Timer(_) => query.bind(crate::definition::SLEEP_HANDLER.to_owned()),
        MemberSource::Signal(..) => query.bind(crate::definition::SIGNAL_HANDLER.to_owned()),
    };
    let query = query
        .bind(fan_in.as_str())
        .bind(MAX_STRIPES)
        .bind(MEMBERS_PER_STRIPE)
        .bind(crate::store::TASKS_CHANNEL)
        .bind(STRIPE_RUN)
        .bind(input_stage);
    let (wake, input) = match source {
        MemberSource::Timer(wake) => (Some(wake), None),
        MemberSource::Signal(wake, input) => (Some(wake), Some(Json(input))),
        MemberSource::Given(input) => (None, Some(Json(input))),
        _ => (None, None),
    };
    let (after, at) = match wake {
        Some(Wake::After(ms)) => (Some(ms), None),
        Some(Wake::At(at)) => (None, Some(at)),
        _ => (None, None),
    };
    // A child workflow's members wait, at `infinity`, for their children's ends.
    let child = matches!(stage.kind(), StageKind::MapWorkflow { .. });
    let never = matches!(wake, Some(Wake::Never)) || child;
    Ok(query
        .bind(after)
        .bind(at)
        .bind(input)
        .bind(never)
        .bind(child.then_some(crate::definition::CHILD_HANDLER))
        .bind(quorum(stage))
        .fetch_one(conn)
        .await?)
}

/// Whether the execution has entered stage `stage` (its group exists).
pub(crate) async fn entered(
    conn: &mut PgConnection,
    execution_id: ExecutionId,
    stage: usize,
) -> Result<bool> {
    Ok(entered_group(conn, execution_id, stage).await?.is_some())
}

/// The group of stage `stage`, if the execution has entered it (one per stage).
pub(crate) async fn entered_group(
    conn: &mut PgConnection,
    execution_id: ExecutionId,
    stage: usize,
) -> Result<Option<GroupId>> {
    Ok(super::query_scalar(
        "SELECT id FROM confluo.stage_group WHERE execution_id = $1 AND stage_index = $2",
    )
    .bind(execution_id)
    .bind(stage as i32)
    .fetch_optional(conn)
    .await?)
}

/// Records a branch's choice as a group of width 0, fired at once (a branch runs no task),
/// and the execution's current stage.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn create_branch(
    conn: &mut PgConnection,
    execution_id: ExecutionId,
    group_id: GroupId,
    stage_index: usize,
    stage_name: &str,
    input_stage: i32,
    fan_in: FanInStrategy,
    choice: &BranchChoice,
) -> Result<()> {
    super::query(
        "WITH g AS (
            INSERT INTO confluo.stage_group
                   (id, execution_id, stage_index, stage_name, kind, width, remaining, fan_in,
                    stripes, stripe_run, input_stage, branch, fired_at)
            VALUES ($1, $2, $3, $4, 'branch', 0, 0, $5, 1, 1, $6, $7, now())
         )
         UPDATE confluo.execution SET current_stage = $3, updated_at = now() WHERE id = $2",
    )
    .bind(group_id)
    .bind(execution_id)
    .bind(stage_index as i32)
    .bind(stage_name)
    .bind(fan_in.as_str())
    .bind(input_stage)
    .bind(sqlx::types::Json(choice))
    .execute(conn)
    .await?;
    Ok(())
}

/// Creates the first stage of many new executions at once, when its members are its
/// handlers (a step, a parallel block) and its strategy keeps no stripes: one group per
/// execution, one task per handler, in one statement that wakes the workers at commit.
/// Each group holds what [`create_stage`] would have created for it.
pub(crate) async fn create_first_stages(
    conn: &mut PgConnection,
    executions: &[ExecutionId],
    workflow: &Workflow,
    fan_in: FanInStrategy,
) -> Result<()> {
    debug_assert!(fan_in != FanInStrategy::Striped);
    let stage: &Stage = &workflow.stages()[0];
    debug_assert!(!matches!(stage.kind(), crate::StageKind::Branch { .. }));
    let retry = stage.retry_policy();
    let handlers = stage.handler_names();
    super::query(
        "WITH g AS (
            INSERT INTO confluo.stage_group
                   (id, execution_id, stage_index, stage_name, kind, width, remaining, fan_in,
                    stripes, stripe_run, input_stage, quorum, needed, tolerable)
            SELECT gen_random_uuid(), e.id, 0, $2, $3, cardinality($4::text[]),
                   CASE WHEN $5 = 'countdown' THEN cardinality($4::text[]) END, $5, 1, $15, -1,
                   $16::int, $16::int, cardinality($4::text[]) - $16::int
              FROM unnest($1::uuid[]) AS e(id)
            RETURNING id, execution_id
         ), t AS (
            INSERT INTO confluo.task
                   (id, execution_id, group_id, workflow_name, workflow_version, stage_index,
                    handler, item_index, input, priority, max_attempts, backoff_base_ms,
                    backoff_max_ms, backoff_jitter, timeout_ms)
            SELECT gen_random_uuid(), g.execution_id, g.id, $6, $7, 0, h.name, (h.ord - 1)::int,
                   NULL, $8, $9, $10, $11, $12, $13
              FROM g, unnest($4::text[]) WITH ORDINALITY AS h(name, ord)
         )
         SELECT pg_notify($14, '')",
    )
    .bind(executions)
    .bind(stage.name())
    .bind(stage.kind().as_str())
    .bind(&handlers)
    .bind(fan_in.as_str())
    .bind(workflow.name())
    .bind(workflow.version())
    .bind(stage.claim_priority())
    .bind(retry.max_attempts as i32)
    .bind(retry.initial_backoff_ms as i64)
    .bind(retry.max_backoff_ms as i64)
    .bind(retry.jitter)
    .bind(stage.attempt_timeout().as_millis() as i64)
    .bind(crate::store::TASKS_CHANNEL)
    .bind(STRIPE_RUN)
    .bind(quorum(stage))
    .execute(conn)
    .await?;
    Ok(())
}

/// The successes a stage's group needs to fire, for a quorum join (`None`: all).
fn quorum(stage: &Stage) -> Option<i32> {
    stage
        .join_rule()
        .quorum()
        .map(|k| i32::try_from(k).unwrap_or(i32::MAX))
}

/// The output of a group as the next stage sees it: a step's own output (a signal wait's:
/// the payload or the timeout output); for a map
/// `{"outputs": [..successful outputs in item order..], "failed": [..]}`; for a parallel
/// block `{"outputs": {branch: output}, "failed": [..]}`; for a conditional branch or a
/// sleep, which pass their input on, the execution input (a branch's or a sleep's group
/// is read only as the output of an execution that ran nothing else: a first-stage
/// branch that took an empty arm, a sleep in first place). One statement over the groups
/// that `group_filter` selects (as `g`).
fn output_sql(group_filter: &str) -> String {
    format!(
        "SELECT {} FROM confluo.stage_group g WHERE {group_filter}",
        output_expression()
    )
}

/// A member `t` still pending or running in a quorum group that fired (a member requeued
/// into a fired group of join `all` runs, and is listed as what it is).
const UNJOINED_OPEN: &str = "t.status IN ('pending', 'running') AND EXISTS (
    SELECT 1 FROM confluo.stage_group f
     WHERE f.id = t.group_id AND f.fired_at IS NOT NULL AND f.quorum IS NOT NULL)";

/// The expression of [`output_sql`] for one group `g` (any row with its `id`, `kind` and
/// `execution_id`).
///
/// Built as `json` (text), not `jsonb`: the value goes straight to the client, and
/// aggregating 10 000 outputs into `jsonb` costs about twice as much (it re-encodes each).
pub(crate) fn output_expression() -> String {
    // A member still open once its group fired (a quorum's join went on without it,
    // and the transaction that fired skipped it while another held it) is listed as
    // what it will end as whatever it does: cancelled (`fan_in::UNJOINED`).
    use super::fan_in::UNJOINED_ERROR_SQL;
    let failed = |branch: &str| {
        format!(
            "COALESCE(json_agg(json_build_object(
                'index', t.item_index, 'branch', {branch},
                'status', CASE WHEN {UNJOINED_OPEN} THEN 'cancelled' ELSE t.status END,
                'attempts', t.attempt,
                'error', CASE WHEN {UNJOINED_OPEN} THEN {UNJOINED_ERROR_SQL}
                              ELSE t.errors -> -1 ->> 'error' END) ORDER BY t.item_index)
              FILTER (WHERE t.status <> 'completed'), '[]'::json)"
        )
    };
    format!(
        "CASE g.kind
            WHEN 'step' THEN ({one_output})
            WHEN 'signal' THEN ({one_output})
            WHEN 'parallel' THEN (
                SELECT json_build_object(
                    'outputs', COALESCE(json_object_agg(t.handler, t.output)
                                        FILTER (WHERE t.status = 'completed'), '{{}}'::json),
                    'failed', {})
                  FROM confluo.task_all t WHERE t.group_id = g.id)
            WHEN 'branch' THEN ({execution_input})
            WHEN 'sleep' THEN ({execution_input})
            ELSE (
                SELECT json_build_object(
                    'outputs', COALESCE(json_agg(t.output ORDER BY t.item_index)
                                        FILTER (WHERE t.status = 'completed'), '[]'::json),
                    'failed', {})
                  FROM confluo.task_all t WHERE t.group_id = g.id)
            END",
        failed("t.handler"),
        failed("NULL"),
        execution_input =
            "SELECT x.input::json FROM confluo.execution x WHERE x.id = g.execution_id",
        one_output = "SELECT COALESCE(t.output, 'null'::jsonb)::json FROM confluo.task_all t
                       WHERE t.group_id = g.id LIMIT 1"
    )
}

/// Why a map stage cannot take its input from `source`, if it cannot: a step's output or
/// the execution input that is not an array, or one longer than
/// [`MAX_MAP_WIDTH`](crate::MAX_MAP_WIDTH). (A block's outputs always fit.) For a map
/// reached through a conditional branch, which nothing checked before it was entered.
pub(crate) async fn unmappable(
    conn: &mut PgConnection,
    execution_id: ExecutionId,
    stage: &str,
    source: MemberSource<'_>,
) -> Result<Option<String>> {
    let shape: Option<(String, Option<i32>)> = match source {
        MemberSource::Handlers
        | MemberSource::GroupOutputs(_)
        | MemberSource::Timer(_)
        | MemberSource::Signal(..)
        | MemberSource::Given(_) => return Ok(None),
        MemberSource::ExecutionInput => {
            super::query_as(
                "SELECT jsonb_typeof(input),
                        CASE WHEN jsonb_typeof(input) = 'array' THEN jsonb_array_length(input) END
                   FROM confluo.execution WHERE id = $1",
            )
            .bind(execution_id)
            .fetch_optional(&mut *conn)
            .await?
        }
        MemberSource::StepOutput(group) => {
            super::query_as(
                "SELECT COALESCE(jsonb_typeof(output), 'null'),
                        CASE WHEN jsonb_typeof(output) = 'array' THEN jsonb_array_length(output) END
                   FROM confluo.task WHERE group_id = $1 LIMIT 1",
            )
            .bind(group)
            .fetch_optional(&mut *conn)
            .await?
        }
    };
    let max = crate::MAX_MAP_WIDTH;
    Ok(match shape {
        Some((_, Some(len))) if len as usize <= max => None,
        Some((_, Some(len))) => Some(format!(
            "map stage {stage:?} takes at most {max} members, and its input has {len}: \
             split the work before the branch"
        )),
        Some((kind, None)) => Some(format!(
            "map stage {stage:?} needs a JSON array as its input and got {kind}: make the \
             stage before it return an array"
        )),
        None => Some(format!("map stage {stage:?} found no input")),
    })
}

/// The group whose output group `group_id` received as its input: its id, kind and stage
/// index (`None`: the execution input).
pub(crate) async fn input_group(
    conn: &mut PgConnection,
    group_id: GroupId,
) -> Result<Option<(GroupId, String, i32)>> {
    let sql = format!(
        "SELECT p.id, p.kind, p.stage_index
           FROM confluo.stage_group g
           JOIN confluo.stage_group p
             ON p.execution_id = g.execution_id AND p.stage_index = {}
          WHERE g.id = $1",
        input_stage_of("g")
    );
    Ok(super::query_as(&sql)
        .bind(group_id)
        .fetch_optional(conn)
        .await?)
}

/// The output of one group.
pub(crate) async fn output<'e, E>(executor: E, group_id: GroupId) -> Result<Value>
where
    E: super::Executor<'e>,
{
    let value: Option<Value> = super::query_scalar(&output_sql("g.id = $1"))
        .bind(group_id)
        .fetch_optional(executor)
        .await?;
    Ok(value.unwrap_or(Value::Null))
}
