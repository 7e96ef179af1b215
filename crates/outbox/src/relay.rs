//! The relay: publishes outbox records per key in sequence order, holding
//! fenced slot leases so several relays share the work and never publish one
//! key at the same time.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use keyorder_core::key::{from_stored_text, label};
use keyorder_core::{
    Client, Error, LeaseConfig, Message, OrderingKey, PoisonPolicy, PublishFence, Publisher, Result, RetryPolicy,
};
use sqlx::postgres::PgPool;
use sqlx::Row;
use tokio::sync::Mutex as AsyncMutex;
use tokio::task::{Id, JoinError, JoinSet};
use tokio::time::Instant;

use crate::sql::{Sql, LEASE_QUEUE};
use crate::{category_ok, db, q, Outbox, SEQ_HEADER};

/// How a relay runs.
#[derive(Debug, Clone)]
pub struct RelayConfig {
    /// The relay group: relays of one group share the outbox's slots
    /// (default `relay`). Two groups would each publish everything.
    pub group: String,
    /// This relay's unique id (default: a fresh UUID).
    pub instance: Option<String>,
    /// Slot lease timing on the database's clock (TTL, heartbeat, and the
    /// margin below which a relay starts no publish).
    pub lease: LeaseConfig,
    /// Keys publishing at once (default 64).
    pub concurrency: usize,
    /// Records read per slot and read (default 256).
    pub batch: usize,
    /// Records one slot may hold in memory; beyond it the slot's reads wait
    /// (default 1024).
    pub held_per_slot: usize,
    /// How often an idle relay looks for new records (default 50 ms).
    pub poll: Duration,
    /// Retry of a failed publish with back-off, holding only its key.
    /// After `retry.max_attempts` attempts the poison policy applies (with
    /// [`PoisonPolicy::Park`], after its own `max_attempts`).
    pub retry: RetryPolicy,
    /// What happens to a record whose publish keeps failing: halt its key
    /// (default) or park it in the dead table and go on with the key.
    pub poison: PoisonPolicy,
    /// Retention: published records deleted per batch, oldest first, a
    /// batch each heartbeat and at once again while batches come back full
    /// (default 1000; 0 keeps every published record). Pending, held,
    /// abandoned, parked and discarded records are never deleted.
    pub retention_batch: usize,
    /// **A benchmark baseline, for comparison only** (default `false`):
    /// publishes pending records without waiting for a key's earlier record
    /// to be confirmed, so a key's records may reach the broker in any
    /// order: no per-key order. Everything else is unchanged: the same
    /// reads, the same fenced statements around each publish (without the
    /// check of the key's earlier records), the same publisher, and every
    /// record is still marked published. `keyorder outbox bench` runs it
    /// beside the ordered relay to measure what the order costs.
    pub ignore_ordering: bool,
}

impl Default for RelayConfig {
    fn default() -> Self {
        RelayConfig {
            group: "relay".into(),
            instance: None,
            lease: LeaseConfig::default(),
            concurrency: 64,
            batch: 256,
            held_per_slot: 1024,
            poll: Duration::from_millis(50),
            retry: RetryPolicy {
                max_attempts: 10,
                initial_backoff: Duration::from_millis(100),
                max_backoff: Duration::from_secs(10),
            },
            poison: PoisonPolicy::Halt,
            retention_batch: 1000,
            ignore_ordering: false,
        }
    }
}

/// A relay's counters (also reported through `metrics` as
/// `keyorder_outbox_*_total`).
#[derive(Debug, Default)]
pub struct RelayStats {
    published: AtomicU64,
    abandoned: AtomicU64,
    parked: AtomicU64,
    halted: AtomicU64,
    retries: AtomicU64,
    fenced: AtomicU64,
    blocked: AtomicU64,
    slots_lost: AtomicU64,
    retention_deleted: AtomicU64,
}

/// A copy of a relay's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RelayStatsSnapshot {
    /// Records published and marked published.
    pub published: u64,
    /// Records that can never be published, marked abandoned.
    pub abandoned: u64,
    /// Poison records parked in the dead table.
    pub parked: u64,
    /// Keys halted on a poison record.
    pub halted: u64,
    /// Failed publishes retried with back-off.
    pub retries: u64,
    /// Statements refused by the fence (this relay no longer held the slot
    /// at its generation), late confirmations included.
    pub fenced: u64,
    /// Publishes held back because an earlier record of the key was still
    /// pending but not yet readable (its transaction ended after a later one
    /// took a lower transaction id).
    pub blocked: u64,
    /// Slot leases this relay lost (not renewed in time).
    pub slots_lost: u64,
    /// Published records this relay deleted (retention).
    pub retention_deleted: u64,
}

impl RelayStats {
    /// The counters now.
    pub fn snapshot(&self) -> RelayStatsSnapshot {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        RelayStatsSnapshot {
            published: g(&self.published),
            abandoned: g(&self.abandoned),
            parked: g(&self.parked),
            halted: g(&self.halted),
            retries: g(&self.retries),
            fenced: g(&self.fenced),
            blocked: g(&self.blocked),
            slots_lost: g(&self.slots_lost),
            retention_deleted: g(&self.retention_deleted),
        }
    }
}

fn bump(counter: &AtomicU64, name: &'static str) {
    counter.fetch_add(1, Ordering::Relaxed);
    metrics::counter!(name).increment(1);
}

/// One record as read.
#[derive(Debug)]
struct Record {
    id: i64,
    message_id: String,
    category: String,
    /// The key itself, decoded from its stored form.
    key: String,
    seq: i64,
    correlation_id: Option<String>,
    headers: String,
    payload: Vec<u8>,
}

type KeyId = (String, String);

#[derive(Debug, Default)]
struct KeyQueue {
    records: BTreeMap<i64, Arc<Record>>,
    busy: bool,
    /// The sequences being published ([`RelayConfig::ignore_ordering`] only,
    /// where one key has several publishes at once).
    in_flight: BTreeSet<i64>,
    not_before: Option<Instant>,
}

#[derive(Debug)]
struct Owned {
    generation: i64,
    pos: (String, i64),
    keys: HashMap<KeyId, KeyQueue>,
    held: usize,
    revoking: bool,
}

/// What one publish attempt came to.
#[derive(Debug)]
enum Outcome {
    /// Published, abandoned, parked, or already resolved: the key moves on.
    Resolved,
    /// An earlier record of the key is still pending (not yet readable).
    Blocked,
    /// The key is halted.
    Halted,
    /// Try again after the delay.
    Retry(Duration),
    /// This relay no longer holds the slot at this generation.
    Fenced,
}

#[derive(Debug, Clone)]
struct Meta {
    slot: u32,
    generation: i64,
    key: KeyId,
    seq: i64,
}

/// What every publish task shares.
struct Ctx {
    pool: PgPool,
    sql: Arc<Sql>,
    group: String,
    me: String,
    client: Client,
    publishers: AsyncMutex<HashMap<String, Publisher>>,
    retry: RetryPolicy,
    poison: PoisonPolicy,
    margin: Duration,
    ignore_ordering: bool,
    stats: Arc<RelayStats>,
    /// `outbox/{epoch}/{group hash}/`: a slot's publish fence scope is this
    /// and the slot number (set at the first step).
    fence_prefix: std::sync::OnceLock<String>,
}

impl Ctx {
    /// The publish fence of `slot` at `generation`: brokers that fence
    /// publishes refuse this relay's publish once a later owner of the slot
    /// published.
    fn fence(&self, slot: u32, generation: i64) -> PublishFence {
        PublishFence {
            scope: format!("{}{slot}", self.fence_prefix.get().map_or("outbox/", String::as_str)),
            token: generation.max(0) as u64,
        }
    }
}

/// A relay: publishes the outbox's records through a keyorder [`Client`],
/// per key in sequence order, keys in parallel. Build it with
/// [`Outbox::relay`], run it with [`Relay::run`]; any number of relays of
/// one group may run at once (they share the slots through fenced leases).
pub struct Relay {
    outbox: Outbox,
    cfg: RelayConfig,
    ctx: Arc<Ctx>,
    slots: Option<u32>,
    owned: BTreeMap<u32, Owned>,
    running_by_slot: HashMap<u32, usize>,
    running: JoinSet<Outcome>,
    meta: HashMap<Id, Meta>,
    last_maintain: Option<Instant>,
    last_read: Option<Instant>,
    read_more: bool,
    waiting: bool,
    last_status: Option<Instant>,
    last_retention: Option<Instant>,
    retention_more: bool,
}

impl fmt::Debug for Relay {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Relay")
            .field("instance", &self.ctx.me)
            .field("group", &self.cfg.group)
            .field("owned", &self.owned.keys().collect::<Vec<_>>())
            .field("running", &self.running.len())
            .finish()
    }
}

impl Relay {
    pub(crate) fn new(outbox: Outbox, client: Client, cfg: RelayConfig) -> Relay {
        let me = cfg.instance.clone().unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
        let ctx = Arc::new(Ctx {
            pool: outbox.pool.clone(),
            sql: outbox.sql.clone(),
            group: cfg.group.clone(),
            me,
            client,
            publishers: AsyncMutex::new(HashMap::new()),
            retry: cfg.retry,
            poison: cfg.poison,
            margin: cfg.lease.margin,
            ignore_ordering: cfg.ignore_ordering,
            stats: Arc::new(RelayStats::default()),
            fence_prefix: std::sync::OnceLock::new(),
        });
        if cfg.ignore_ordering {
            tracing::warn!("outbox relay: ignore_ordering is set: a key's records may be published out of order (a benchmark baseline)");
        }
        Relay {
            outbox,
            cfg,
            ctx,
            slots: None,
            owned: BTreeMap::new(),
            running_by_slot: HashMap::new(),
            running: JoinSet::new(),
            meta: HashMap::new(),
            last_maintain: None,
            last_read: None,
            read_more: false,
            waiting: false,
            last_status: None,
            last_retention: None,
            retention_more: false,
        }
    }

    /// This relay's id (its owner name in the slot leases).
    pub fn instance_id(&self) -> &str {
        &self.ctx.me
    }

    /// The live counters.
    pub fn stats(&self) -> Arc<RelayStats> {
        self.ctx.stats.clone()
    }

    /// The slots this relay holds now.
    pub fn owned_slots(&self) -> Vec<u32> {
        self.owned.keys().copied().collect()
    }

    /// Runs until `shutdown` completes, then drains: publishes in flight
    /// finish and are marked, and the slots are released for other relays.
    /// A database error is retried with back-off; only a configuration
    /// error ends the run early.
    pub async fn run(mut self, shutdown: impl Future<Output = ()> + Send) -> Result<RelayStatsSnapshot> {
        tokio::pin!(shutdown);
        let mut backoff = Duration::ZERO;
        let outcome = loop {
            let mut pause = Duration::ZERO;
            match self.step().await {
                Ok(()) => backoff = Duration::ZERO,
                Err(Error::Broker(b)) => {
                    tracing::warn!(error = %b.message(), temporary = b.is_temporary(), "outbox relay: database error; retrying");
                    backoff = (backoff * 2).clamp(Duration::from_millis(50), Duration::from_secs(5));
                    pause = backoff;
                }
                Err(other) => break Err(other),
            }
            let wake = self.next_wake().max(pause);
            tokio::select! {
                biased;
                () = &mut shutdown => break Ok(()),
                Some(done) = self.running.join_next_with_id(), if !self.running.is_empty() => self.finish(done),
                () = tokio::time::sleep(wake) => {}
            }
        };
        while let Some(done) = self.running.join_next_with_id().await {
            self.finish(done);
        }
        let close = self.close().await;
        outcome?;
        close?;
        Ok(self.ctx.stats.snapshot())
    }

    /// One round of the relay without waiting: collects finished publishes,
    /// renews and rebalances slot leases when due, reads new records when
    /// due, and starts the publishable heads of idle keys. [`Relay::run`]
    /// calls it in a loop; a test can call it by hand (and stop calling it
    /// to simulate a stalled relay).
    pub async fn step(&mut self) -> Result<()> {
        while let Some(done) = self.running.try_join_next_with_id() {
            self.finish(done);
        }
        if self.slots.is_none() {
            let (n, epoch) = self.outbox.settings().await?;
            let group = keyorder_core::key::stable_hash(self.cfg.group.as_bytes());
            let _ = self.ctx.fence_prefix.set(format!("outbox/{epoch}/{group:016x}/"));
            q(&self.ctx.sql.ensure_slots)
                .bind(LEASE_QUEUE)
                .bind(&self.cfg.group)
                .bind(n as i32)
                .execute(&self.ctx.pool)
                .await
                .map_err(db)?;
            self.slots = Some(n);
        }
        let every = if self.waiting {
            Duration::from_millis(100).min(self.cfg.lease.heartbeat)
        } else {
            self.cfg.lease.heartbeat
        };
        if self.last_maintain.is_none_or(|t| t.elapsed() >= every) {
            self.maintain().await?;
        }
        self.release_drained().await?;
        let heartbeat = self.cfg.lease.heartbeat;
        if self.last_status.is_none_or(|t| t.elapsed() >= heartbeat) {
            self.refresh_status().await;
        }
        if self.cfg.retention_batch > 0
            && (self.retention_more || self.last_retention.is_none_or(|t| t.elapsed() >= heartbeat))
        {
            self.retain().await;
        }
        if self.read_more || self.last_read.is_none_or(|t| t.elapsed() >= self.cfg.poll) {
            self.read().await?;
        }
        self.start();
        Ok(())
    }

    /// How long the run loop may sleep before the next step is due.
    fn next_wake(&self) -> Duration {
        if self.read_more || self.retention_more {
            return Duration::ZERO;
        }
        let now = Instant::now();
        let mut at = self.last_read.map_or(now, |t| t + self.cfg.poll);
        if let Some(t) = self.last_maintain {
            let every = if self.waiting {
                Duration::from_millis(100).min(self.cfg.lease.heartbeat)
            } else {
                self.cfg.lease.heartbeat
            };
            at = at.min(t + every);
        }
        for o in self.owned.values() {
            for kq in o.keys.values() {
                if let (false, Some(t)) = (kq.busy, kq.not_before) {
                    at = at.min(t);
                }
            }
        }
        at.saturating_duration_since(now).max(Duration::from_millis(1))
    }

    /// Refreshes the gauges from [`Outbox::status`] (one statement, each
    /// heartbeat). A failure is logged, not fatal: publishing goes on.
    async fn refresh_status(&mut self) {
        self.last_status = Some(Instant::now());
        match self.outbox.status().await {
            Ok(s) => {
                let schema = self.outbox.cfg.schema.clone();
                let gauge = |name: &'static str, v: f64| metrics::gauge!(name, "schema" => schema.clone()).set(v);
                gauge("keyorder_outbox_pending", s.pending as f64);
                gauge(
                    "keyorder_outbox_oldest_pending_seconds",
                    s.oldest_pending_age.map_or(0.0, |d| d.as_secs_f64()),
                );
                gauge("keyorder_outbox_abandoned", s.abandoned as f64);
                gauge("keyorder_outbox_parked", s.parked as f64);
                gauge("keyorder_outbox_held_keys", s.held_keys as f64);
            }
            Err(e) => tracing::warn!(error = %e, "outbox relay: status refresh failed"),
        }
    }

    /// Deletes one bounded batch of published records; a full batch asks
    /// for another at the next step. A failure is logged, not fatal.
    async fn retain(&mut self) {
        self.last_retention = Some(Instant::now());
        let batch = self.cfg.retention_batch;
        match self.outbox.delete_published(batch).await {
            Ok(n) => {
                self.retention_more = n >= batch as u64;
                if n > 0 {
                    self.ctx.stats.retention_deleted.fetch_add(n, Ordering::Relaxed);
                    metrics::counter!("keyorder_outbox_retention_deleted_total").increment(n);
                }
            }
            Err(e) => {
                self.retention_more = false;
                tracing::warn!(error = %e, "outbox relay: retention failed");
            }
        }
    }

    fn ms(d: Duration) -> f64 {
        d.as_millis() as f64
    }

    /// Heartbeat, lease renewal, fair share over live relays.
    async fn maintain(&mut self) -> Result<()> {
        let ctx = self.ctx.clone();
        let (sql, pool, grp, me) = (&ctx.sql, &ctx.pool, &ctx.group, &ctx.me);
        let ttl = self.cfg.lease.ttl;
        self.last_maintain = Some(Instant::now());
        q(&sql.lease.heartbeat)
            .bind(LEASE_QUEUE)
            .bind(grp)
            .bind(me)
            .execute(pool)
            .await
            .map_err(db)?;
        let held: Vec<i32> = self.owned.keys().map(|s| *s as i32).collect();
        let renewed: HashMap<u32, i64> = q(&sql.lease.renew)
            .bind(LEASE_QUEUE)
            .bind(grp)
            .bind(me)
            .bind(Self::ms(ttl))
            .bind(&held)
            .fetch_all(pool)
            .await
            .map_err(db)?
            .iter()
            .map(|r| (r.get::<i32, _>(0) as u32, r.get::<i64, _>(1)))
            .collect();
        let lost: Vec<u32> = self
            .owned
            .iter()
            .filter(|(slot, o)| renewed.get(slot) != Some(&o.generation))
            .map(|(slot, _)| *slot)
            .collect();
        for slot in lost {
            if let Some(o) = self.owned.remove(&slot) {
                tracing::warn!(slot, generation = o.generation, "outbox relay: slot lease lost");
                bump(&ctx.stats.slots_lost, "keyorder_outbox_slots_lost_total");
            }
        }
        let live: Vec<String> = q(&sql.lease.live_members)
            .bind(LEASE_QUEUE)
            .bind(grp)
            .bind(Self::ms(ttl))
            .fetch_all(pool)
            .await
            .map_err(db)?
            .iter()
            .map(|r| r.get::<String, _>(0))
            .collect();
        self.waiting = false;
        if live.is_empty() {
            return Ok(());
        }
        for slot in 0..self.slots.unwrap_or(0) {
            let mine = &live[slot as usize % live.len()] == me;
            if let Some(o) = self.owned.get_mut(&slot) {
                if !mine {
                    o.revoking = true;
                }
                continue;
            }
            if !mine {
                continue;
            }
            // A publish of an earlier generation of this slot still runs
            // here: wait for it, so one relay never runs a key twice.
            if self.running_by_slot.get(&slot).copied().unwrap_or(0) > 0 {
                self.waiting = true;
                continue;
            }
            let row = q(&sql.lease.acquire)
                .bind(LEASE_QUEUE)
                .bind(grp)
                .bind(slot as i32)
                .bind(me)
                .bind(Self::ms(ttl))
                .fetch_optional(pool)
                .await
                .map_err(db)?;
            match row {
                Some(r) => {
                    let generation: i64 = r.get(0);
                    tracing::debug!(slot, generation, "outbox relay: slot acquired");
                    self.owned.insert(
                        slot,
                        Owned {
                            generation,
                            pos: ("0".into(), 0),
                            keys: HashMap::new(),
                            held: 0,
                            revoking: false,
                        },
                    );
                    self.read_more = true;
                }
                None => self.waiting = true,
            }
        }
        Ok(())
    }

    /// Releases revoked slots whose publishes have all returned.
    async fn release_drained(&mut self) -> Result<()> {
        let ready: Vec<(u32, i64)> = self
            .owned
            .iter()
            .filter(|(slot, o)| o.revoking && self.running_by_slot.get(slot).copied().unwrap_or(0) == 0)
            .map(|(slot, o)| (*slot, o.generation))
            .collect();
        for (slot, generation) in ready {
            self.release(slot, generation).await?;
        }
        Ok(())
    }

    async fn release(&mut self, slot: u32, generation: i64) -> Result<()> {
        q(&self.ctx.sql.lease.release)
            .bind(LEASE_QUEUE)
            .bind(&self.ctx.group)
            .bind(slot as i32)
            .bind(&self.ctx.me)
            .bind(generation)
            .execute(&self.ctx.pool)
            .await
            .map_err(db)?;
        self.owned.remove(&slot);
        Ok(())
    }

    /// Releases every slot and leaves the group (after draining).
    async fn close(&mut self) -> Result<()> {
        let held: Vec<(u32, i64)> = self.owned.iter().map(|(s, o)| (*s, o.generation)).collect();
        for (slot, generation) in held {
            self.release(slot, generation).await?;
        }
        // `release_all` also frees a lease whose acquire committed after its
        // future was dropped at shutdown (not in `owned`); then leave.
        for sql in [&self.ctx.sql.lease.release_all, &self.ctx.sql.lease.leave] {
            q(sql)
                .bind(LEASE_QUEUE)
                .bind(&self.ctx.group)
                .bind(&self.ctx.me)
                .execute(&self.ctx.pool)
                .await
                .map_err(db)?;
        }
        Ok(())
    }

    /// Reads new pending records of every owned slot after its read
    /// position, commit-safe: a record whose transaction ends later is read
    /// later, never skipped.
    async fn read(&mut self) -> Result<()> {
        self.last_read = Some(Instant::now());
        self.read_more = false;
        let cap = self.cfg.held_per_slot.max(1);
        let wanted: Vec<(u32, i64, String, i64)> = self
            .owned
            .iter()
            .filter(|(_, o)| !o.revoking && o.held < cap)
            .map(|(s, o)| (*s, o.generation, o.pos.0.clone(), o.pos.1))
            .collect();
        if wanted.is_empty() {
            return Ok(());
        }
        let slots: Vec<i32> = wanted.iter().map(|w| w.0 as i32).collect();
        let gens: Vec<i64> = wanted.iter().map(|w| w.1).collect();
        let txids: Vec<String> = wanted.iter().map(|w| w.2.clone()).collect();
        let ids: Vec<i64> = wanted.iter().map(|w| w.3).collect();
        let rows = q(&self.ctx.sql.read)
            .bind(LEASE_QUEUE)
            .bind(&self.ctx.group)
            .bind(&slots)
            .bind(&gens)
            .bind(&txids)
            .bind(&ids)
            .bind(&self.ctx.me)
            .bind(self.cfg.batch.max(1) as i64)
            .fetch_all(&self.ctx.pool)
            .await
            .map_err(db)?;
        let mut per_slot: HashMap<u32, usize> = HashMap::new();
        for r in rows {
            let slot = r.get::<i32, _>(0) as u32;
            let rec = Record {
                id: r.get(1),
                message_id: r.get(3),
                category: r.get(4),
                key: from_stored_text(&r.get::<String, _>(5)).into_owned(),
                seq: r.get(6),
                correlation_id: r.get(7),
                headers: r.get(8),
                payload: r.get(9),
            };
            let txid: String = r.get(2);
            let Some(o) = self.owned.get_mut(&slot) else { continue };
            *per_slot.entry(slot).or_default() += 1;
            o.pos = (txid, rec.id);
            let kq = o.keys.entry((rec.category.clone(), rec.key.clone())).or_default();
            if let std::collections::btree_map::Entry::Vacant(v) = kq.records.entry(rec.seq) {
                v.insert(Arc::new(rec));
                o.held += 1;
            }
        }
        self.read_more = per_slot.values().any(|n| *n >= self.cfg.batch.max(1));
        Ok(())
    }

    /// Starts the head of every idle key whose back-off has passed, up to
    /// the concurrency limit (with [`RelayConfig::ignore_ordering`], every
    /// record of such a key that is not already being published).
    fn start(&mut self) {
        let now = Instant::now();
        let limit = self.cfg.concurrency.max(1);
        let unordered = self.cfg.ignore_ordering;
        for (slot, o) in self.owned.iter_mut() {
            if o.revoking {
                continue;
            }
            for (key, kq) in o.keys.iter_mut() {
                if self.running.len() >= limit {
                    return;
                }
                if kq.busy || kq.not_before.is_some_and(|t| t > now) {
                    continue;
                }
                kq.not_before = None;
                if unordered {
                    for (seq, rec) in &kq.records {
                        if self.running.len() >= limit {
                            return;
                        }
                        if !kq.in_flight.insert(*seq) {
                            continue;
                        }
                        launch(
                            (&mut self.running, &mut self.running_by_slot, &mut self.meta),
                            &self.ctx,
                            Meta {
                                slot: *slot,
                                generation: o.generation,
                                key: key.clone(),
                                seq: *seq,
                            },
                            rec.clone(),
                        );
                    }
                    continue;
                }
                let Some((seq, rec)) = kq.records.first_key_value() else {
                    continue;
                };
                kq.busy = true;
                launch(
                    (&mut self.running, &mut self.running_by_slot, &mut self.meta),
                    &self.ctx,
                    Meta {
                        slot: *slot,
                        generation: o.generation,
                        key: key.clone(),
                        seq: *seq,
                    },
                    rec.clone(),
                );
            }
        }
    }

    /// Applies a finished publish task's outcome.
    fn finish(&mut self, done: std::result::Result<(Id, Outcome), JoinError>) {
        let (id, outcome) = match done {
            Ok((id, outcome)) => (id, outcome),
            Err(e) => {
                tracing::error!(error = %e, "outbox relay: a publish task failed; retrying its key");
                (e.id(), Outcome::Retry(self.cfg.retry.max_backoff))
            }
        };
        let Some(meta) = self.meta.remove(&id) else { return };
        if let Some(n) = self.running_by_slot.get_mut(&meta.slot) {
            *n = n.saturating_sub(1);
        }
        let Some(o) = self.owned.get_mut(&meta.slot) else {
            return;
        };
        if o.generation != meta.generation {
            return;
        }
        let now = Instant::now();
        let Some(kq) = o.keys.get_mut(&meta.key) else { return };
        kq.busy = false;
        kq.in_flight.remove(&meta.seq);
        match outcome {
            Outcome::Resolved => {
                if kq.records.remove(&meta.seq).is_some() {
                    o.held = o.held.saturating_sub(1);
                }
                if kq.records.is_empty() && kq.in_flight.is_empty() {
                    o.keys.remove(&meta.key);
                }
            }
            Outcome::Blocked => kq.not_before = Some(now + self.cfg.poll),
            Outcome::Halted => kq.not_before = Some(now + self.cfg.lease.heartbeat),
            Outcome::Retry(d) => kq.not_before = Some(now + d),
            Outcome::Fenced => {
                tracing::warn!(slot = meta.slot, "outbox relay: fenced; dropping the slot");
                self.owned.remove(&meta.slot);
            }
        }
    }
}

/// Publishes one record: the fenced begin (attempt counted, earlier
/// records of the key resolved, key not halted), the publish awaited, then
/// the fenced mark. Every failure path is decided here.
/// Starts one record's publish task and books it under its slot.
fn launch(
    (running, by_slot, meta): (&mut JoinSet<Outcome>, &mut HashMap<u32, usize>, &mut HashMap<Id, Meta>),
    ctx: &Arc<Ctx>,
    m: Meta,
    rec: Arc<Record>,
) {
    let handle = running.spawn(publish_one(ctx.clone(), m.slot, m.generation, rec));
    *by_slot.entry(m.slot).or_default() += 1;
    meta.insert(handle.id(), m);
}

async fn publish_one(ctx: Arc<Ctx>, slot: u32, generation: i64, rec: Arc<Record>) -> Outcome {
    let key_label = label(&rec.key);
    let key = match OrderingKey::with_rules(&rec.key, ctx.client.key_rules()) {
        Ok(k) if category_ok(&rec.category) => k,
        Ok(_) => return abandon(&ctx, slot, generation, &rec, "invalid category name").await,
        Err(e) => return abandon(&ctx, slot, generation, &rec, &e.to_string()).await,
    };
    let begin_sql = if ctx.ignore_ordering {
        &ctx.sql.begin_unordered
    } else {
        &ctx.sql.begin
    };
    let begin = q(begin_sql)
        .bind(LEASE_QUEUE)
        .bind(&ctx.group)
        .bind(slot as i32)
        .bind(&ctx.me)
        .bind(generation)
        .bind(rec.id)
        .fetch_one(&ctx.pool)
        .await;
    let row = match begin {
        Ok(row) => row,
        Err(e) => return db_failed(&ctx, e),
    };
    let (owned, exists, earlier, halted): (i64, i64, i64, i64) = (row.get(0), row.get(1), row.get(2), row.get(3));
    let attempts: Option<i32> = row.get(4);
    let lease_ms: Option<i64> = row.get(5);
    if owned == 0 {
        bump(&ctx.stats.fenced, "keyorder_outbox_fenced_total");
        return Outcome::Fenced;
    }
    if exists == 0 {
        return Outcome::Resolved;
    }
    if halted > 0 {
        return Outcome::Halted;
    }
    let Some(attempts) = attempts.filter(|_| earlier == 0) else {
        bump(&ctx.stats.blocked, "keyorder_outbox_blocked_total");
        return Outcome::Blocked;
    };
    // Self-fence: start no publish with less than the margin of lease left.
    if lease_ms.is_none_or(|ms| ms < ctx.margin.as_millis() as i64) {
        return Outcome::Retry(Duration::from_millis(100));
    }
    let publisher = {
        let mut cache = ctx.publishers.lock().await;
        match cache.get(&rec.category) {
            Some(p) => Ok(p.clone()),
            None => match ctx.client.publisher(&rec.category).await {
                Ok(p) => {
                    cache.insert(rec.category.clone(), p.clone());
                    Ok(p)
                }
                Err(e) => Err(e),
            },
        }
    };
    let result = match publisher {
        Ok(p) => {
            p.publish_fenced(message_of(&rec, key), &ctx.fence(slot, generation))
                .await
        }
        Err(e) => Err(e),
    };
    match result {
        Ok(()) => match resolve(&ctx, slot, generation, &rec, "published", None).await {
            Ok(true) => {
                bump(&ctx.stats.published, "keyorder_outbox_published_total");
                Outcome::Resolved
            }
            Ok(false) => {
                tracing::warn!(key = %key_label, seq = rec.seq, "outbox relay: late confirmation refused by the fence");
                bump(&ctx.stats.fenced, "keyorder_outbox_fenced_total");
                Outcome::Fenced
            }
            // Published but not marked: it is published again later (the
            // consumer's SequenceGuard drops the repeat).
            Err(e) => db_failed(&ctx, e),
        },
        Err(Error::Key(e)) => abandon(&ctx, slot, generation, &rec, &e.to_string()).await,
        // The broker refused the publish: a later owner of the slot has
        // published (this relay lost the slot while it was stalled). Nothing
        // reached consumers; the new owner publishes the record.
        Err(Error::Fenced { .. }) => {
            tracing::warn!(key = %key_label, seq = rec.seq, "outbox relay: late publish refused by the broker's fence");
            bump(&ctx.stats.fenced, "keyorder_outbox_fenced_total");
            Outcome::Fenced
        }
        // The category refuses every publish (its scope layout changed while
        // in use, C23): no fault of this record. It waits, without being
        // parked or halted, until an operator fixes the category.
        Err(e @ Error::Config(_)) => {
            tracing::error!(key = %key_label, seq = rec.seq, error = %e, "outbox relay: the category refuses publishes; waiting");
            Outcome::Retry(ctx.retry.max_backoff)
        }
        Err(e) => {
            let attempts = attempts.max(1) as u32;
            let max = match ctx.poison {
                PoisonPolicy::Park { max_attempts } => max_attempts,
                PoisonPolicy::Halt => ctx.retry.max_attempts,
            }
            .max(1);
            if attempts < max {
                bump(&ctx.stats.retries, "keyorder_outbox_retries_total");
                tracing::warn!(key = %key_label, seq = rec.seq, attempts, error = %e, "outbox relay: publish failed; retrying");
                return Outcome::Retry(ctx.retry.backoff(attempts));
            }
            let reason = format!("publish failed {attempts} times: {e}");
            poison(&ctx, slot, generation, &rec, &reason).await
        }
    }
}

fn message_of(rec: &Record, key: OrderingKey) -> Message {
    let mut msg = Message::new(rec.payload.clone()).with_id(rec.message_id.clone());
    if let Ok(headers) = serde_json::from_str::<BTreeMap<String, String>>(&rec.headers) {
        for (k, v) in headers {
            msg = msg.with_header(k, from_stored_text(&v));
        }
    }
    if let Some(c) = &rec.correlation_id {
        msg = msg.with_correlation_id(from_stored_text(c));
    }
    msg.with_ordering_key(key).with_header(SEQ_HEADER, rec.seq.to_string())
}

fn db_failed(ctx: &Ctx, e: sqlx::Error) -> Outcome {
    tracing::warn!(error = %e, "outbox relay: database error; retrying the key");
    Outcome::Retry(ctx.retry.initial_backoff.max(Duration::from_millis(100)))
}

/// The fenced mark: `true` when this owner, at this generation, resolved the
/// record (or it was already resolved); `false` when fenced.
async fn resolve(
    ctx: &Ctx,
    slot: u32,
    generation: i64,
    rec: &Record,
    state: &str,
    reason: Option<&str>,
) -> std::result::Result<bool, sqlx::Error> {
    let row = q(&ctx.sql.resolve)
        .bind(LEASE_QUEUE)
        .bind(&ctx.group)
        .bind(slot as i32)
        .bind(&ctx.me)
        .bind(generation)
        .bind(rec.id)
        .bind(state)
        .bind(reason)
        .fetch_one(&ctx.pool)
        .await?;
    Ok(row.get::<i64, _>(0) > 0)
}

async fn abandon(ctx: &Ctx, slot: u32, generation: i64, rec: &Record, reason: &str) -> Outcome {
    let reason = format!("abandoned: {reason}");
    match resolve(ctx, slot, generation, rec, "abandoned", Some(&reason)).await {
        Ok(true) => {
            tracing::warn!(key = %label(&rec.key), id = rec.message_id.as_str(), reason = reason.as_str(), "outbox relay: record can never be published");
            bump(&ctx.stats.abandoned, "keyorder_outbox_abandoned_total");
            Outcome::Resolved
        }
        Ok(false) => {
            bump(&ctx.stats.fenced, "keyorder_outbox_fenced_total");
            Outcome::Fenced
        }
        Err(e) => db_failed(ctx, e),
    }
}

async fn poison(ctx: &Ctx, slot: u32, generation: i64, rec: &Record, reason: &str) -> Outcome {
    match ctx.poison {
        PoisonPolicy::Park { .. } => match resolve(ctx, slot, generation, rec, "parked", Some(reason)).await {
            Ok(true) => {
                tracing::warn!(key = %label(&rec.key), seq = rec.seq, reason, "outbox relay: poison record parked");
                bump(&ctx.stats.parked, "keyorder_outbox_parked_total");
                Outcome::Resolved
            }
            Ok(false) => {
                bump(&ctx.stats.fenced, "keyorder_outbox_fenced_total");
                Outcome::Fenced
            }
            Err(e) => db_failed(ctx, e),
        },
        PoisonPolicy::Halt => {
            let row = q(&ctx.sql.halt)
                .bind(LEASE_QUEUE)
                .bind(&ctx.group)
                .bind(slot as i32)
                .bind(&ctx.me)
                .bind(generation)
                .bind(rec.id)
                .bind(reason)
                .fetch_one(&ctx.pool)
                .await;
            match row.map(|r| r.get::<i64, _>(0)) {
                Ok(0) => {
                    bump(&ctx.stats.fenced, "keyorder_outbox_fenced_total");
                    Outcome::Fenced
                }
                Ok(_) => {
                    tracing::warn!(key = %label(&rec.key), seq = rec.seq, reason, "outbox relay: key halted on a poison record");
                    bump(&ctx.stats.halted, "keyorder_outbox_halted_total");
                    Outcome::Halted
                }
                Err(e) => db_failed(ctx, e),
            }
        }
    }
}
