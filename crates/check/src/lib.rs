//! What the `keyorder` command and the conformance suite share to check a
//! run: the event log every handler writes (in memory or in PostgreSQL),
//! the checker that judges it (per-key order, loss, overlapping owners),
//! an instance that logs its deliveries, and the worker process that runs
//! one in a process of its own (`kill -9` in the fail-over scenarios).
//! Kept apart from `keyorder-testkit` so that the shipped command does not
//! link the test suite's deliberately broken transport.

pub mod checker;
pub mod eventlog;
pub mod instance;
pub mod pglog;
pub mod worker;

pub use checker::{check, Expectation, Published, Verdict};
pub use eventlog::{Event, EventLog, EventStart, MemoryEventLog};
