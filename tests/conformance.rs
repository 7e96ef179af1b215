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

/// PostgreSQL at `POSTGRES_URL` (default: the loopback server `scripts/services` starts).
#[cfg(feature = "postgres")]
struct PgHarness {
    url: String,
}

#[cfg(feature = "postgres")]
#[keyorder::async_trait]
impl Harness for PgHarness {
    fn name(&self) -> &str {
        "postgres"
    }
    fn capabilities(&self) -> Capabilities {
        keyorder::postgres::CAPABILITIES
    }
    async fn client(&self) -> Result<Client> {
        keyorder::connect(&self.url).await
    }
    fn not_applicable(&self, scenario: Scenario) -> Option<String> {
        (scenario == Scenario::C14).then(|| {
            "the test PostgreSQL is shared by every trial running in parallel; restarting it needs a cluster of \
             its own (not built yet)"
                .to_owned()
        })
    }
    fn lease(&self) -> keyorder::LeaseConfig {
        keyorder::LeaseConfig {
            ttl: std::time::Duration::from_secs(3),
            heartbeat: std::time::Duration::from_millis(500),
            margin: std::time::Duration::from_secs(1),
        }
    }
    fn worker_url(&self) -> Option<String> {
        Some(self.url.clone())
    }
}

fn harnesses() -> Vec<Arc<dyn Harness>> {
    #[allow(unused_mut)]
    let mut all: Vec<Arc<dyn Harness>> = vec![Arc::new(MemoryHarness {
        transport: MemoryTransport::new(),
    })];
    #[cfg(feature = "postgres")]
    {
        let base = std::env::var("POSTGRES_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
        all.push(Arc::new(PgHarness {
            url: format!("{base}?schema=keyorder_conformance&migrate=true&pool=4"),
        }));
    }
    all
}

/// Whether the harness's broker answers; `Err` explains why not.
fn reachable(harness: &dyn Harness) -> std::result::Result<(), String> {
    if harness.name() == "memory" {
        return Ok(());
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    rt.block_on(async {
        tokio::time::timeout(std::time::Duration::from_secs(20), harness.client())
            .await
            .map_err(|_| "no answer within 20 s".to_owned())?
            .map(|_| ())
            .map_err(|e| e.to_string())
    })
}

/// How a worker process (C6, C7) connects: the facade's `connect`.
fn connect_boxed(url: String) -> Pin<Box<dyn Future<Output = Result<Client>> + Send>> {
    Box::pin(async move { keyorder::connect(&url).await })
}

fn main() {
    // Spawned as a worker process by a process scenario: run it and exit.
    keyorder_testkit::worker::run_if_worker(connect_boxed);
    if let Ok(filter) = std::env::var("KEYORDER_LOG") {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_writer(std::io::stderr)
            .init();
    }
    let args = Arguments::from_args();
    let mut trials = Vec::new();
    let required = std::env::var("KEYORDER_REQUIRE_BROKERS").is_ok_and(|v| v == "1");
    for harness in harnesses() {
        if let Err(why) = reachable(&*harness) {
            let name = format!("{}::broker_reachable", harness.name());
            let why = format!("{} broker unreachable: {why} (run scripts/services)", harness.name());
            if required {
                trials.push(Trial::test(name, move || Err(why.into())));
            } else {
                trials.push(Trial::ignorable_test(name, move || Ok(Completion::ignored_with(why))));
            }
            continue;
        }
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
