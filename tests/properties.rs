//! Property tests: random workflow shapes (steps, parallel blocks, maps of width 0..64,
//! conditional branches, sleeps, signal waits raced by their signals and timeouts, maps
//! of child workflows run by a loop of `claim` and `run_builtin`),
//! failure patterns, duplicate and late completions and worker counts, run by concurrent
//! workers on separate connections against real PostgreSQL. Whatever the case, the
//! execution ends as a model of it predicts, every group fires exactly once, counters
//! tell the truth, and replays change nothing. A failing case shrinks to a minimal one.
//!
//! `PROPTEST_CASES=200 cargo test --test properties` explores more cases.

mod common;

use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::TestDb;
use confluo::{ExecutionStatus, FanInStrategy, Join, Outcome, RetryPolicy, Stage, Workflow};
use proptest::prelude::*;
use serde_json::{json, Value};

#[derive(Debug, Clone, Copy, PartialEq)]
enum Shape {
    Step,
    Parallel(u8),
    Map,
    /// A branch on `/0` of the previous output: `1` (the first element of a step's
    /// non-empty array) runs a map `y` over that array; anything else (an empty array, a
    /// block's output) runs `otherwise`, a step `x`. Numbered: the branch, `y`, `x`.
    Branch,
    /// A sleep of a few milliseconds: what follows receives what it received.
    Sleep,
    /// A wait for a signal sent a few milliseconds after the start (before the wait is
    /// reached, or while it waits), timing out after a few milliseconds with the same
    /// output as the signal's payload ([`SIGNALLED`]): whoever wins, the model is one.
    Signal,
    /// A map of child workflows ([`CHILD`]: one step adding 1 to its input) over the
    /// previous output: like [`Shape::Map`], but each member is a whole execution, whose
    /// step fails for good (failing the child, and so its member) as its input rolls.
    Children,
    /// Dependency fan-in: a step `z` from the start (beside everything before it), then a
    /// step waiting for both it and the stage before; it returns one element per
    /// dependency. Numbered: `z`, then the join.
    Join,
    /// A parallel block of `n` joined `at_least(k)`, `k` its members that do not fail for
    /// good (so what it passes on does not depend on who finishes first), or 1 when all
    /// of them fail (so the quorum is out of reach, and the execution fails).
    Quorum(u8),
}

/// The child workflow of [`Shape::Children`], and its one step.
const CHILD: &str = "prop_child";
const CHILD_STEP: &str = "c0";
/// The "stage" a child's step rolls its failures with, keyed by its input, not by where
/// it runs: every child's step is stage 0, item 0 of its own execution.
const CHILD_ROLL: usize = usize::MAX;

/// The payload of every signal, and the timeout output of every wait.
const SIGNALLED: [i64; 2] = [1, 2];

#[derive(Debug, Clone)]
struct Case {
    /// Elements the first step returns.
    width: usize,
    /// The stages after the first step.
    stages: Vec<Shape>,
    /// Percent of members that fail for good (dead letters; a step's fails the execution).
    dead_pct: u64,
    /// Percent of members whose first attempt fails and is retried.
    flaky_pct: u64,
    /// Percent of completions sent twice.
    duplicate_pct: u64,
    /// Percent of retried members whose failed attempt completes late.
    late_pct: u64,
    workers: usize,
    strategy: FanInStrategy,
    seed: u64,
}

fn roll(seed: u64, what: impl Hash) -> u64 {
    let mut h = DefaultHasher::new();
    (seed, what).hash(&mut h);
    h.finish() % 100
}

impl Case {
    fn workflow(&self, name: &str) -> Workflow {
        let retry =
            RetryPolicy::exponential(3).backoff(Duration::from_millis(1), Duration::from_millis(5));
        let mut wf = Workflow::new(name, 1).stage(Stage::step("s0").retry(retry));
        // Stages as the plan numbers them (see `expected`).
        let mut index = 1;
        for (i, shape) in self.stages.iter().enumerate() {
            let at = index;
            index += match shape {
                Shape::Branch => 3,
                Shape::Join => 2,
                _ => 1,
            };
            if let Shape::Quorum(n) = *shape {
                let live = (0..n).filter(|b| !self.dead(at, u32::from(*b))).count() as u32;
                let stage = Stage::parallel(
                    format!("s{}", i + 1),
                    (0..n).map(|b| format!("s{}b{b}", i + 1)),
                )
                .join(Join::AtLeast(live.max(1)))
                .retry(retry);
                // A quorum cannot be striped: a striped case's default gives way.
                wf = wf.stage(if self.strategy == FanInStrategy::Striped {
                    stage
                } else {
                    stage.fan_in(self.strategy)
                });
                continue;
            }
            if *shape == Shape::Join {
                let (z, before) = (format!("s{}z", i + 1), format!("s{i}"));
                wf = wf
                    .stage(
                        Stage::step(&z)
                            .at_start()
                            .retry(retry)
                            .fan_in(self.strategy),
                    )
                    .stage(
                        Stage::step(format!("s{}", i + 1))
                            .after([before, z])
                            .retry(retry)
                            .fan_in(self.strategy),
                    );
                continue;
            }
            let stage = match shape {
                Shape::Step => Stage::step(format!("s{}", i + 1)),
                Shape::Parallel(n) => Stage::parallel(
                    format!("s{}", i + 1),
                    (0..*n).map(|b| format!("s{}b{b}", i + 1)),
                ),
                Shape::Map => Stage::map(format!("s{}", i + 1)),
                Shape::Branch => {
                    let arm = |s: Stage| s.retry(retry).fan_in(self.strategy);
                    Stage::branch(format!("s{}", i + 1))
                        .by("/0")
                        .on("1", [arm(Stage::map(format!("s{}y", i + 1)))])
                        .otherwise([arm(Stage::step(format!("s{}x", i + 1)))])
                        .into()
                }
                Shape::Children => Stage::map_workflow(format!("s{}", i + 1), CHILD),
                Shape::Join | Shape::Quorum(_) => unreachable!("placed above"),
                Shape::Sleep => Stage::sleep(format!("s{}", i + 1), Duration::from_millis(3)),
                Shape::Signal => Stage::signal(format!("s{}", i + 1))
                    .within(Duration::from_millis(roll(self.seed, ("timeout", i)) / 4))
                    .on_timeout(json!(SIGNALLED))
                    .into(),
            };
            wf = wf.stage(stage.retry(retry).fan_in(self.strategy));
        }
        wf
    }

    /// The child workflow of every [`Shape::Children`].
    fn child(&self) -> Workflow {
        let retry =
            RetryPolicy::exponential(3).backoff(Duration::from_millis(1), Duration::from_millis(5));
        Workflow::new(CHILD, 1).stage(Stage::step(CHILD_STEP).retry(retry).fan_in(self.strategy))
    }

    fn dead(&self, stage: usize, item: u32) -> bool {
        roll(self.seed, ("dead", stage, item)) < self.dead_pct
    }

    /// What the execution ends as: its status, the successful outputs of the last stage
    /// that ran (a step's whole output), and whether that stage was a step.
    fn expected(&self) -> (ExecutionStatus, Value, bool) {
        let failed = (ExecutionStatus::Failed, Value::Null, false);
        if self.dead(0, 0) {
            return failed;
        }
        let mut model = Model {
            elements: (1..=self.width as i64).map(|v| json!(v)).collect(),
            last: Value::Null,
            step: true,
        };
        model.last = json!(model.elements);
        // Stages as the plan numbers them: a branch, then its arms' `y` and `x`.
        let mut index = 1;
        for (i, shape) in self.stages.iter().enumerate() {
            let ran = match shape {
                Shape::Branch => {
                    let (shape, at) = if model.step && !model.elements.is_empty() {
                        (Shape::Map, index + 1)
                    } else {
                        (Shape::Step, index + 2)
                    };
                    index += 3;
                    self.apply(&mut model, shape, at, i + 1)
                }
                Shape::Join => {
                    index += 2;
                    !self.dead(index - 2, 0)
                        && self.apply(&mut model, Shape::Join, index - 1, i + 1)
                }
                shape => {
                    index += 1;
                    self.apply(&mut model, *shape, index - 1, i + 1)
                }
            };
            if !ran {
                return failed;
            }
        }
        (ExecutionStatus::Completed, model.last, model.step)
    }

    /// Runs one stage numbered `index` (the `position`-th of the list) in the model;
    /// false if it fails the execution.
    fn apply(&self, model: &mut Model, shape: Shape, index: usize, position: usize) -> bool {
        match shape {
            Shape::Step => {
                if self.dead(index, 0) {
                    return false;
                }
                model.elements = (1..=model.elements.len() as i64)
                    .map(|v| json!(v))
                    .collect();
                model.last = json!(model.elements);
            }
            Shape::Parallel(n) | Shape::Quorum(n) => {
                let ok: Vec<u8> = (0..n)
                    .filter(|b| !self.dead(index, u32::from(*b)))
                    .collect();
                if ok.is_empty() && matches!(shape, Shape::Quorum(_)) {
                    return false;
                }
                model.elements = ok.iter().map(|b| json!(b)).collect();
                model.last = json!(ok
                    .iter()
                    .map(|b| (format!("s{position}b{b}"), json!(b)))
                    .collect::<serde_json::Map<_, _>>());
            }
            Shape::Map => {
                model.elements = model
                    .elements
                    .iter()
                    .enumerate()
                    .filter(|(item, _)| !self.dead(index, *item as u32))
                    .map(|(_, v)| json!(v.as_i64().unwrap() + 1))
                    .collect();
                model.last = json!(model.elements);
            }
            // A child fails when its step does; its output is its step's.
            Shape::Children => {
                model.elements = model
                    .elements
                    .iter()
                    .map(|v| v.as_i64().unwrap())
                    .filter(|v| !self.dead(CHILD_ROLL, *v as u32))
                    .map(|v| json!(v + 1))
                    .collect();
                model.last = json!(model.elements);
            }
            // Its one task may fail for good like a step's; otherwise nothing changes.
            Shape::Sleep => return !self.dead(index, 0),
            // The signal or the timeout: either gives the same output, and neither fails.
            Shape::Signal => {
                model.elements = SIGNALLED.iter().map(|v| json!(v)).collect();
                model.last = json!(SIGNALLED);
                model.step = true;
                return true;
            }
            // Its `z` ran (the caller checked it); it returns one element per dependency.
            Shape::Join => {
                if self.dead(index, 0) {
                    return false;
                }
                model.elements = vec![json!(1), json!(2)];
                model.last = json!([1, 2]);
                model.step = true;
                return true;
            }
            Shape::Branch => unreachable!("a branch runs one of its arms' stages"),
        }
        model.step = shape == Shape::Step;
        true
    }
}

/// Where the model's execution stands after a stage.
struct Model {
    /// The successful outputs (a step's: the elements of its array).
    elements: Vec<Value>,
    /// The output as compared at the end (a block's: its successful outputs).
    last: Value,
    /// Whether the stage was a step.
    step: bool,
}

/// What a handler returns for `input`, as the model says.
fn output(stage: usize, handler: &str, item: u32, input: &Value) -> Value {
    if let Some(branch) = handler.split_once('b').map(|(_, b)| b) {
        return json!(branch.parse::<u8>().unwrap());
    }
    let _ = stage;
    if handler == "confluo:signal" {
        return input["on_timeout"].clone(); // what the workers' own handler returns
    }
    match input {
        Value::Number(n) if handler == "s0" => json!((1..=n.as_i64().unwrap()).collect::<Vec<_>>()),
        Value::Number(n) => json!(n.as_i64().unwrap() + 1), // a map member
        Value::Array(a) => json!((1..=a.len() as i64).collect::<Vec<_>>()),
        // A join's input: one entry per dependency.
        Value::Object(o) if !o.contains_key("outputs") => {
            json!((1..=o.len() as i64).collect::<Vec<_>>())
        }
        Value::Object(o) => {
            let n = match &o["outputs"] {
                Value::Array(a) => a.len(),
                Value::Object(m) => m.len(),
                _ => 0,
            };
            let _ = item;
            json!((1..=n as i64).collect::<Vec<_>>())
        }
        _ => Value::Null,
    }
}

fn case() -> impl Strategy<Value = Case> {
    let shape = prop_oneof![
        Just(Shape::Step),
        (1u8..=4).prop_map(Shape::Parallel),
        (1u8..=4).prop_map(Shape::Quorum),
        Just(Shape::Map),
        Just(Shape::Branch),
        Just(Shape::Sleep),
        Just(Shape::Signal),
        Just(Shape::Children),
        Just(Shape::Join)
    ];
    (
        0usize..64,
        prop::collection::vec(shape, 1..4),
        (0u64..20, 0u64..30, 0u64..30, 0u64..50),
        1usize..4,
        prop_oneof![
            Just(FanInStrategy::Countdown),
            Just(FanInStrategy::Striped),
            Just(FanInStrategy::RowLock)
        ],
        any::<u64>(),
    )
        .prop_map(
            |(
                width,
                stages,
                (dead_pct, flaky_pct, duplicate_pct, late_pct),
                workers,
                strategy,
                seed,
            )| Case {
                width,
                stages,
                dead_pct,
                flaky_pct,
                duplicate_pct,
                late_pct,
                workers,
                strategy,
                seed,
            },
        )
}

/// Runs a case with its workers; returns a description of the first broken invariant.
async fn run(case: &Case) -> Result<(), String> {
    let db = TestDb::new(case.workers as u32 * 2 + 2).await;
    let wf = case.workflow("prop");
    db.register(&case.child()).await;
    db.register(&wf).await;
    let id = db
        .engine
        .start("prop", &json!(case.width))
        .await
        .map_err(|e| e.to_string())?;
    let done = Arc::new(AtomicBool::new(false));
    let fired = Arc::new(AtomicUsize::new(0));
    let violations = Arc::new(Mutex::new(Vec::<String>::new()));
    // Each wait's signal, sent a few milliseconds in (sometimes twice); a received one
    // fired the wait's group.
    let mut signallers = Vec::new();
    for (i, _) in case
        .stages
        .iter()
        .enumerate()
        .filter(|(_, s)| **s == Shape::Signal)
    {
        let (engine, fired, violations) = (db.engine.clone(), fired.clone(), violations.clone());
        let (delay, twice) = (
            roll(case.seed, ("signal", i)) / 3,
            roll(case.seed, ("dup", i)) < case.duplicate_pct,
        );
        signallers.push(tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(delay)).await;
            let name = format!("s{}", i + 1);
            for attempt in 0..if twice { 2 } else { 1 } {
                let outcome = engine.signal(id, &name, json!(SIGNALLED)).await.unwrap();
                let fine = match outcome {
                    confluo::SignalOutcome::Received => {
                        fired.fetch_add(1, Ordering::Relaxed);
                        attempt == 0
                    }
                    confluo::SignalOutcome::Kept => attempt == 0,
                    confluo::SignalOutcome::AlreadyReceived => attempt == 1,
                    _ => true, // too late, or the execution ended
                };
                if !fine {
                    violations
                        .lock()
                        .unwrap()
                        .push(format!("signal {name} #{attempt} was {outcome:?}"));
                }
            }
        }));
    }
    let mut workers = Vec::new();
    for w in 0..case.workers {
        let engine = common::engine(db.new_pool(2).await);
        engine.register(&case.child()).await.unwrap();
        engine.register(&wf).await.unwrap();
        let (case, done, fired, violations) = (
            case.clone(),
            done.clone(),
            fired.clone(),
            violations.clone(),
        );
        workers.push(tokio::spawn(async move {
            let mut stale = Vec::new();
            while !done.load(Ordering::Relaxed) {
                let tasks = engine
                    .claim(&format!("w{w}"), 3, Duration::from_secs(60))
                    .await
                    .unwrap();
                if tasks.is_empty() {
                    tokio::time::sleep(Duration::from_millis(3)).await;
                    continue;
                }
                for task in tasks {
                    // A child's member: the engine's own handler reports its child's end.
                    // (Sleeps and timeouts are run below, so that faults reach them too.)
                    if task.handler() == "confluo:child" {
                        let outcome = engine.run_builtin(&task).await.unwrap().unwrap();
                        if matches!(
                            outcome,
                            Outcome::Completed { fired: true }
                                | Outcome::DeadLettered { fired: true }
                        ) {
                            fired.fetch_add(1, Ordering::Relaxed);
                        }
                        continue;
                    }
                    let input = engine.task_input(&task).await.unwrap();
                    let out = output(
                        task.stage_index(),
                        task.handler(),
                        task.item_index(),
                        &input,
                    );
                    let member = if task.handler() == CHILD_STEP {
                        (CHILD_ROLL, input.as_i64().unwrap() as u32)
                    } else {
                        (task.stage_index(), task.item_index())
                    };
                    // A wait's timeout is run as the workers' own handler runs it.
                    let timer = task.handler() == "confluo:signal";
                    let outcome = if case.dead(member.0, member.1) && !timer {
                        engine.fail(&task, "injected: dead", true).await.unwrap()
                    } else if task.attempt() == 1
                        && roll(case.seed, ("flaky", member)) < case.flaky_pct
                    {
                        if roll(case.seed, ("late", member)) < case.late_pct {
                            stale.push((task.clone(), out.clone()));
                        }
                        engine.fail(&task, "injected: flaky", false).await.unwrap()
                    } else {
                        let first = engine.complete(&task, out.clone()).await.unwrap();
                        // (A member a quorum cancelled as it ran has lost its lease:
                        // there is nothing to replay.)
                        if first != Outcome::LeaseLost
                            && roll(case.seed, ("dup", member)) < case.duplicate_pct
                        {
                            let again = engine.complete(&task, out.clone()).await.unwrap();
                            if again != Outcome::AlreadyRecorded {
                                violations
                                    .lock()
                                    .unwrap()
                                    .push(format!("duplicate of {member:?} was {again:?}"));
                            }
                        }
                        first
                    };
                    if matches!(
                        outcome,
                        Outcome::Completed { fired: true } | Outcome::DeadLettered { fired: true }
                    ) {
                        fired.fetch_add(1, Ordering::Relaxed);
                    }
                }
                // Late completions of failed attempts, one claim later: that attempt's
                // outcome is recorded (as a failure) or its lease is gone; nothing changes.
                for (old, out) in stale.drain(..) {
                    let late = engine.complete(&old, out).await.unwrap();
                    if !matches!(late, Outcome::LeaseLost | Outcome::AlreadyRecorded) {
                        violations
                            .lock()
                            .unwrap()
                            .push(format!("late completion was {late:?}"));
                    }
                }
            }
        }));
    }
    let execution = db
        .engine
        .wait(id, Duration::from_secs(20))
        .await
        .map_err(|e| format!("{e}"))?;
    done.store(true, Ordering::Relaxed);
    for w in workers.into_iter().chain(signallers) {
        w.await
            .map_err(|e| format!("a worker or signaller panicked: {e}"))?;
    }
    if let Some(v) = violations.lock().unwrap().first() {
        return Err(v.clone());
    }

    let (status, last, last_is_step) = case.expected();
    if execution.status != status {
        return Err(format!(
            "execution {:?}, expected {status:?}",
            execution.status
        ));
    }
    if status == ExecutionStatus::Completed {
        let got = execution.output.clone().unwrap_or(Value::Null);
        let got = if last_is_step {
            got
        } else {
            got["outputs"].clone()
        };
        if got != last {
            return Err(format!("output {got}, expected {last}"));
        }
    }
    // Every group with members fired exactly once, each fire reported to one finisher
    // (a wait whose signal was kept fires unreported, in the transaction that entered it);
    // every group of a completed execution fired; every counter tells the truth. The
    // execution's children included.
    let (fired_groups, unfired, lying): (i64, i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE g.width > 0 AND g.fired_at IS NOT NULL
                                   AND NOT (g.kind = 'signal' AND g.fired_at = g.created_at)),
                count(*) FILTER (WHERE g.width > 0 AND x.status = 'completed'
                                   AND g.fired_at IS NULL),
                count(*) FILTER (WHERE (g.fan_in = 'countdown' AND g.remaining <> o.open)
                                    OR (g.fan_in = 'countdown' AND g.quorum IS NOT NULL
                                        AND g.needed <> g.quorum - o.completed)
                                    OR (g.fan_in = 'striped' AND g.remaining <>
                                        (SELECT count(*) FROM confluo.group_stripe s
                                          WHERE s.group_id = g.id AND s.remaining > 0)))
           FROM confluo.stage_group g
           JOIN confluo.execution x ON x.id = g.execution_id
           JOIN LATERAL (SELECT count(*) FILTER (WHERE t.status IN ('pending', 'running')) AS open,
                                count(*) FILTER (WHERE t.status = 'completed') AS completed
                           FROM confluo.task t WHERE t.group_id = g.id) o ON true
          WHERE x.id = $1 OR x.parent_execution = $1",
    )
    .bind(id)
    .fetch_one(&db.pool)
    .await
    .map_err(|e| e.to_string())?;
    if lying > 0 {
        return Err(format!("{lying} counters disagree with their members"));
    }
    let reported = fired.load(Ordering::Relaxed) as i64;
    if reported != fired_groups {
        return Err(format!(
            "{reported} finishers told fired, {fired_groups} groups fired"
        ));
    }
    if unfired > 0 {
        return Err(format!(
            "{unfired} groups of completed executions never fired"
        ));
    }
    // A completed execution's joins all counted down to zero, one per join stage.
    if status == ExecutionStatus::Completed {
        let joins: (i64, i64) = sqlx::query_as(
            "SELECT count(*), count(*) FILTER (WHERE remaining = 0)
               FROM confluo.stage_join WHERE execution_id = $1",
        )
        .bind(id)
        .fetch_one(&db.pool)
        .await
        .map_err(|e| e.to_string())?;
        let expected = case.stages.iter().filter(|s| **s == Shape::Join).count() as i64;
        if joins != (expected, expected) {
            return Err(format!("joins {joins:?}, expected {expected} at zero"));
        }
    }
    // Every child's member has exactly one child, ended, and completed exactly when it did.
    let mismatched: Vec<String> = sqlx::query_scalar(
        "SELECT t.item_index || ' ' || t.status || ': ' || count(c.id) || ' children, '
                || COALESCE(string_agg(c.status, ','), '-')
           FROM confluo.task t LEFT JOIN confluo.execution c ON c.parent_task = t.id
          WHERE t.execution_id = $1 AND t.handler = 'confluo:child'
          GROUP BY t.id, t.item_index, t.status
         HAVING count(c.id) <> 1 OR bool_or(c.status = 'running')
             OR bool_or((t.status = 'completed') <> (c.status = 'completed'))",
    )
    .bind(id)
    .fetch_all(&db.pool)
    .await
    .map_err(|e| e.to_string())?;
    if let Some(m) = mismatched.first() {
        return Err(format!("member {m}"));
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|c| c.parse().ok()).unwrap_or(24),
        max_shrink_iters: 100,
        ..ProptestConfig::default()
    })]

    #[test]
    fn random_workflows_keep_every_invariant(case in case()) {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let result = rt.block_on(run(&case));
        prop_assert!(result.is_ok(), "{}", result.unwrap_err());
    }
}
