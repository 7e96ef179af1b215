//! A park retried after its commit (its outcome unknown to the caller, say a
//! dropped connection) stores the dead letter once, on the real server.

use std::collections::HashSet;
use std::time::Duration;

use keyorder_core::{Inbound, KeyRules, LeaseConfig, Message, SourceSpec, Transport, TransportSource};
use keyorder_postgres::{PgConfig, PgTransport};

fn url() -> String {
    std::env::var("POSTGRES_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

/// Fetches until a delivery arrives (maintaining the source meanwhile).
async fn one(source: &mut Box<dyn TransportSource>) -> Inbound {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        assert!(tokio::time::Instant::now() < deadline, "no delivery within 60 s");
        source.maintain().await.unwrap();
        let mut got = source
            .fetch(1, &HashSet::new(), Duration::from_millis(100))
            .await
            .unwrap();
        if let Some(i) = got.pop() {
            return i;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_park_stores_one_dead_letter() {
    let cfg = PgConfig::from_url(
        &format!("{}?schema=keyorder_park_once&slots=1&migrate=true", url())
            .parse()
            .unwrap(),
    )
    .unwrap();
    let t = PgTransport::connect(cfg).await.expect("PostgreSQL must be reachable");
    let queue = format!("park-{}", uuid::Uuid::new_v4().simple());
    let publisher = t.publisher(&queue).await.unwrap();
    publisher
        .publish(Message::new("poison").with_key("k").unwrap())
        .await
        .unwrap();
    let spec = SourceSpec {
        category: queue.clone(),
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
    };
    let mut source = t.open(&spec).await.unwrap();
    let delivery = one(&mut source).await;
    assert_eq!(delivery.settle.begin_attempt().await.unwrap(), 1);
    delivery.settle.park("bad input").await.unwrap();
    // The same park again, as a retry after an unknown outcome would send it.
    delivery.settle.park("bad input").await.unwrap();
    let dead = t.admin().dead_letters(&queue, "g").await.unwrap();
    assert_eq!(dead.len(), 1, "one dead letter per event: {dead:?}");
    assert_eq!(dead[0].reason, "bad input");
    source.close().await.unwrap();
}
