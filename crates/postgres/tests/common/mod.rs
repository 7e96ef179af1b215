//! Set-up shared by the PostgreSQL tests that drive a source by hand.

use std::time::Duration;

use keyorder_core::raw::Room;
use keyorder_core::{Inbound, KeyRules, LeaseConfig, SourceSpec, TransportSource};
use keyorder_postgres::{PgConfig, PgTransport};
use keyorder_testkit::brokers::Broker;

/// The server under test (`POSTGRES_URL`, else the local one).
pub(crate) fn url() -> String {
    Broker::Postgres.url()
}

/// Connects with `cfg` (a configuration on [`url`]); a server that cannot
/// be reached fails the test naming it, the URL and `scripts/services`.
pub(crate) async fn connect(cfg: PgConfig) -> PgTransport {
    Broker::Postgres.require(&url(), PgTransport::connect(cfg)).await
}

/// A transport on the server under test, in `schema` (migrated), with
/// `slots` slots per queue.
pub(crate) async fn transport(schema: &str, slots: u32) -> PgTransport {
    let cfg = PgConfig::from_url(
        &format!("{}?schema={schema}&slots={slots}&migrate=true", url())
            .parse()
            .unwrap(),
    )
    .unwrap();
    connect(cfg).await
}

/// An ordered source of `queue` for group `g`, instance `a`, with a 10 s lease.
pub(crate) fn spec(queue: &str) -> SourceSpec {
    SourceSpec {
        category: queue.to_owned(),
        correlated: Vec::new(),
        group: "g".to_owned(),
        instance: "a".to_owned(),
        ordered: true,
        lease: LeaseConfig {
            ttl: Duration::from_secs(10),
            heartbeat: Duration::from_secs(1),
            margin: Duration::from_secs(2),
        },
        key_rules: KeyRules::default(),
    }
}

/// Fetches until a delivery arrives (maintaining the source meanwhile).
pub(crate) async fn one(source: &mut Box<dyn TransportSource>) -> Inbound {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        assert!(tokio::time::Instant::now() < deadline, "no delivery within 60 s");
        source.maintain().await.unwrap();
        let mut got = source.fetch(&Room::up_to(1), Duration::from_millis(100)).await.unwrap();
        if let Some(i) = got.pop() {
            return i;
        }
    }
}

/// Fetches until `n` deliveries arrived (maintaining the source meanwhile).
// Not every file that takes `one` takes this.
#[allow(dead_code)]
pub(crate) async fn take(source: &mut Box<dyn TransportSource>, n: usize) -> Vec<Inbound> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let mut got = Vec::new();
    while got.len() < n {
        assert!(
            tokio::time::Instant::now() < deadline,
            "got {} of {n} deliveries",
            got.len()
        );
        source.maintain().await.unwrap();
        got.extend(
            source
                .fetch(&Room::up_to(n - got.len()), Duration::from_millis(100))
                .await
                .unwrap(),
        );
    }
    got
}
