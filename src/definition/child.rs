//! Child workflows: a map whose members are whole executions of another workflow
//! ([`Stage::map_workflow`]).
//!
//! Entering the stage creates one member task per element of its input array, as a map
//! does, but no user handler runs them: each is due at `infinity`, and the same
//! transaction starts one execution of the child workflow per member, with the element as
//! its input. The child's end (completed, failed, cancelled or timed out) makes its
//! member due at once, in the transaction that ends the child; the workers' own handler
//! (`confluo:child`) then reports the child's output as the member's, or its failure as
//! the member's permanent failure, through the ordinary guarded completion and countdown.
//! So the parent's group fans in exactly once, like any map, whatever the number of
//! children and however they end together.

use super::{Stage, StageKind};

/// The handler of a child workflow's member task, run by every worker that serves the
/// parent workflow once the child has ended.
pub(crate) const CHILD_HANDLER: &str = "confluo:child";

impl Stage {
    /// A map whose members are executions of the workflow `workflow`: one per element of
    /// the previous stage's output array (the execution input, for a first stage), each
    /// started with its element as input. The stage's output is the array of the
    /// children's outputs, as a map's is of its members'; a child that fails, is
    /// cancelled or times out is a dead-lettered member (its error says which child and
    /// why), handled as [`fail_execution_on_member_failure`](Self::fail_execution_on_member_failure)
    /// says.
    ///
    /// The children run the latest version of `workflow` registered when the stage is
    /// entered (pin one with [`map_workflow_version`](Self::map_workflow_version)), with
    /// the parent's fan-in default. Registering the parent needs `workflow` registered.
    /// Cancelling the parent, or its failure or time-out, cancels the children that
    /// still run. Nothing to register for the members: workers run them themselves.
    ///
    /// ```
    /// use confluo::{Stage, Workflow};
    ///
    /// let charge = Workflow::new("charge", 1).step("authorize").step("capture");
    /// let batch = Workflow::new("billing_run", 1)
    ///     .step("select_accounts") // returns an array: one child per element
    ///     .stage(Stage::map_workflow("charge_each", "charge"))
    ///     .step("report"); // receives the children's outputs
    /// assert!(charge.validate().is_ok() && batch.validate().is_ok());
    /// ```
    pub fn map_workflow(name: impl Into<String>, workflow: impl Into<String>) -> Self {
        Self::with_kind(
            name,
            StageKind::MapWorkflow {
                workflow: workflow.into(),
                version: None,
            },
        )
    }

    /// [`map_workflow`](Self::map_workflow) pinned to one version of the child workflow.
    pub fn map_workflow_version(
        name: impl Into<String>,
        workflow: impl Into<String>,
        version: i32,
    ) -> Self {
        Self::with_kind(
            name,
            StageKind::MapWorkflow {
                workflow: workflow.into(),
                version: Some(version),
            },
        )
    }
}
