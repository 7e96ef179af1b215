//! `PgAdmin`: `impl Admin`, the operator's verbs (scopes, halted keys,
//! hot keys, dead letters, resolving a halt, groups and their removal), and
//! a queue's deletion (`PgTransport::delete_queue`), `VACUUM` and the
//! sessions' durability settings.

use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;
use keyorder_core::key::{from_stored_text, label};
use keyorder_core::{Admin, DeadLetter, Error, GroupInfo, HaltedKey, HeadAction, HotKey, Result, ScopeInfo};
use sqlx::{AssertSqlSafe, Row};

use crate::error::{broker, removal_error, REMOVAL_LOCK_TIMEOUT};
use crate::exec::q;
use crate::names::{scope_name, GROUP_TABLES, TABLES};
use crate::pg::Pg;

/// The operator's verbs on one schema.
pub(crate) struct PgAdmin {
    pub(crate) t: Pg,
}

impl fmt::Debug for PgAdmin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgAdmin").field("schema", &self.t.cfg.schema).finish()
    }
}

impl PgAdmin {
    /// One (category, group) statement's rows; a missing schema names the fix.
    async fn rows(&self, sql: &Arc<str>, category: &str, group: &str) -> Result<Vec<sqlx::postgres::PgRow>> {
        self.t
            .db
            .all(q(sql).bind(category).bind(group))
            .await
            .map_err(|e| self.t.missing_schema(e))
    }
}

#[async_trait]
impl Admin for PgAdmin {
    async fn scopes(&self, category: &str, group: &str) -> Result<Vec<ScopeInfo>> {
        // A layout changed under the group is what the operator must see
        // first (C23): its slots no longer say where keys are.
        if let Some(row) = self
            .t
            .db
            .all(q(&self.t.sql.group_slots).bind(category).bind(group))
            .await
            .map_err(|e| self.t.missing_schema(e))?
            .first()
        {
            let n: i32 = row.get(0);
            self.t
                .check_layout(category, n as u32, &format!("consumer group `{group}`"), false)
                .await?;
        }
        let rows = self.rows(&self.t.sql.scopes, category, group).await?;
        Ok(rows
            .iter()
            .map(|r| ScopeInfo {
                scope: scope_name(category, r.get::<i32, _>(0) as u32).to_string(),
                owner: r.get(1),
                generation: r.get::<i64, _>(2) as u64,
                lag: r.get::<i64, _>(3) as u64,
                halted: r.get::<i64, _>(4) as usize,
            })
            .collect())
    }

    async fn halted(&self, category: &str, group: &str) -> Result<Vec<HaltedKey>> {
        let rows = self.rows(&self.t.sql.halted, category, group).await?;
        Ok(rows
            .iter()
            .map(|r| {
                let stored: String = r.get(0);
                let key = from_stored_text(&stored);
                HaltedKey {
                    label: label(&key),
                    preview: keyorder_core::key::redact(&key),
                    scope: scope_name(category, r.get::<i32, _>(1) as u32).to_string(),
                    head_id: r.get(2),
                    reason: r.get(3),
                    attempts: r.get::<i32, _>(4) as u32,
                    held: Some(r.get::<i64, _>(5) as u64),
                }
            })
            .collect())
    }

    async fn hot_keys(&self, category: &str, group: &str, limit: usize) -> Result<Vec<HotKey>> {
        let rows = self
            .t
            .db
            .all(q(&self.t.sql.hot_keys).bind(category).bind(group).bind(limit as i64))
            .await
            .map_err(|e| self.t.missing_schema(e))?;
        Ok(rows
            .iter()
            .map(|r| HotKey {
                label: label(&from_stored_text(&r.get::<String, _>(0))),
                backlog: r.get::<i64, _>(1) as u64,
            })
            .collect())
    }

    async fn dead_letters(&self, category: &str, group: &str) -> Result<Vec<DeadLetter>> {
        let rows = self.rows(&self.t.sql.dead, category, group).await?;
        Ok(rows
            .iter()
            .map(|r| DeadLetter {
                id: r.get(0),
                label: r
                    .get::<Option<String>, _>(1)
                    .map_or_else(|| "keyless".into(), |k| label(&from_stored_text(&k))),
                reason: r.get(2),
            })
            .collect())
    }

    async fn resolve(&self, category: &str, group: &str, key: &str, action: HeadAction) -> Result<()> {
        let halted = self.rows(&self.t.sql.halted, category, group).await?;
        // `found` is the stored form (what the statements below match);
        // the operator names the key by its value or its label.
        let Some(found) = halted.iter().map(|r| r.get::<String, _>(0)).find(|stored| {
            let k = from_stored_text(stored);
            k == key || label(&k) == key
        }) else {
            return Err(Error::NotFound(format!(
                "no halted key {}",
                keyorder_core::key::redact(key)
            )));
        };
        // One transaction (a transaction-mode pooler keeps it on one server
        // connection), unnamed statements behind a pooler.
        let pooled = self.t.cfg.pooled;
        let mut tx = self.t.db.pool.begin().await.map_err(broker)?;
        let (stmt, mark) = match action {
            HeadAction::Skip => (&self.t.sql.op_ack, "skip"),
            HeadAction::DeadLetter => (&self.t.sql.op_dead, "dlq"),
            HeadAction::Resume => (&self.t.sql.op_resume, "resume"),
        };
        q(stmt)
            .bind(category)
            .bind(group)
            .bind(&found)
            .persistent(!pooled)
            .execute(&mut *tx)
            .await
            .map_err(broker)?;
        if action == HeadAction::DeadLetter {
            q(&self.t.sql.op_ack)
                .bind(category)
                .bind(group)
                .bind(&found)
                .persistent(!pooled)
                .execute(&mut *tx)
                .await
                .map_err(broker)?;
        }
        q(&self.t.sql.op_mark)
            .bind(category)
            .bind(group)
            .bind(&found)
            .bind(mark)
            .persistent(!pooled)
            .execute(&mut *tx)
            .await
            .map_err(broker)?;
        tx.commit().await.map_err(broker)?;
        if action == HeadAction::Skip {
            tracing::warn!(key = %label(&from_stored_text(&found)), "operator skipped a halted head");
        }
        Ok(())
    }

    /// Every group recorded for the queue (created at its first start, kept
    /// while stopped, until removed), with the members seen within their
    /// lease TTL.
    async fn groups(&self, category: &str) -> Result<Vec<GroupInfo>> {
        let rows = self
            .t
            .db
            .all(q(&self.t.sql.groups).bind(category))
            .await
            .map_err(|e| self.t.missing_schema(e))?;
        Ok(rows
            .iter()
            .map(|r| GroupInfo {
                name: r.get(0),
                live_members: r.get::<i64, _>(1) as usize,
            })
            .collect())
    }

    /// Deletes what the queue keeps for the group (its slot rows with their
    /// cursors and leases, acknowledgements, attempt counts, read marks,
    /// halted heads, dead letters, members), in one transaction holding the
    /// queue's row like a group's creation does; retention then no longer
    /// waits for it. The events stay (other groups may need them). A
    /// subscription started with the group's name later creates it afresh,
    /// at the oldest retained event, with generations above the removed
    /// group's.
    ///
    /// The group's row and slot rows are taken `for update` before anything
    /// is checked or deleted: a heartbeat, settlement or read in flight
    /// commits first (and is seen: a live member or lease refuses the
    /// removal), one that comes after finds nothing (its member stops with
    /// an error naming the removal). The slot rows go before the tables
    /// that hang off them. A lock held longer than ten seconds fails the
    /// removal (nothing deleted) rather than hold the queue's row, which
    /// retention and new groups wait for.
    /// Deletes the queue with every row kept for it ([`delete_queue`]):
    /// refused while a slot of it has a live owner.
    async fn delete_category(&self, category: &str) -> Result<String> {
        let rows = delete_queue(&self.t, category).await?;
        Ok(format!("{rows} rows"))
    }

    async fn vacuum(&self) -> Result<()> {
        crate::schema::vacuum(self.t.direct_url(), &self.t.cfg.schema).await
    }

    async fn durability(&self) -> Result<Option<String>> {
        let settings = durability(&self.t).await?;
        let relaxed = settings.iter().any(|(_, v)| v == "off");
        let mut line = settings
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(" ");
        if relaxed {
            line.push_str(
                " (relaxed: a crash of the server itself can lose acknowledgements; \
                 the ordering guarantee assumes both on)",
            );
        }
        Ok(Some(line))
    }

    async fn remove_group(&self, category: &str, group: &str) -> Result<()> {
        let what = format!("removing consumer group `{group}` of queue `{category}`");
        let pooled = self.t.cfg.pooled;
        let mut tx = self.t.db.pool.begin().await.map_err(broker)?;
        sqlx::query("select set_config('lock_timeout', $1, true)")
            .bind(REMOVAL_LOCK_TIMEOUT)
            .persistent(false)
            .execute(&mut *tx)
            .await
            .map_err(broker)?;
        q(&self.t.sql.lock_queue)
            .bind(category)
            .persistent(!pooled)
            .execute(&mut *tx)
            .await
            .map_err(|e| match e {
                sqlx::Error::Database(_) if e.to_string().contains("does not exist") => self.t.missing_schema(e),
                e => removal_error(e, &what),
            })?;
        for lock in [&self.t.sql.lock_group, &self.t.sql.lock_group_slots] {
            q(lock)
                .bind(category)
                .bind(group)
                .persistent(!pooled)
                .execute(&mut *tx)
                .await
                .map_err(|e| removal_error(e, &what))?;
        }
        let row = q(&self.t.sql.group_live)
            .bind(category)
            .bind(group)
            .persistent(!pooled)
            .fetch_one(&mut *tx)
            .await
            .map_err(broker)?;
        let (known, members, leases): (bool, i64, i64) = (row.get(0), row.get(1), row.get(2));
        if !known {
            return Err(Error::NotFound(format!(
                "consumer group `{group}` of queue `{category}`"
            )));
        }
        if members > 0 || leases > 0 {
            return Err(Error::Config(format!(
                "postgres: consumer group `{group}` of queue `{category}` is running ({members} live members, \
                 {leases} live slot leases): stop its subscriptions (or wait for their leases to expire), then \
                 remove it"
            )));
        }
        q(&self.t.sql.raise_floor)
            .bind(category)
            .bind(group)
            .persistent(!pooled)
            .execute(&mut *tx)
            .await
            .map_err(|e| removal_error(e, &what))?;
        let s = &self.t.cfg.schema;
        for table in GROUP_TABLES {
            sqlx::query(AssertSqlSafe(format!(
                "delete from {s}.{table} where queue = $1 and grp = $2"
            )))
            .persistent(false)
            .bind(category)
            .bind(group)
            .execute(&mut *tx)
            .await
            .map_err(|e| removal_error(e, &what))?;
        }
        tx.commit().await.map_err(broker)?;
        tracing::info!(queue = category, group, "postgres: consumer group removed");
        Ok(())
    }
}

/// `synchronous_commit` and `fsync` of the schema's sessions (see
/// `PgTransport::durability`).
pub(crate) async fn durability(t: &Pg) -> Result<Vec<(String, String)>> {
    let q = sqlx::query("select current_setting('synchronous_commit'), current_setting('fsync')").persistent(false);
    let row = t.db.one(q).await.map_err(broker)?;
    Ok(vec![
        ("synchronous_commit".to_owned(), row.try_get(0).map_err(broker)?),
        ("fsync".to_owned(), row.try_get(1).map_err(broker)?),
    ])
}

/// Deletes `queue` and everything kept for it (see `PgTransport::delete_queue`).
pub(crate) async fn delete_queue(t: &Pg, queue: &str) -> Result<u64> {
    let s = &t.cfg.schema;
    let what = format!("deleting queue `{queue}`");
    let mut tx = t.db.pool.begin().await.map_err(broker)?;
    sqlx::query("select set_config('lock_timeout', $1, true)")
        .bind(REMOVAL_LOCK_TIMEOUT)
        .persistent(false)
        .execute(&mut *tx)
        .await
        .map_err(broker)?;
    // The queue's row first, as a group's creation, its removal and
    // retention take it (retention then deletes events: taking the
    // events' rows before the queue's could deadlock with it); then
    // every slot row `for update`, like a group's removal (the fenced
    // statements in flight commit first, later ones find nothing).
    for lock in [&t.sql.lock_queue, &t.sql.lock_queue_group_slots] {
        q(lock)
            .bind(queue)
            .persistent(false)
            .execute(&mut *tx)
            .await
            .map_err(|e| match e {
                sqlx::Error::Database(_) if e.to_string().contains("does not exist") => t.missing_schema(e),
                e => removal_error(e, &what),
            })?;
    }
    let live: i64 = sqlx::query(AssertSqlSafe(format!(
        "select (select count(*) from {s}.slots where queue = $1 and owner is not null \
         and lease_expiry > clock_timestamp()) + (select count(*) from {s}.plain_events where queue = $1 \
         and locked_until > clock_timestamp())"
    )))
    .persistent(false)
    .bind(queue)
    .fetch_one(&mut *tx)
    .await
    .map_err(|e| t.missing_schema(e))?
    .get(0);
    if live > 0 {
        return Err(Error::Config(format!(
            "postgres: queue `{queue}` is in use ({live} live slot leases or claims): stop its subscriptions \
             (or wait for their leases to expire), then delete it"
        )));
    }
    // Generations never go back, should the queue's groups start again.
    q(&t.sql.raise_floor_queue)
        .bind(queue)
        .persistent(false)
        .execute(&mut *tx)
        .await
        .map_err(|e| removal_error(e, &what))?;
    let mut rows = 0;
    for table in TABLES {
        let done = sqlx::query(AssertSqlSafe(format!("delete from {s}.{table} where queue = $1")))
            .persistent(false)
            .bind(queue)
            .execute(&mut *tx)
            .await
            .map_err(broker)?;
        rows += done.rows_affected();
    }
    tx.commit().await.map_err(broker)?;
    Ok(rows)
}
