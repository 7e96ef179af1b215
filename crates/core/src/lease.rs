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

use crate::error::{Error, Result};
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
    /// The shortest TTL [`LeaseConfig::from_ttl`] derives a usable lease
    /// from, and the shortest [`SubscriptionBuilder::build`] accepts: below
    /// it one slow broker round trip outlives the lease.
    ///
    /// [`SubscriptionBuilder::build`]: crate::SubscriptionBuilder::build
    pub const MIN_TTL: Duration = Duration::from_secs(1);

    /// The longest heartbeat [`LeaseConfig::from_ttl`] derives: a long TTL
    /// still renews at least this often.
    pub const MAX_DERIVED_HEARTBEAT: Duration = Duration::from_secs(5);

    /// A lease of `ttl`, with the heartbeat and margin derived from it:
    /// the heartbeat is a fifth of the TTL (at most
    /// [`MAX_DERIVED_HEARTBEAT`](Self::MAX_DERIVED_HEARTBEAT)) and the
    /// self-fence margin three tenths, so the owner renews at least three
    /// times before its self-fence pauses work. `from_ttl(10 s)` is the
    /// [`Default`] (10 s, 2 s, 3 s).
    ///
    /// [`check`](Self::check) (and so the subscription's `build`) refuses a
    /// TTL below [`MIN_TTL`](Self::MIN_TTL); every TTL from it up is
    /// accepted.
    ///
    /// ```
    /// use std::time::Duration;
    /// use keyorder_core::LeaseConfig;
    /// let lease = LeaseConfig::from_ttl(Duration::from_secs(30));
    /// assert_eq!(lease.heartbeat, Duration::from_secs(5));
    /// assert_eq!(lease.margin, Duration::from_secs(9));
    /// assert!(lease.check().is_ok());
    /// assert!(LeaseConfig::from_ttl(Duration::from_millis(200)).check().is_err());
    /// ```
    pub fn from_ttl(ttl: Duration) -> LeaseConfig {
        LeaseConfig {
            ttl,
            heartbeat: (ttl / 5).min(Self::MAX_DERIVED_HEARTBEAT),
            margin: ttl * 3 / 10,
        }
    }

    /// The age past which the self-fence pauses a scope.
    pub fn fresh_for(&self) -> Duration {
        self.ttl.saturating_sub(self.margin)
    }

    /// Checks the timing: a TTL of at least [`MIN_TTL`](Self::MIN_TTL), a
    /// heartbeat above zero and shorter than `ttl - margin` (the owner must
    /// renew before its own self-fence pauses work).
    ///
    /// # Errors
    /// [`Error::Config`] naming the fix.
    pub fn check(&self) -> Result<()> {
        self.problem().map_or(Ok(()), |p| {
            Err(Error::Config(format!(
                "lease: {p}; LeaseConfig::from_ttl(ttl) derives a heartbeat and margin that fit any TTL of at \
                 least {} ms",
                Self::MIN_TTL.as_millis()
            )))
        })
    }

    fn problem(&self) -> Option<String> {
        let ms = |d: Duration| d.as_millis();
        if self.ttl < Self::MIN_TTL {
            Some(format!(
                "ttl {} ms is below the minimum of {} ms: use a TTL of at least {} ms",
                ms(self.ttl),
                ms(Self::MIN_TTL),
                ms(Self::MIN_TTL)
            ))
        } else if self.heartbeat.is_zero() || self.heartbeat >= self.fresh_for() {
            Some(format!(
                "heartbeat {} ms must be above zero and shorter than ttl - margin ({} ms - {} ms = {} ms): shorten \
                 the heartbeat or the margin (e.g. ttl 10000 ms, heartbeat 2000 ms, margin 3000 ms)",
                ms(self.heartbeat),
                ms(self.ttl),
                ms(self.margin),
                ms(self.fresh_for())
            ))
        } else {
            None
        }
    }
}

/// The lease's URL options, the same on every adapter: the names an
/// adapter lists among its known options.
pub const LEASE_URL_OPTIONS: &str = "lease_ttl_ms, lease_heartbeat_ms, lease_margin_ms";

/// The largest `lease_ttl_ms` a URL takes (one day).
const MAX_URL_TTL_MS: u64 = 86_400_000;

/// The lease a transport's URL states, parsed the same way by every
/// adapter: `lease_ttl_ms` (1000 to 86400000), and optionally
/// `lease_heartbeat_ms` and `lease_margin_ms`; what is not given is derived
/// from the TTL as [`LeaseConfig::from_ttl`] does (the TTL defaults to
/// 10000 ms when only the others are given). The result is the
/// subscriptions' default lease ([`crate::Transport::default_lease`]); a
/// lease set on the builder wins.
///
/// ```
/// use std::time::Duration;
/// use keyorder_core::lease::LeaseOptions;
/// let url = url::Url::parse("redis://127.0.0.1:6379/?lease_ttl_ms=4000").unwrap();
/// let mut opts = LeaseOptions::default();
/// for (k, v) in url.query_pairs() {
///     assert!(opts.accept("redis", &k, &v).unwrap());
/// }
/// let lease = opts.lease("redis").unwrap().unwrap();
/// assert_eq!(lease.ttl, Duration::from_secs(4));
/// assert_eq!(lease.heartbeat, Duration::from_millis(800));
/// assert_eq!(lease.margin, Duration::from_millis(1200));
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LeaseOptions {
    ttl: Option<Duration>,
    heartbeat: Option<Duration>,
    margin: Option<Duration>,
}

impl LeaseOptions {
    /// Takes the URL option `key=value` when it is a lease option
    /// (`Ok(true)`); `Ok(false)` for any other option. `adapter` prefixes
    /// the error (`redis`, `amqp`, ...).
    ///
    /// # Errors
    /// [`Error::Url`] for a bad value, naming the option and what it takes.
    pub fn accept(&mut self, adapter: &str, key: &str, value: &str) -> Result<bool> {
        let (slot, range) = match key {
            "lease_ttl_ms" => (&mut self.ttl, Self::MIN_TTL_MS..=MAX_URL_TTL_MS),
            "lease_heartbeat_ms" => (&mut self.heartbeat, 1..=MAX_URL_TTL_MS),
            "lease_margin_ms" => (&mut self.margin, 0..=MAX_URL_TTL_MS),
            _ => return Ok(false),
        };
        let ms = value.parse::<u64>().ok().filter(|n| range.contains(n)).ok_or_else(|| {
            Error::Url(format!(
                "{adapter}: {key}={}: expected a whole number of milliseconds in {}..={}",
                crate::redact::text(value),
                range.start(),
                range.end()
            ))
        })?;
        *slot = Some(Duration::from_millis(ms));
        Ok(true)
    }

    const MIN_TTL_MS: u64 = LeaseConfig::MIN_TTL.as_millis() as u64;

    /// The lease the options state, `None` when the URL names none.
    ///
    /// # Errors
    /// [`Error::Url`] when the heartbeat or margin given does not fit the
    /// TTL, naming the options to change.
    pub fn lease(&self, adapter: &str) -> Result<Option<LeaseConfig>> {
        if *self == LeaseOptions::default() {
            return Ok(None);
        }
        let base = LeaseConfig::from_ttl(self.ttl.unwrap_or(LeaseConfig::default().ttl));
        let lease = LeaseConfig {
            ttl: base.ttl,
            heartbeat: self.heartbeat.unwrap_or(base.heartbeat),
            margin: self.margin.unwrap_or(base.margin),
        };
        match lease.problem() {
            None => Ok(Some(lease)),
            Some(p) => Err(Error::Url(format!(
                "{adapter}: lease options: {p}; or give lease_ttl_ms alone (the heartbeat and margin are then \
                 derived from it)"
            ))),
        }
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

/// Counter: fenced round trips that confirmed a held lease.
const RENEWALS: &str = "keyorder_lease_renewals_total";
/// Counter: leases lost to the broker (not released by choice).
const LOSSES: &str = "keyorder_lease_losses_total";

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
        // Both series exist from the first lease on, at 0 until counted.
        metrics::counter!(RENEWALS).increment(0);
        metrics::counter!(LOSSES).increment(0);
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

    /// Records a fenced round trip that succeeded; `sent_at` is when it was
    /// sent. Counted in `keyorder_lease_renewals_total`.
    pub fn confirm(&self, sent_at: Instant) {
        let ns = sent_at.saturating_duration_since(self.base).as_nanos() as u64;
        self.confirmed_ns.fetch_max(ns, Ordering::SeqCst);
        metrics::counter!(RENEWALS).increment(1);
        self.changed.notify_waiters();
    }

    /// Marks the scope ended here by this instance's own choice (a
    /// hand-over it was asked for, a release, a close): nothing more starts
    /// under this lease. Not a loss: see [`ScopeLease::lose_to_broker`].
    pub fn lose(&self) {
        self.end(false);
    }

    /// Marks the scope lost because the broker no longer confirms this
    /// owner: a renewal refused or unanswered past the lease, a newer
    /// owner's generation seen, the group removed, a fenced settlement
    /// refused. Nothing more starts under this lease; the first call counts
    /// one in `keyorder_lease_losses_total`.
    pub fn lose_to_broker(&self) {
        self.end(true);
    }

    fn end(&self, lost_to_broker: bool) {
        if !self.lost.swap(true, Ordering::SeqCst) {
            LOST_EPOCH.fetch_add(1, Ordering::SeqCst);
            if lost_to_broker {
                metrics::counter!(LOSSES).increment(1);
            }
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

    fn opts(query: &str) -> Result<Option<LeaseConfig>> {
        let url = url::Url::parse(&format!("memory://?{query}")).unwrap();
        let mut o = LeaseOptions::default();
        for (k, v) in url.query_pairs() {
            assert!(o.accept("memory", &k, &v)?, "{k} not taken");
        }
        o.lease("memory")
    }

    #[test]
    fn from_ttl_gives_the_default_at_ten_seconds_and_fits_every_allowed_ttl() {
        assert_eq!(LeaseConfig::from_ttl(Duration::from_secs(10)), LeaseConfig::default());
        let hour = LeaseConfig::from_ttl(Duration::from_secs(3600));
        assert_eq!(hour.heartbeat, LeaseConfig::MAX_DERIVED_HEARTBEAT);
        assert_eq!(hour.margin, Duration::from_secs(1080));
        for ms in (1000..=2000).chain([2999, 3001, 9_999, 60_000, 86_400_000, 86_400_001]) {
            let l = LeaseConfig::from_ttl(Duration::from_millis(ms));
            assert!(l.check().is_ok(), "{l:?}");
            assert!(
                l.heartbeat * 3 <= l.fresh_for(),
                "renews three times before the fence: {l:?}"
            );
        }
        for ms in [0, 1, 10, 999] {
            let err = LeaseConfig::from_ttl(Duration::from_millis(ms))
                .check()
                .unwrap_err()
                .to_string();
            assert!(err.contains("below the minimum of 1000 ms"), "{err}");
        }
    }

    #[test]
    fn check_names_the_fix_for_a_heartbeat_that_does_not_fit() {
        let bad = LeaseConfig {
            ttl: Duration::from_secs(5),
            heartbeat: Duration::from_secs(3),
            margin: Duration::from_secs(2),
        };
        let err = bad.check().unwrap_err().to_string();
        assert!(
            err.contains("heartbeat 3000 ms") && err.contains("= 3000 ms") && err.contains("from_ttl"),
            "{err}"
        );
        let zero = LeaseConfig {
            heartbeat: Duration::ZERO,
            ..LeaseConfig::default()
        };
        assert!(zero.check().is_err());
        assert!(LeaseConfig::default().check().is_ok());
    }

    #[test]
    fn url_options_derive_what_is_missing_and_refuse_bad_values() {
        assert_eq!(opts("").unwrap(), None);
        assert_eq!(
            opts("lease_ttl_ms=4000").unwrap(),
            Some(LeaseConfig::from_ttl(Duration::from_secs(4)))
        );
        assert_eq!(
            opts("lease_ttl_ms=4000&lease_heartbeat_ms=500&lease_margin_ms=1500").unwrap(),
            Some(LeaseConfig {
                ttl: Duration::from_secs(4),
                heartbeat: Duration::from_millis(500),
                margin: Duration::from_millis(1500),
            })
        );
        // Only the heartbeat: the default TTL's margin.
        assert_eq!(
            opts("lease_heartbeat_ms=1000").unwrap(),
            Some(LeaseConfig {
                heartbeat: Duration::from_secs(1),
                ..LeaseConfig::default()
            })
        );
        for (query, want) in [
            (
                "lease_ttl_ms=999",
                "lease_ttl_ms=999: expected a whole number of milliseconds in 1000..=86400000",
            ),
            ("lease_ttl_ms=ten", "lease_ttl_ms=ten: expected"),
            ("lease_ttl_ms=-5", "lease_ttl_ms=-5: expected"),
            ("lease_heartbeat_ms=0", "lease_heartbeat_ms=0: expected"),
            ("lease_margin_ms=1.5", "lease_margin_ms=1.5: expected"),
            ("lease_ttl_ms=3000&lease_heartbeat_ms=2500", "heartbeat 2500 ms must be"),
            (
                "lease_ttl_ms=3000&lease_margin_ms=3000",
                "ttl - margin (3000 ms - 3000 ms = 0 ms)",
            ),
        ] {
            let err = opts(query).unwrap_err().to_string();
            assert!(err.starts_with("url: memory: ") && err.contains(want), "{query}: {err}");
        }
        let mut o = LeaseOptions::default();
        assert!(!o.accept("memory", "partitions", "4").unwrap());
    }

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
