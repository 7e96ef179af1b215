//! Self-fencing: the consumer's own view of the scopes it owns.
//!
//! Every scope an instance owns has a [`ScopeLease`]: its generation (the
//! fencing token on every delivery), and the instant of the last
//! broker-confirmed ownership. The dispatcher starts no handler for a scope
//! whose last confirmation is older than the lease TTL minus a safety margin,
//! until a fenced round trip succeeds again, and discards buffered deliveries
//! of a scope marked lost.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::rt::{AtomicBool, AtomicU64, Notify};

/// Process-wide, so a plain std atomic even under shuttle (a static outlives
/// shuttle's runs; only its monotonic growth matters).
static LOST_EPOCH: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// A process-wide counter of leases marked lost: a dispatcher sweeps its
/// waiting jobs for lost leases only when it moved.
pub fn lost_epoch() -> u64 {
    LOST_EPOCH.load(Ordering::SeqCst)
}

/// Lease timing shared by an adapter and the self-fence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseConfig {
    /// How long the broker keeps a lease without renewal.
    pub ttl: Duration,
    /// How often the owner renews.
    pub heartbeat: Duration,
    /// The self-fence pauses work once ownership is older than `ttl - margin`.
    pub margin: Duration,
}

impl Default for LeaseConfig {
    fn default() -> Self {
        LeaseConfig {
            ttl: Duration::from_secs(10),
            heartbeat: Duration::from_secs(2),
            margin: Duration::from_secs(3),
        }
    }
}

impl LeaseConfig {
    /// The age past which the self-fence pauses a scope.
    pub fn fresh_for(&self) -> Duration {
        self.ttl.saturating_sub(self.margin)
    }
}

/// What the self-fence says about a scope right now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseState {
    /// Confirmed within `ttl - margin`: work may start.
    Fresh,
    /// Not confirmed recently: start nothing until a fenced round trip succeeds.
    Stale,
    /// Lost to another owner (or released): discard buffered work.
    Lost,
}

/// The consumer-side record of one owned scope.
#[derive(Debug)]
pub struct ScopeLease {
    scope: Arc<str>,
    generation: u64,
    fresh_for: Duration,
    /// The instant every confirmation is measured from.
    base: Instant,
    /// Nanoseconds after `base` of the last confirmation (lock-free: read
    /// before every handler start).
    confirmed_ns: AtomicU64,
    lost: AtomicBool,
    changed: Notify,
}

impl ScopeLease {
    /// A lease confirmed at `confirmed_at` (the instant the confirming
    /// round trip was *sent*, which errs on the safe side).
    pub fn new(scope: impl Into<Arc<str>>, generation: u64, config: &LeaseConfig, confirmed_at: Instant) -> Arc<Self> {
        // `base` precedes every instant this lease will see, so offsets are
        // never negative (a confirmation older than `base` counts as `base`).
        let base = confirmed_at;
        Arc::new(ScopeLease {
            scope: scope.into(),
            generation,
            fresh_for: config.fresh_for(),
            base,
            confirmed_ns: AtomicU64::new(0),
            lost: AtomicBool::new(false),
            changed: Notify::new(),
        })
    }

    /// The scope's name.
    pub fn scope(&self) -> &Arc<str> {
        &self.scope
    }

    /// The owner's generation: the fencing token.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Records a fenced round trip that succeeded; `sent_at` is when it was sent.
    pub fn confirm(&self, sent_at: Instant) {
        let ns = sent_at.saturating_duration_since(self.base).as_nanos() as u64;
        self.confirmed_ns.fetch_max(ns, Ordering::SeqCst);
        self.changed.notify_waiters();
    }

    /// Marks the scope lost: nothing more starts under this lease.
    pub fn lose(&self) {
        if !self.lost.swap(true, Ordering::SeqCst) {
            LOST_EPOCH.fetch_add(1, Ordering::SeqCst);
        }
        self.changed.notify_waiters();
    }

    /// Whether the scope was marked lost.
    pub fn is_lost(&self) -> bool {
        self.lost.load(Ordering::SeqCst)
    }

    /// The self-fence's verdict now.
    pub fn state(&self) -> LeaseState {
        if self.is_lost() {
            return LeaseState::Lost;
        }
        let confirmed = self.base + Duration::from_nanos(self.confirmed_ns.load(Ordering::SeqCst));
        if confirmed.elapsed() <= self.fresh_for {
            LeaseState::Fresh
        } else {
            LeaseState::Stale
        }
    }

    /// Waits until the lease is fresh (`true`) or lost (`false`). Returns at
    /// once in the common case; `paused` is called once if it had to wait.
    pub async fn usable(&self, mut paused: impl FnMut()) -> bool {
        let mut counted = false;
        loop {
            let notified = self.changed.notified();
            match self.state() {
                LeaseState::Fresh => return true,
                LeaseState::Lost => return false,
                LeaseState::Stale => {
                    if !counted {
                        counted = true;
                        paused();
                    }
                    // Re-check at least every 100 ms: the adapter may confirm
                    // without anybody waiting yet.
                    let _ = crate::rt::timeout(Duration::from_millis(100), notified).await;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_stale_lease_pauses_until_confirmed_and_a_lost_one_refuses() {
        let cfg = LeaseConfig {
            ttl: Duration::from_secs(10),
            heartbeat: Duration::from_secs(2),
            margin: Duration::from_secs(3),
        };
        let lease = ScopeLease::new("p0", 4, &cfg, Instant::now());
        assert_eq!(lease.state(), LeaseState::Fresh);
        tokio::time::advance(Duration::from_secs(8)).await;
        assert_eq!(lease.state(), LeaseState::Stale);
        let waiter = {
            let lease = lease.clone();
            tokio::spawn(async move {
                let mut pauses = 0;
                let ok = lease.usable(|| pauses += 1).await;
                (ok, pauses)
            })
        };
        tokio::task::yield_now().await;
        lease.confirm(Instant::now());
        assert_eq!(waiter.await.unwrap(), (true, 1));
        lease.lose();
        assert!(!lease.usable(|| {}).await);
    }
}
