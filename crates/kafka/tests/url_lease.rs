//! `lease_ttl_ms` in the URL is the lease of a subscription whose builder
//! sets none, on the real broker: it is the member's session timeout, which
//! the broker times the group's first assignment by (the test broker, tansu,
//! assigns a new group's partitions about half a session after the join).

// Shared set-up; this file uses only part of it.
#[allow(dead_code)]
mod common;

use std::sync::Arc;
use std::time::Duration;

use keyorder_core::{Client, KeySource, LeaseConfig, Message};
use tokio::time::Instant;

/// How long a new group's only member, on `url`, waits for its first message.
async fn first_message_after(url: &str) -> Duration {
    let client = Client::new(Arc::new(common::connect(url).await));
    let category = format!("url-lease-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let publisher = client.publisher(&category).await.unwrap();
    publisher
        .publish(Message::new("m0").with_key("k").unwrap())
        .await
        .unwrap();
    let started = Instant::now();
    let run = common::Recording::start(
        client
            .subscribe(&category, "g")
            .ordered_by(KeySource::routing_key())
            .build()
            .await
            .unwrap(),
    );
    run.until(1, Duration::from_secs(90), "the first message").await;
    let took = started.elapsed();
    assert_eq!(run.stop().await, ["m0"]);
    took
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_url_lease_ttl_is_the_session_the_broker_times_the_group_by() {
    let url = format!("kafka://{}?partitions=1&lease_ttl_ms=24000", common::brokers());
    let t = common::connect(&url).await;
    assert_eq!(t.config().lease, Some(LeaseConfig::from_ttl(Duration::from_secs(24))));
    drop(t);
    // A 24 s session: the broker assigns after about 12 s. With the default
    // lease (10 s) it would assign after about 5 s.
    let long = first_message_after(&url).await;
    let default = first_message_after(&format!("kafka://{}?partitions=1", common::brokers())).await;
    eprintln!("first message after {long:?} (lease_ttl_ms=24000), {default:?} (the default lease)");
    assert!(
        long >= Duration::from_secs(10),
        "the group's first assignment came {long:?} after the join: the broker did not time it by a 24 s session \
         (the default lease's took {default:?})"
    );
}
