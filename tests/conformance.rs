//! The conformance run: every scenario of `keyorder-testkit` against every
//! adapter compiled in. Trials are named `<adapter>::c<N>_<slug>`; a scenario
//! ruled out by capabilities or by the test broker is an ignored trial whose
//! reason is printed, so the output is the capability matrix.
//!
//! `cargo test --all-features --test conformance` (brokers at the loopback
//! URLs `scripts/services` prints; `KEYORDER_REQUIRE_BROKERS=1` makes an
//! unreachable broker fail the run).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use keyorder::{Capabilities, Client, MemoryTransport, Result, Transport};
use keyorder_testkit::{Harness, Scenario};
use libtest_mimic::{Arguments, Completion, Trial};

/// The in-memory transport: every instance of a scenario shares one broker.
struct MemoryHarness {
    transport: MemoryTransport,
}

#[keyorder::async_trait]
impl Harness for MemoryHarness {
    fn name(&self) -> &str {
        "memory"
    }
    fn capabilities(&self) -> Capabilities {
        self.transport.capabilities()
    }
    async fn client(&self) -> Result<Client> {
        Ok(Client::new(Arc::new(self.transport.clone())))
    }
}

fn harnesses() -> Vec<Arc<dyn Harness>> {
    vec![Arc::new(MemoryHarness {
        transport: MemoryTransport::new(),
    })]
}

/// How a worker process (C6, C7) connects: the facade's `connect`.
fn connect_boxed(url: String) -> Pin<Box<dyn Future<Output = Result<Client>> + Send>> {
    Box::pin(async move { keyorder::connect(&url).await })
}

fn main() {
    // Spawned as a worker process by a process scenario: run it and exit.
    keyorder_testkit::worker::run_if_worker(connect_boxed);
    let args = Arguments::from_args();
    let mut trials = Vec::new();
    for harness in harnesses() {
        for scenario in Scenario::ALL {
            let name = format!("{}::{}", harness.name(), scenario.slug());
            match scenario.not_applicable(&*harness) {
                Some(reason) => trials.push(Trial::ignorable_test(name, move || {
                    Ok(Completion::ignored_with(format!("not applicable: {reason}")))
                })),
                None => {
                    let harness = harness.clone();
                    trials.push(Trial::test(name, move || {
                        let rt = tokio::runtime::Builder::new_multi_thread()
                            .worker_threads(2)
                            .enable_all()
                            .build()?;
                        rt.block_on(scenario.run(&*harness)).map_err(Into::into)
                    }));
                }
            }
        }
    }
    libtest_mimic::run(&args, trials).exit();
}
