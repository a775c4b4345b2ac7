//! A workflow's stages numbered for the database: the plan.
//!
//! Groups and tasks record a stage by its index. Without branches that is the position in
//! the workflow's list. A branch's arms are numbered right after the branch, depth first,
//! arm after arm (its `otherwise` last), and the stage after the branch comes after all
//! of them:
//!
//! ```text
//! validate, route{card: [charge], invoice: [bill, wait]; otherwise: [review]}, receipt
//!    0        1          2                 3     4                   5          6
//! ```
//!
//! Every stage knows where its execution goes next: the following stage of its list, or,
//! for the last stage of an arm, the stage after the branch (`None` past the end). So
//! indices only grow along any path an execution takes, and each index is entered at most
//! once per execution (the `(execution_id, stage_index)` guard holds).
//!
//! With dependencies ([`Stage::after`]), the stages of the workflow's own list are the
//! nodes of a graph (a branch with its arms is one node). A node *finishes* when its
//! flow has nowhere further to go inside it (`next` is `None`): then every stage that
//! waits for it is entered, directly when it waits for this node alone, through its
//! countdown of unfinished dependencies when it waits for several; a node nothing waits
//! for is the last stage, and the execution completes. `next` goes straight on only to
//! a stage that waits for this node alone, when nothing else does; the list form is the
//! chain in which every stage waits for the one before it, so its plan is as before.

use super::dependencies;
use super::{Stage, StageKind};

/// The numbered stages of a workflow.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Plan {
    slots: Vec<Slot>,
    /// For each node of the list (by plan index): the nodes that wait for it.
    dependents: Vec<Vec<usize>>,
    /// For each node of the list (by plan index): the nodes it waits for.
    dependencies: Vec<Vec<usize>>,
    /// The nodes entered when an execution starts (waiting for nothing).
    roots: Vec<usize>,
}

/// One numbered stage.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Slot {
    pub stage: Stage,
    /// Where its execution goes once it fired; `None`: its node finishes.
    pub next: Option<usize>,
    /// For a branch: where each arm starts (its `next` for an empty arm), in arm order,
    /// then `otherwise` if it has one.
    pub entries: Vec<Option<usize>>,
    /// The node (a stage of the workflow's list) it belongs to: itself, or the branch
    /// whose arm holds it.
    pub node: usize,
}

impl Plan {
    pub(crate) fn of(stages: &[Stage]) -> Plan {
        // Each node's plan index: its arms come right after it.
        let mut at = Vec::with_capacity(stages.len());
        let mut index = 0;
        for stage in stages {
            at.push(index);
            index += 1 + size_of_arms(stage);
        }
        let graph = dependencies::graph(stages);
        let total = size(stages);
        let (mut dependents, mut deps) = (vec![Vec::new(); total], vec![Vec::new(); total]);
        for (k, waits_for) in graph.iter().enumerate() {
            for &j in waits_for {
                dependents[at[j]].push(at[k]);
                deps[at[k]].push(at[j]);
            }
        }
        let roots = (0..stages.len())
            .filter(|&k| graph[k].is_empty())
            .map(|k| at[k])
            .collect();
        let mut slots = Vec::with_capacity(total);
        for (k, stage) in stages.iter().enumerate() {
            // Straight on only to a stage that waits for this node alone, and nothing else does.
            let next = match dependents[at[k]].as_slice() {
                [only] if deps[*only].len() == 1 => Some(*only),
                _ => None,
            };
            place_one(stage, next, at[k], &mut slots);
        }
        Plan {
            slots,
            dependents,
            dependencies: deps,
            roots,
        }
    }

    /// The stage at `index`.
    pub(crate) fn get(&self, index: usize) -> Option<&Slot> {
        self.slots.get(index)
    }

    /// Every numbered stage, in index order.
    pub(crate) fn slots(&self) -> &[Slot] {
        &self.slots
    }

    /// How many stages there are, arms included.
    pub(crate) fn len(&self) -> usize {
        self.slots.len()
    }

    /// Where the execution goes straight on after stage `index` fires (`None`: its node
    /// finishes, see [`node`](Self::node)).
    pub(crate) fn next(&self, index: usize) -> Option<usize> {
        self.slots.get(index).and_then(|s| s.next)
    }

    /// Whether the execution completes once stage `index` fires: its node's flow ends
    /// there and nothing waits for the node (it is the last stage).
    pub(crate) fn ends_after(&self, index: usize) -> bool {
        self.next(index).is_none() && self.dependents(self.node(index)).is_empty()
    }

    /// The node that stage `index` belongs to.
    pub(crate) fn node(&self, index: usize) -> usize {
        self.slots.get(index).map_or(index, |s| s.node)
    }

    /// The nodes that wait for the node `node` (none: it is the last stage).
    pub(crate) fn dependents(&self, node: usize) -> &[usize] {
        self.dependents.get(node).map_or(&[], Vec::as_slice)
    }

    /// The nodes that the node `node` waits for.
    pub(crate) fn dependencies(&self, node: usize) -> &[usize] {
        self.dependencies.get(node).map_or(&[], Vec::as_slice)
    }

    /// The nodes entered when an execution starts.
    pub(crate) fn roots(&self) -> &[usize] {
        &self.roots
    }
}

/// Stages in all in `stages`, arms included.
fn size(stages: &[Stage]) -> usize {
    stages.iter().map(|s| 1 + size_of_arms(s)).sum()
}

fn size_of_arms(stage: &Stage) -> usize {
    match stage.kind() {
        StageKind::Branch {
            arms, otherwise, ..
        } => {
            arms.iter().map(|a| size(&a.stages)).sum::<usize>()
                + otherwise.as_deref().map_or(0, size)
        }
        _ => 0,
    }
}

/// Numbers `stage` (and its arms) from `slots.len()`, going on to `next` in node `node`.
fn place_one(stage: &Stage, next: Option<usize>, node: usize, slots: &mut Vec<Slot>) {
    let index = slots.len();
    slots.push(Slot {
        stage: stage.clone(),
        next,
        entries: Vec::new(),
        node,
    });
    if let StageKind::Branch {
        arms, otherwise, ..
    } = stage.kind()
    {
        let lists = arms
            .iter()
            .map(|a| a.stages.as_slice())
            .chain(otherwise.as_deref());
        let mut entries = Vec::new();
        for list in lists {
            entries.push(if list.is_empty() {
                next
            } else {
                Some(slots.len())
            });
            place(list, next, node, slots);
        }
        slots[index].entries = entries;
    }
}

/// Numbers an arm's `stages` from `slots.len()`, the last going on to `after`.
fn place(stages: &[Stage], after: Option<usize>, node: usize, slots: &mut Vec<Slot>) {
    for (k, stage) in stages.iter().enumerate() {
        let next = if k + 1 < stages.len() {
            Some(slots.len() + 1 + size_of_arms(stage))
        } else {
            after
        };
        place_one(stage, next, node, slots);
    }
}

#[cfg(test)]
mod tests {
    use crate::definition::{Stage, Workflow};

    #[test]
    fn arms_are_numbered_after_their_branch_and_rejoin_after_it() {
        let wf = Workflow::new("w", 1)
            .step("validate")
            .stage(
                Stage::branch("route")
                    .on("card", [Stage::step("charge")])
                    .on("invoice", [Stage::step("bill"), Stage::step("wait")])
                    .on("free", Vec::<Stage>::new())
                    .otherwise([Stage::step("review")]),
            )
            .step("receipt");
        let plan = wf.plan();
        let names: Vec<&str> = plan.slots().iter().map(|s| s.stage.name()).collect();
        assert_eq!(
            names,
            ["validate", "route", "charge", "bill", "wait", "review", "receipt"]
        );
        let next: Vec<Option<usize>> = plan.slots().iter().map(|s| s.next).collect();
        assert_eq!(
            next,
            [Some(1), Some(6), Some(6), Some(4), Some(6), Some(6), None]
        );
        assert_eq!(
            plan.slots()[1].entries,
            [Some(2), Some(3), Some(6), Some(5)]
        );
    }

    #[test]
    fn dependencies_go_straight_on_only_to_a_stage_waiting_for_one_alone() {
        let wf = Workflow::new("w", 1)
            .step("fetch_a")
            .stage(Stage::step("fetch_b").at_start())
            .stage(
                Stage::from(Stage::branch("route").on("x", [Stage::step("inner")]))
                    .after(["fetch_a"]),
            )
            .stage(Stage::step("merge").after(["fetch_b", "route"]));
        let plan = wf.plan();
        assert_eq!(plan.roots(), [0, 1]);
        let next: Vec<Option<usize>> = plan.slots().iter().map(|s| s.next).collect();
        // fetch_a goes straight to route; the arm's end, fetch_b and merge finish their
        // nodes (merge waits for two; nothing waits for merge).
        assert_eq!(next, [Some(2), None, None, None, None]);
        let nodes: Vec<usize> = plan.slots().iter().map(|s| s.node).collect();
        assert_eq!(nodes, [0, 1, 2, 2, 4]);
        assert_eq!(plan.dependents(1), [4]);
        assert_eq!(plan.dependents(2), [4]);
        assert_eq!(plan.dependencies(4), [1, 2]);
        assert!(plan.dependents(4).is_empty());
        assert!(wf.validate().is_ok());
    }

    #[test]
    fn a_branch_at_the_end_completes_after_its_arm() {
        let wf = Workflow::new("w", 1).stage(
            Stage::branch("b")
                .on("x", [Stage::branch("inner").on("y", [Stage::step("deep")])])
                .on("z", Vec::<Stage>::new()),
        );
        let plan = wf.plan();
        assert_eq!(plan.len(), 3);
        assert_eq!(plan.slots()[0].entries, [Some(1), None]);
        assert_eq!(plan.slots()[1].entries, [Some(2)]);
        assert_eq!(plan.next(2), None);
    }
}
