//! The consumer side: drop a delivery whose per-key sequence is not above
//! the last one applied (a stalled relay's late publish, a relay's retry).

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use keyorder_core::key::{label, stored_text};
use keyorder_core::{Delivery, Error, Handler, HandlerError, HandlerResult, Result};
use sqlx::postgres::{PgConnection, PgPool};
use sqlx::AssertSqlSafe;

use crate::sql::Sql;
use crate::{db, sequence_of, Outbox};

/// Where a [`SequenceGuard`] keeps the last applied sequence of each key.
#[async_trait]
pub trait AppliedStore: Send + Sync + fmt::Debug + 'static {
    /// The last sequence applied for `key`, if any is known.
    async fn last_applied(&self, key: &str) -> Result<Option<u64>>;
    /// Records that `seq` was applied for `key` (never lowers the value).
    async fn set_applied(&self, key: &str, seq: u64) -> Result<()>;
}

/// An in-memory, bounded store: the `capacity` most recently used keys.
///
/// A key evicted from it (or every key, after a restart) has no known last
/// sequence, so a late duplicate of it is applied again: use [`PgApplied`]
/// where that matters.
#[derive(Debug)]
pub struct MemoryApplied {
    capacity: usize,
    inner: Mutex<Lru>,
}

#[derive(Debug, Default)]
struct Lru {
    tick: u64,
    map: HashMap<String, (u64, u64)>,
    order: BTreeMap<u64, String>,
}

impl Lru {
    fn touch(&mut self, key: &str) -> Option<u64> {
        let (seq, old) = *self.map.get(key)?;
        self.tick += 1;
        self.order.remove(&old);
        self.order.insert(self.tick, key.to_owned());
        self.map.insert(key.to_owned(), (seq, self.tick));
        Some(seq)
    }
}

impl MemoryApplied {
    /// A store of at most `capacity` keys (at least 1).
    pub fn new(capacity: usize) -> Self {
        MemoryApplied {
            capacity: capacity.max(1),
            inner: Mutex::default(),
        }
    }
    /// Keys held now.
    pub fn len(&self) -> usize {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).map.len()
    }
    /// Whether no key is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[async_trait]
impl AppliedStore for MemoryApplied {
    async fn last_applied(&self, key: &str) -> Result<Option<u64>> {
        Ok(self.inner.lock().unwrap_or_else(|e| e.into_inner()).touch(key))
    }

    async fn set_applied(&self, key: &str, seq: u64) -> Result<()> {
        let mut lru = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let seq = lru.touch(key).map_or(seq, |old| old.max(seq));
        lru.tick += 1;
        let tick = lru.tick;
        if let Some((_, old)) = lru.map.insert(key.to_owned(), (seq, tick)) {
            lru.order.remove(&old);
        }
        lru.order.insert(tick, key.to_owned());
        while lru.map.len() > self.capacity {
            let Some((_, evicted)) = lru.order.pop_first() else {
                break;
            };
            lru.map.remove(&evicted);
        }
        Ok(())
    }
}

/// A PostgreSQL store: the outbox schema's `applied` table, one row per
/// (name, key). Your handler can record a sequence in its own transaction
/// with [`PgApplied::record_in`], so its effects and the record commit
/// together (an effect is then applied once even across crashes).
#[derive(Clone)]
pub struct PgApplied {
    pool: PgPool,
    sql: Arc<Sql>,
    name: String,
}

impl fmt::Debug for PgApplied {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgApplied").field("name", &self.name).finish()
    }
}

impl PgApplied {
    /// The store of consumer `name` (for example the consumer group) in the
    /// outbox's schema (run [`Outbox::migrate`] first).
    pub fn new(outbox: &Outbox, name: impl Into<String>) -> Self {
        PgApplied {
            pool: outbox.pool.clone(),
            sql: outbox.sql.clone(),
            name: name.into(),
        }
    }

    /// Records `seq` for `key` in the caller's transaction. Returns `false`
    /// (and changes nothing) when `seq` is not above the recorded value: the
    /// delivery is stale and its effects should be rolled back.
    pub async fn record_in(&self, conn: &mut PgConnection, key: &str, seq: u64) -> Result<bool> {
        let row = sqlx::query(AssertSqlSafe(self.sql.applied_put.clone()))
            .bind(&self.name)
            .bind(stored_text(key))
            .bind(seq as i64)
            .fetch_optional(&mut *conn)
            .await
            .map_err(db)?;
        Ok(row.is_some())
    }
}

#[async_trait]
impl AppliedStore for PgApplied {
    async fn last_applied(&self, key: &str) -> Result<Option<u64>> {
        let seq: Option<i64> = sqlx::query_scalar(AssertSqlSafe(self.sql.applied_get.clone()))
            .bind(&self.name)
            .bind(stored_text(key))
            .fetch_optional(&self.pool)
            .await
            .map_err(db)?;
        Ok(seq.map(|s| s as u64))
    }

    async fn set_applied(&self, key: &str, seq: u64) -> Result<()> {
        let mut conn = self.pool.acquire().await.map_err(db)?;
        self.record_in(&mut conn, key, seq).await.map(|_| ())
    }
}

/// A guard's counters.
#[derive(Debug, Default)]
pub struct GuardStats {
    dropped: AtomicU64,
    applied: AtomicU64,
}

impl GuardStats {
    /// Deliveries dropped as stale (sequence not above the last applied).
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }
    /// Deliveries the inner handler applied.
    pub fn applied(&self) -> u64 {
        self.applied.load(Ordering::Relaxed)
    }
}

/// A [`Handler`] wrapper for consumers of an outbox: a delivery whose
/// per-key sequence ([`crate::SEQ_HEADER`]) is not above the last applied
/// one of its key is acknowledged without running the inner handler, and
/// counted (`keyorder_outbox_stale_dropped_total`, [`GuardStats::dropped`]).
/// That removes a stalled relay's late publish and the repeats of relay
/// retries. A delivery without a key or a sequence runs as is.
///
/// The guard reads the last applied sequence before the inner handler runs
/// and records the new one after it returned `Ok`; a crash in between runs
/// the delivery again (at-least-once), unless the handler records the
/// sequence itself in its own transaction ([`PgApplied::record_in`]).
pub struct SequenceGuard<H, S = MemoryApplied> {
    inner: H,
    store: Arc<S>,
    stats: Arc<GuardStats>,
}

impl<H, S: fmt::Debug> fmt::Debug for SequenceGuard<H, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SequenceGuard")
            .field("store", &self.store)
            .field("dropped", &self.stats.dropped())
            .finish()
    }
}

impl<H: Handler> SequenceGuard<H, MemoryApplied> {
    /// A guard with an in-memory store of the `capacity` most recent keys.
    pub fn in_memory(inner: H, capacity: usize) -> Self {
        Self::new(inner, Arc::new(MemoryApplied::new(capacity)))
    }
}

impl<H: Handler, S: AppliedStore> SequenceGuard<H, S> {
    /// A guard over `inner` with `store`.
    pub fn new(inner: H, store: Arc<S>) -> Self {
        SequenceGuard {
            inner,
            store,
            stats: Arc::default(),
        }
    }
    /// The live counters (take them before the guard moves into a run).
    pub fn stats(&self) -> Arc<GuardStats> {
        self.stats.clone()
    }
    /// The store.
    pub fn store(&self) -> &Arc<S> {
        &self.store
    }
}

#[async_trait]
impl<H: Handler, S: AppliedStore> Handler for SequenceGuard<H, S> {
    async fn handle(&self, delivery: Delivery) -> HandlerResult {
        let (Some(key), Some(seq)) = (delivery.key().cloned(), sequence_of(delivery.message())) else {
            return self.inner.handle(delivery).await;
        };
        let last = self.store.last_applied(key.as_str()).await.map_err(retry)?;
        if last.is_some_and(|last| seq <= last) {
            self.stats.dropped.fetch_add(1, Ordering::Relaxed);
            metrics::counter!("keyorder_outbox_stale_dropped_total").increment(1);
            tracing::debug!(key = %label(key.as_str()), seq, last, "stale outbox delivery dropped");
            return Ok(());
        }
        self.inner.handle(delivery).await?;
        self.store.set_applied(key.as_str(), seq).await.map_err(retry)?;
        self.stats.applied.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

fn retry(e: Error) -> HandlerError {
    HandlerError::retry(e)
}
