#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]

mod admin;
mod guard;
mod relay;
mod sql;

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use keyorder_core::key::{from_stored_text, label, redact, stored_text};
use keyorder_core::{Client, Error, KeyRules, OrderingKey, Result};
use sqlx::postgres::{PgConnection, PgPool, PgPoolOptions};
use sqlx::{AssertSqlSafe, Row};

pub use admin::{AbandonedRecord, Acted, OutboxStatus, RecordState, MAX_LIST};
pub use guard::{AppliedStore, GuardStats, MemoryApplied, PgApplied, SequenceGuard};
pub use keyorder_postgres::sqlx;
pub use relay::{Relay, RelayConfig, RelayStats, RelayStatsSnapshot};

use crate::sql::Sql;

/// The header that carries a record's per-key sequence to the consumer
/// (decimal). [`SequenceGuard`] drops a delivery whose sequence is not above
/// the last one applied for its key.
pub const SEQ_HEADER: &str = "keyorder-seq";

/// The default schema of the outbox's tables.
pub const DEFAULT_SCHEMA: &str = "keyorder_outbox";

/// The default number of relay slots (fixed by the first `migrate`).
pub const DEFAULT_SLOTS: u32 = 16;

/// A record's per-key sequence, read from the [`SEQ_HEADER`] header.
pub fn sequence_of(message: &keyorder_core::Message) -> Option<u64> {
    message.header(SEQ_HEADER).and_then(|v| v.parse().ok())
}

pub(crate) fn db(e: sqlx::Error) -> Error {
    keyorder_postgres::broker_error("postgres (outbox)", e)
}

pub(crate) fn q(sql: &str) -> sqlx::query::Query<'static, sqlx::Postgres, sqlx::postgres::PgArguments> {
    sqlx::query(AssertSqlSafe(sql.to_owned()))
}

/// Whether `name` is a valid category name, by the rule every keyorder
/// publisher applies (1-200 characters of `[A-Za-z0-9._-]`).
pub(crate) fn category_ok(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 200
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

/// Where the outbox lives.
#[derive(Debug, Clone)]
pub struct OutboxConfig {
    /// The schema of the outbox's tables (default [`DEFAULT_SCHEMA`]).
    pub schema: String,
    /// Relay slots: keys map to `stable_hash(key) % slots` and relays share
    /// the slots. Fixed by the first [`Outbox::migrate`]; later values are
    /// checked against it. Choose at least the number of relays you will run.
    pub slots: u32,
    /// The key rules records are validated with (share them with the
    /// [`Client`] the relay publishes through).
    pub key_rules: KeyRules,
}

impl Default for OutboxConfig {
    fn default() -> Self {
        OutboxConfig {
            schema: DEFAULT_SCHEMA.into(),
            slots: DEFAULT_SLOTS,
            key_rules: KeyRules::default(),
        }
    }
}

/// A message to stage: its destination category, its ordering key (checked
/// when staged, not here), payload, headers, correlation id and a stable
/// message id (a fresh UUID v7 unless set), which the published message keeps.
#[derive(Clone)]
pub struct Outgoing {
    category: String,
    key: String,
    id: String,
    correlation_id: Option<String>,
    headers: BTreeMap<String, String>,
    payload: Bytes,
}

impl fmt::Debug for Outgoing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Outgoing")
            .field("category", &self.category)
            .field("key", &redact(&self.key))
            .field("id", &self.id)
            .field("payload_bytes", &self.payload.len())
            .finish()
    }
}

impl Outgoing {
    /// A message for `category`, ordered by `key`.
    pub fn new(category: impl Into<String>, key: impl Into<String>, payload: impl Into<Bytes>) -> Self {
        Outgoing {
            category: category.into(),
            key: key.into(),
            id: uuid::Uuid::now_v7().to_string(),
            correlation_id: None,
            headers: BTreeMap::new(),
            payload: payload.into(),
        }
    }
    /// Sets the stable message id (for example your own event id).
    pub fn with_id(mut self, id: impl Into<String>) -> Self {
        self.id = id.into();
        self
    }
    /// Sets the correlation id.
    pub fn with_correlation_id(mut self, id: impl Into<String>) -> Self {
        self.correlation_id = Some(id.into());
        self
    }
    /// Sets a header (the relay adds [`SEQ_HEADER`] and the key header).
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.insert(name.into(), value.into());
        self
    }
    /// Sets the message type header ([`keyorder_core::TYPE_HEADER`]).
    pub fn with_type(self, name: impl Into<String>) -> Self {
        self.with_header(keyorder_core::TYPE_HEADER, name)
    }
    /// The destination category.
    pub fn category(&self) -> &str {
        &self.category
    }
    /// The key as given (user data: do not log it).
    pub fn key(&self) -> &str {
        &self.key
    }
    /// The message id.
    pub fn id(&self) -> &str {
        &self.id
    }
}

/// A staged record: its row id, message id and per-key sequence (1, 2, 3...
/// in the key's commit order within its category).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Staged {
    /// The record's row id.
    pub record_id: i64,
    /// The stable message id the published message carries.
    pub message_id: String,
    /// The per-key sequence.
    pub seq: u64,
}

/// A key the relay halted on a poison record, until an operator resumes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HaltedRecord {
    /// The category.
    pub category: String,
    /// The key's log-safe label (`k#` + stable hash).
    pub label: String,
    /// The halted head's record id.
    pub record_id: i64,
    /// The halted head's message id (empty if the record is gone).
    pub message_id: String,
    /// Attempts made on the head.
    pub attempts: u32,
    /// Why it halted.
    pub reason: String,
}

/// A record parked in the dead table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParkedRecord {
    /// The record's row id.
    pub record_id: i64,
    /// Its message id.
    pub message_id: String,
    /// The category.
    pub category: String,
    /// The key's log-safe label.
    pub label: String,
    /// Its per-key sequence.
    pub seq: u64,
    /// Why it was parked.
    pub reason: String,
}

/// A transactional outbox in one PostgreSQL schema: stage records in your
/// own transactions, relay them with [`Outbox::relay`]. Cheap to clone.
#[derive(Clone)]
pub struct Outbox {
    pool: PgPool,
    cfg: Arc<OutboxConfig>,
    sql: Arc<Sql>,
}

impl fmt::Debug for Outbox {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Outbox")
            .field("schema", &self.cfg.schema)
            .field("slots", &self.cfg.slots)
            .finish()
    }
}

impl Outbox {
    /// An outbox over an existing pool (the relay and the admin calls use
    /// it; staging uses the caller's connection).
    ///
    /// # Errors
    /// [`Error::Url`] for a schema that is not a lower-case identifier;
    /// [`Error::Config`] for zero slots.
    pub fn new(pool: PgPool, cfg: OutboxConfig) -> Result<Self> {
        keyorder_postgres::shared::check_schema(&cfg.schema)?;
        if cfg.slots == 0 || cfg.slots > 4096 {
            return Err(Error::Config("outbox slots: expected 1..=4096".into()));
        }
        let sql = Arc::new(Sql::new(&cfg.schema));
        Ok(Outbox {
            pool,
            cfg: Arc::new(cfg),
            sql,
        })
    }

    /// Connects a pool of `max_connections` to `url` (a plain PostgreSQL
    /// URL) and builds the outbox with `cfg`.
    pub async fn connect(url: &str, max_connections: u32, cfg: OutboxConfig) -> Result<Self> {
        let parsed = url::Url::parse(url).map_err(|_| Error::Url("outbox: the URL is not a postgres:// URL".into()))?;
        keyorder_postgres::shared::check_driver_url(&parsed)?;
        let pool = PgPoolOptions::new()
            .max_connections(max_connections.max(1))
            .acquire_timeout(Duration::from_secs(10))
            .connect(url)
            .await
            .map_err(db)?;
        Self::new(pool, cfg)
    }

    /// The pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The configuration.
    pub fn config(&self) -> &OutboxConfig {
        &self.cfg
    }

    /// Creates the schema and tables if they do not exist and fixes the slot
    /// count (idempotent; safe from several processes at once: it runs under
    /// an advisory lock).
    ///
    /// # Errors
    /// [`Error::Config`] when the schema's slot count differs from this
    /// configuration's (keys would move between relays' slots).
    pub async fn migrate(&self) -> Result<()> {
        let mut tx = self.pool.begin().await.map_err(db)?;
        sqlx::query("select pg_advisory_xact_lock(7306172007)")
            .execute(&mut *tx)
            .await
            .map_err(db)?;
        for stmt in &self.sql.migrate {
            q(stmt).execute(&mut *tx).await.map_err(db)?;
        }
        q(&self.sql.settings_init)
            .bind(self.cfg.slots as i32)
            .execute(&mut *tx)
            .await
            .map_err(db)?;
        q(&self.sql.settings_epoch).execute(&mut *tx).await.map_err(db)?;
        tx.commit().await.map_err(db)?;
        let n = self.slots().await?;
        if n != self.cfg.slots {
            return Err(Error::Config(format!(
                "outbox schema `{}` has {n} slots but this outbox is configured with {}: use slots = {n}",
                self.cfg.schema, self.cfg.slots
            )));
        }
        Ok(())
    }

    /// The persisted slot count.
    pub(crate) async fn slots(&self) -> Result<u32> {
        Ok(self.settings().await?.0)
    }

    /// The persisted slot count and epoch (the id of this outbox's
    /// incarnation, in every publish fence scope).
    pub(crate) async fn settings(&self) -> Result<(u32, String)> {
        let row: Option<(i32, Option<String>)> = sqlx::query_as(AssertSqlSafe(self.sql.settings.clone()))
            .fetch_optional(&self.pool)
            .await
            .map_err(|e| self.missing_schema(e))?;
        match row {
            Some((n, Some(epoch))) => Ok((n as u32, epoch)),
            _ => Err(self.not_migrated()),
        }
    }

    fn not_migrated(&self) -> Error {
        Error::Config(format!(
            "outbox schema `{}` is not migrated: call Outbox::migrate() once",
            self.cfg.schema
        ))
    }

    fn missing_schema(&self, e: sqlx::Error) -> Error {
        let text = e.to_string();
        if text.contains("does not exist") && text.contains(&self.cfg.schema) {
            self.not_migrated()
        } else {
            db(e)
        }
    }

    /// Stages one record in the caller's transaction (`&mut tx` of a
    /// `sqlx::Transaction`, or any connection).
    ///
    /// The key is validated here, in this call, with the outbox's
    /// [`KeyRules`]: an invalid key fails with [`Error::Key`] and nothing is
    /// written. The record takes the next sequence of its (category, key)
    /// from a counter row upserted in the same statement; the row stays
    /// locked until the caller's transaction ends, so same-key stagers
    /// serialise and the sequence is the key's commit order. A transaction
    /// that stages several keys should use [`Outbox::stage_many`], which
    /// takes the counters in key order (no deadlock between two such
    /// transactions).
    ///
    /// With keyorder-core's feature `otel` (this crate's `otel`), the
    /// record's headers take the current `tracing` span's W3C trace context
    /// ([`keyorder_core::TRACEPARENT_HEADER`], [`keyorder_core::TRACESTATE_HEADER`])
    /// unless it sets its own: the consumer's delivery span continues the
    /// trace of the staging transaction, not the relay's.
    ///
    /// # Errors
    /// [`Error::Key`] (invalid key), [`Error::Config`] (invalid category
    /// name, schema not migrated), [`Error::Broker`] (the database failed:
    /// roll the transaction back).
    pub async fn stage(&self, conn: &mut PgConnection, mut message: Outgoing) -> Result<Staged> {
        // Feature `otel`: the staging span's trace context, unless the
        // record carries a valid one; the relay publishes it as it is.
        if !keyorder_core::trace::carries_context(&message.headers) {
            keyorder_core::trace::replace_context(&mut message.headers, keyorder_core::trace::current_context());
        }
        let key = OrderingKey::with_rules(&message.key, &self.cfg.key_rules)?;
        if !category_ok(&message.category) {
            return Err(Error::Config(format!(
                "category name {} must be 1-200 characters of [A-Za-z0-9._-]",
                redact(&message.category)
            )));
        }
        // Text and `jsonb` hold no NUL: values in their stored form (see
        // `stored_text`; itself unless it holds NUL or starts with U+0001).
        let stored: BTreeMap<&String, std::borrow::Cow<'_, str>> =
            message.headers.iter().map(|(k, v)| (k, stored_text(v))).collect();
        let headers = serde_json::to_string(&stored).map_err(|e| Error::broker(e.to_string()))?;
        let row = q(&self.sql.stage)
            .bind(&message.category)
            .bind(stored_text(key.as_str()))
            .bind(&message.id)
            .bind((key.stable_hash() >> 1) as i64)
            .bind(message.correlation_id.as_deref().map(stored_text))
            .bind(headers)
            .bind(message.payload.as_ref())
            .fetch_optional(&mut *conn)
            .await
            .map_err(|e| self.missing_schema(e))?
            .ok_or_else(|| self.not_migrated())?;
        Ok(Staged {
            record_id: row.get(0),
            message_id: message.id,
            seq: row.get::<i64, _>(1) as u64,
        })
    }

    /// Stages several records in the caller's transaction, taking their
    /// keys' counters in (category, key) order so that two transactions
    /// staging overlapping keys never deadlock. Every key is validated
    /// before anything is written. Records of one key keep the order they
    /// are given in; the result is in the order given.
    pub async fn stage_many(&self, conn: &mut PgConnection, messages: Vec<Outgoing>) -> Result<Vec<Staged>> {
        for m in &messages {
            self.cfg.key_rules.check(&m.key)?;
        }
        let mut order: Vec<usize> = (0..messages.len()).collect();
        // Stable: records of one key keep their given order.
        order.sort_by(|a, b| {
            (&messages[*a].category, &messages[*a].key).cmp(&(&messages[*b].category, &messages[*b].key))
        });
        let mut out: Vec<Option<Staged>> = vec![None; messages.len()];
        for i in order {
            out[i] = Some(self.stage(conn, messages[i].clone()).await?);
        }
        Ok(out.into_iter().map(|s| s.expect("every index staged")).collect())
    }

    /// A relay that publishes this outbox's records through `client`
    /// (any keyorder transport). Run it with [`Relay::run`].
    pub fn relay(&self, client: Client, cfg: RelayConfig) -> Relay {
        Relay::new(self.clone(), client, cfg)
    }

    /// Keys halted on a poison record (policy [`keyorder_core::PoisonPolicy::Halt`]).
    pub async fn halted(&self) -> Result<Vec<HaltedRecord>> {
        let rows = q(&self.sql.halted)
            .fetch_all(&self.pool)
            .await
            .map_err(|e| self.missing_schema(e))?;
        Ok(rows
            .iter()
            .map(|r| HaltedRecord {
                category: r.get(0),
                label: label(&from_stored_text(&r.get::<String, _>(1))),
                record_id: r.get(2),
                reason: r.get(3),
                attempts: r.get::<i32, _>(4) as u32,
                message_id: r.get::<Option<String>, _>(5).unwrap_or_default(),
            })
            .collect())
    }

    /// Resumes a halted key (its value or its label): resets its pending
    /// records' attempts and lets the relay publish its head again.
    ///
    /// # Errors
    /// [`Error::NotFound`] when no such key is halted.
    pub async fn resume(&self, category: &str, key: &str) -> Result<()> {
        let rows = q(&self.sql.halted)
            .fetch_all(&self.pool)
            .await
            .map_err(|e| self.missing_schema(e))?;
        // `stored` is the key's stored form (what the statements match).
        let found = rows
            .iter()
            .map(|r| (r.get::<String, _>(0), r.get::<String, _>(1)))
            .find(|(c, stored)| {
                let k = from_stored_text(stored);
                c == category && (k == key || label(&k) == key)
            });
        let Some((category, stored)) = found else {
            return Err(Error::NotFound(format!("no halted key {}", redact(key))));
        };
        let mut tx = self.pool.begin().await.map_err(db)?;
        for stmt in [&self.sql.reset_attempts, &self.sql.unhalt] {
            q(stmt)
                .bind(&category)
                .bind(&stored)
                .execute(&mut *tx)
                .await
                .map_err(db)?;
        }
        tx.commit().await.map_err(db)?;
        tracing::warn!(key = %label(&from_stored_text(&stored)), "operator resumed a halted outbox key");
        Ok(())
    }

    /// Records parked in the dead table (policy
    /// [`keyorder_core::PoisonPolicy::Park`]).
    pub async fn parked(&self) -> Result<Vec<ParkedRecord>> {
        let rows = q(&self.sql.dead)
            .fetch_all(&self.pool)
            .await
            .map_err(|e| self.missing_schema(e))?;
        Ok(rows
            .iter()
            .map(|r| ParkedRecord {
                record_id: r.get(0),
                message_id: r.get(1),
                category: r.get(2),
                label: label(&from_stored_text(&r.get::<String, _>(3))),
                seq: r.get::<i64, _>(4) as u64,
                reason: r.get(5),
            })
            .collect())
    }

    /// Deletes up to `limit` published, abandoned or parked records resolved
    /// more than `older_than` ago (pending records are never deleted; the
    /// per-key counters stay, so sequences never go back). Returns how many
    /// were deleted.
    pub async fn purge(&self, older_than: Duration, limit: u32) -> Result<u64> {
        let done = q(&self.sql.purge)
            .bind(older_than.as_secs_f64())
            .bind(i64::from(limit))
            .execute(&self.pool)
            .await
            .map_err(|e| self.missing_schema(e))?;
        Ok(done.rows_affected())
    }

    /// The slot a key's records go to, `(stable_hash(key) >> 1) % slots`,
    /// for tools that write records with raw SQL (computed from the key
    /// itself; the `key` column holds
    /// [`stored_text`]`(key)`).
    pub fn slot_of(key: &str, slots: u32) -> u32 {
        ((keyorder_core::key::stable_hash(key.as_bytes()) >> 1) % u64::from(slots.max(1))) as u32
    }
}
