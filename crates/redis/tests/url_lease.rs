//! `lease_ttl_ms` in the URL is the lease of a subscription whose builder
//! sets none, on the real server: the partition's lease key expires that
//! long after its owner's last renewal (its `PTTL`).

// Shared set-up; this file uses only part of it.
#[allow(dead_code)]
mod common;

use std::sync::Arc;
use std::time::Duration;

use keyorder_core::{Client, Delivery, HandlerResult, KeySource, LeaseConfig, Message};
use keyorder_redis::Names;
use redis::AsyncCommands;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_url_lease_ttl_is_the_lease_keys_expiry() {
    // 37 s: renewed every 5 s (the derived heartbeat's cap), so the key
    // always has more than the default TTL (10 s) left.
    let url = format!("{}/?lease_ttl_ms=37000", common::url().trim_end_matches('/'));
    let t = common::connect(&url).await;
    assert_eq!(t.config().lease, Some(LeaseConfig::from_ttl(Duration::from_secs(37))));
    let client = Client::new(Arc::new(t));
    let category = format!("url-lease-{}", uuid::Uuid::new_v4().simple());
    let publisher = client.publisher(&category).await.unwrap();
    publisher
        .publish(Message::new("x").with_key("k").unwrap())
        .await
        .unwrap();
    let sub = client
        .subscribe(&category, "g")
        .ordered_by(KeySource::routing_key())
        .build()
        .await
        .unwrap();
    let (ran_tx, mut ran) = tokio::sync::mpsc::unbounded_channel();
    let handler = move |_d: Delivery| {
        let ran_tx = ran_tx.clone();
        async move {
            let _ = ran_tx.send(());
            HandlerResult::Ok(())
        }
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(sub.run(handler, async move {
        let _ = stopped.await;
    }));
    tokio::time::timeout(Duration::from_secs(30), ran.recv())
        .await
        .expect("the message ran within 30 s");
    let mut c = redis::Client::open(common::url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let lease_key = Names::new(&category).unwrap().lease("k", "g");
    let left: i64 = c.pttl(&lease_key).await.unwrap();
    assert!(
        (20_000..=37_000).contains(&left),
        "the lease key expires in {left} ms (lease_ttl_ms=37000; the default is 10000)"
    );
    let _ = stop.send(());
    run.await.unwrap().unwrap();
}
