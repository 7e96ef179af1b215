//! `lease_ttl_ms` in the URL is the lease of a subscription whose builder
//! sets none, on the real broker: it is the member's session timeout, so a
//! static member that closed (a static member does not leave its group)
//! keeps its partition for that long before the broker gives it to
//! another member.

mod common;

use std::sync::Arc;
use std::time::Duration;

use keyorder_core::{Client, KeySource, LeaseConfig, Message};
use tokio::time::Instant;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_url_lease_ttl_is_the_session_the_broker_holds_a_partition_for() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    let category = format!("url-lease-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    // 20 s, twice the default lease (10 s): without the URL's lease the
    // broker would hand the partition over about 13 s after the close (the
    // 10 s session, then a rebalance of the second member's 6 s lease).
    let a = common::connect(&format!(
        "kafka://{}?partitions=1&static_membership=true&lease_ttl_ms=20000",
        common::brokers()
    ))
    .await;
    assert_eq!(a.config().lease, Some(LeaseConfig::from_ttl(Duration::from_secs(20))));
    let a = Client::new(Arc::new(a));
    let publisher = a.publisher(&category).await.unwrap();
    let first = common::Recording::start(
        a.subscribe(&category, "g")
            .ordered_by(KeySource::routing_key())
            .instance_id("url-lease-a")
            .build()
            .await
            .unwrap(),
    );
    publisher
        .publish(Message::new("m0").with_key("k").unwrap())
        .await
        .unwrap();
    first
        .until(1, Duration::from_secs(90), "the static member's first message")
        .await;
    // A second (dynamic) member with a short lease of its own, so it would
    // take the partition over soon after the first's session ended.
    let b = Client::new(Arc::new(
        common::connect(&format!("kafka://{}?partitions=1", common::brokers())).await,
    ));
    let second = common::Recording::start(
        b.subscribe(&category, "g")
            .ordered_by(KeySource::routing_key())
            .instance_id("url-lease-b")
            .lease(common::lease())
            .build()
            .await
            .unwrap(),
    );
    assert_eq!(first.stop().await, ["m0"]);
    let closed = Instant::now();
    publisher
        .publish(Message::new("m1").with_key("k").unwrap())
        .await
        .unwrap();
    second
        .until(1, Duration::from_secs(90), "the partition handed over")
        .await;
    let took = closed.elapsed();
    assert!(
        took >= Duration::from_secs(18),
        "the broker handed the closed static member's partition over after {took:?}, before a session of \
         lease_ttl_ms=20000 could end: the URL's lease was not its session timeout"
    );
    assert_eq!(second.stop().await, ["m1"]);
}
