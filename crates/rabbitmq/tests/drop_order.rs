//! A subscription dropped (its task aborted, no graceful close) while it
//! holds a key's messages unacknowledged must hand the queue on, head
//! first. Its channels are closed before its consumers go: a dropped source
//! that only ended its tasks left its consumer registered and its channel
//! holding the deliveries on a connection that stayed up (the standby never
//! got the key: this test, before `Source::drop` closed the channels), and a
//! `basic.cancel` before the close would let RabbitMQ give the standby the
//! key's later messages while the dropped channel still held the earlier
//! ones (the model's CANCEL_BEFORE_CLOSE, `verification/rabbitmq.pml`).

// Shared set-up; this file uses only part of it.
#[allow(dead_code)]
mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use keyorder_core::{Client, Delivery, HandlerResult, KeySource, LeaseConfig, Message};
use keyorder_testkit::until;
use tokio::time::Instant;

/// Three times the prefetch (`prefetch=10` below): the standby has later
/// messages to be given while the dropped owner holds the first ones.
const N: u32 = 30;

fn url(options: &str) -> String {
    let base = keyorder_testkit::brokers::Broker::RabbitMq.url();
    format!("{base}?{options}")
}

async fn client(url: &str) -> Client {
    let t = common::connect(url).await;
    Client::new(Arc::new(t))
}

fn lease() -> LeaseConfig {
    LeaseConfig {
        ttl: Duration::from_secs(10),
        heartbeat: Duration::from_secs(2),
        margin: Duration::from_secs(2),
    }
}

async fn dropped_owner_hands_the_key_on_in_order(options: &str) {
    let cat = format!("drop-order-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let url = url(options);
    let (ca, cb, cp) = (client(&url).await, client(&url).await, client(&url).await);
    let started_a: Arc<Mutex<Vec<u32>>> = Arc::default();
    let log = started_a.clone();
    let a = ca
        .subscribe(&cat, "g")
        .ordered_by(KeySource::routing_key())
        .instance_id("drop-a")
        .lease(lease())
        .concurrency(4)
        .build()
        .await
        .unwrap();
    // A starts `0` and never finishes it: the key's later messages wait in
    // A, unacknowledged.
    let run_a = tokio::spawn(a.run(
        move |d: Delivery| {
            let log = log.clone();
            async move {
                let seq: u32 = String::from_utf8_lossy(d.payload()).parse().unwrap();
                log.lock().unwrap().push(seq);
                std::future::pending::<()>().await;
                HandlerResult::Ok(())
            }
        },
        std::future::pending::<()>(),
    ));
    let p = cp.publisher(&cat).await.unwrap();
    for s in 0..N {
        p.publish(Message::new(s.to_string()).with_key("the-key").unwrap())
            .await
            .unwrap();
    }
    let seen = started_a.clone();
    until(
        "A to start the key's first message",
        Duration::from_secs(60),
        async || !seen.lock().unwrap().is_empty(),
    )
    .await;
    assert_eq!(
        started_a.lock().unwrap().as_slice(),
        [0],
        "A started more than the key's head"
    );

    let started_b: Arc<Mutex<Vec<u32>>> = Arc::default();
    let log = started_b.clone();
    let b = cb
        .subscribe(&cat, "g")
        .ordered_by(KeySource::routing_key())
        .instance_id("drop-b")
        .lease(lease())
        .concurrency(4)
        .build()
        .await
        .unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run_b = tokio::spawn(b.run(
        move |d: Delivery| {
            let log = log.clone();
            async move {
                let seq: u32 = String::from_utf8_lossy(d.payload()).parse().unwrap();
                log.lock().unwrap().push(seq);
                HandlerResult::Ok(())
            }
        },
        async move {
            let _ = stopped.await;
        },
    ));
    assert!(
        started_b.lock().unwrap().is_empty(),
        "B started work while A owned the queue"
    );

    run_a.abort();
    let _ = run_a.await;
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let g = started_b.lock().unwrap().clone();
        if (0..N).all(|s| g.contains(&s)) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "B did not get every message of the key within 90 s (B's starts: {g:?}): the dropped owner's channel \
             kept its deliveries"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _ = stop.send(());
    let _ = tokio::time::timeout(Duration::from_secs(30), run_b).await;
    let seen = started_b.lock().unwrap().clone();
    assert_eq!(
        seen.first(),
        Some(&0),
        "B's first start was not the key's head (starts: {seen:?})"
    );
    let mut high = 0;
    for s in &seen {
        assert!(
            *s >= high,
            "message {s} of the key started after message {high} (B's starts: {seen:?}): the dropped owner's consumer \
             went before its channel closed"
        );
        high = high.max(*s);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sac_dropped_owner_hands_the_key_on_in_order() {
    dropped_owner_hands_the_key_on_in_order(
        "topology=sac&prefetch=10&queue_type=classic&expires_ms=600000&consumer_timeout_ms=3600000",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hash_dropped_owner_hands_the_key_on_in_order() {
    dropped_owner_hands_the_key_on_in_order(
        "topology=hash&queues=1&prefetch=10&queue_type=classic&expires_ms=600000&consumer_timeout_ms=3600000",
    )
    .await;
}
