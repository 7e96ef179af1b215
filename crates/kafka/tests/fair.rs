//! Sharing the dispatcher's room between partitions, on the test Kafka
//! broker. Two partitions hold a backlog each, one key per partition, and
//! the room (the budget) is smaller than either backlog. Handing the room
//! out one partition after another in a fixed order filled it with the
//! first partition's messages for as long as that partition had any: its key
//! ran while the other partition's key waited for it to finish. Each key's
//! messages start only when its previous one is durable, so both must run
//! side by side.

mod common;

use std::sync::Arc;
use std::time::Duration;

use keyorder_core::{Client, KeySource, Message};
use keyorder_kafka::partition_for;

const PER_KEY: usize = 300;

fn url() -> String {
    format!("kafka://{}?partitions=2&fetch_wait_ms=10", common::brokers())
}

/// The first test key (`k-N`) that lands in partition `p` of 2.
fn key_in(p: i32) -> String {
    (0..)
        .map(|i| format!("k-{i}"))
        .find(|k| partition_for(k.as_bytes(), 2) == p)
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_of_two_partitions_run_side_by_side_when_the_room_is_smaller_than_either_backlog() {
    let t = common::connect(&url()).await;
    let client = Client::new(Arc::new(t));
    let category = format!("fair-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let keys = [key_in(0), key_in(1)];

    // The whole backlog first, one publishing task per key (per-key order).
    let publisher = Arc::new(client.publisher(&category).await.unwrap());
    let mut tasks = Vec::new();
    for key in keys.clone() {
        let publisher = publisher.clone();
        tasks.push(tokio::spawn(async move {
            for seq in 0..PER_KEY {
                let msg = Message::new(format!("{key}/{seq}")).with_key(&key).unwrap();
                publisher.publish(msg).await.unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }

    let sub = client
        .subscribe(&category, "g")
        .ordered_by(KeySource::routing_key())
        .concurrency(4)
        .budget(32)
        .lease(common::lease())
        .build()
        .await
        .unwrap();
    let running = common::Recording::start(sub);
    running
        .until(2 * PER_KEY, Duration::from_secs(120), "the whole backlog")
        .await;
    let log = running.stop().await;
    assert_eq!(log.len(), 2 * PER_KEY, "each message once");
    let seqs = |key: &str| -> Vec<usize> {
        log.iter()
            .filter_map(|b| b.strip_prefix(&format!("{key}/")).map(|s| s.parse().unwrap()))
            .collect()
    };
    for key in &keys {
        assert_eq!(seqs(key), (0..PER_KEY).collect::<Vec<_>>(), "{key} in order, once");
    }
    // Side by side: neither key got through half its backlog before the
    // other one's first message ran.
    for (a, b) in [(&keys[0], &keys[1]), (&keys[1], &keys[0])] {
        let first_b = log.iter().position(|m| m.starts_with(&format!("{b}/"))).unwrap();
        let a_before = log[..first_b]
            .iter()
            .filter(|m| m.starts_with(&format!("{a}/")))
            .count();
        assert!(
            a_before < PER_KEY / 2,
            "{a_before} of {PER_KEY} messages of {a} ran before the first of {b} (its partition waited)"
        );
    }
}
