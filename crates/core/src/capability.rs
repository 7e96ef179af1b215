//! What a transport can do, declared from its configuration alone.

/// The capabilities of a transport with its declared configuration.
///
/// A plain `Copy + Default` struct so adapter crates build it with
/// `Capabilities { fencing: true, ..Default::default() }`. Every flag is a
/// promise the adapter keeps on a real broker, proven by the conformance
/// scenarios that need it.
///
/// ```
/// use keyorder_core::Capabilities;
/// let caps = Capabilities { cross_instance_affinity: true, fencing: true, ..Default::default() };
/// assert!(!caps.park_and_release);
/// assert_eq!(caps.missing().first(), Some(&"self_fencing"));
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Capabilities {
    /// The transport pins a key to one consumer across processes.
    pub cross_instance_affinity: bool,
    /// A stale owner's broker operations (read, ack, commit, cursor advance) are rejected.
    pub fencing: bool,
    /// The consumer refuses to start work for a scope whose ownership it has
    /// not confirmed within the lease.
    pub self_fencing: bool,
    /// A dead owner's unacknowledged messages go to the next owner, in order.
    pub crash_reclaim: bool,
    /// A key can stop at a poison head.
    pub halt_on_poison: bool,
    /// A poison head can be dead-lettered and its key released, after a durable confirm.
    pub park_and_release: bool,
    /// One owner per correlation value across several categories.
    pub correlated_ownership: bool,
    /// Partitions grow with the key set.
    pub dynamic_partitions: bool,
    /// Affinity can move on a topology change (consistent hash).
    pub remap_window: bool,
    /// The broker checks a fenced publish
    /// ([`crate::Publisher::publish_fenced`]): once a publisher of a higher
    /// generation published for a scope, a lower generation's late publish
    /// is refused and stores nothing (the outbox relay's hand-over).
    pub publish_fencing: bool,
    /// Consumers may run as separate OS processes sharing the broker.
    pub multi_process: bool,
    /// The broker keeps acknowledged writes across a restart (in the test set-up).
    pub persistent: bool,
}

impl Capabilities {
    /// Every flag with its name, in declaration order.
    pub fn flags(&self) -> [(&'static str, bool); 12] {
        [
            ("cross_instance_affinity", self.cross_instance_affinity),
            ("fencing", self.fencing),
            ("self_fencing", self.self_fencing),
            ("crash_reclaim", self.crash_reclaim),
            ("halt_on_poison", self.halt_on_poison),
            ("park_and_release", self.park_and_release),
            ("correlated_ownership", self.correlated_ownership),
            ("dynamic_partitions", self.dynamic_partitions),
            ("remap_window", self.remap_window),
            ("publish_fencing", self.publish_fencing),
            ("multi_process", self.multi_process),
            ("persistent", self.persistent),
        ]
    }

    /// The names of the flags that are off.
    pub fn missing(&self) -> Vec<&'static str> {
        self.flags().into_iter().filter(|(_, on)| !on).map(|(n, _)| n).collect()
    }
}
