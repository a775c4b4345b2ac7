//! Workflow definitions: ordered stages, their options, and validation.
//!
//! A definition is plain data. It is validated when registered
//! ([`Engine::register`](crate::Engine::register)) and stored in the database, so that every
//! execution stays pinned to the version it started with.

mod branch;
mod child;
mod dependencies;
mod join;
mod plan;
mod retry;
mod signal;
mod validate;

use std::sync::OnceLock;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::fanin::FanInStrategy;

pub(crate) use branch::{decide, Decision, Source};
pub use branch::{Arm, Branch, BranchChoice};
pub(crate) use child::CHILD_HANDLER;
pub(crate) use join::strategy_for;
pub use join::Join;
pub(crate) use plan::Plan;
pub use retry::RetryPolicy;
pub use signal::SignalWait;
pub(crate) use signal::{timed_out, timeout_input, SIGNAL_HANDLER};
pub use validate::DefinitionError;

/// An ordered list of stages under a name and a version.
///
/// ```
/// use confluo::{Stage, Workflow, RetryPolicy};
/// use std::time::Duration;
///
/// let wf = Workflow::new("orders", 1)
///     .step("validate")
///     .stage(Stage::parallel("checks", ["fraud", "stock"]).fail_execution_on_member_failure())
///     .map("ship")
///     .stage(Stage::step("notify").retry(RetryPolicy::exponential(5)).timeout(Duration::from_secs(10)));
/// assert!(wf.validate().is_ok());
/// assert!(Workflow::new("empty", 1).validate().is_err());
/// ```
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Workflow {
    name: String,
    version: i32,
    stages: Vec<Stage>,
    /// Where to announce the end of its executions that name no callback of their own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    callback: Option<String>,
    /// The stages numbered, built from `stages` when first asked for.
    #[serde(skip)]
    plan: OnceLock<Plan>,
}

impl PartialEq for Workflow {
    fn eq(&self, other: &Self) -> bool {
        self.name == other.name
            && self.version == other.version
            && self.stages == other.stages
            && self.callback == other.callback
    }
}

/// One stage: what runs, and how its members are retried and joined.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Stage {
    name: String,
    kind: StageKind,
    #[serde(default)]
    retry: RetryPolicy,
    #[serde(default)]
    on_member_failure: OnMemberFailure,
    #[serde(default = "default_timeout_ms")]
    timeout_ms: u64,
    #[serde(default)]
    priority: i32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    fan_in: Option<FanInStrategy>,
    /// The stages it waits for ([`Stage::after`]); `None`: the one listed before it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    after: Option<Vec<String>>,
    /// When a parallel or map stage fires ([`Stage::join`]).
    #[serde(default, skip_serializing_if = "Join::is_all")]
    join: Join,
}

/// What a stage runs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
#[non_exhaustive]
pub enum StageKind {
    /// One task; its handler is named after the stage.
    Step,
    /// A static block: one task per branch, each run by the handler named after the branch,
    /// all with the same input.
    Parallel {
        /// Branch names, in order.
        branches: Vec<String>,
    },
    /// Dynamic fan-out: one task per element of the previous output array (the execution
    /// input, for a first stage), all run by the handler named after the stage.
    Map,
    /// A conditional branch ([`Stage::branch`]): runs no task; the value `by` selects in
    /// the previous output picks the arm whose stages run next, or `otherwise`.
    Branch {
        /// A JSON pointer into the previous output (`""`: all of it).
        #[serde(default)]
        by: String,
        /// The arms, in the order they are matched.
        arms: Vec<Arm>,
        /// The stages run when no arm matches (none: the execution fails).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        otherwise: Option<Vec<Stage>>,
    },
    /// A durable sleep ([`Stage::sleep`], [`Stage::sleep_until`]): one task due at the wake
    /// time, run by the worker itself; the next stage receives what the sleep received.
    Sleep {
        /// Sleep this long from entering the stage, in milliseconds...
        #[serde(default, skip_serializing_if = "Option::is_none")]
        for_ms: Option<u64>,
        /// ...or until the RFC 3339 time this JSON pointer selects in the previous output.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        until: Option<String>,
    },
    /// A wait for the signal named after the stage ([`Stage::signal`]), sent with
    /// [`Engine::signal`](crate::Engine::signal): one task completed by the signal, whose
    /// payload is the stage's output.
    Signal {
        /// Give up this long after entering the stage, in milliseconds (none: wait as long
        /// as the execution runs)...
        #[serde(default, skip_serializing_if = "Option::is_none")]
        timeout_ms: Option<u64>,
        /// ...failing the execution, or with this output.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        on_timeout: Option<serde_json::Value>,
    },
    /// A map whose members are executions of another workflow ([`Stage::map_workflow`]):
    /// one child per element of the previous output array; each member's output is its
    /// child's.
    MapWorkflow {
        /// The child workflow.
        workflow: String,
        /// Its version (none: the latest registered when the stage is entered).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        version: Option<i32>,
    },
}

/// The handler of a sleep's task, run by every worker that serves the workflow (a name no
/// stage can take: names starting with `confluo:` are reserved).
pub(crate) const SLEEP_HANDLER: &str = "confluo:sleep";

impl StageKind {
    /// The name stored in the database (`step`, `parallel`, `map`, `branch`, `sleep`,
    /// `signal`, `map_workflow`).
    pub fn as_str(&self) -> &'static str {
        match self {
            StageKind::Step => "step",
            StageKind::Parallel { .. } => "parallel",
            StageKind::Map => "map",
            StageKind::Branch { .. } => "branch",
            StageKind::Sleep { .. } => "sleep",
            StageKind::Signal { .. } => "signal",
            StageKind::MapWorkflow { .. } => "map_workflow",
        }
    }

    /// Whether the stage takes one member per element of an array input (a map, a map
    /// of child workflows).
    pub(crate) fn maps(&self) -> bool {
        matches!(self, StageKind::Map | StageKind::MapWorkflow { .. })
    }
}

/// What happens to the execution when a member of a parallel or map stage is dead-lettered.
///
/// A step has one member, so its dead letter always fails the execution.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnMemberFailure {
    /// The group still fans in once every member is terminal; the next stage gets the
    /// successful outputs and the list of failed members (the default).
    #[default]
    PartialResults,
    /// The execution fails at once; pending siblings are cancelled in the same transaction.
    FailExecution,
}

fn default_timeout_ms() -> u64 {
    300_000
}

fn duration_ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl Stage {
    pub(crate) fn with_kind(name: impl Into<String>, kind: StageKind) -> Self {
        Stage {
            name: name.into(),
            kind,
            retry: RetryPolicy::default(),
            on_member_failure: OnMemberFailure::default(),
            timeout_ms: default_timeout_ms(),
            priority: 0,
            fan_in: None,
            after: None,
            join: Join::All,
        }
    }

    /// A single task whose input is the previous stage's output.
    pub fn step(name: impl Into<String>) -> Self {
        Self::with_kind(name, StageKind::Step)
    }

    /// A static parallel block with one task per branch.
    pub fn parallel<I, S>(name: impl Into<String>, branches: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let branches = branches.into_iter().map(Into::into).collect();
        Self::with_kind(name, StageKind::Parallel { branches })
    }

    /// A dynamic map with one task per element of the previous output array.
    pub fn map(name: impl Into<String>) -> Self {
        Self::with_kind(name, StageKind::Map)
    }

    /// A conditional branch: add arms with [`Branch::on`], a default with
    /// [`Branch::otherwise`], and pick the value to match with [`Branch::by`]. Only the
    /// chosen arm's tasks are created; the stage after the branch receives the output of
    /// the arm's last stage. Retry, timeout and priority do not apply to a branch (it
    /// runs no task); its arms' stages have their own.
    pub fn branch(name: impl Into<String>) -> Branch {
        Branch::new(name)
    }

    /// A durable sleep of `duration` from the moment the stage is entered: a task due then,
    /// in the database, so it survives restarts of every process; workers wake it (within
    /// their [`poll_interval`](crate::WorkerBuilder::poll_interval)) with a handler of their
    /// own, none to register. The next stage receives what the sleep received.
    pub fn sleep(name: impl Into<String>, duration: Duration) -> Self {
        Self::with_kind(
            name,
            StageKind::Sleep {
                for_ms: Some(duration_ms(duration)),
                until: None,
            },
        )
    }

    /// A durable sleep until the time that the JSON pointer `until` selects in the previous
    /// output (an RFC 3339 string such as `"2027-01-31T09:00:00Z"`; `""`: the whole
    /// output). A time in the past wakes at once; a missing or unreadable value fails the
    /// execution, saying what was found. Otherwise as [`sleep`](Self::sleep).
    pub fn sleep_until(name: impl Into<String>, until: impl Into<String>) -> Self {
        Self::with_kind(
            name,
            StageKind::Sleep {
                for_ms: None,
                until: Some(until.into()),
            },
        )
    }

    /// A wait for the signal named `name` (the stage's own name), sent to the execution
    /// with [`Engine::signal`](crate::Engine::signal) or `confluo signal`. The signal's
    /// payload is the stage's output, what the next stage receives. A signal sent before
    /// the execution reaches the stage is kept and received on arrival; each name is
    /// received once per execution. Give up after a while with [`SignalWait::within`],
    /// and take a default path on a timeout with [`SignalWait::on_timeout`]. Nothing to
    /// register: workers time waits out with a handler of their own.
    pub fn signal(name: impl Into<String>) -> SignalWait {
        SignalWait::new(name)
    }

    /// Sets the retry policy of this stage's tasks (default: [`RetryPolicy::default`]).
    pub fn retry(mut self, policy: RetryPolicy) -> Self {
        self.retry = policy;
        self
    }

    /// Bounds each attempt of a handler (default 5 minutes). A timed-out attempt is a
    /// failed attempt, retried per the policy.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout_ms = duration_ms(timeout);
        self
    }

    /// Claim this stage's tasks before those of lower priority (default 0).
    pub fn priority(mut self, priority: i32) -> Self {
        self.priority = priority;
        self
    }

    /// Decides this stage's fan-in with `strategy`, whatever the engine's default
    /// ([`EngineBuilder::fan_in`](crate::EngineBuilder::fan_in)).
    pub fn fan_in(mut self, strategy: FanInStrategy) -> Self {
        self.fan_in = Some(strategy);
        self
    }

    /// When this parallel or map stage fires ([`Join`]): once every member is terminal
    /// (`All`, the default), as soon as one member completes (`Any`), or as soon as `k`
    /// have (`AtLeast(k)`), failing the execution once `k` can no longer be reached. When
    /// a quorum fires, the members still pending or running are cancelled in the same
    /// transaction (a member being acknowledged at that instant finishes, and counts as
    /// cancelled if it completes), and the next stage receives the completed members'
    /// outputs, as for `All`, with the others under `failed`. A map entered with fewer
    /// members than `k` fails the execution, saying so. A quorum counts on the group's own
    /// row: it cannot be striped ([`FanInStrategy::Striped`](crate::FanInStrategy) as the
    /// engine's default gives way to a countdown for this stage).
    pub fn join(mut self, rule: Join) -> Self {
        self.join = rule;
        self
    }

    /// The stage's join rule.
    pub fn join_rule(&self) -> Join {
        self.join
    }

    /// Fail the whole execution as soon as one member is dead-lettered, instead of passing
    /// partial results on (whatever the join rule).
    pub fn fail_execution_on_member_failure(mut self) -> Self {
        self.on_member_failure = OnMemberFailure::FailExecution;
        self
    }

    /// The stage name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// What the stage runs.
    pub fn kind(&self) -> &StageKind {
        &self.kind
    }

    /// The retry policy of its tasks.
    pub fn retry_policy(&self) -> &RetryPolicy {
        &self.retry
    }

    /// The per-attempt handler timeout.
    pub fn attempt_timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms)
    }

    /// The fan-in strategy chosen for this stage, if any (else the engine's default).
    pub fn fan_in_strategy(&self) -> Option<FanInStrategy> {
        self.fan_in
    }

    /// The claim priority of its tasks.
    pub fn claim_priority(&self) -> i32 {
        self.priority
    }

    /// Whether a dead-lettered member fails the execution (always true for a step, a
    /// sleep and a signal wait).
    pub fn fails_execution_on_member_failure(&self) -> bool {
        self.has_one_member() || self.on_member_failure == OnMemberFailure::FailExecution
    }

    /// Whether the stage's group always has exactly one member (a step, a sleep, a signal
    /// wait): its one arrival is always the group's last.
    pub(crate) fn has_one_member(&self) -> bool {
        matches!(
            self.kind,
            StageKind::Step | StageKind::Sleep { .. } | StageKind::Signal { .. }
        )
    }

    /// The handler names this stage's own tasks need: its own name, or its parallel
    /// branch names; none for a conditional branch (its arms' stages have their own), a
    /// sleep, a signal wait or a map of child workflows (workers run them themselves).
    pub fn handler_names(&self) -> Vec<&str> {
        match &self.kind {
            StageKind::Parallel { branches } => branches.iter().map(String::as_str).collect(),
            StageKind::Step | StageKind::Map => vec![self.name.as_str()],
            StageKind::Branch { .. }
            | StageKind::Sleep { .. }
            | StageKind::Signal { .. }
            | StageKind::MapWorkflow { .. } => Vec::new(),
        }
    }
}

impl Workflow {
    /// An empty workflow; add stages with [`step`](Self::step), [`parallel`](Self::parallel),
    /// [`map`](Self::map) or [`stage`](Self::stage).
    pub fn new(name: impl Into<String>, version: i32) -> Self {
        Workflow {
            name: name.into(),
            version,
            stages: Vec::new(),
            callback: None,
            plan: OnceLock::new(),
        }
    }

    /// Announces the end of every execution of this version to `url` (a webhook, sent
    /// through the outbox: see [`StartOptions::callback`](crate::StartOptions::callback)),
    /// unless the execution names its own.
    pub fn callback(mut self, url: impl Into<String>) -> Self {
        self.callback = Some(url.into());
        self
    }

    /// The webhook URL of its executions, if it has one.
    pub fn callback_url(&self) -> Option<&str> {
        self.callback.as_deref()
    }

    /// Appends a stage built with [`Stage`]'s options, or a [`Branch`].
    pub fn stage(mut self, stage: impl Into<Stage>) -> Self {
        self.stages.push(stage.into());
        self.plan = OnceLock::new();
        self
    }

    /// Appends a step with default options.
    pub fn step(self, name: impl Into<String>) -> Self {
        self.stage(Stage::step(name))
    }

    /// Appends a parallel block with default options.
    pub fn parallel<I, S>(self, name: impl Into<String>, branches: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.stage(Stage::parallel(name, branches))
    }

    /// Appends a map with default options.
    pub fn map(self, name: impl Into<String>) -> Self {
        self.stage(Stage::map(name))
    }

    /// Appends a map of child workflows with default options ([`Stage::map_workflow`]).
    pub fn map_workflow(self, name: impl Into<String>, workflow: impl Into<String>) -> Self {
        self.stage(Stage::map_workflow(name, workflow))
    }

    /// The workflow name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The workflow version.
    pub fn version(&self) -> i32 {
        self.version
    }

    /// The top-level stages, in order (a branch's arms are inside it).
    pub fn stages(&self) -> &[Stage] {
        &self.stages
    }

    /// The stage at `index` as groups, tasks and [`StageProgress`](crate::StageProgress)
    /// number them: the position in [`stages`](Self::stages), except that the stages of a
    /// branch's arms are numbered right after the branch, depth first, arm after arm (its
    /// `otherwise` last), and the stages after the branch after all of them.
    pub fn stage_at(&self, index: usize) -> Option<&Stage> {
        self.plan().get(index).map(|s| &s.stage)
    }

    /// How many stages [`stage_at`](Self::stage_at) numbers: arms included.
    pub fn stage_count(&self) -> usize {
        self.plan().len()
    }

    /// The numbered stages.
    pub(crate) fn plan(&self) -> &Plan {
        self.plan.get_or_init(|| Plan::of(&self.stages))
    }

    /// The handlers workers run themselves for its stages, arms included: a sleep's, a
    /// signal wait's with a timeout, a child workflow member's.
    pub(crate) fn builtin_handlers(&self) -> Vec<&'static str> {
        let mut names = Vec::new();
        for slot in self.plan().slots() {
            let name = match slot.stage.kind() {
                StageKind::Sleep { .. } => SLEEP_HANDLER,
                StageKind::Signal {
                    timeout_ms: Some(_),
                    ..
                } => SIGNAL_HANDLER,
                StageKind::MapWorkflow { .. } => CHILD_HANDLER,
                _ => continue,
            };
            if !names.contains(&name) {
                names.push(name);
            }
        }
        names
    }

    /// The index of the signal wait named `name`, if it has one.
    pub(crate) fn signal_stage(&self, name: &str) -> Option<usize> {
        self.plan().slots().iter().position(|s| {
            s.stage.name() == name && matches!(s.stage.kind(), StageKind::Signal { .. })
        })
    }

    /// The child workflows its [`Stage::map_workflow`] stages start, arms included, in
    /// stage order: each as the stage, the workflow and the version pinned (if any).
    pub fn child_workflows(&self) -> Vec<(&str, &str, Option<i32>)> {
        self.plan()
            .slots()
            .iter()
            .filter_map(|s| match s.stage.kind() {
                StageKind::MapWorkflow { workflow, version } => {
                    Some((s.stage.name(), workflow.as_str(), *version))
                }
                _ => None,
            })
            .collect()
    }

    /// The names of its signal waits, arms included, in stage order.
    pub fn signal_names(&self) -> Vec<&str> {
        self.plan()
            .slots()
            .iter()
            .filter(|s| matches!(s.stage.kind(), StageKind::Signal { .. }))
            .map(|s| s.stage.name())
            .collect()
    }

    /// Every handler name the workflow needs, in stage order, arms included.
    pub fn handler_names(&self) -> Vec<&str> {
        self.plan()
            .slots()
            .iter()
            .flat_map(|s| s.stage.handler_names())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_each_invalid_shape_with_its_own_error() {
        type Expected = fn(&DefinitionError) -> bool;
        let cases: Vec<(Workflow, Expected)> = vec![
            (Workflow::new("", 1).step("a"), |e| {
                matches!(e, DefinitionError::InvalidWorkflowName { .. })
            }),
            (Workflow::new("w", 0).step("a"), |e| {
                matches!(e, DefinitionError::InvalidVersion(0))
            }),
            (Workflow::new("w", 1), |e| {
                matches!(e, DefinitionError::NoStages)
            }),
            (Workflow::new("w", 1).step(" "), |e| {
                matches!(e, DefinitionError::InvalidStageName { index: 0, .. })
            }),
            (
                Workflow::new("w", 1).step("a").map("a"),
                |e| matches!(e, DefinitionError::DuplicateStage(n) if n == "a"),
            ),
            (
                Workflow::new("w", 1).parallel("p", Vec::<String>::new()),
                |e| matches!(e, DefinitionError::EmptyParallel(n) if n == "p"),
            ),
            (Workflow::new("w", 1).parallel("p", ["x", ""]), |e| {
                matches!(e, DefinitionError::InvalidBranchName { .. })
            }),
            (
                Workflow::new("w", 1).step("x").parallel("p", ["x"]),
                |e| matches!(e, DefinitionError::DuplicateHandler(n) if n == "x"),
            ),
            (
                Workflow::new("w", 1).stage(Stage::step("a").retry(RetryPolicy::exponential(0))),
                |e| matches!(e, DefinitionError::InvalidRetryPolicy { .. }),
            ),
            (
                Workflow::new("w", 1)
                    .stage(Stage::step("a").retry(RetryPolicy::none().jitter(2.0))),
                |e| matches!(e, DefinitionError::InvalidRetryPolicy { .. }),
            ),
            (
                Workflow::new("w", 1).stage(Stage::step("a").timeout(Duration::ZERO)),
                |e| matches!(e, DefinitionError::InvalidTimeout(_)),
            ),
            (
                Workflow::new("w", 1).stage(Stage::branch("b")),
                |e| matches!(e, DefinitionError::EmptyBranch(n) if n == "b"),
            ),
            (
                Workflow::new("w", 1).stage(
                    Stage::branch("b")
                        .on("x", [Stage::step("s")])
                        .on("x", [Stage::step("t")]),
                ),
                |e| matches!(e, DefinitionError::InvalidArm { when, .. } if when == "x"),
            ),
            (
                Workflow::new("w", 1)
                    .stage(Stage::branch("b").by("method").on("x", [Stage::step("s")])),
                |e| matches!(e, DefinitionError::InvalidBranchPointer { .. }),
            ),
            // Names are unique across arms and the rest of the workflow...
            (
                Workflow::new("w", 1)
                    .step("s")
                    .stage(Stage::branch("b").on("x", [Stage::step("s")])),
                |e| matches!(e, DefinitionError::DuplicateStage(n) if n == "s"),
            ),
            // ...and stages inside arms are checked like any other.
            (
                Workflow::new("w", 1).stage(
                    Stage::branch("b")
                        .on("x", Vec::<Stage>::new())
                        .otherwise([Stage::step("t").retry(RetryPolicy::exponential(0))]),
                ),
                |e| matches!(e, DefinitionError::InvalidRetryPolicy { stage, .. } if stage == "t"),
            ),
        ];
        for (wf, expected) in cases {
            let err = wf.validate().expect_err("definition should be rejected");
            assert!(expected(&err), "unexpected error {err:?} for {wf:?}");
        }
    }

    #[test]
    fn round_trips_through_json() {
        let wf = Workflow::new("orders", 3)
            .step("a")
            .stage(Stage::parallel("p", ["b", "c"]).fail_execution_on_member_failure())
            .stage(
                Stage::map("m")
                    .priority(5)
                    .timeout(Duration::from_millis(1500)),
            );
        wf.validate().unwrap();
        let json = serde_json::to_value(&wf).unwrap();
        let back: Workflow = serde_json::from_value(json).unwrap();
        assert_eq!(wf, back);
        assert_eq!(wf.handler_names(), ["a", "b", "c", "m"]);
        assert!(wf.stages()[0].fails_execution_on_member_failure());
        assert!(wf.stages()[1].fails_execution_on_member_failure());
        assert!(!wf.stages()[2].fails_execution_on_member_failure());
    }

    #[test]
    fn a_branch_round_trips_and_its_arms_handlers_are_the_workflows() {
        let wf = Workflow::new("pay", 1)
            .step("classify")
            .stage(
                Stage::branch("route")
                    .by("/method")
                    .on("card", [Stage::step("charge").priority(3)])
                    .on("free", Vec::<Stage>::new())
                    .otherwise([Stage::parallel("review", ["ops", "risk"])]),
            )
            .step("receipt");
        wf.validate().unwrap();
        let json = serde_json::to_value(&wf).unwrap();
        assert_eq!(json["stages"][1]["kind"]["kind"], "branch");
        let back: Workflow = serde_json::from_value(json).unwrap();
        assert_eq!(wf, back);
        assert_eq!(back.stage_count(), 5);
        assert_eq!(back.stage_at(2).unwrap().name(), "charge");
        assert_eq!(back.stage_at(4).unwrap().name(), "receipt");
        assert_eq!(
            wf.handler_names(),
            ["classify", "charge", "ops", "risk", "receipt"]
        );
    }
}
