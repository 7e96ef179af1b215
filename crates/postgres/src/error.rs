//! The one conversion of the driver's (sqlx) error into keyorder's
//! [`Error`] ([`broker`]: the sqlx error kept as the source, classified
//! temporary or not by [`is_temporary`]; the orphan rule rules out a `From`
//! impl here, both types being foreign), and the adapter's named errors: a schema with
//! no keyorder tables, a removed group, a removal that waited too long for
//! a lock, a queue whose layout is not the one in use.

use keyorder_core::{BrokerError, Error};

/// A driver error, as keyorder's.
pub(crate) fn broker(e: sqlx::Error) -> Error {
    broker_error("postgres", e)
}

/// A sqlx error as keyorder's [`Error::Broker`], its text after `prefix`
/// (`"postgres (outbox)"`), kept as the source ([`PgCause`]) and classified
/// temporary or not: what the outbox, which shares this crate's driver,
/// converts its errors with.
pub fn broker_error(prefix: &str, e: sqlx::Error) -> Error {
    let temporary = is_temporary(&e);
    Error::Broker(
        BrokerError::new(format!("{prefix}: {e}"))
            .with_temporary(temporary)
            .caused_by(PgCause(e)),
    )
}

/// The sqlx error behind a PostgreSQL [`Error::Broker`], as its
/// `source()`: downcast to it and call [`PgCause::sqlx`] for the error
/// itself, [`PgCause::code`] for the SQLSTATE. Its `Display` and `Debug`
/// show sqlx's `Display` text only: the server's detail and context fields,
/// which sqlx's `Debug` prints, can quote a row's values (an ordering key).
pub struct PgCause(sqlx::Error);

impl PgCause {
    /// The driver's error.
    pub fn sqlx(&self) -> &sqlx::Error {
        &self.0
    }

    /// The server's SQLSTATE, where the server answered.
    pub fn code(&self) -> Option<String> {
        match &self.0 {
            sqlx::Error::Database(d) => d.code().map(|c| c.into_owned()),
            _ => None,
        }
    }
}

impl std::fmt::Display for PgCause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::fmt::Debug for PgCause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PgCause({:?})", self.0.to_string())
    }
}

impl std::error::Error for PgCause {}

/// Whether retrying may succeed: the connection failed or was cut (I/O,
/// SQLSTATE 08000, 08001, 08003, 08006, the server shutting down or
/// starting, 57P01-57P03; not 08P01 or 08004, which a pooler such as
/// PgBouncer answers for a database or login that does not exist),
/// the pool had no connection in time, or the server refused for now
/// (serialization failure, deadlock, a lock not available, class 53: out
/// of resources). A statement's own error (a constraint, a missing table,
/// bad SQL), TLS and configuration errors, and a closed pool fail again.
pub(crate) fn is_temporary(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(d) => d.code().is_some_and(|c| {
            c.starts_with("53")
                || matches!(
                    &*c,
                    "08000"
                        | "08001"
                        | "08003"
                        | "08006"
                        | "25P03"
                        | "40001"
                        | "40P01"
                        | "55P03"
                        | "57P01"
                        | "57P02"
                        | "57P03"
                        | "57P05"
                )
        }),
        _ => false,
    }
}

/// A statement's error where `schema` has no keyorder tables names the fix
/// (run the migrations); any other is [`broker`]'s.
pub(crate) fn missing_schema(schema: &str, e: sqlx::Error) -> Error {
    let text = e.to_string();
    if text.contains("does not exist") && text.contains(schema) {
        Error::Config(format!(
            "schema `{}` has no keyorder tables: run PgTransport::migrate() once (keyorder bench and the \
             test runner do)",
            schema
        ))
    } else {
        broker(e)
    }
}

/// How long a group's removal (or a queue's deletion) waits for a lock
/// before it gives up: it holds the queue's row meanwhile, which retention
/// and new groups of the queue wait for.
pub(crate) const REMOVAL_LOCK_TIMEOUT: &str = "10s";

/// The error of a member whose group is gone.
pub(crate) fn group_removed(queue: &str, grp: &str) -> Error {
    Error::Config(format!(
        "postgres: consumer group `{grp}` of queue `{queue}` was removed by an operator (`keyorder groups remove`, \
         or `keyorder delete-queue` for the whole queue) while this member ran: the subscription stops; subscribe \
         again to start the group afresh (at the oldest retained event)"
    ))
}

/// A removal's lock wait that ran out becomes an error that says why and
/// what to do.
pub(crate) fn removal_error(e: sqlx::Error, what: &str) -> Error {
    if let sqlx::Error::Database(d) = &e {
        if d.code().as_deref() == Some("55P03") {
            return Error::Config(format!(
                "postgres: {what} was not done: a settlement, read or heartbeat of it (or retention, or another \
                 operator action) held its rows for more than {REMOVAL_LOCK_TIMEOUT} (a stalled handler's \
                 statement, a transaction left open behind a pooler); nothing was deleted: try again, or end the \
                 blocking session (pg_stat_activity shows it)"
            ));
        }
    }
    broker(e)
}

/// A queue whose recorded slot count (its layout) is not the one `who`
/// uses: keys would move between slots.
pub(crate) fn layout_error(queue: &str, recorded: u32, who: &str, uses: u32) -> Error {
    Error::Config(format!(
        "postgres: queue `{queue}` has a layout of {recorded} slots but {who} uses {uses}: a different slot count \
         would move keys between owners and break their order, so it is refused. Fix: use ?slots={recorded} if \
         that is the queue's count; if the count was changed in the queues table while the queue was in use, set \
         it back to {uses} there (keyorder never changes it; to change it, stop the publishers, drain every group \
         and publish to a new queue)"
    ))
}
