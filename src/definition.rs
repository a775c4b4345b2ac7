//! Workflow definitions: ordered stages, their options, and validation.
//!
//! A definition is plain data. It is validated when registered
//! ([`Engine::register`](crate::Engine::register)) and stored in the database, so that every
//! execution stays pinned to the version it started with.

use std::collections::HashSet;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::fanin::FanInStrategy;

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
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Workflow {
    name: String,
    version: i32,
    stages: Vec<Stage>,
    /// Where to announce the end of its executions that name no callback of their own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    callback: Option<String>,
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
}

/// What a stage runs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
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
}

impl StageKind {
    /// The name stored in the database (`step`, `parallel`, `map`).
    pub fn as_str(&self) -> &'static str {
        match self {
            StageKind::Step => "step",
            StageKind::Parallel { .. } => "parallel",
            StageKind::Map => "map",
        }
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

/// How often and how late a failed attempt is retried.
///
/// The policy is copied onto every task row when the task is created, so it survives
/// restarts and applies the same on every worker.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct RetryPolicy {
    /// Attempts in all, the first included (1 = no retry).
    pub max_attempts: u32,
    /// Delay before the second attempt, in milliseconds; doubled for each later attempt.
    pub initial_backoff_ms: u64,
    /// Upper bound of the delay, in milliseconds.
    pub max_backoff_ms: u64,
    /// Fraction of the delay drawn at random and taken off (0 = none, 1 = full jitter),
    /// so that a burst of failures does not retry in lockstep.
    pub jitter: f64,
}

impl Default for RetryPolicy {
    /// Three attempts, 1 s then 2 s apart (at most 60 s), 20 % jitter.
    fn default() -> Self {
        RetryPolicy {
            max_attempts: 3,
            initial_backoff_ms: 1_000,
            max_backoff_ms: 60_000,
            jitter: 0.2,
        }
    }
}

impl RetryPolicy {
    /// No retries: the first failure dead-letters the task.
    pub fn none() -> Self {
        RetryPolicy {
            max_attempts: 1,
            ..Self::default()
        }
    }

    /// `max_attempts` attempts with the default exponential backoff.
    pub fn exponential(max_attempts: u32) -> Self {
        RetryPolicy {
            max_attempts,
            ..Self::default()
        }
    }

    /// Sets the first delay and the cap of the exponential backoff.
    pub fn backoff(mut self, initial: Duration, max: Duration) -> Self {
        self.initial_backoff_ms = duration_ms(initial);
        self.max_backoff_ms = duration_ms(max);
        self
    }

    /// Sets the jitter fraction, 0.0 to 1.0.
    pub fn jitter(mut self, jitter: f64) -> Self {
        self.jitter = jitter;
        self
    }
}

fn default_timeout_ms() -> u64 {
    300_000
}

fn duration_ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl Stage {
    fn new(name: impl Into<String>, kind: StageKind) -> Self {
        Stage {
            name: name.into(),
            kind,
            retry: RetryPolicy::default(),
            on_member_failure: OnMemberFailure::default(),
            timeout_ms: default_timeout_ms(),
            priority: 0,
            fan_in: None,
        }
    }

    /// A single task whose input is the previous stage's output.
    pub fn step(name: impl Into<String>) -> Self {
        Self::new(name, StageKind::Step)
    }

    /// A static parallel block with one task per branch.
    pub fn parallel<I, S>(name: impl Into<String>, branches: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let branches = branches.into_iter().map(Into::into).collect();
        Self::new(name, StageKind::Parallel { branches })
    }

    /// A dynamic map with one task per element of the previous output array.
    pub fn map(name: impl Into<String>) -> Self {
        Self::new(name, StageKind::Map)
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

    /// Fail the whole execution as soon as one member is dead-lettered, instead of passing
    /// partial results on.
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

    /// Whether a dead-lettered member fails the execution (always true for a step).
    pub fn fails_execution_on_member_failure(&self) -> bool {
        matches!(self.kind, StageKind::Step)
            || self.on_member_failure == OnMemberFailure::FailExecution
    }

    /// The handler names this stage needs: its own name, or its branch names.
    pub fn handler_names(&self) -> Vec<&str> {
        match &self.kind {
            StageKind::Parallel { branches } => branches.iter().map(String::as_str).collect(),
            StageKind::Step | StageKind::Map => vec![self.name.as_str()],
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

    /// Appends a stage built with [`Stage`]'s options.
    pub fn stage(mut self, stage: Stage) -> Self {
        self.stages.push(stage);
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

    /// The workflow name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The workflow version.
    pub fn version(&self) -> i32 {
        self.version
    }

    /// The stages, in order.
    pub fn stages(&self) -> &[Stage] {
        &self.stages
    }

    /// Every handler name the workflow needs, in stage order.
    pub fn handler_names(&self) -> Vec<&str> {
        self.stages.iter().flat_map(Stage::handler_names).collect()
    }

    /// Checks the definition; [`Engine::register`](crate::Engine::register) calls this.
    ///
    /// # Errors
    /// The first problem found, as a [`DefinitionError`].
    pub fn validate(&self) -> Result<(), DefinitionError> {
        check_name(&self.name).map_err(|reason| DefinitionError::InvalidWorkflowName {
            name: self.name.clone(),
            reason,
        })?;
        if self.version <= 0 {
            return Err(DefinitionError::InvalidVersion(self.version));
        }
        if self.stages.is_empty() {
            return Err(DefinitionError::NoStages);
        }
        if let Some(url) = &self.callback {
            crate::callback::check(url).map_err(|reason| DefinitionError::InvalidCallback {
                url: url.clone(),
                reason,
            })?;
        }
        let mut stage_names = HashSet::new();
        let mut handler_names = HashSet::new();
        for (index, stage) in self.stages.iter().enumerate() {
            check_name(&stage.name).map_err(|reason| DefinitionError::InvalidStageName {
                index,
                name: stage.name.clone(),
                reason,
            })?;
            if !stage_names.insert(stage.name.as_str()) {
                return Err(DefinitionError::DuplicateStage(stage.name.clone()));
            }
            if let StageKind::Parallel { branches } = &stage.kind {
                if branches.is_empty() {
                    return Err(DefinitionError::EmptyParallel(stage.name.clone()));
                }
                for branch in branches {
                    check_name(branch).map_err(|reason| DefinitionError::InvalidBranchName {
                        stage: stage.name.clone(),
                        name: branch.clone(),
                        reason,
                    })?;
                }
            }
            for handler in stage.handler_names() {
                if !handler_names.insert(handler) {
                    return Err(DefinitionError::DuplicateHandler(handler.to_owned()));
                }
            }
            check_retry(&stage.retry).map_err(|reason| DefinitionError::InvalidRetryPolicy {
                stage: stage.name.clone(),
                reason,
            })?;
            if stage.timeout_ms == 0 || stage.timeout_ms > i64::MAX as u64 {
                return Err(DefinitionError::InvalidTimeout(stage.name.clone()));
            }
        }
        Ok(())
    }
}

const MAX_NAME_LEN: usize = 200;

fn check_name(name: &str) -> Result<(), &'static str> {
    if name.trim().is_empty() {
        Err("it is empty")
    } else if name.trim() != name {
        Err("it has leading or trailing white space")
    } else if name.len() > MAX_NAME_LEN {
        Err("it is longer than 200 bytes")
    } else if name.chars().any(char::is_control) {
        Err("it contains control characters")
    } else {
        Ok(())
    }
}

fn check_retry(policy: &RetryPolicy) -> Result<(), &'static str> {
    if policy.max_attempts == 0 || policy.max_attempts > i32::MAX as u32 {
        Err("max_attempts must be at least 1")
    } else if policy.initial_backoff_ms > policy.max_backoff_ms {
        Err("the initial backoff exceeds the maximum backoff")
    } else if policy.max_backoff_ms > i64::MAX as u64 {
        Err("the maximum backoff is too large")
    } else if !(0.0..=1.0).contains(&policy.jitter) {
        Err("jitter must be between 0.0 and 1.0")
    } else {
        Ok(())
    }
}

/// Why a workflow definition was rejected.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DefinitionError {
    /// The callback URL is unusable.
    #[error("callback URL {url:?} is invalid: {reason}")]
    InvalidCallback {
        /// The URL given.
        url: String,
        /// Why it is refused.
        reason: &'static str,
    },
    /// The workflow name is unusable.
    #[error("workflow name {name:?} is invalid: {reason}")]
    InvalidWorkflowName {
        /// The name given.
        name: String,
        /// Why it is refused.
        reason: &'static str,
    },
    /// Versions start at 1.
    #[error("workflow version must be positive, got {0}")]
    InvalidVersion(i32),
    /// A workflow needs at least one stage.
    #[error("the workflow has no stages")]
    NoStages,
    /// A stage name is unusable.
    #[error("stage {index} name {name:?} is invalid: {reason}")]
    InvalidStageName {
        /// Position of the stage.
        index: usize,
        /// The name given.
        name: String,
        /// Why it is refused.
        reason: &'static str,
    },
    /// Two stages share a name.
    #[error("stage name {0:?} is used twice")]
    DuplicateStage(String),
    /// A parallel stage without branches.
    #[error("parallel stage {0:?} has no branches")]
    EmptyParallel(String),
    /// A branch name is unusable.
    #[error("branch {name:?} of stage {stage:?} is invalid: {reason}")]
    InvalidBranchName {
        /// The stage.
        stage: String,
        /// The name given.
        name: String,
        /// Why it is refused.
        reason: &'static str,
    },
    /// Handlers are looked up by name: stage names of steps and maps and branch names
    /// must all differ.
    #[error("handler name {0:?} is used twice (step, map and branch names must be unique)")]
    DuplicateHandler(String),
    /// A retry policy that cannot work.
    #[error("retry policy of stage {stage:?} is invalid: {reason}")]
    InvalidRetryPolicy {
        /// The stage.
        stage: String,
        /// Why it is refused.
        reason: &'static str,
    },
    /// A zero or overflowing timeout.
    #[error("timeout of stage {0:?} must be positive")]
    InvalidTimeout(String),
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
}
