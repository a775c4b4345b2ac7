//! Starting executions: one, inside the caller's transaction, or many in a few statements.

use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use serde_json::Value;
use sqlx::PgConnection;

use crate::definition::Workflow;
use crate::dispatch;
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::ids::ExecutionId;
use crate::store::{executions, workflows};

/// A century: deadlines further out are capped, so that the timestamp stays in range.
const MAX_DEADLINE_MS: i64 = 100 * 365 * 24 * 3600 * 1000;

/// Options of [`Engine::start_with`].
#[derive(Clone, Debug, Default)]
pub struct StartOptions {
    version: Option<i32>,
    idempotency_key: Option<String>,
    deadline: Option<Duration>,
    callback: Option<String>,
}

impl StartOptions {
    /// Default options: the latest registered version, no idempotency key.
    pub fn new() -> Self {
        Self::default()
    }

    /// Runs this version instead of the latest registered one.
    pub fn version(mut self, version: i32) -> Self {
        self.version = Some(version);
        self
    }

    /// Starting twice with the same key (per workflow name) returns the first execution's
    /// id and starts nothing, also when the two calls race.
    pub fn idempotency_key(mut self, key: impl Into<String>) -> Self {
        self.idempotency_key = Some(key.into());
        self
    }

    /// Gives the execution this long to finish, counted from its start. Once the deadline
    /// passes, a worker's housekeeping pass (every half lease, at most 5 s apart) moves it
    /// to [`ExecutionStatus::TimedOut`](crate::ExecutionStatus::TimedOut) and cancels its
    /// pending tasks in the same transaction; running handlers see their
    /// [`cancellation`](crate::TaskContext::cancellation) at their next lease renewal, and
    /// what they return dispatches nothing.
    ///
    /// ```
    /// use std::time::Duration;
    /// let options = confluo::StartOptions::new().deadline(Duration::from_secs(15 * 60));
    /// # let _ = options;
    /// ```
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.deadline = Some(deadline);
        self
    }

    /// Announces the execution's end (completed, failed, cancelled or timed out) with a
    /// POST to `url`, instead of its workflow's [`callback`](crate::Workflow::callback)
    /// (which, like the rest of the definition, is pinned when the execution starts).
    ///
    /// The notification is written in the transaction that ends the execution, so it
    /// exists if and only if the end commits; a worker with webhook delivery turned on
    /// (the `webhooks` feature) posts it afterwards, at least once, retrying with
    /// backoff, signed with HMAC-SHA256; [`Engine::notifications`](crate::Engine::notifications)
    /// shows how delivery went. The form is checked when the execution starts
    /// ([`Error::InvalidCallback`]); where it points is checked at delivery.
    pub fn callback(mut self, url: impl Into<String>) -> Self {
        self.callback = Some(url.into());
        self
    }

    /// The callback, checked.
    fn checked_callback(&self) -> Result<Option<&str>> {
        match &self.callback {
            None => Ok(None),
            Some(url) => crate::callback::check(url)
                .map(|()| Some(url.as_str()))
                .map_err(|reason| crate::Error::InvalidCallback {
                    url: url.clone(),
                    reason,
                }),
        }
    }

    /// The deadline in milliseconds from now, capped at a century.
    fn deadline_ms(&self) -> Option<i64> {
        self.deadline.map(|d| {
            i64::try_from(d.as_millis()).map_or(MAX_DEADLINE_MS, |ms| ms.min(MAX_DEADLINE_MS))
        })
    }
}

/// What [`Engine::start_with`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Started {
    /// The execution.
    pub id: ExecutionId,
    /// False when an earlier start with the same idempotency key had created it: nothing
    /// was started this time.
    pub created: bool,
}

impl Engine {
    /// Starts the latest registered version of `workflow` with `input`.
    ///
    /// # Errors
    /// [`Error::WorkflowNotFound`]; [`Error::InvalidInput`] when the first stage is a map
    /// and the input is not an array; [`Error::InvalidCallback`]; [`Error::Json`];
    /// [`Error::Database`].
    ///
    /// # Cancel safety
    /// The start is one transaction: dropped before it commits, nothing was started.
    pub async fn start<I: Serialize + ?Sized>(
        &self,
        workflow: &str,
        input: &I,
    ) -> Result<ExecutionId> {
        Ok(self
            .start_with(workflow, input, StartOptions::default())
            .await?
            .id)
    }

    /// [`start`](Self::start) with a version, an idempotency key or a deadline; says
    /// whether it created the execution or found the one an earlier start with the same
    /// idempotency key created.
    ///
    /// ```no_run
    /// # async fn run(engine: confluo::Engine) -> confluo::Result<()> {
    /// use confluo::StartOptions;
    /// let first = engine
    ///     .start_with("orders", &101, StartOptions::new().idempotency_key("order-101"))
    ///     .await?;
    /// let again = engine
    ///     .start_with("orders", &101, StartOptions::new().idempotency_key("order-101"))
    ///     .await?;
    /// assert!(first.created && !again.created && first.id == again.id);
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// As [`start`](Self::start).
    ///
    /// # Cancel safety
    /// One transaction: dropped before it commits, nothing was started. If the commit's answer
    /// is lost, starting again with the same idempotency key returns the execution it made.
    pub async fn start_with<I: Serialize + ?Sized>(
        &self,
        workflow: &str,
        input: &I,
        options: StartOptions,
    ) -> Result<Started> {
        let mut tx = crate::store::begin(self.pool()).await?;
        let started = self.start_in(&mut tx, workflow, input, options).await?;
        tx.commit().await?;
        Ok(started)
    }

    /// Starts an execution inside the caller's transaction, so that it exists if and only
    /// if the caller's own writes commit.
    ///
    /// # Errors
    /// As [`start`](Self::start).
    ///
    /// # Cancel safety
    /// Dropped before it returns, the caller's transaction may hold part of the start: roll
    /// it back (dropping an uncommitted sqlx transaction does).
    pub async fn start_using<I: Serialize + ?Sized>(
        &self,
        conn: &mut PgConnection,
        workflow: &str,
        input: &I,
        options: StartOptions,
    ) -> Result<ExecutionId> {
        Ok(self.start_in(conn, workflow, input, options).await?.id)
    }

    async fn start_in<I: Serialize + ?Sized>(
        &self,
        conn: &mut PgConnection,
        workflow: &str,
        input: &I,
        options: StartOptions,
    ) -> Result<Started> {
        let input = serde_json::to_value(input)?;
        let definition = self
            .definition_to_start(conn, workflow, options.version)
            .await?;
        check_input(&definition, &input, None)?;
        // Pinned now, as the rest of the definition is: its own, else its workflow's.
        let callback_url = options.checked_callback()?.or(definition.callback_url());
        let deadline_ms = options.deadline_ms();
        let (id, created) = executions::insert(
            conn,
            executions::NewExecution {
                id: ExecutionId::new(),
                workflow_name: definition.name(),
                workflow_version: definition.version(),
                input: &input,
                idempotency_key: options.idempotency_key.as_deref(),
                fan_in: self.fan_in(),
                deadline_ms,
                callback_url,
            },
        )
        .await?;
        if created {
            dispatch::start(self, conn, &definition, id, self.fan_in()).await?;
            tracing::debug!(execution_id = %id, workflow, "execution started");
        }
        Ok(Started { id, created })
    }

    /// Starts many executions of `workflow` in one transaction, in a few statements
    /// whatever their number: one inserts the executions, one creates the first stage's
    /// groups and tasks of all of them (a first-stage map, or a striped first stage, is
    /// entered per execution, still in the same transaction). Each item carries its own
    /// [`StartOptions`]: an idempotency key already taken (by an earlier start, or by an
    /// earlier item of the same call) returns that execution's id and starts nothing, as
    /// [`start_with`](Self::start_with) does. Returns one id per item, in order.
    ///
    /// ```no_run
    /// # async fn demo(engine: confluo::Engine) -> confluo::Result<()> {
    /// use confluo::StartOptions;
    /// let orders = [(101, "order-101"), (102, "order-102")];
    /// let ids = engine
    ///     .start_many(
    ///         "orders",
    ///         orders
    ///             .iter()
    ///             .map(|(n, key)| (n, StartOptions::new().idempotency_key(*key))),
    ///     )
    ///     .await?;
    /// assert_eq!(ids.len(), 2);
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// As [`start`](Self::start), for any item (then nothing is started): an
    /// [`Error::InvalidInput`] names the item; [`Error::InvalidCallback`].
    ///
    /// # Cancel safety
    /// One transaction: dropped before it commits, nothing was started.
    pub async fn start_many<I, S>(&self, workflow: &str, starts: S) -> Result<Vec<ExecutionId>>
    where
        I: Serialize,
        S: IntoIterator<Item = (I, StartOptions)>,
    {
        let mut items = Vec::new();
        for (input, options) in starts {
            options.checked_callback()?;
            items.push((serde_json::to_value(input)?, options));
        }
        let mut tx = crate::store::begin(self.pool()).await?;
        let mut ids = vec![ExecutionId::from(uuid::Uuid::nil()); items.len()];
        // One batch per version asked for (usually one: the latest).
        let mut versions: Vec<Option<i32>> = items.iter().map(|(_, o)| o.version).collect();
        versions.sort_unstable();
        versions.dedup();
        for version in versions {
            let definition = self.definition_to_start(&mut tx, workflow, version).await?;
            let positions: Vec<usize> = (0..items.len())
                .filter(|&i| items[i].1.version == version)
                .collect();
            for &i in &positions {
                check_input(&definition, &items[i].0, Some(i))?;
            }
            let batch: Vec<executions::NewExecutionRow> = positions
                .iter()
                .map(|&i| executions::NewExecutionRow {
                    id: ExecutionId::new(),
                    input: &items[i].0,
                    idempotency_key: items[i].1.idempotency_key.as_deref(),
                    deadline_ms: items[i].1.deadline_ms(),
                    callback_url: items[i].1.callback.as_deref().or(definition.callback_url()),
                })
                .collect();
            let started =
                executions::insert_many(&mut tx, &definition, self.fan_in(), &batch).await?;
            let created: Vec<ExecutionId> = started
                .iter()
                .filter(|(_, created)| *created)
                .map(|(id, _)| *id)
                .collect();
            dispatch::enter_first_stage_many(self, &mut tx, &definition, &created, self.fan_in())
                .await?;
            for (&i, (id, _)) in positions.iter().zip(started) {
                ids[i] = id;
            }
        }
        tx.commit().await?;
        tracing::debug!(workflow, executions = ids.len(), "executions started");
        Ok(ids)
    }

    /// The definition a start runs: `version`, or the latest registered one, from the
    /// cache when this process has seen it (definitions never change once registered).
    pub(crate) async fn definition_to_start(
        &self,
        conn: &mut PgConnection,
        workflow: &str,
        version: Option<i32>,
    ) -> Result<Arc<Workflow>> {
        let version = match version {
            Some(version) => version,
            None => workflows::latest_version(&mut *conn, workflow).await?,
        };
        self.definition(conn, workflow, version).await
    }
}

/// Refuses an input the first stage cannot take: a first-stage map needs an array.
/// `item` names the position in a batch.
fn check_input(definition: &Workflow, input: &Value, item: Option<usize>) -> Result<()> {
    let first = &definition.stages()[0];
    if first.kind().maps() && !input.is_array() {
        let which = item.map_or(String::new(), |i| format!("item {i}: "));
        return Err(Error::InvalidInput {
            workflow: definition.name().to_owned(),
            reason: format!(
                "{which}the first stage {:?} is a map, so the input must be a JSON array",
                first.name()
            ),
        });
    }
    if let (true, Some(items)) = (first.kind().maps(), input.as_array()) {
        if items.len() > crate::MAX_MAP_WIDTH {
            return Err(Error::MapTooWide {
                workflow: definition.name().to_owned(),
                stage: first.name().to_owned(),
                width: items.len(),
                max: crate::MAX_MAP_WIDTH,
            });
        }
    }
    Ok(())
}
