//! Conditional branches: a stage that picks, from the previous stage's output, which of
//! its named sequences of stages runs.
//!
//! A branch runs no task. When the stage before it fires, the same transaction reads that
//! stage's output, selects a value from it ([`Branch::by`], a JSON pointer), and enters
//! the first stage of the matching arm, creating only that arm's tasks. The stage after
//! the branch receives the output of the arm's last stage (or, for an empty arm, what the
//! branch received). The choice is recorded on the branch's group, so `inspect` and the
//! API show which arm ran and why ([`BranchChoice`]).

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{Stage, StageKind};

/// Builds a conditional branch stage; see [`Stage::branch`].
///
/// ```
/// use confluo::{Stage, Workflow};
///
/// let wf = Workflow::new("payments", 1)
///     .step("classify")
///     .stage(
///         Stage::branch("route")
///             .by("/method")
///             .on("card", [Stage::step("charge_card")])
///             .on("invoice", [Stage::step("send_invoice"), Stage::step("await_transfer")])
///             .otherwise([Stage::step("manual_review")]),
///     )
///     .step("receipt");
/// assert!(wf.validate().is_ok());
/// ```
#[derive(Clone, Debug, PartialEq)]
#[must_use = "a branch does nothing until it is added to a workflow with `Workflow::stage`"]
pub struct Branch {
    name: String,
    by: String,
    arms: Vec<Arm>,
    otherwise: Option<Vec<Stage>>,
}

/// One arm of a branch: the stages that run when the selected value matches `when`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Arm {
    /// The value that selects this arm (see [`Branch::on`] for how values compare).
    pub when: String,
    /// The stages it runs, in order (none: the branch passes its input on).
    #[serde(default)]
    pub stages: Vec<Stage>,
}

impl Branch {
    pub(crate) fn new(name: impl Into<String>) -> Self {
        Branch {
            name: name.into(),
            by: String::new(),
            arms: Vec::new(),
            otherwise: None,
        }
    }

    /// Selects the value to match with a JSON pointer (RFC 6901) into the previous
    /// stage's output, such as `/method` or `/outputs/fraud/verdict` (after a parallel
    /// block). Default `""`: the whole output.
    pub fn by(mut self, pointer: impl Into<String>) -> Self {
        self.by = pointer.into();
        self
    }

    /// Adds an arm: `stages` run when the selected value is the string `when`, or a
    /// number, boolean or `null` whose JSON text is `when` (`on("3", ..)` matches `3`,
    /// `on("true", ..)` matches `true`). Arrays, objects and a missing value match no arm.
    pub fn on<I, S>(mut self, when: impl Into<String>, stages: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<Stage>,
    {
        self.arms.push(Arm {
            when: when.into(),
            stages: stages.into_iter().map(Into::into).collect(),
        });
        self
    }

    /// The stages that run when no arm matches. Without it, an unmatched value fails the
    /// execution, with the value and the arms in its error.
    pub fn otherwise<I, S>(mut self, stages: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<Stage>,
    {
        self.otherwise = Some(stages.into_iter().map(Into::into).collect());
        self
    }
}

impl From<Branch> for Stage {
    fn from(b: Branch) -> Stage {
        Stage::with_kind(
            b.name,
            StageKind::Branch {
                by: b.by,
                arms: b.arms,
                otherwise: b.otherwise,
            },
        )
    }
}

/// Which arm a branch took, as recorded on its group (see
/// [`StageProgress::branch`](crate::StageProgress::branch)).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[non_exhaustive]
pub struct BranchChoice {
    /// The arm's `when`; `None`: no arm matched and the branch took its `otherwise`.
    pub arm: Option<String>,
    /// The value the branch selected (`null` if its pointer found nothing).
    #[cfg_attr(feature = "openapi", schema(value_type = Object))]
    pub value: Value,
}

/// What a branch decided for a value.
#[derive(Debug, PartialEq)]
pub(crate) enum Decision {
    /// Run arm `0` (its position), or `otherwise` with `None`.
    Take(Option<usize>, BranchChoice),
    /// No arm matched and there is no `otherwise`: the execution fails with this error.
    Unmatched(String),
}

/// Where a branch's value comes from, as its error names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Source {
    /// The previous stage's output.
    PreviousOutput,
    /// The execution input (a branch that comes first, or after stages that pass their
    /// input on).
    ExecutionInput,
}

/// Picks the arm of branch `name` for `output`, the value it receives from `source`.
pub(crate) fn decide(
    name: &str,
    by: &str,
    arms: &[Arm],
    has_otherwise: bool,
    output: &Value,
    source: Source,
) -> Decision {
    let selected = output.pointer(by);
    let key = match selected {
        Some(Value::String(s)) => Some(s.clone()),
        Some(v @ (Value::Number(_) | Value::Bool(_) | Value::Null)) => Some(v.to_string()),
        _ => None,
    };
    let value = selected.cloned().unwrap_or(Value::Null);
    let arm = key.and_then(|k| arms.iter().position(|a| a.when == k));
    match arm {
        Some(i) => Decision::Take(
            Some(i),
            BranchChoice {
                arm: Some(arms[i].when.clone()),
                value,
            },
        ),
        None if has_otherwise => Decision::Take(None, BranchChoice { arm: None, value }),
        None => {
            let whens: Vec<&str> = arms.iter().map(|a| a.when.as_str()).collect();
            let found = match selected {
                None => format!("nothing at {by:?}"),
                Some(v) => format!("{} at {by:?}", preview(v)),
            };
            let (input, fix) = match source {
                Source::PreviousOutput => (
                    "the previous output",
                    "make the previous stage return one of those values",
                ),
                Source::ExecutionInput => (
                    "the execution input",
                    "start the execution with one of those values",
                ),
            };
            Decision::Unmatched(format!(
                "branch {name:?} found {found} in {input}, which matches none of its arms \
                 {whens:?}, and it has no otherwise: add an arm or an otherwise to the \
                 workflow (a new version), or {fix}"
            ))
        }
    }
}

/// A value's JSON text, cut to a readable length.
fn preview(value: &Value) -> String {
    let text = value.to_string();
    match text.char_indices().nth(80) {
        Some((cut, _)) => format!("{}...", &text[..cut]),
        None => text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn arms() -> Vec<Arm> {
        ["card", "3", "true", "null"]
            .into_iter()
            .map(|w| Arm {
                when: w.into(),
                stages: vec![],
            })
            .collect()
    }

    #[test]
    fn strings_and_scalars_match_by_their_text() {
        let take = |v: Value| match decide(
            "b",
            "/m",
            &arms(),
            true,
            &json!({ "m": v }),
            Source::PreviousOutput,
        ) {
            Decision::Take(arm, _) => arm,
            Decision::Unmatched(e) => panic!("{e}"),
        };
        assert_eq!(take(json!("card")), Some(0));
        assert_eq!(take(json!(3)), Some(1));
        assert_eq!(take(json!(true)), Some(2));
        assert_eq!(take(json!(null)), Some(3));
        assert_eq!(take(json!("3")), Some(1));
        assert_eq!(take(json!(["card"])), None);
        assert_eq!(take(json!({"card": 1})), None);
        assert_eq!(take(json!("Card")), None);
    }

    #[test]
    fn the_whole_output_is_matched_by_default() {
        let d = decide(
            "b",
            "",
            &arms(),
            false,
            &json!("card"),
            Source::PreviousOutput,
        );
        assert_eq!(
            d,
            Decision::Take(
                Some(0),
                BranchChoice {
                    arm: Some("card".into()),
                    value: json!("card")
                }
            )
        );
    }

    #[test]
    fn an_unmatched_value_without_otherwise_says_what_was_found() {
        let Decision::Unmatched(e) = decide(
            "route",
            "/m",
            &arms(),
            false,
            &json!({"m": "cash"}),
            Source::PreviousOutput,
        ) else {
            panic!("expected no match");
        };
        assert!(e.contains("\"cash\" at \"/m\""), "{e}");
        assert!(e.contains("\"card\""), "{e}");
        let Decision::Unmatched(e) = decide(
            "route",
            "/x",
            &arms(),
            false,
            &json!({}),
            Source::PreviousOutput,
        ) else {
            panic!("expected no match");
        };
        assert!(e.contains("nothing at \"/x\""), "{e}");
        assert!(e.contains("in the previous output"), "{e}");
        // A branch that comes first decides on the execution input, and says so.
        let Decision::Unmatched(e) = decide(
            "route",
            "/m",
            &arms(),
            false,
            &json!({"m": "cash"}),
            Source::ExecutionInput,
        ) else {
            panic!("expected no match");
        };
        assert!(e.contains("in the execution input"), "{e}");
        assert!(e.contains("start the execution with"), "{e}");
        assert!(!e.contains("previous"), "{e}");
    }
}
