//! `MemoryBenchHints`: how a demo or bench runs `memory://`.

use crate::bench::BenchHints;

/// The [`BenchHints`] of `memory://`: every connect is a broker of its own,
/// so a demo's or bench's instances share one client; the rest is the
/// default (an unordered subscription is the plain path already).
#[derive(Debug, Clone, Copy, Default)]
pub struct MemoryBenchHints;

impl BenchHints for MemoryBenchHints {
    fn connects_share_broker(&self) -> bool {
        false
    }
}
