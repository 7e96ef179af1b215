//! Counters of what a subscription actually did, mirrored to the `metrics`
//! facade (names `keyorder_*`).

use std::sync::atomic::{AtomicU64, Ordering};

macro_rules! stats {
    ($($(#[$doc:meta])* $name:ident),* $(,)?) => {
        /// Live counters of one subscription (atomics; cheap to read).
        #[derive(Debug, Default)]
        pub struct Stats {
            $($(#[$doc])* pub $name: AtomicU64,)*
        }

        /// A copy of [`Stats`] at one instant.
        #[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
        pub struct StatsSnapshot {
            $($(#[$doc])* pub $name: u64,)*
        }

        impl Stats {
            /// Reads every counter.
            pub fn snapshot(&self) -> StatsSnapshot {
                StatsSnapshot { $($name: self.$name.load(Ordering::Relaxed),)* }
            }
        }
    };
}

stats! {
    /// Deliveries handed to the dispatcher.
    received,
    /// Deliveries applied (handler `Ok` and acknowledged).
    applied,
    /// Handler attempts that failed and were retried.
    retries,
    /// Handler panics (counted as poison errors).
    panics,
    /// Heads dead-lettered by the `Park` policy or the keyless/mismatch rejection.
    parked,
    /// Keys halted at a poison head (a counter; see `halted_now` for the gauge).
    halts,
    /// Keys halted right now.
    halted_now,
    /// Broker operations rejected by the fence (stale owner).
    fence_rejections,
    /// Deliveries whose handler's own store refused the fencing token
    /// (`HandlerError::Fenced`): not acknowledged, scope given up.
    handler_fenced,
    /// Times the self-fence paused a scope whose ownership was not confirmed recently.
    self_fence_pauses,
    /// Buffered deliveries discarded because their scope was lost.
    self_fence_discards,
    /// Deliveries whose selected key differed from the routing key (rejected).
    key_mismatches,
    /// Keyless deliveries processed in parallel.
    keyless,
    /// Keyless deliveries rejected by policy.
    keyless_rejected,
    /// Times back-pressure widened from a key to its scope (key depth or budget full).
    widened,
    /// Times the whole subscription backed off because failures spanned many keys.
    global_backoffs,
    /// Scopes handed over to another instance.
    scopes_released,
    /// Messages of a halted key handed back to a transport that holds them
    /// until the halt is resolved (PostgreSQL), instead of waiting in memory.
    handed_back,
    /// Redelivered, unsettled messages run alone (a crash they cause is
    /// charged to them only).
    isolated,
}

pub(crate) fn bump(counter: &AtomicU64, metric: &'static str) {
    counter.fetch_add(1, Ordering::Relaxed);
    metrics::counter!(metric).increment(1);
}
