//! Health for orchestrators: whether a subscription's loop is turning
//! (live), whether it is connected and consuming (ready), and whether part
//! of its work is stuck (degraded: a halted key, or the whole subscription
//! backing off because failures span many keys).
//!
//! A halted key makes a subscription degraded, never dead: restarting the
//! process would not resolve the halt (the next owner halts at the same
//! head), while it would interrupt every healthy key. A liveness probe
//! reads [`HealthReport::live`], a readiness probe [`HealthReport::ready`];
//! both stay `true` while degraded, and the reasons say what to do.
//!
//! ```
//! # async fn demo() -> keyorder_core::Result<()> {
//! use keyorder_core::{Client, KeySource};
//! let client = Client::memory();
//! let subscription = client
//!     .subscribe("orders", "billing")
//!     .ordered_by(KeySource::routing_key())
//!     .build()
//!     .await?;
//! let health = subscription.health();
//! let report = health.check();
//! assert!(report.live && !report.ready, "built, not yet running: {:?}", report.reasons);
//! # drop(subscription); Ok(()) }
//! ```

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use crate::stats::Stats;

/// Where the subscription's loop is.
const BUILT: u8 = 0;
const RUNNING: u8 = 1;
const STOPPING: u8 = 2;
const STOPPED: u8 = 3;

/// A subscription's health, shared with whatever reports it (a probe
/// endpoint, a log line); cheap to clone and to [`check`](Self::check).
/// Take it with [`crate::Subscription::health`] before `run` consumes the
/// subscription.
#[derive(Clone)]
pub struct Health {
    inner: Arc<Inner>,
}

struct Inner {
    epoch: Instant,
    /// Milliseconds from `epoch` to the end of the last turn of the loop.
    turned: AtomicU64,
    phase: AtomicU8,
    /// Whether the dispatcher was backing off as a whole at the last turn.
    backing_off: AtomicBool,
    /// Whether the last turn reached the broker: `None` before the first
    /// turn ended, `Some(None)` connected, `Some(Some(error))` while the
    /// loop retries a transport error (one lock: never read half-updated).
    link: Mutex<Option<Option<String>>>,
    /// A loop that has not turned for this long is not live.
    stall: Duration,
    stats: Arc<Stats>,
}

impl fmt::Debug for Health {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Health").field("report", &self.check()).finish()
    }
}

/// What [`Health::check`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthReport {
    /// The loop is turning: it finished a turn within the stall window (or
    /// has not started yet). `false` once stopped, or when a turn has been
    /// stuck past the window: restart the process.
    pub live: bool,
    /// Running and connected: the last turn reached the broker. `false`
    /// before `run`, while a transport error is being retried, and from
    /// shutdown on.
    pub ready: bool,
    /// Part of the work is stuck while the rest flows: keys halted at a
    /// poison head, or failures spanning many keys (the whole subscription
    /// backs off). Live and ready stay as they are.
    pub degraded: bool,
    /// Keys halted here right now.
    pub halted_keys: u64,
    /// Time since the loop last finished a turn (`None` before `run`).
    pub since_turn: Option<Duration>,
    /// Why it is not live, not ready or degraded, each with what to do;
    /// empty when healthy.
    pub reasons: Vec<String>,
}

impl HealthReport {
    /// One word for the report: `healthy`, `degraded`, `not ready` or `dead`.
    pub fn status(&self) -> &'static str {
        match (self.live, self.ready, self.degraded) {
            (false, _, _) => "dead",
            (true, false, _) => "not ready",
            (true, true, true) => "degraded",
            (true, true, false) => "healthy",
        }
    }
}

impl Health {
    /// Health of a subscription not yet running; `stall` is how long a turn
    /// may take before the loop counts as stuck.
    pub(crate) fn new(stats: Arc<Stats>, stall: Duration) -> Health {
        Health {
            inner: Arc::new(Inner {
                epoch: Instant::now(),
                turned: AtomicU64::new(0),
                phase: AtomicU8::new(BUILT),
                backing_off: AtomicBool::new(false),
                link: Mutex::new(None),
                stall,
                stats,
            }),
        }
    }

    /// How long a turn may take before the loop counts as stuck.
    pub fn stall_window(&self) -> Duration {
        self.inner.stall
    }

    fn now_ms(&self) -> u64 {
        self.inner.epoch.elapsed().as_millis() as u64
    }

    /// The loop started.
    pub(crate) fn running(&self) {
        self.inner.turned.store(self.now_ms(), Ordering::Relaxed);
        self.inner.phase.store(RUNNING, Ordering::Relaxed);
    }

    /// A turn ended: `error` is the transport error it ended with, if any.
    pub(crate) fn turned(&self, error: Option<String>, backing_off: bool) {
        self.inner.backing_off.store(backing_off, Ordering::Relaxed);
        *self.inner.link.lock().unwrap_or_else(|e| e.into_inner()) = Some(error);
        self.inner.turned.store(self.now_ms(), Ordering::Relaxed);
    }

    /// Shutdown began (draining).
    pub(crate) fn stopping(&self) {
        self.inner.phase.store(STOPPING, Ordering::Relaxed);
    }

    /// The run ended.
    pub(crate) fn stopped(&self) {
        self.inner.phase.store(STOPPED, Ordering::Relaxed);
    }

    /// Reads the subscription's health now.
    pub fn check(&self) -> HealthReport {
        let inner = &self.inner;
        let phase = inner.phase.load(Ordering::Relaxed);
        let halted = inner.stats.halted_now.load(Ordering::Relaxed);
        let backing_off = inner.backing_off.load(Ordering::Relaxed);
        let mut reasons = Vec::new();
        let since = (phase != BUILT)
            .then(|| Duration::from_millis(self.now_ms().saturating_sub(inner.turned.load(Ordering::Relaxed))));
        let (live, ready) = match phase {
            BUILT => {
                reasons.push("not running yet: call Subscription::run".to_owned());
                (true, false)
            }
            RUNNING => {
                let stuck = since.is_some_and(|s| s > inner.stall);
                if stuck {
                    reasons.push(format!(
                        "the loop has not turned for {} ms (stall window {} ms): a broker call or the handler's \
                         shutdown is stuck; restart the process",
                        since.unwrap_or_default().as_millis(),
                        inner.stall.as_millis()
                    ));
                }
                let link = inner.link.lock().unwrap_or_else(|e| e.into_inner()).clone();
                let connected = matches!(link, Some(None));
                match link {
                    Some(None) => {}
                    Some(Some(e)) => reasons.push(format!("transport error, retrying: {e}")),
                    None => reasons.push("connecting: the first turn has not finished".to_owned()),
                }
                (!stuck, connected && !stuck)
            }
            STOPPING => {
                reasons.push("shutting down: draining in-flight work".to_owned());
                (true, false)
            }
            _ => {
                reasons.push("stopped: the run has ended".to_owned());
                (false, false)
            }
        };
        if halted > 0 {
            reasons.push(format!(
                "{halted} key(s) halted at a poison head: see them with `keyorder head show` and resolve each \
                 with `keyorder head skip|dlq|resume`"
            ));
        }
        if backing_off {
            reasons.push(
                "failures span many keys: the whole subscription is backing off (a shared dependency is likely down)"
                    .to_owned(),
            );
        }
        HealthReport {
            live,
            ready,
            degraded: live && (halted > 0 || backing_off),
            halted_keys: halted,
            since_turn: since,
            reasons,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_stuck_loop_is_not_live() {
        let health = Health::new(Arc::new(Stats::default()), Duration::ZERO);
        assert!(health.check().live, "built: live");
        health.running();
        health.turned(None, false);
        tokio::time::advance(Duration::from_millis(5)).await;
        let report = health.check();
        assert!(!report.live && !report.ready, "{report:?}");
        assert!(report.reasons[0].contains("not turned"), "{report:?}");
    }

    #[test]
    fn a_halt_degrades_without_killing() {
        let stats = Arc::new(Stats::default());
        let health = Health::new(stats.clone(), Duration::from_secs(60));
        health.running();
        health.turned(None, false);
        assert_eq!(health.check().status(), "healthy");
        stats.halted_now.store(2, Ordering::Relaxed);
        let report = health.check();
        assert_eq!(
            (report.live, report.ready, report.degraded),
            (true, true, true),
            "{report:?}"
        );
        assert_eq!(report.status(), "degraded");
        // The fix it names is a command the CLI has (`keyorder head ...`;
        // there is no `keyorder halted` nor `keyorder resolve`).
        let halt = report
            .reasons
            .iter()
            .find(|r| r.contains("halted"))
            .expect("a halt reason");
        assert!(
            halt.contains("keyorder head show") && halt.contains("keyorder head skip|dlq|resume"),
            "{halt}"
        );
        health.turned(Some("connection refused".into()), false);
        let report = health.check();
        assert_eq!(report.status(), "not ready", "{report:?}");
        assert!(
            report.reasons.iter().any(|r| r.contains("connection refused")),
            "{report:?}"
        );
        health.stopped();
        assert_eq!(health.check().status(), "dead");
    }
}
