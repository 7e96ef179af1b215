//! Scenarios C1-C24 and the operator's, written once, by behaviour: each module holds the
//! scenarios of one behaviour; `ctx` holds what they share. The spec, with
//! what each checks and which capability gates it, is `docs/CONFORMANCE.md`.

mod crashloop;
mod ctx;
mod failover;
mod faults;
pub(crate) mod groups;
mod handover;
mod keys;
mod operator;
mod order;
mod ownership;
mod poison;
mod registration;
mod scenario;
mod scopecount;

use std::sync::Arc;

use crate::pglog::PgEventLog;
use crate::Harness;

use ctx::Ctx;
pub(crate) use ctx::Outcome;
pub use keys::C12_CARRIED_KEYS;
pub use scenario::Scenario;

impl Scenario {
    /// Runs the scenario; `Err` explains the failure.
    pub async fn run(self, harness: &dyn Harness) -> Outcome {
        let mut ctx = Ctx::new(harness, self);
        if matches!(
            self,
            Scenario::C6 | Scenario::C7 | Scenario::C19 | Scenario::C20 | Scenario::C21 | Scenario::C22
        ) {
            // Separate processes share the event log in PostgreSQL.
            let log = PgEventLog::connect(&harness.event_log_url(), &ctx.ns)
                .await
                .map_err(|e| format!("the process scenarios need the PostgreSQL event log: {e}"))?;
            ctx.log = Arc::new(log);
        }
        match self {
            Scenario::C1 => order::c1(&ctx).await,
            Scenario::C2 => order::c2(&ctx).await,
            Scenario::C3 => order::c3(&ctx).await,
            Scenario::C4 => poison::c4(&ctx).await,
            Scenario::C5 => poison::c5(&ctx).await,
            Scenario::C6 => failover::c6(&ctx).await,
            Scenario::C7 => failover::c7(&ctx).await,
            Scenario::C8 => registration::c8(&ctx).await,
            Scenario::C9 => registration::c9(&ctx).await,
            Scenario::C10 => registration::c10(&ctx).await,
            Scenario::C12 => keys::c12(&ctx).await,
            Scenario::C13 => keys::c13(&ctx).await,
            Scenario::C14 => failover::c14(&ctx).await,
            Scenario::C15 => order::c15(&ctx).await,
            Scenario::C16 => ownership::c16(&ctx).await,
            Scenario::C11 => ownership::c11(&ctx).await,
            Scenario::C17 => groups::c17(&ctx).await,
            Scenario::C18 => groups::c18(&ctx).await,
            Scenario::C19 => faults::c19(&ctx).await,
            Scenario::C20 => faults::c20(&ctx).await,
            Scenario::C21 => handover::c21(&ctx).await,
            Scenario::C22 => crashloop::c22(&ctx).await,
            Scenario::C23 => scopecount::c23(&ctx).await,
            Scenario::C24 => failover::c24(&ctx).await,
            Scenario::Operator => operator::operator_from_another_transport(&ctx).await,
            #[allow(unreachable_patterns)]
            _ => Err(format!("{}: no runner", self.slug())),
        }
    }
}
