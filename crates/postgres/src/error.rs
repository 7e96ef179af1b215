//! The one conversion of the driver's (sqlx) error into keyorder's
//! [`Error`] ([`broker`]: the sqlx error kept as the source, classified
//! temporary or not by [`is_temporary`]; the orphan rule rules out a `From`
//! impl here, both types being foreign), and the adapter's named errors: a schema with
//! no keyorder tables, a removed group, a removal that waited too long for
//! a lock, a queue whose layout is not the one in use.

use keyorder_core::{BrokerError, Error};

/// A driver error, as keyorder's.
pub(crate) fn broker(e: sqlx::Error) -> Error {
    let temporary = is_temporary(&e);
    Error::Broker(
        BrokerError::new(format!("postgres: {e}"))
            .with_temporary(temporary)
            .caused_by(e),
    )
}

/// Whether retrying may succeed: the connection failed or was cut (I/O,
/// SQLSTATE class 08, the server shutting down or starting, 57P01-57P03),
/// the pool had no connection in time, or the server refused for now
/// (serialization failure, deadlock, a lock not available, class 53: out
/// of resources). A statement's own error (a constraint, a missing table,
/// bad SQL), TLS and configuration errors, and a closed pool fail again.
pub(crate) fn is_temporary(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(d) => d.code().is_some_and(|c| {
            c.starts_with("08")
                || c.starts_with("53")
                || matches!(&*c, "40001" | "40P01" | "55P03" | "57P01" | "57P02" | "57P03")
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
