//! The stress workflow and its handlers, with fault injection. The same handler logic
//! runs in in-process workers, in worker processes, and in the rogue client (without
//! faults), so every output is a pure function of the input and checkable afterwards.

use std::hash::{DefaultHasher, Hash, Hasher};
use std::time::Duration;

use confluo::{ExecutionId, Join, RetryPolicy, Stage, TaskError, WorkerBuilder, Workflow};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use sqlx::PgPool;

pub const WORKFLOW: &str = "stress";
/// A hung attempt is cut off by the stage timeout and counts as a failed attempt.
pub const MEMBER_TIMEOUT: Duration = Duration::from_secs(1);

/// split (a step) and, beside it from the start, census (a step, faults: the execution's
/// width) -> member (a map after split, faults) -> left | right (a parallel block that
/// records what it received) -> parity (a conditional branch on the parity of left's
/// total: `even` or `odd`, a step each, passing the block's output on) -> rest (a durable
/// sleep of 20 ms, passing it on again) -> approval (a signal wait, sent by the run's
/// approver at any moment of an execution, or timed out after 300 ms with `{"approved":
/// null}`) -> total (a step waiting for approval and census, which receives both by name
/// and returns [`AUDITS`] audit requests, each carrying what the wait gave it) -> audits
/// (a map of child workflows, [`audit_workflow`], one per request).
///
/// Stages as numbered: split 0, census 1, member 2, checks 3, parity 4, even 5, odd 6,
/// rest 7, approval 8, total 9, audits 10. With a `quorum`, the map joins `at_least`
/// that many members (0: all).
pub fn workflow(quorum: u32) -> Workflow {
    let join = match quorum {
        0 => Join::All,
        k => Join::AtLeast(k),
    };
    let retry =
        RetryPolicy::exponential(3).backoff(Duration::from_millis(20), Duration::from_millis(200));
    Workflow::new(WORKFLOW, 1)
        .step("split")
        .stage(Stage::step("census").at_start().retry(retry))
        .stage(
            Stage::map("member")
                .after(["split"])
                .retry(retry)
                .timeout(MEMBER_TIMEOUT)
                .join(join),
        )
        .stage(Stage::parallel("checks", ["left", "right"]).retry(retry))
        .stage(
            Stage::branch("parity")
                .by("/outputs/left/parity")
                .on("even", [Stage::step("even").retry(retry)])
                .on("odd", [Stage::step("odd").retry(retry)]),
        )
        .stage(Stage::sleep("rest", Duration::from_millis(20)))
        .stage(
            Stage::signal(SIGNAL)
                .within(Duration::from_millis(300))
                .on_timeout(json!({"approved": null})),
        )
        .stage(Stage::step("total").after([SIGNAL, "census"]))
        .stage(Stage::map_workflow("audits", AUDIT_WORKFLOW))
}

/// The child workflow of the `audits` stage: one step, `audit`, with the member map's
/// retries, timeout and faults (so whole children fail, and their members with them).
pub fn audit_workflow() -> Workflow {
    let retry =
        RetryPolicy::exponential(3).backoff(Duration::from_millis(20), Duration::from_millis(200));
    Workflow::new(AUDIT_WORKFLOW, 1)
        .stage(Stage::step("audit").retry(retry).timeout(MEMBER_TIMEOUT))
}

pub const AUDIT_WORKFLOW: &str = "stress_audit";
/// Children each execution's `audits` stage starts.
pub const AUDITS: usize = 3;

/// What an audit child returns for its input `{"i": k, "wait": ...}`.
pub fn audit_output(input: &Value) -> Value {
    json!({"audited": input["i"], "wait": input["wait"]})
}

/// The signal the approval stage waits for: its payload is `{"approved": <execution id>}`.
pub const SIGNAL: &str = "approval";

/// The handlers of the stress workflow.
pub const HANDLERS: [&str; 8] = [
    "split", "census", "member", "left", "right", "even", "odd", "total",
];

/// Rates of the faults injected inside handlers (per attempt, except `exhaust`).
#[derive(Clone, Debug, Default, Serialize, Deserialize, clap::Args)]
pub struct HandlerFaults {
    /// Fraction of member attempts that fail with a retryable error.
    #[arg(long, default_value_t = 0.0)]
    pub error_rate: f64,
    /// Fraction of members that fail every attempt, ending dead-lettered (ten times as
    /// many audit children, whose members then fail too).
    #[arg(long, default_value_t = 0.0)]
    pub exhaust_rate: f64,
    /// Fraction of member attempts whose handler panics.
    #[arg(long, default_value_t = 0.0)]
    pub panic_rate: f64,
    /// Fraction of member attempts that hang past the stage timeout.
    #[arg(long, default_value_t = 0.0)]
    pub hang_rate: f64,
}

/// What a handler needs: where to record what it saw, and which faults to inject.
#[derive(Clone)]
pub struct Context {
    pub pool: PgPool,
    pub faults: HandlerFaults,
    pub seed: u64,
}

/// A task, as the handler logic sees it.
pub struct Task<'a> {
    pub execution_id: ExecutionId,
    pub task_id: confluo::TaskId,
    pub stage_index: usize,
    pub handler: &'a str,
    pub item_index: u32,
    pub attempt: u32,
}

/// The message of injected panics.
const INJECTED_PANIC: &str = "injected panic";

/// Keeps injected panics (thousands in a run) out of stderr; other panics still print.
pub fn silence_injected_panics() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if info.payload().downcast_ref::<&str>() != Some(&INJECTED_PANIC) {
            default(info);
        }
    }));
}

/// A number in [0, 1) fixed by its arguments, the same in every process.
fn roll(seed: u64, what: impl Hash) -> f64 {
    let mut h = DefaultHasher::new();
    (seed, what).hash(&mut h);
    (h.finish() >> 11) as f64 / (1u64 << 53) as f64
}

pub fn member_output(input: &Value) -> Value {
    json!(input.as_i64().unwrap_or(-1) * 2 + 1)
}

impl Context {
    /// Runs one of the harness's own writes, unnamed and in a transaction: the worker's
    /// pool may go through PgBouncer in transaction mode (`--through-pgbouncer`).
    async fn write(
        &self,
        statement: sqlx::query::Query<'_, sqlx::Postgres, sqlx::postgres::PgArguments>,
    ) -> sqlx::Result<()> {
        let mut tx = self.pool.begin().await?;
        statement.persistent(false).execute(&mut *tx).await?;
        tx.commit().await
    }

    /// Counts an injected fault in the harness's table.
    pub async fn record_fault(&self, kind: &str) {
        let _ = self
            .write(sqlx::query("INSERT INTO confluo_stress.fault (kind) VALUES ($1)").bind(kind))
            .await;
    }

    /// Runs one attempt; with `inject`, faults are injected at their rates.
    pub async fn perform(
        &self,
        task: Task<'_>,
        input: &Value,
        inject: bool,
    ) -> Result<Value, TaskError> {
        if task.stage_index > 0 && task.item_index == 0 {
            // The harness's own log of dispatches: a stage dispatched twice would show two
            // first members for one (execution, stage).
            self.write(
                sqlx::query(
                    "INSERT INTO confluo_stress.started (execution_id, stage_index, task_id)
                     VALUES ($1, $2, $3) ON CONFLICT DO NOTHING",
                )
                .bind(task.execution_id)
                .bind(task.stage_index as i32)
                .bind(task.task_id),
            )
            .await
            .map_err(TaskError::retryable)?;
        }
        match task.handler {
            "split" => {
                let width = input["width"].as_u64().unwrap_or(0);
                Ok(json!((0..width).collect::<Vec<_>>()))
            }
            "member" => {
                if inject {
                    self.inject(&task).await?;
                }
                Ok(member_output(input))
            }
            "left" | "right" => {
                let outputs = input["outputs"].as_array().cloned().unwrap_or_default();
                let failed = input["failed"].as_array().map_or(0, |f| f.len());
                let sum: i64 = outputs.iter().filter_map(Value::as_i64).sum();
                self.write(
                    sqlx::query(
                        "INSERT INTO confluo_stress.seen
                                (execution_id, handler, outputs, total, failed)
                         VALUES ($1, $2, $3, $4, $5)",
                    )
                    .bind(task.execution_id)
                    .bind(task.handler)
                    .bind(outputs.len() as i64)
                    .bind(sum)
                    .bind(failed as i64),
                )
                .await
                .map_err(TaskError::retryable)?;
                let parity = if sum % 2 == 0 { "even" } else { "odd" };
                Ok(json!({"outputs": outputs.len(), "total": sum, "parity": parity}))
            }
            // The arm taken says so, and passes the block's output on.
            "even" | "odd" => {
                let mut output = input.clone();
                output["arm"] = json!(task.handler);
                Ok(output)
            }
            "census" => {
                if inject {
                    self.inject(&task).await?;
                }
                Ok(json!({"width": input["width"]}))
            }
            // {"approval": <the wait's output>, "census": {"width": ..}}
            "total" => Ok(json!((0..AUDITS)
                .map(|i| json!({"i": i, "wait": input[SIGNAL]}))
                .collect::<Vec<_>>())),
            "audit" => {
                if inject {
                    self.inject(&task).await?;
                }
                Ok(audit_output(input))
            }
            // A sleep's task, when the rogue client claims one (workers run it themselves).
            "confluo:sleep" => Ok(Value::Null),
            // A signal wait's timeout, likewise: the output the stage gives on a timeout.
            "confluo:signal" => Ok(input["on_timeout"].clone()),
            other => Err(TaskError::permanent(format!("no stress handler {other}"))),
        }
    }

    async fn inject(&self, task: &Task<'_>) -> Result<(), TaskError> {
        let f = &self.faults;
        let per_attempt = |kind: &str| roll(self.seed, (kind, task.task_id, task.attempt));
        // Children are few (three per execution): ten times the rate, or a small run
        // would see no child fail.
        let (exhaust_rate, exhausted) = match task.handler {
            "audit" => ((f.exhaust_rate * 10.0).min(1.0), "exhausted child attempt"),
            "census" => (f.exhaust_rate, "exhausted census attempt"),
            _ => (f.exhaust_rate, "exhausted attempt"),
        };
        let exhaust = ("exhaust", task.handler, task.execution_id, task.item_index);
        if roll(self.seed, exhaust) < exhaust_rate {
            self.record_fault(exhausted).await;
            return Err(TaskError::retryable("injected: this member always fails"));
        }
        if per_attempt("error") < f.error_rate {
            self.record_fault("error").await;
            return Err(TaskError::retryable("injected error"));
        }
        if per_attempt("panic") < f.panic_rate {
            self.record_fault("panic").await;
            std::panic::panic_any(INJECTED_PANIC);
        }
        if per_attempt("hang") < f.hang_rate {
            self.record_fault("hang").await;
            tokio::time::sleep(MEMBER_TIMEOUT * 30).await;
        }
        Ok(())
    }

    /// Registers every stress handler on a worker, the audit child's included.
    pub fn install(&self, mut worker: WorkerBuilder) -> WorkerBuilder {
        let all = HANDLERS.map(|h| (WORKFLOW, h));
        for (workflow, name) in all.into_iter().chain([(AUDIT_WORKFLOW, "audit")]) {
            let ctx = self.clone();
            worker = worker.handler(workflow, name, move |t| {
                let ctx = ctx.clone();
                async move {
                    let task = Task {
                        execution_id: t.execution_id(),
                        task_id: t.task_id(),
                        stage_index: t.stage_index(),
                        handler: t.handler(),
                        item_index: t.item_index(),
                        attempt: t.attempt(),
                    };
                    ctx.perform(task, t.input(), true).await
                }
            });
        }
        worker
    }
}
