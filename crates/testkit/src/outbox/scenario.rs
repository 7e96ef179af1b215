//! The end-to-end outbox scenarios: their names.

/// The end-to-end outbox scenarios.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutboxScenario {
    /// Per-key order from commit to handler; nothing lost, nothing applied twice.
    C1,
    /// Both relays publish, both consumers apply, no key runs twice at once.
    C2,
    /// `kill -9` of a relay holding a published but unconfirmed record.
    C6,
    /// `SIGSTOP` of a relay past its lease inside a publish, then `SIGCONT`.
    C7,
    /// Unsafe keys fail the staging call; one that reached the table anyway
    /// is abandoned by the relay, never published.
    C12,
    /// Concurrent stagers of shared keys, and a late commit with a lower
    /// transaction id.
    C15,
}

impl OutboxScenario {
    /// Every end-to-end scenario, in order.
    pub const ALL: [OutboxScenario; 6] = [
        OutboxScenario::C1,
        OutboxScenario::C2,
        OutboxScenario::C6,
        OutboxScenario::C7,
        OutboxScenario::C12,
        OutboxScenario::C15,
    ];

    /// The trial name's scenario part.
    pub fn slug(self) -> &'static str {
        match self {
            OutboxScenario::C1 => "c1_per_key_order",
            OutboxScenario::C2 => "c2_single_processor",
            OutboxScenario::C6 => "c6_relay_crash",
            OutboxScenario::C7 => "c7_relay_stall",
            OutboxScenario::C12 => "c12_unsafe_keys",
            OutboxScenario::C15 => "c15_concurrent_stagers",
        }
    }
}
