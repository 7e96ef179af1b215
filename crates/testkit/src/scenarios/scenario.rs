//! What a scenario is: its number, its trial name, and when a transport
//! cannot run it (capabilities or test broker).

use crate::Harness;

/// One conformance scenario.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Scenario {
    /// C1 per-key order.
    C1,
    /// C2 single processor per key.
    C2,
    /// C3 parallel across keys.
    C3,
    /// C4 halt on poison.
    C4,
    /// C5 park and release.
    C5,
    /// C6 crash failover (process).
    C6,
    /// C7 stall failover (process).
    C7,
    /// C8 registration validation.
    C8,
    /// C9 capability gating.
    C9,
    /// C10 one key per category.
    C10,
    /// C11 correlated categories.
    C11,
    /// C12 unsafe keys.
    C12,
    /// C13 keyless messages.
    C13,
    /// C14 broker restart.
    C14,
    /// C15 concurrent producers.
    C15,
    /// C16 rebalance / scale out.
    C16,
    /// C17 many groups on one category.
    C17,
    /// C18 the operator resolves a halt while the scope flows.
    C18,
    /// C19 connection faults between a worker and its broker.
    C19,
    /// C20 a worker whose clock is far off.
    C20,
    /// C21 one scope handed over again and again, one owner stalled.
    C21,
    /// C22 a message that kills its process on every attempt, restarted.
    C22,
    /// C23 the scope count changed while publishers and consumers run.
    C23,
    /// C24 a broker node leading one of the group's queues is lost mid-stream (a cluster).
    C24,
    /// The operator's verbs from another transport (list, refuse an
    /// unknown label, skip by label).
    Operator,
}

impl Scenario {
    /// Every scenario, in order.
    pub const ALL: [Scenario; 25] = [
        Scenario::C1,
        Scenario::C2,
        Scenario::C3,
        Scenario::C4,
        Scenario::C5,
        Scenario::C6,
        Scenario::C7,
        Scenario::C8,
        Scenario::C9,
        Scenario::C10,
        Scenario::C11,
        Scenario::C12,
        Scenario::C13,
        Scenario::C14,
        Scenario::C15,
        Scenario::C16,
        Scenario::C17,
        Scenario::C18,
        Scenario::C19,
        Scenario::C20,
        Scenario::C21,
        Scenario::C22,
        Scenario::C23,
        Scenario::C24,
        Scenario::Operator,
    ];

    /// The trial name's scenario part, e.g. `c1_per_key_order`.
    pub fn slug(self) -> &'static str {
        match self {
            Scenario::C1 => "c1_per_key_order",
            Scenario::C2 => "c2_single_processor",
            Scenario::C3 => "c3_parallel_across_keys",
            Scenario::C4 => "c4_halt_on_poison",
            Scenario::C5 => "c5_park_and_release",
            Scenario::C6 => "c6_crash_failover",
            Scenario::C7 => "c7_stall_failover",
            Scenario::C8 => "c8_registration_validation",
            Scenario::C9 => "c9_capability_gating",
            Scenario::C10 => "c10_one_key_per_category",
            Scenario::C11 => "c11_correlated_categories",
            Scenario::C12 => "c12_unsafe_keys",
            Scenario::C13 => "c13_keyless_messages",
            Scenario::C14 => "c14_broker_restart",
            Scenario::C15 => "c15_concurrent_producers",
            Scenario::C16 => "c16_rebalance",
            Scenario::C17 => "c17_many_groups",
            Scenario::C18 => "c18_resolve_under_flow",
            Scenario::C19 => "c19_connection_faults",
            Scenario::C20 => "c20_clock_skew",
            Scenario::C21 => "c21_repeated_handover",
            Scenario::C22 => "c22_crash_loop",
            Scenario::C23 => "c23_scope_count_change",
            Scenario::C24 => "c24_node_loss",
            Scenario::Operator => "operator_from_another_transport",
        }
    }

    /// Why `harness` cannot run this scenario (capabilities or test broker),
    /// or `None` when it must run.
    pub fn not_applicable(self, harness: &dyn Harness) -> Option<String> {
        let caps = harness.capabilities();
        let need = |flags: &[(&str, bool)]| {
            let missing: Vec<&str> = flags.iter().filter(|(_, on)| !on).map(|(n, _)| *n).collect();
            (!missing.is_empty()).then(|| format!("transport `{}` lacks {}", harness.name(), missing.join(", ")))
        };
        let by_caps = match self {
            Scenario::C4 | Scenario::C18 | Scenario::Operator => need(&[("halt_on_poison", caps.halt_on_poison)]),
            Scenario::C5 => need(&[("park_and_release", caps.park_and_release)]),
            Scenario::C6 => need(&[
                ("crash_reclaim", caps.crash_reclaim),
                (
                    "multi_process (kill -9 needs a broker shared across processes)",
                    caps.multi_process,
                ),
            ]),
            Scenario::C7 | Scenario::C21 => need(&[
                ("fencing or self_fencing", caps.fencing || caps.self_fencing),
                (
                    "multi_process (SIGSTOP needs a broker shared across processes)",
                    caps.multi_process,
                ),
            ]),
            Scenario::C11 => need(&[("correlated_ownership", caps.correlated_ownership)]),
            Scenario::C23 => harness.scope_count_fixed(),
            Scenario::C24 => harness.single_node(),
            Scenario::C22 => need(&[
                (
                    "halt_on_poison or park_and_release",
                    caps.halt_on_poison || caps.park_and_release,
                ),
                (
                    "multi_process (a restarted worker needs a broker shared across processes)",
                    caps.multi_process,
                ),
            ]),
            Scenario::C19 | Scenario::C20 => need(&[(
                "multi_process (a fault between a worker process and its broker needs a broker shared across \
                 processes)",
                caps.multi_process,
            )]),
            Scenario::C14 => need(&[(
                "persistent (the test broker keeps nothing across a restart)",
                caps.persistent,
            )]),
            _ => None,
        };
        harness.not_applicable(self).or(by_caps)
    }
}
