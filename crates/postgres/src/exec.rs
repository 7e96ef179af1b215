//! Running one statement, straight on the pool or behind a transaction-mode
//! connection pooler (PgBouncer `pool_mode = transaction`).
//!
//! sqlx runs a statement with parameters in two round trips: `Parse` +
//! `Describe` + `Sync`, then `Bind` + `Execute` + `Sync`. A transaction-mode
//! pooler may hand the second half to another server connection once the
//! first `Sync` leaves the session idle, and named prepared statements do not
//! follow a client from one server connection to another. So behind a pooler
//! every statement runs inside a transaction of its own (the pooler keeps one
//! server connection for a transaction) as an unnamed statement. That costs
//! two more round trips per statement (`BEGIN`, `COMMIT`); nothing else on
//! the pooled path keeps session state (no advisory locks, no `SET`).

use std::sync::Arc;

use sqlx::postgres::{PgPool, PgQueryResult, PgRow};
use sqlx::AssertSqlSafe;

/// One statement with its parameters bound.
pub(crate) type PgQuery<'q> = sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>;

/// A statement text (the schema validated before it was formatted in), to
/// bind its parameters to.
pub(crate) fn q(sql: &Arc<str>) -> sqlx::query::Query<'static, sqlx::Postgres, sqlx::postgres::PgArguments> {
    sqlx::query(AssertSqlSafe(sql.clone()))
}

/// The pool and how to run a statement on it.
#[derive(Debug, Clone)]
pub(crate) struct Exec {
    pub(crate) pool: PgPool,
    /// Behind a transaction-mode pooler (`?pooler=transaction`).
    pub(crate) pooled: bool,
}

/// Ends the server session of the transaction `tx` if its client leaves it
/// idle for longer than `limit` (at least 1 s): a process stalled between
/// two of the transaction's statements (a pause, `SIGSTOP`, a frozen VM)
/// would otherwise hold its locks, and every other member of the queue
/// would wait on them, for as long as its connection lives. Its commit then
/// fails (a temporary error, `25P03`) and is retried; the locks go with
/// the session. Local to the transaction, so it holds behind a
/// transaction-mode pooler too. At most the server's limit (`i32::MAX`
/// ms, about 24.8 days: a longer lease TTL is allowed).
pub(crate) async fn bound_idle(tx: &mut sqlx::PgConnection, limit: std::time::Duration) -> Result<(), sqlx::Error> {
    let ms = limit.as_millis().clamp(1000, i32::MAX as u128).to_string();
    sqlx::query("select set_config('idle_in_transaction_session_timeout', $1, true)")
        .bind(ms)
        .persistent(false)
        .execute(tx)
        .await
        .map(drop)
}

impl Exec {
    /// Every row the statement returns.
    pub(crate) async fn all(&self, query: PgQuery<'_>) -> Result<Vec<PgRow>, sqlx::Error> {
        if self.pooled {
            let mut tx = self.pool.begin().await?;
            let rows = query.persistent(false).fetch_all(&mut *tx).await?;
            tx.commit().await?;
            Ok(rows)
        } else {
            query.fetch_all(&self.pool).await
        }
    }

    /// The statement's first row, if any.
    pub(crate) async fn opt(&self, query: PgQuery<'_>) -> Result<Option<PgRow>, sqlx::Error> {
        if self.pooled {
            Ok(self.all(query).await?.into_iter().next())
        } else {
            query.fetch_optional(&self.pool).await
        }
    }

    /// The statement's one row (`RowNotFound` if it returned none).
    pub(crate) async fn one(&self, query: PgQuery<'_>) -> Result<PgRow, sqlx::Error> {
        self.opt(query).await?.ok_or(sqlx::Error::RowNotFound)
    }

    /// Runs a statement for its effect.
    pub(crate) async fn exec(&self, query: PgQuery<'_>) -> Result<PgQueryResult, sqlx::Error> {
        if self.pooled {
            let mut tx = self.pool.begin().await?;
            let done = query.persistent(false).execute(&mut *tx).await?;
            tx.commit().await?;
            Ok(done)
        } else {
            query.execute(&self.pool).await
        }
    }
}
