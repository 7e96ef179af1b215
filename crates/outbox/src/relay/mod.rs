//! The relay: publishes outbox records per key in sequence order, holding
//! fenced slot leases so several relays share the work and never publish one
//! key at the same time.
//!
//! Rooms: `config` (how it runs, what it counts), `state` (what it holds),
//! `publish` (one record's fenced publish); this file is the relay's loop.

mod config;
mod publish;
mod state;

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use keyorder_core::key::from_stored_text;
use keyorder_core::raw::assign;
use keyorder_core::{Client, Error, Result};
use sqlx::Row;
use tokio::sync::Mutex as AsyncMutex;
use tokio::task::{Id, JoinError, JoinSet};
use tokio::time::Instant;

use crate::sql::LEASE_QUEUE;
use crate::{db, q, Outbox};

use config::*;
pub use config::{RelayConfig, RelayStats, RelayStatsSnapshot};
use publish::*;
use state::*;

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
        let slots = self.slots.unwrap_or(0);
        let names: Vec<String> = (0..slots).map(|s| s.to_string()).collect();
        let owners = assign(&live, &names);
        for slot in 0..slots {
            let mine = owners.get(names[slot as usize].as_str()) == Some(&me.as_str());
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
