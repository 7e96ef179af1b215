//! `KafkaBenchHints`: how a demo or bench runs `kafka://`.

use std::time::Duration;

use keyorder_core::raw::BenchHints;

/// The [`BenchHints`] of `kafka://`: instances are launched 250 ms apart. A
/// member joins its group when its subscription starts running, and the
/// test broker (tansu) settles a group by polling in 1 s steps, so members
/// that join within about 0.1 s of each other leave the group's follower
/// waiting a whole poll (1 s) for its assignment, while a follower that
/// joins 0.25 s after the leader gets it 0.25 s after the leader.
#[derive(Debug, Clone, Copy, Default)]
pub struct KafkaBenchHints;

impl BenchHints for KafkaBenchHints {
    fn launch_spacing(&self) -> Duration {
        Duration::from_millis(250)
    }
}
