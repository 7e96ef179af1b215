//! A subscription joins its consumer group when it runs, not when it is
//! built. A member that joined at `build` took its share of the partitions
//! at once: a subscription built and not yet run (or never run) held them,
//! and their messages waited for it while the group's running members sat
//! idle.

mod common;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use keyorder_core::{Client, KeySource, Message};
use keyorder_kafka::partition_for;

/// Messages per partition.
const PER_PARTITION: usize = 10;

fn url() -> String {
    format!("kafka://{}?partitions=2&fetch_wait_ms=10", common::brokers())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_built_subscription_that_does_not_run_takes_no_partition() {
    let t = common::connect(&url()).await;
    let client = Client::new(Arc::new(t));
    let category = format!("join-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);

    // Keys in both partitions, in publish order.
    let keys: Vec<String> = (0..)
        .map(|i| format!("k-{i}"))
        .filter(|k| partition_for(k.as_bytes(), 2) == 0)
        .take(PER_PARTITION)
        .chain(
            (0..)
                .map(|i| format!("k-{i}"))
                .filter(|k| partition_for(k.as_bytes(), 2) == 1)
                .take(PER_PARTITION),
        )
        .collect();
    let publisher = client.publisher(&category).await.unwrap();
    for key in &keys {
        publisher
            .publish(Message::new(key.clone()).with_key(key).unwrap())
            .await
            .unwrap();
    }

    let build = || {
        client
            .subscribe(&category, "g")
            .ordered_by(KeySource::routing_key())
            .lease(common::lease())
            .build()
    };
    // Built first and never run.
    let idle = build().await.unwrap();
    let busy = build().await.unwrap();
    let running = common::Recording::start(busy);

    // The running member gets both partitions: every message.
    running
        .until(
            keys.len(),
            Duration::from_secs(60),
            "a subscription that never ran holds partitions",
        )
        .await;
    let log = running.stop().await;
    drop(idle);

    assert_eq!(log.len(), keys.len(), "each message once: {log:?}");
    assert_eq!(
        log.iter().collect::<HashSet<_>>(),
        keys.iter().collect::<HashSet<_>>(),
        "every published message ran"
    );
}
