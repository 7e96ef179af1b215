//! The in-memory transport: one process, submission order.
//!
//! A category is split into partitions (`stable_hash(key) % partitions`;
//! keyless messages round-robin). Each consumer group owns every partition
//! through one member at a time, with a generation that grows on every
//! acquire; settlements are fenced on (member, generation) exactly as a
//! broker adapter fences them, so the conformance suite exercises the same
//! paths. Members that stop polling for longer than their lease TTL lose
//! their partitions, and the next owner re-reads every unacknowledged entry.
//!
//! Use it for the demo, quick starts, docs and tests: it keeps nothing on
//! disk and lives inside one process (`connect("memory://")`).

mod admin;
mod bench;
mod broker;
mod names;
mod publisher;
mod settle;
mod source;
mod transport;

pub use bench::MemoryBenchHints;
pub use transport::{MemoryTransport, DEFAULT_PARTITIONS};

#[cfg(test)]
mod tests;
