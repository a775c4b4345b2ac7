//! Signal waits: a stage that waits for a named signal from outside the workflow (a human
//! approval, a payment webhook), sent with [`Engine::signal`](crate::Engine::signal).
//!
//! A wait is a group of one task that no user handler runs. The signal completes it, in
//! the transaction of [`Engine::signal`](crate::Engine::signal) when the stage is already
//! waiting, or in the transaction that enters the stage when the signal came first (it is
//! kept until then). Either way the completion is the ordinary one, guarded by a lease
//! token and counted down, so the stage fires once. The signal's payload is the stage's
//! output. With [`SignalWait::within`], the task is due at the deadline and the workers'
//! own handler (`confluo:signal`) times it out: it fails the execution, or, with
//! [`SignalWait::on_timeout`], gives the stage that output instead.

use std::time::Duration;

use serde_json::Value;

use super::{duration_ms, Stage, StageKind};

/// The handler of a wait's task, run by every worker that serves the workflow when its
/// deadline passes.
pub(crate) const SIGNAL_HANDLER: &str = "confluo:signal";

/// Builds a stage that waits for a signal; see [`Stage::signal`].
///
/// ```
/// use confluo::{Stage, Workflow};
/// use serde_json::json;
/// use std::time::Duration;
///
/// let wf = Workflow::new("expenses", 1)
///     .step("submit")
///     .stage(
///         Stage::signal("approval")
///             .within(Duration::from_secs(3 * 24 * 3600))
///             .on_timeout(json!({"approved": false, "by": "timeout"})),
///     )
///     .stage(
///         Stage::branch("decide")
///             .by("/approved")
///             .on("true", [Stage::step("pay")])
///             .otherwise([Stage::step("reject")]),
///     );
/// assert!(wf.validate().is_ok());
/// ```
#[derive(Clone, Debug, PartialEq)]
#[must_use = "a signal wait does nothing until it is added to a workflow with `Workflow::stage`"]
pub struct SignalWait {
    name: String,
    timeout_ms: Option<u64>,
    on_timeout: Option<Value>,
}

impl SignalWait {
    pub(crate) fn new(name: impl Into<String>) -> Self {
        SignalWait {
            name: name.into(),
            timeout_ms: None,
            on_timeout: None,
        }
    }

    /// Gives up when no signal arrived within `timeout` of the stage being entered (not
    /// of the execution's start): the execution fails, saying which signal it waited
    /// for, unless [`on_timeout`](Self::on_timeout) gives an output. Without it, the
    /// stage waits for as long as the execution runs (its deadline, if it has one, still
    /// applies). The deadline is a due time in the database, so it survives restarts;
    /// workers act on it within their poll interval.
    pub fn within(mut self, timeout: Duration) -> Self {
        self.timeout_ms = Some(duration_ms(timeout));
        self
    }

    /// On a timeout, the stage's output is `output` instead of a failure: follow the
    /// stage with a [`Stage::branch`] on it to take a default path. Needs
    /// [`within`](Self::within).
    pub fn on_timeout(mut self, output: Value) -> Self {
        self.on_timeout = Some(output);
        self
    }
}

impl From<SignalWait> for Stage {
    fn from(w: SignalWait) -> Stage {
        Stage::with_kind(
            w.name,
            StageKind::Signal {
                timeout_ms: w.timeout_ms,
                on_timeout: w.on_timeout,
            },
        )
    }
}

/// The input of a wait's task, which its timeout handler reads: the output to give on a
/// timeout, or the failure to report.
pub(crate) fn timeout_input(
    stage: &str,
    timeout_ms: Option<u64>,
    on_timeout: &Option<Value>,
) -> Value {
    match on_timeout {
        Some(output) => serde_json::json!({ "on_timeout": output }),
        None => serde_json::json!({
            "fail": format!(
                "no signal {stage:?} arrived within {}: send it with Engine::signal or \
                 `confluo signal`, or give the stage an output for timeouts (`on_timeout`)",
                humanize_ms(timeout_ms.unwrap_or(0))
            )
        }),
    }
}

/// What the timeout handler does with a wait's task input: the output, or the failure.
pub(crate) fn timed_out(input: &Value) -> Result<Value, String> {
    match input.get("on_timeout") {
        Some(output) => Ok(output.clone()),
        None => Err(input
            .get("fail")
            .and_then(Value::as_str)
            .unwrap_or("the signal did not arrive in time")
            .to_owned()),
    }
}

fn humanize_ms(ms: u64) -> String {
    match ms {
        ms if ms % 86_400_000 == 0 && ms > 0 => format!("{} d", ms / 86_400_000),
        ms if ms % 3_600_000 == 0 && ms > 0 => format!("{} h", ms / 3_600_000),
        ms if ms % 60_000 == 0 && ms > 0 => format!("{} min", ms / 60_000),
        ms if ms % 1_000 == 0 && ms > 0 => format!("{} s", ms / 1_000),
        ms => format!("{ms} ms"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeouts_read_back_what_the_stage_was_given() {
        let fail = timeout_input("approval", Some(7_200_000), &None);
        let error = timed_out(&fail).unwrap_err();
        assert!(
            error.contains("\"approval\"") && error.contains("2 h"),
            "{error}"
        );
        let given = serde_json::json!({"approved": false});
        let out = timeout_input("approval", Some(1), &Some(given.clone()));
        assert_eq!(timed_out(&out), Ok(given));
        assert_eq!(
            timed_out(&serde_json::json!({"on_timeout": null})),
            Ok(Value::Null)
        );
    }
}
