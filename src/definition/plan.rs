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

use super::{Stage, StageKind};

/// The numbered stages of a workflow.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Plan {
    slots: Vec<Slot>,
}

/// One numbered stage.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Slot {
    pub stage: Stage,
    /// Where its execution goes once it fired; `None`: it completes.
    pub next: Option<usize>,
    /// For a branch: where each arm starts (its `next` for an empty arm), in arm order,
    /// then `otherwise` if it has one.
    pub entries: Vec<Option<usize>>,
}

impl Plan {
    pub(crate) fn of(stages: &[Stage]) -> Plan {
        let mut slots = Vec::with_capacity(size(stages));
        place(stages, None, &mut slots);
        Plan { slots }
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

    /// Where the execution goes after stage `index` fires (`None`: it completes).
    pub(crate) fn next(&self, index: usize) -> Option<usize> {
        self.slots.get(index).and_then(|s| s.next)
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

/// Numbers `stages` from `slots.len()`, the last going on to `after`.
fn place(stages: &[Stage], after: Option<usize>, slots: &mut Vec<Slot>) {
    for (k, stage) in stages.iter().enumerate() {
        let index = slots.len();
        let next = if k + 1 < stages.len() {
            Some(index + 1 + size_of_arms(stage))
        } else {
            after
        };
        slots.push(Slot {
            stage: stage.clone(),
            next,
            entries: Vec::new(),
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
                place(list, next, slots);
            }
            slots[index].entries = entries;
        }
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
