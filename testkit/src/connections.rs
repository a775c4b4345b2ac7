//! How many connections a server has left: what `demo` checks before it starts workers,
//! and what the tests budget themselves to.

/// A server's connection limit and use, as one statement reads them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnectionRoom {
    /// `max_connections`.
    pub max: i64,
    /// `superuser_reserved_connections`, kept out of reach of other roles.
    pub reserved: i64,
    /// Client connections open now (this one included).
    pub open: i64,
}

impl ConnectionRoom {
    /// Reads the server's limit and its open client connections.
    ///
    /// # Cancel safety
    /// Reads only: dropping it changes nothing.
    pub async fn of<'e, E>(executor: E) -> sqlx::Result<ConnectionRoom>
    where
        E: sqlx::PgExecutor<'e>,
    {
        let (max, reserved, open): (i64, i64, i64) = sqlx::query_as(
            "SELECT current_setting('max_connections')::int8,
                    current_setting('superuser_reserved_connections')::int8,
                    (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend')",
        )
        .fetch_one(executor)
        .await?;
        Ok(ConnectionRoom {
            max,
            reserved,
            open,
        })
    }

    /// Connections other clients may still open.
    pub fn free(&self) -> i64 {
        self.max - self.reserved - self.open
    }
}
