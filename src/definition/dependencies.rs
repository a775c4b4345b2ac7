//! Dependency fan-in (a DAG): a stage may wait for several earlier stages of the list,
//! not only for the one before it ([`Stage::after`]). The list form is the chain in which
//! each stage waits for the one before it.
//!
//! The graph is over a workflow's own list (a branch's arms run in order inside it, and
//! a stage waits for the branch as a whole). A stage waits only for stages listed before
//! it, so the list is an order in which every stage comes after what it waits for, and
//! the graph has no cycle; and every stage but the last is waited for by a later one, so
//! the execution ends with its last stage, once everything else has finished.

use super::validate::DefinitionError;
use super::{Stage, StageKind};

impl Stage {
    /// Waits for the stages named in `stages` (earlier stages of the workflow's list)
    /// instead of the one listed just before it. With several, it is entered once all of
    /// them have finished, by the transaction that finishes the last of them (a countdown
    /// of its unfinished dependencies, decremented in each dependency's own finishing
    /// transaction), and its input is an object of their outputs by stage name:
    ///
    /// ```
    /// use confluo::{Stage, Workflow};
    ///
    /// let report = Workflow::new("report", 1)
    ///     .step("fetch_orders")
    ///     .stage(Stage::step("fetch_refunds").at_start()) // runs alongside fetch_orders
    ///     .stage(Stage::step("merge").after(["fetch_orders", "fetch_refunds"]));
    /// assert!(report.validate().is_ok());
    /// // merge receives {"fetch_orders": <its output>, "fetch_refunds": <its output>}.
    /// ```
    ///
    /// A stage that waits for several must be a step or a parallel block (an object is
    /// not a map's array); one that waits for one receives that stage's output as usual.
    /// A branch waits with `Stage::from(branch).after(..)`.
    pub fn after<I, S>(mut self, stages: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let mut names: Vec<String> = Vec::new();
        for name in stages.into_iter().map(Into::into) {
            if !names.contains(&name) {
                names.push(name);
            }
        }
        self.after = Some(names);
        self
    }

    /// Waits for nothing: entered when the execution starts, with the execution input,
    /// alongside the first stage (and the others that start).
    pub fn at_start(mut self) -> Self {
        self.after = Some(Vec::new());
        self
    }

    /// The stages it waits for, as given with [`after`](Self::after) or
    /// [`at_start`](Self::at_start) (`None`: the one listed before it).
    pub fn dependencies(&self) -> Option<&[String]> {
        self.after.as_deref()
    }
}

/// What each stage of `stages` (a workflow's list) waits for, as positions in the list:
/// the one before it unless it names others. Unknown names are left out (validation
/// reports them).
pub(crate) fn graph(stages: &[Stage]) -> Vec<Vec<usize>> {
    stages
        .iter()
        .enumerate()
        .map(|(k, stage)| match &stage.after {
            None => k.checked_sub(1).into_iter().collect(),
            Some(names) => names
                .iter()
                .filter_map(|n| stages.iter().position(|s| &s.name == n))
                .collect(),
        })
        .collect()
}

/// Checks the dependencies of a workflow's list: each names an earlier stage of the list
/// once, every stage but the last is waited for, a stage waiting for several can take an
/// object, and no stage inside a branch's arms names any.
pub(crate) fn check(stages: &[Stage]) -> Result<(), DefinitionError> {
    for stage in stages {
        check_arms(stage)?;
    }
    let graph = graph(stages);
    for (k, stage) in stages.iter().enumerate() {
        let names = stage.after.as_deref().unwrap_or_default();
        for (i, name) in names.iter().enumerate() {
            if names[..i].contains(name) {
                return Err(DefinitionError::DuplicateDependency {
                    stage: stage.name.clone(),
                    dependency: name.clone(),
                });
            }
            let Some(at) = stages.iter().position(|s| &s.name == name) else {
                return Err(DefinitionError::UnknownDependency {
                    stage: stage.name.clone(),
                    dependency: name.clone(),
                });
            };
            if at >= k {
                if let Some(cycle) = cycle_through(&graph, stages, k) {
                    return Err(DefinitionError::DependencyCycle(cycle));
                }
                return Err(DefinitionError::DependencyOrder {
                    stage: stage.name.clone(),
                    dependency: name.clone(),
                });
            }
        }
        if graph[k].len() > 1 && !matches!(stage.kind, StageKind::Step | StageKind::Parallel { .. })
        {
            return Err(DefinitionError::InvalidJoin {
                stage: stage.name.clone(),
                kind: stage.kind.as_str(),
            });
        }
    }
    let last = stages.len() - 1;
    for (k, stage) in stages.iter().enumerate().take(last) {
        if !graph.iter().any(|deps| deps.contains(&k)) {
            return Err(DefinitionError::UnjoinedStage {
                stage: stage.name.clone(),
                last: stages[last].name.clone(),
            });
        }
    }
    Ok(())
}

/// Refuses dependencies inside a branch's arms (at any depth).
fn check_arms(stage: &Stage) -> Result<(), DefinitionError> {
    if let StageKind::Branch {
        arms, otherwise, ..
    } = &stage.kind
    {
        let lists = arms.iter().map(|a| &a.stages).chain(otherwise.as_ref());
        for inner in lists.flatten() {
            if inner.after.is_some() {
                return Err(DefinitionError::DependencyInArm {
                    stage: inner.name.clone(),
                    branch: stage.name.clone(),
                });
            }
            check_arms(inner)?;
        }
    }
    Ok(())
}

/// A cycle through stage `k`, if there is one, as stage names from `k` back to it.
fn cycle_through(graph: &[Vec<usize>], stages: &[Stage], k: usize) -> Option<Vec<String>> {
    fn walk(graph: &[Vec<usize>], at: usize, to: usize, path: &mut Vec<usize>) -> bool {
        for &next in &graph[at] {
            if next == to {
                return true;
            }
            if !path.contains(&next) {
                path.push(next);
                if walk(graph, next, to, path) {
                    return true;
                }
                path.pop();
            }
        }
        false
    }
    let mut path = vec![k];
    walk(graph, k, k, &mut path).then(|| {
        path.iter()
            .chain([&k])
            .map(|&i| stages[i].name.clone())
            .collect()
    })
}
