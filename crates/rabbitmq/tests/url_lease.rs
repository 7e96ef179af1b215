//! `lease_ttl_ms` in the URL is the lease of a subscription whose builder
//! sets none, on the real broker: an ordered source's connection carries
//! the AMQP heartbeat derived from it (`ceil((ttl - margin) / 2)` s), which
//! is how RabbitMQ ends a stalled owner's lease; the broker reports it as
//! the connection's `timeout`.

// Shared set-up; this file uses only part of it.
#[allow(dead_code)]
mod common;

use std::sync::Arc;
use std::time::Duration;

use keyorder_core::{Client, KeySource, LeaseConfig};

/// The connections' heartbeats (`rabbitmqctl list_connections timeout`),
/// in seconds, as the broker negotiated them.
fn heartbeats() -> Vec<u64> {
    let out = std::process::Command::new("rabbitmqctl")
        .args(["list_connections", "-q", "--no-table-headers", "timeout"])
        .output()
        .expect("rabbitmqctl runs (scripts/services installs RabbitMQ)");
    assert!(
        out.status.success(),
        "rabbitmqctl: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

fn with(secs: u64) -> usize {
    heartbeats().into_iter().filter(|h| *h == secs).count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_url_lease_sets_the_heartbeat_the_broker_enforces() {
    // TTL 37 s: margin 11.1 s, so ceil(25.9 / 2) = 13 s, a heartbeat no
    // other test uses.
    let url = format!(
        "{}?topology=hash&queues=2&queue_type=classic&expires_ms=60000&lease_ttl_ms=37000",
        common::base()
    );
    let client = Client::new(Arc::new(common::connect(&url).await));
    assert_eq!(
        client.transport().default_lease(),
        Some(LeaseConfig::from_ttl(Duration::from_secs(37)))
    );
    let category = format!("lease-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let before = with(13);
    let sub = client
        .subscribe(&category, "g")
        .ordered_by(KeySource::routing_key())
        .build()
        .await
        .unwrap();
    let run = common::Run::start(sub);
    keyorder_testkit::until(
        "a connection with a 13 s heartbeat",
        Duration::from_secs(30),
        async || {
            let now = with(13);
            if now > before {
                Ok(())
            } else {
                Err(format!(
                    "{now} connections with 13 s (before: {before}); all: {:?}",
                    heartbeats()
                ))
            }
        },
    )
    .await;
    // A lease set on the builder wins: TTL 10 s gives ceil(7 / 2) = 4 s.
    let with_13 = with(13);
    let own = client
        .subscribe(&category, "h")
        .ordered_by(KeySource::routing_key())
        .lease(LeaseConfig::from_ttl(Duration::from_secs(10)))
        .build()
        .await
        .unwrap();
    let own = common::Run::start(own);
    let publisher = client.publisher(&category).await.unwrap();
    publisher
        .publish(keyorder_core::Message::new("x").with_key("k").unwrap())
        .await
        .unwrap();
    own.until(1, 30).await;
    assert_eq!(with(13), with_13, "the builder's lease is not the URL's");
    own.stop().await;
    run.stop().await;
    keyorder_testkit::until("the 13 s connection closed", Duration::from_secs(30), async || {
        let now = with(13);
        if now <= before {
            Ok(())
        } else {
            Err(format!("{now} connections with 13 s (before: {before})"))
        }
    })
    .await;
}
