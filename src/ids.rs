//! Newtype identifiers, so that an execution id is never passed where a task id belongs.

use std::fmt;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

macro_rules! uuid_id {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, sqlx::Type)]
        #[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
        #[serde(transparent)]
        #[sqlx(transparent)]
        pub struct $name(pub Uuid);

        impl $name {
            /// A new random id.
            pub fn new() -> Self {
                Self(Uuid::new_v4())
            }

            /// The underlying UUID.
            pub fn as_uuid(&self) -> Uuid {
                self.0
            }
        }

        impl Default for $name {
            fn default() -> Self {
                Self::new()
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(&self.0, f)
            }
        }

        impl From<Uuid> for $name {
            fn from(id: Uuid) -> Self {
                Self(id)
            }
        }
    };
}

uuid_id!(
    /// Identifies one execution (one run) of a workflow.
    ExecutionId
);
uuid_id!(
    /// Identifies one task: one member of a stage's group.
    TaskId
);
uuid_id!(
    /// Identifies one stage's group (its countdown row) within an execution.
    GroupId
);
uuid_id!(
    /// Fences one attempt at a task. Every claim hands out a new token; an acknowledgement
    /// carrying any other token changes nothing.
    LeaseToken
);
