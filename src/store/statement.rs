//! How every statement of `store` reaches the server: through sqlx's named, cached
//! prepared statements (the default: one round trip per statement once prepared), or,
//! behind a transaction pooler ([`use_unnamed_statements`]), as unnamed statements run
//! inside a transaction.
//!
//! A pooler in transaction mode (PgBouncer before 1.21, or later without
//! `max_prepared_statements`) hands a client's successive transactions to whichever
//! server connection is free. A named statement prepared on one server connection is
//! missing on the next, or collides with another client's of the same name; sqlx's
//! unnamed statements take two exchanges (parse, then bind and execute), which the pooler
//! may also send to two server connections unless a transaction holds one. So in that
//! mode every statement is unnamed, and one that the caller runs outside a transaction
//! runs in a READ COMMITTED transaction of its own (`BEGIN` .. `COMMIT`, two round trips
//! more). Its effects and guarantees are those of the autocommitted statement.
//!
//! [`query`], [`query_as`] and [`query_scalar`] stand in for sqlx's functions of the
//! same names; their `execute`/`fetch_*` take anything sqlx can acquire a connection
//! from (a pool, a connection, a transaction).

use std::sync::atomic::{AtomicBool, Ordering};

use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgArguments, PgQueryResult, PgRow};
use sqlx::{Connection, Encode, FromRow, PgConnection, PgPool, Postgres, Transaction, Type};

/// Whether this process prepares unnamed statements (see the module's documentation).
static UNNAMED: AtomicBool = AtomicBool::new(false);

/// Switches this process to unnamed statements, each inside a transaction, for good: a
/// pool behind a transaction pooler cannot use named ones, and every engine of the
/// process shares the statements of this module. Unnamed statements are correct on a
/// direct connection too; they only cost a parse each and, outside a transaction, a
/// `BEGIN` and a `COMMIT`.
pub(crate) fn use_unnamed_statements() {
    UNNAMED.store(true, Ordering::Relaxed);
}

/// Whether [`use_unnamed_statements`] was called in this process.
fn unnamed_statements() -> bool {
    UNNAMED.load(Ordering::Relaxed)
}

/// `sqlx::query`, named or unnamed as this process says.
pub(crate) fn query(sql: &str) -> Query<'_> {
    Query(sqlx::query(sql).persistent(!unnamed_statements()))
}

/// `sqlx::query_as`, named or unnamed as this process says.
pub(crate) fn query_as<O>(sql: &str) -> QueryAs<'_, O>
where
    O: for<'r> FromRow<'r, PgRow>,
{
    QueryAs(sqlx::query_as(sql).persistent(!unnamed_statements()))
}

/// `sqlx::query_scalar`, named or unnamed as this process says.
pub(crate) fn query_scalar<O>(sql: &str) -> QueryScalar<'_, O>
where
    (O,): for<'r> FromRow<'r, PgRow>,
{
    QueryScalar(sqlx::query_scalar(sql).persistent(!unnamed_statements()))
}

/// A statement returning rows or a count.
#[must_use = "a statement does nothing until it is executed"]
pub(crate) struct Query<'q>(sqlx::query::Query<'q, Postgres, PgArguments>);

/// A statement returning rows as `O`.
#[must_use = "a statement does nothing until it is executed"]
pub(crate) struct QueryAs<'q, O>(sqlx::query::QueryAs<'q, Postgres, O, PgArguments>);

/// A statement returning single values of type `O`.
#[must_use = "a statement does nothing until it is executed"]
pub(crate) struct QueryScalar<'q, O>(sqlx::query::QueryScalar<'q, Postgres, O, PgArguments>);

/// Runs `$run` (a call on the statement, given a `&mut PgConnection`) on a connection
/// of `$executor`, inside a transaction of its own when statements are unnamed and the
/// connection is not already in one.
macro_rules! run {
    ($executor:expr, |$conn:ident| $run:expr) => {{
        let mut pooled;
        let acquired: &mut PgConnection = match $executor.into() {
            On::Pool(pool) => {
                pooled = pool.acquire().await?;
                &mut pooled
            }
            On::Connection(conn) => conn,
        };
        if !unnamed_statements() || acquired.is_in_transaction() {
            let $conn = acquired;
            $run.await
        } else {
            let mut tx = acquired.begin_with(super::BEGIN).await?;
            let $conn: &mut PgConnection = &mut tx;
            let out = $run.await?;
            tx.commit().await?;
            Ok(out)
        }
    }};
}

macro_rules! bind {
    () => {
        /// Binds the next parameter, as sqlx's `bind`.
        pub(crate) fn bind<T>(self, value: T) -> Self
        where
            T: 'q + Encode<'q, Postgres> + Type<Postgres>,
        {
            Self(self.0.bind(value))
        }
    };
}

impl<'q> Query<'q> {
    bind!();

    /// Runs the statement; how many rows it touched.
    pub(crate) async fn execute<'c, A>(self, executor: A) -> sqlx::Result<PgQueryResult>
    where
        A: Executor<'c>,
    {
        run!(executor, |conn| self.0.execute(conn))
    }
}

/// The `fetch_*` of a statement returning rows as `O` (a row, or its single value).
macro_rules! fetches {
    () => {
        /// Runs the statement; every row.
        pub(crate) async fn fetch_all<'c, A>(self, executor: A) -> sqlx::Result<Vec<O>>
        where
            A: Executor<'c>,
        {
            run!(executor, |conn| self.0.fetch_all(conn))
        }

        /// Runs the statement; its one row (`RowNotFound` without).
        pub(crate) async fn fetch_one<'c, A>(self, executor: A) -> sqlx::Result<O>
        where
            A: Executor<'c>,
        {
            run!(executor, |conn| self.0.fetch_one(conn))
        }

        /// Runs the statement; its first row, if any.
        pub(crate) async fn fetch_optional<'c, A>(self, executor: A) -> sqlx::Result<Option<O>>
        where
            A: Executor<'c>,
        {
            run!(executor, |conn| self.0.fetch_optional(conn))
        }
    };
}

impl<'q, O> QueryAs<'q, O>
where
    O: Send + Unpin + for<'r> FromRow<'r, PgRow>,
{
    bind!();
    fetches!();
}

impl<'q, O> QueryScalar<'q, O>
where
    O: Send + Unpin,
    (O,): Send + Unpin + for<'r> FromRow<'r, PgRow>,
{
    bind!();
    fetches!();
}

/// What the statements of `store` run on: a pool (a connection is taken from it for the
/// statement), or a connection, in a transaction or not.
pub(crate) enum On<'c> {
    Pool(&'c PgPool),
    Connection(&'c mut PgConnection),
}

/// Anything a statement of `store` runs on (see [`On`]).
pub(crate) trait Executor<'c>: Into<On<'c>> {}

impl<'c, E: Into<On<'c>>> Executor<'c> for E {}

impl<'c> From<&'c PgPool> for On<'c> {
    fn from(pool: &'c PgPool) -> Self {
        On::Pool(pool)
    }
}

impl<'c> From<&'c mut PgConnection> for On<'c> {
    fn from(conn: &'c mut PgConnection) -> Self {
        On::Connection(conn)
    }
}

impl<'c> From<&'c mut PoolConnection<Postgres>> for On<'c> {
    fn from(conn: &'c mut PoolConnection<Postgres>) -> Self {
        On::Connection(conn)
    }
}

impl<'c, 't> From<&'c mut Transaction<'t, Postgres>> for On<'c> {
    fn from(tx: &'c mut Transaction<'t, Postgres>) -> Self {
        On::Connection(tx)
    }
}
