//! Strategy selection, poison and retry policies, decided at start-up from
//! configuration alone.

use std::time::Duration;

use crate::capability::Capabilities;
use crate::error::{Error, Result};

/// How an ordered subscription keeps per-key order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Strategy {
    /// The transport-native path when the transport, with its declared
    /// affinity or topology, pins keys across instances; otherwise start-up
    /// fails. Never picks [`Strategy::LocalPartitioned`].
    #[default]
    Auto,
    /// Order within this one process only. Only ever chosen explicitly.
    LocalPartitioned,
    /// Require the transport's cross-instance affinity.
    TransportNative,
}

/// What a [`Strategy`] resolved to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resolved {
    /// Ordered across every instance by the transport's affinity.
    TransportNative,
    /// Ordered within this process only.
    LocalPartitioned,
}

impl Strategy {
    /// The one resolver: decides from the transport's declared capabilities,
    /// with no broker round trip. `fix` says how this transport gets
    /// cross-instance affinity (for example "declare `?topology=hash&queues=8`").
    ///
    /// ```
    /// use keyorder_core::{Capabilities, Resolved, Strategy};
    /// let none = Capabilities::default();
    /// let err = Strategy::Auto.resolve("rabbitmq", &none, "add ?topology=hash").unwrap_err();
    /// assert!(err.to_string().contains("LocalPartitioned"));
    /// assert_eq!(Strategy::LocalPartitioned.resolve("rabbitmq", &none, "").unwrap(), Resolved::LocalPartitioned);
    /// ```
    pub fn resolve(self, transport: &str, caps: &Capabilities, fix: &str) -> Result<Resolved> {
        match self {
            Strategy::LocalPartitioned => Ok(Resolved::LocalPartitioned),
            Strategy::Auto | Strategy::TransportNative if caps.cross_instance_affinity => Ok(Resolved::TransportNative),
            Strategy::Auto | Strategy::TransportNative => Err(Error::Unsupported {
                transport: transport.to_owned(),
                capability: "cross_instance_affinity",
                fix: format!(
                    "{self:?} needs a transport that pins a key to one consumer across processes; \
                     {fix}; or choose Strategy::LocalPartitioned explicitly (orders within one process only)"
                ),
            }),
        }
    }
}

/// What happens when a key's retries are exhausted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PoisonPolicy {
    /// The head stays pending and the key stops until an operator resumes it
    /// (the default for ordered subscriptions).
    #[default]
    Halt,
    /// The head is dead-lettered after `max_attempts` and the key is released
    /// once the transport durably confirmed the park.
    Park {
        /// Attempts before the head is parked (at least 1).
        max_attempts: u32,
    },
}

/// Retry with exponential back-off before the poison policy applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Attempts in all, the first included (at least 1). `Park` overrides it.
    pub max_attempts: u32,
    /// Back-off before the second attempt.
    pub initial_backoff: Duration,
    /// Upper bound of the back-off.
    pub max_backoff: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_attempts: 5,
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(10),
        }
    }
}

impl RetryPolicy {
    /// The back-off after `attempt` failed (1-based), doubling, capped.
    pub fn backoff(&self, attempt: u32) -> Duration {
        let factor = 1u32 << attempt.saturating_sub(1).min(20);
        self.initial_backoff.saturating_mul(factor).min(self.max_backoff)
    }
}

/// When failures span many keys at once (a broken dependency, not a bad
/// message), the whole subscription backs off instead of halting or parking
/// healthy keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GlobalBackoff {
    /// The window over which failing keys are counted.
    pub window: Duration,
    /// Distinct failing keys within the window that trip the back-off
    /// (0 turns it off).
    pub distinct_keys: usize,
    /// How long the subscription pauses each time it trips.
    pub pause: Duration,
}

impl Default for GlobalBackoff {
    fn default() -> Self {
        GlobalBackoff {
            window: Duration::from_secs(10),
            distinct_keys: 16,
            pause: Duration::from_secs(2),
        }
    }
}
