//! Worker processes: keyorder-check's ordered worker (see
//! [`keyorder_check::worker`]), and this crate's outbox relays and group
//! operators, each started by the runner re-executing itself.

pub use keyorder_check::worker::*;

/// If this process was spawned as a worker, a relay or an operator, runs it
/// and exits; otherwise returns at once. Call it first in the runner's
/// `main`.
pub fn run_if_worker(connect: Connector) {
    crate::outbox::run_if_relay(connect);
    crate::scenarios::groups::run_if_operator(connect);
    keyorder_check::worker::run_if_worker(connect);
}
