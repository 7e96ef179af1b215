//! The event log in PostgreSQL: the store every instance of a scenario
//! shares when instances run as separate processes. Times come from the
//! database's clock (`clock_timestamp()`), never from the instances'.

use async_trait::async_trait;
use keyorder_core::key::{from_stored_text, stored_text};
use keyorder_core::{Error, Result};
use sqlx::postgres::{PgPool, PgPoolOptions};
use sqlx::Row;

use crate::eventlog::{Event, EventLog, EventStart};

fn db(e: sqlx::Error) -> Error {
    Error::broker(format!("event log: {e}"))
}

/// A scenario's event log in table `keyorder_test.events`, one `run` id per
/// scenario. Keys are stored in their [`stored_text`] form (the `text`
/// column cannot hold NUL) and decoded on read.
#[derive(Debug, Clone)]
pub struct PgEventLog {
    pool: PgPool,
    run: String,
}

const NOW_US: &str = "(extract(epoch from clock_timestamp()) * 1000000)::bigint";

impl PgEventLog {
    /// Whether `url` names a store this log can live in: a PostgreSQL
    /// database (`postgres://`, `postgresql://`). A tool whose transport
    /// URL is one keeps its event log there unless told otherwise.
    pub fn can_open(url: &str) -> bool {
        url.starts_with("postgres://") || url.starts_with("postgresql://")
    }

    /// Connects and creates the table if needed.
    pub async fn connect(url: &str, run: &str) -> Result<Self> {
        let pool = PgPoolOptions::new().max_connections(4).connect(url).await.map_err(db)?;
        let mut tx = pool.begin().await.map_err(db)?;
        // Serialise concurrent first-time creation by several processes.
        sqlx::query("select pg_advisory_xact_lock(7306172001)")
            .execute(&mut *tx)
            .await
            .map_err(db)?;
        sqlx::query("create schema if not exists keyorder_test")
            .execute(&mut *tx)
            .await
            .map_err(db)?;
        sqlx::query(
            "create table if not exists keyorder_test.events (
                id bigserial primary key,
                run text not null,
                message_id text not null,
                key text not null,
                seq bigint not null,
                instance text not null,
                generation bigint not null,
                start_us bigint not null,
                end_us bigint,
                ok boolean not null default false
            )",
        )
        .execute(&mut *tx)
        .await
        .map_err(db)?;
        sqlx::query("create index if not exists events_run on keyorder_test.events (run)")
            .execute(&mut *tx)
            .await
            .map_err(db)?;
        tx.commit().await.map_err(db)?;
        Ok(PgEventLog {
            pool,
            run: run.to_owned(),
        })
    }

    /// The run id.
    pub fn run(&self) -> &str {
        &self.run
    }
}

#[async_trait]
impl EventLog for PgEventLog {
    async fn start(&self, e: EventStart) -> Result<u64> {
        let sql = sqlx::AssertSqlSafe(format!(
            "insert into keyorder_test.events (run, message_id, key, seq, instance, generation, start_us)
             values ($1, $2, $3, $4, $5, $6, {NOW_US}) returning id"
        ));
        let id: i64 = sqlx::query_scalar(sql)
            .bind(&self.run)
            .bind(&e.message_id)
            .bind(stored_text(&e.key))
            .bind(e.seq as i64)
            .bind(&e.instance)
            .bind(e.generation as i64)
            .fetch_one(&self.pool)
            .await
            .map_err(db)?;
        Ok(id as u64)
    }

    async fn end(&self, id: u64, ok: bool) -> Result<()> {
        let sql = sqlx::AssertSqlSafe(format!(
            "update keyorder_test.events set end_us = {NOW_US}, ok = $2 where id = $1"
        ));
        sqlx::query(sql)
            .bind(id as i64)
            .bind(ok)
            .execute(&self.pool)
            .await
            .map_err(db)?;
        Ok(())
    }

    async fn events(&self) -> Result<Vec<Event>> {
        let rows = sqlx::query(
            "select message_id, key, seq, instance, generation, start_us, end_us, ok
             from keyorder_test.events where run = $1 order by start_us, id",
        )
        .bind(&self.run)
        .fetch_all(&self.pool)
        .await
        .map_err(db)?;
        rows.iter()
            .map(|r| {
                Ok(Event {
                    message_id: r.try_get("message_id").map_err(db)?,
                    key: from_stored_text(&r.try_get::<String, _>("key").map_err(db)?).into_owned(),
                    seq: r.try_get::<i64, _>("seq").map_err(db)? as u64,
                    instance: r.try_get("instance").map_err(db)?,
                    generation: r.try_get::<i64, _>("generation").map_err(db)? as u64,
                    start: r.try_get::<i64, _>("start_us").map_err(db)? as u64,
                    end: r.try_get::<Option<i64>, _>("end_us").map_err(db)?.map(|v| v as u64),
                    ok: r.try_get("ok").map_err(db)?,
                })
            })
            .collect()
    }

    async fn now(&self) -> Result<u64> {
        let sql = sqlx::AssertSqlSafe(format!("select {NOW_US}"));
        let now: i64 = sqlx::query_scalar(sql).fetch_one(&self.pool).await.map_err(db)?;
        Ok(now as u64)
    }
}
