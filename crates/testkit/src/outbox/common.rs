//! What the outbox trials share: the outcome type, the relay settings.

pub(super) type Outcome = std::result::Result<(), String>;

pub(super) fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// The environment variable that carries a relay process's configuration.
pub const RELAY_ENV: &str = "KEYORDER_TESTKIT_RELAY";

/// Relay slots in the trials' outboxes.
pub(super) const SLOTS: u32 = 16;

/// The relays' slot lease: seconds, so a loaded 2-core machine keeps it.
pub(super) const RELAY_LEASE_MS: (u64, u64, u64) = (5_000, 500, 1_500);

pub(super) fn ensure(cond: bool, what: impl FnOnce() -> String) -> Outcome {
    if cond {
        Ok(())
    } else {
        Err(what())
    }
}
