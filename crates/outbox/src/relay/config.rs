//! How a relay runs (`RelayConfig`) and what it counts (`RelayStats`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use keyorder_core::{LeaseConfig, PoisonPolicy, RetryPolicy};

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
    pub(super) published: AtomicU64,
    pub(super) abandoned: AtomicU64,
    pub(super) parked: AtomicU64,
    pub(super) halted: AtomicU64,
    pub(super) retries: AtomicU64,
    pub(super) fenced: AtomicU64,
    pub(super) blocked: AtomicU64,
    pub(super) slots_lost: AtomicU64,
    pub(super) retention_deleted: AtomicU64,
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

pub(super) fn bump(counter: &AtomicU64, name: &'static str) {
    counter.fetch_add(1, Ordering::Relaxed);
    metrics::counter!(name).increment(1);
}
