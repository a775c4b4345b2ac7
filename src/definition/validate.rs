//! Checking a definition before it is registered.

use std::collections::HashSet;

use super::{Arm, RetryPolicy, StageKind, Workflow};

impl Workflow {
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
        for (index, slot) in self.plan().slots().iter().enumerate() {
            let stage = &slot.stage;
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
            if stage.name.starts_with("confluo:") {
                return Err(DefinitionError::InvalidStageName {
                    index,
                    name: stage.name.clone(),
                    reason: "names starting with \"confluo:\" are reserved",
                });
            }
            match &stage.kind {
                StageKind::Branch { by, arms, .. } => check_branch(&stage.name, by, arms)?,
                StageKind::Sleep { for_ms, until } => check_sleep(&stage.name, *for_ms, until)?,
                StageKind::Signal {
                    timeout_ms,
                    on_timeout,
                } => {
                    let next_is_map = self
                        .plan()
                        .next(index)
                        .and_then(|i| self.stage_at(i))
                        .is_some_and(|s| s.kind.maps());
                    check_signal(&stage.name, *timeout_ms, on_timeout, next_is_map)?
                }
                StageKind::MapWorkflow { workflow, version } => {
                    check_child(&stage.name, workflow, *version)?
                }
                _ => {}
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
            super::join::check(stage).map_err(|reason| DefinitionError::InvalidJoinRule {
                stage: stage.name.clone(),
                rule: stage.join.to_string(),
                reason,
            })?;
        }
        super::dependencies::check(&self.stages)
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

/// A branch needs arms with distinct values, and a pointer that can select a value.
fn check_branch(stage: &str, by: &str, arms: &[Arm]) -> Result<(), DefinitionError> {
    if !(by.is_empty() || by.starts_with('/')) {
        return Err(DefinitionError::InvalidBranchPointer {
            stage: stage.to_owned(),
            pointer: by.to_owned(),
        });
    }
    if arms.is_empty() {
        return Err(DefinitionError::EmptyBranch(stage.to_owned()));
    }
    let mut seen = HashSet::new();
    for arm in arms {
        let reason = if arm.when.len() > MAX_NAME_LEN {
            "it is longer than 200 bytes"
        } else if !seen.insert(arm.when.as_str()) {
            "another arm matches the same value"
        } else {
            continue;
        };
        return Err(DefinitionError::InvalidArm {
            stage: stage.to_owned(),
            when: arm.when.clone(),
            reason,
        });
    }
    Ok(())
}

/// The longest sleep: 1 000 years, far inside what PostgreSQL can add to now.
const MAX_SLEEP_MS: u64 = 1_000 * 366 * 24 * 3_600 * 1_000;

/// A sleep needs one wake time: a duration PostgreSQL can add, or a JSON pointer.
fn check_sleep(
    stage: &str,
    for_ms: Option<u64>,
    until: &Option<String>,
) -> Result<(), DefinitionError> {
    let reason = match (for_ms, until) {
        (Some(ms), None) if ms <= MAX_SLEEP_MS => return Ok(()),
        (None, Some(p)) if p.is_empty() || p.starts_with('/') => return Ok(()),
        (Some(_), None) => "it is longer than 1 000 years",
        (None, Some(_)) => "`until` is not a JSON pointer (\"\" or a path such as \"/due\")",
        _ => {
            "it needs exactly one of a duration (`Stage::sleep`) and `until` (`Stage::sleep_until`)"
        }
    };
    Err(DefinitionError::InvalidSleep {
        stage: stage.to_owned(),
        reason,
    })
}

/// A signal wait's timeout must be one PostgreSQL can add, and its timeout output needs
/// a timeout and must feed the next stage.
fn check_signal(
    stage: &str,
    timeout_ms: Option<u64>,
    on_timeout: &Option<serde_json::Value>,
    next_is_map: bool,
) -> Result<(), DefinitionError> {
    let reason = match (timeout_ms, on_timeout) {
        (Some(ms), _) if ms > MAX_SLEEP_MS => "its timeout is longer than 1 000 years",
        (None, Some(_)) => {
            "it has an output for timeouts (`on_timeout`) but no timeout: add `.within(duration)`"
        }
        (_, Some(output)) if next_is_map && !output.is_array() => {
            "the next stage is a map, so its output for timeouts (`on_timeout`) must be a JSON array"
        }
        _ => return Ok(()),
    };
    Err(DefinitionError::InvalidSignal {
        stage: stage.to_owned(),
        reason,
    })
}

/// A map of child workflows names a workflow that can be registered, and a version that
/// can be.
fn check_child(stage: &str, workflow: &str, version: Option<i32>) -> Result<(), DefinitionError> {
    let reason = match (check_name(workflow), version) {
        (Err(reason), _) => reason,
        (_, Some(v)) if v <= 0 => "its pinned version is not positive",
        _ => return Ok(()),
    };
    Err(DefinitionError::InvalidChildWorkflow {
        stage: stage.to_owned(),
        workflow: workflow.to_owned(),
        reason,
    })
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
    /// A stage waits for a stage the workflow's list does not have ([`Stage::after`](crate::Stage::after)).
    #[error(
        "stage {stage:?} waits for {dependency:?}, which is not a stage of the workflow's list: \
         name one of its stages (a stage inside a branch's arm cannot be waited for; wait for \
         the branch)"
    )]
    UnknownDependency {
        /// The waiting stage.
        stage: String,
        /// The name it gave.
        dependency: String,
    },
    /// A stage names the same dependency twice (possible only in a definition built as
    /// data: [`Stage::after`](crate::Stage::after) keeps one of each).
    #[error(
        "stage {stage:?} waits for {dependency:?} twice: name each stage it waits for once \
         (its input has one field per dependency)"
    )]
    DuplicateDependency {
        /// The waiting stage.
        stage: String,
        /// The name given twice.
        dependency: String,
    },
    /// Stages wait for one another in a circle.
    #[error(
        "the stages wait for one another in a cycle ({}), so none could ever start: remove \
         one of these dependencies",
        .0.join(" waits for ")
    )]
    DependencyCycle(Vec<String>),
    /// A stage waits for itself or for a stage listed after it.
    #[error(
        "stage {stage:?} waits for {dependency:?}, which is listed after it (or is itself): a \
         stage may only wait for stages listed before it; move {stage:?} after {dependency:?}"
    )]
    DependencyOrder {
        /// The waiting stage.
        stage: String,
        /// The stage it waits for.
        dependency: String,
    },
    /// A stage that nothing waits for and that is not the last: its result would be lost.
    #[error(
        "no stage waits for stage {stage:?}, and the execution ends with its last stage \
         ({last:?}) once everything it waits for has finished: make a later stage wait for \
         {stage:?} (Stage::after), or drop it"
    )]
    UnjoinedStage {
        /// The stage nothing waits for.
        stage: String,
        /// The workflow's last stage.
        last: String,
    },
    /// A stage that waits for several is not a step or a parallel block.
    #[error(
        "stage {stage:?} waits for several stages, so its input is an object of their outputs \
         by name, which a {kind} cannot take: make it a step or a parallel block, or put a \
         step before it that returns what it needs"
    )]
    InvalidJoin {
        /// The stage.
        stage: String,
        /// Its kind.
        kind: &'static str,
    },
    /// A stage inside a branch's arm names dependencies.
    #[error(
        "stage {stage:?} is in an arm of branch {branch:?}, whose stages run in order: it \
         cannot wait for other stages; make branch {branch:?} wait for them instead"
    )]
    DependencyInArm {
        /// The stage in the arm.
        stage: String,
        /// The branch.
        branch: String,
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
    /// A branch stage without arms.
    #[error("branch stage {0:?} has no arms: add one with `.on(value, stages)`")]
    EmptyBranch(String),
    /// A branch's pointer is not a JSON pointer.
    #[error(
        "branch stage {stage:?} selects with {pointer:?}, which is not a JSON pointer: use \"\" \
         for the whole previous output, or a path such as \"/method\""
    )]
    InvalidBranchPointer {
        /// The stage.
        stage: String,
        /// The pointer given.
        pointer: String,
    },
    /// A sleep stage without a usable wake time.
    #[error("sleep stage {stage:?} is invalid: {reason}")]
    InvalidSleep {
        /// The stage.
        stage: String,
        /// Why it is refused.
        reason: &'static str,
    },
    /// A signal wait whose timeout cannot work.
    #[error("signal stage {stage:?} is invalid: {reason}")]
    InvalidSignal {
        /// The stage.
        stage: String,
        /// Why it is refused.
        reason: &'static str,
    },
    /// A map of child workflows names no usable workflow.
    #[error("stage {stage:?} maps over workflow {workflow:?}, which is invalid: {reason}")]
    InvalidChildWorkflow {
        /// The stage.
        stage: String,
        /// The child workflow named.
        workflow: String,
        /// Why it is refused.
        reason: &'static str,
    },
    /// A join rule the stage cannot have ([`Stage::join`](crate::Stage::join)).
    #[error("join rule {rule} of stage {stage:?} is invalid: {reason}")]
    InvalidJoinRule {
        /// The stage.
        stage: String,
        /// The rule given.
        rule: String,
        /// Why it is refused.
        reason: &'static str,
    },
    /// A branch's arm is unusable.
    #[error("arm {when:?} of branch stage {stage:?} is invalid: {reason}")]
    InvalidArm {
        /// The stage.
        stage: String,
        /// The arm's value.
        when: String,
        /// Why it is refused.
        reason: &'static str,
    },
}
