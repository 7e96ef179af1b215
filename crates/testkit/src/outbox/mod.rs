//! The outbox end to end: records staged in PostgreSQL by `keyorder-outbox`,
//! handed to a broker by **two relays**, applied by **two ordered consumer
//! instances** behind a [`SequenceGuard`](keyorder_outbox::SequenceGuard) whose last applied sequences live
//! in PostgreSQL ([`PgApplied`](keyorder_outbox::PgApplied), shared by both instances). The runner turns
//! [`OutboxScenario::ALL`] × adapters into trials named
//! `outbox-<adapter>::<slug>`.
//!
//! Relays are separate OS processes wherever the adapter's broker is shared
//! between processes (the runner re-executes itself, see
//! [`run_if_relay`]), so `c6_relay_crash` is a real `kill -9` and
//! `c7_relay_stall` a real `SIGSTOP`/`SIGCONT`. The in-memory transport
//! lives in one process, so there the relays are tasks: the crash aborts
//! the relay's task (its in-flight publishes with it) and the stall stops
//! driving it (no heartbeat, no confirmation), which is what the relay
//! would see of a `SIGSTOP`.
//!
//! The event log records what the consumers' handlers applied (after the
//! guard); the one [`crate::checker`] judges order, loss and overlap, and
//! every trial also requires that no record was applied twice.

mod common;
mod hold;
mod relays;
mod scenario;
mod scenarios;
mod trial;

use keyorder_outbox::sqlx::{self, AssertSqlSafe};

use crate::Harness;
pub use common::RELAY_ENV;
use common::*;
pub use hold::HoldRule;
pub use relays::{run_if_relay, RelayWorkerConfig};
pub use scenario::OutboxScenario;
use scenarios::*;
use trial::*;

impl OutboxScenario {
    /// Runs the scenario over `harness`'s broker, with the outbox in a
    /// fresh schema on the harness's PostgreSQL event-log server (dropped
    /// when the trial passes, kept for a look when it fails).
    pub async fn run(self, harness: &dyn Harness) -> Outcome {
        let mut t = Trial::new(harness, self).await?;
        let res = match self {
            OutboxScenario::C1 => c1(&mut t).await,
            OutboxScenario::C2 => c2(&mut t).await,
            OutboxScenario::C6 => c6(&mut t).await,
            OutboxScenario::C7 => c7(&mut t).await,
            OutboxScenario::C12 => c12(&mut t).await,
            OutboxScenario::C15 => c15(&mut t).await,
        };
        if res.is_ok() {
            let _ = sqlx::query(AssertSqlSafe(format!("drop schema if exists {} cascade", t.schema)))
                .execute(t.pool())
                .await;
        }
        res
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn slugs_are_distinct_and_numbered() {
        let slugs: HashSet<&str> = OutboxScenario::ALL.iter().map(|s| s.slug()).collect();
        assert_eq!(slugs.len(), OutboxScenario::ALL.len());
        assert!(slugs.iter().all(|s| s.starts_with('c')));
    }

    #[test]
    fn a_relay_config_round_trips() {
        let cfg = RelayWorkerConfig {
            url: "redis://127.0.0.1:6379".into(),
            outbox_url: "postgres://x".into(),
            schema: "s".into(),
            instance: "r1".into(),
            lease_ms: RELAY_LEASE_MS,
            hold: Some(HoldRule {
                from_seq: 4,
                after_publish: true,
            }),
        };
        let back: RelayWorkerConfig = serde_json::from_str(&serde_json::to_string(&cfg).unwrap()).unwrap();
        assert_eq!(back.hold.map(|h| h.from_seq), Some(4));
    }
}
