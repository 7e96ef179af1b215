//! Closing a source whose poll thread waits on a revoke nobody read yet.
//!
//! The revoke event holds the sender the rebalance callback waits on (up to
//! `max.poll.interval.ms` less the session timeout). Close stops the thread
//! and waits for it; while that event sat unread in the source's channel
//! the thread waited for an answer that could not come, so close waited
//! out its own timeout (the lease TTL) and the member never left the group.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use keyorder_core::raw::Room;
use keyorder_core::{KeyRules, Message, SourceSpec, Transport, TransportSource};
use keyorder_kafka::partition_for;
use keyorder_testkit::instance::wait_until;

fn spec(category: &str, instance: &str) -> SourceSpec {
    SourceSpec {
        category: category.into(),
        correlated: Vec::new(),
        group: "g".into(),
        instance: instance.into(),
        ordered: true,
        lease: common::lease(),
        key_rules: KeyRules::default(),
    }
}

/// Fetches (and maintains) until a message arrives, up to `limit`.
async fn until_a_message(s: &mut Box<dyn TransportSource>, limit: Duration) -> bool {
    wait_until("a message", limit, async || {
        let got = s.fetch(&Room::up_to(16), Duration::from_millis(200)).await.unwrap();
        s.maintain().await.unwrap();
        !got.is_empty()
    })
    .await
    .is_ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_does_not_wait_on_an_unread_revoke() {
    let url = format!("kafka://{}?partitions=2&fetch_wait_ms=10", common::brokers());
    let t = common::connect(&url).await;
    let category = format!("close-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let publisher = t.publisher(&category).await.unwrap();
    // A message in each partition.
    for p in 0..2 {
        let key = (0..)
            .map(|i| format!("k-{i}"))
            .find(|k| partition_for(k.as_bytes(), 2) == p)
            .unwrap();
        publisher
            .publish(Message::new("x").with_key(&key).unwrap())
            .await
            .unwrap();
    }

    // The first member takes both partitions and runs.
    let mut a = t.open(&spec(&category, "a")).await.unwrap();
    assert!(
        until_a_message(&mut a, Duration::from_secs(60)).await,
        "the first member gets its partitions"
    );

    // A second member joins; the group takes a partition from the first,
    // whose poll thread forwards the revoke and waits. The first source is
    // not fetched meanwhile: the revoke stays unread.
    let mut b = t.open(&spec(&category, "b")).await.unwrap();
    let stop_b = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let b_stop = stop_b.clone();
    let b_run = tokio::spawn(async move {
        while !b_stop.load(std::sync::atomic::Ordering::SeqCst) {
            let _ = b.fetch(&Room::up_to(16), Duration::from_millis(200)).await;
            let _ = b.maintain().await;
        }
        b.close().await.unwrap();
    });
    // The test broker rebalances after about half the session timeout.
    tokio::time::sleep(common::lease().ttl + Duration::from_secs(2)).await;

    let started = Instant::now();
    a.close().await.unwrap();
    let took = started.elapsed();
    stop_b.store(true, std::sync::atomic::Ordering::SeqCst);
    b_run.await.unwrap();
    assert!(
        took < common::lease().ttl,
        "close waited {took:?}, as long as its timeout for the poll thread ({:?}): the thread was held by an unread revoke",
        common::lease().ttl
    );
}
