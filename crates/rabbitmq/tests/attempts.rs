//! Attempts counted on the attempts stream, through the public API on the
//! real RabbitMQ: an operator's skip forgets a head's count (a later
//! message with its id counts from 1), and two messages of different keys
//! that share a `message_id` keep counts of their own. (Both failed before
//! the fix: `second` was halted after one attempt; the counts were
//! `[1, 2, 5]` and `[1, 3, 4]`.)

// Shared set-up; this file uses only part of it.
#[allow(dead_code)]
mod common;

use common::base;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use keyorder_core::{
    Client, Delivery, HandlerError, HandlerResult, HeadAction, KeySource, LeaseConfig, Message, PoisonPolicy,
    RetryPolicy,
};
use keyorder_rabbitmq::RabbitTransport;
use keyorder_testkit::instance::wait_until;

fn url() -> String {
    format!(
        "{}?topology=hash&queues=2&queue_type=classic&expires_ms=600000&consumer_timeout_ms=3600000",
        base()
    )
}

async fn client() -> Client {
    let t = RabbitTransport::from_url(&url().parse().unwrap()).await.unwrap();
    Client::new(Arc::new(t))
}

fn lease() -> LeaseConfig {
    LeaseConfig {
        ttl: Duration::from_secs(4),
        heartbeat: Duration::from_millis(500),
        margin: Duration::from_millis(1500),
    }
}

type Log = Arc<Mutex<BTreeMap<String, Vec<u32>>>>;

/// An operator's `skip` of a halted head writes a reset record: a later
/// message with the same `message_id` (a dead letter replayed, an outbox
/// that published twice, a producer's idempotency key) counts its own
/// attempts from 1 (it inherited the skipped head's and halted after one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_skipped_heads_count_is_forgotten_and_the_next_message_with_its_id_counts_from_1() {
    let category = format!("att-skip-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let id = format!("dup-{}", uuid::Uuid::new_v4().simple());
    let c = client().await;
    let sub = c
        .subscribe(&category, "g")
        .ordered_by(KeySource::routing_key())
        .poison(PoisonPolicy::Halt)
        .retry(RetryPolicy {
            max_attempts: 3,
            initial_backoff: Duration::from_millis(20),
            max_backoff: Duration::from_millis(50),
        })
        .lease(lease())
        .build()
        .await
        .unwrap();
    let log: Log = Arc::default();
    let l = log.clone();
    let handler = move |d: Delivery| {
        let l = l.clone();
        async move {
            let body = String::from_utf8_lossy(d.payload()).into_owned();
            l.lock().unwrap().entry(body.clone()).or_default().push(d.attempt());
            match body.as_str() {
                "first" => Err(HandlerError::retry("always fails")),
                "second" if d.attempt() == 1 => Err(HandlerError::retry("fails once")),
                _ => HandlerResult::Ok(()),
            }
        }
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(sub.run(handler, async move {
        let _ = stopped.await;
    }));
    let p = c.publisher(&category).await.unwrap();
    p.publish(Message::new("first").with_key("p").unwrap().with_id(id.clone()))
        .await
        .unwrap();
    let admin = c.admin();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if admin
            .halted(&category, "g")
            .await
            .map(|h| h.len() == 1)
            .unwrap_or(false)
        {
            break;
        }
        assert!(Instant::now() < deadline, "first never halted");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    admin
        .resolve(&category, "g", &keyorder_core::key::label("p"), HeadAction::Skip)
        .await
        .unwrap();
    // The same id again (as a replay of a dead letter or a duplicate would).
    p.publish(Message::new("second").with_key("p").unwrap().with_id(id.clone()))
        .await
        .unwrap();
    let ok = wait_until("second's two attempts", Duration::from_secs(20), async || {
        log.lock().unwrap().get("second").is_some_and(|a| a.len() >= 2)
    })
    .await
    .is_ok();
    let halted = admin.halted(&category, "g").await.unwrap_or_default();
    let seen = log.lock().unwrap().clone();
    let _ = stop.send(());
    let _ = tokio::time::timeout(Duration::from_secs(10), run).await;
    assert!(
        ok,
        "`second` failed once and should have run again as attempt 2 (max 3); attempts seen: {seen:?}; halted now: \
         {halted:?}"
    );
}

/// Two different messages (different keys) that share a `message_id` and
/// fail at the same time keep counts of their own (each was charged the
/// other's retries).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_of_two_keys_sharing_a_message_id_keep_counts_of_their_own() {
    let category = format!("att-share-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let id = format!("same-{}", uuid::Uuid::new_v4().simple());
    let c = client().await;
    let sub = c
        .subscribe(&category, "g")
        .ordered_by(KeySource::routing_key())
        .poison(PoisonPolicy::Halt)
        .retry(RetryPolicy {
            max_attempts: 5,
            initial_backoff: Duration::from_millis(200),
            max_backoff: Duration::from_millis(200),
        })
        .lease(lease())
        .build()
        .await
        .unwrap();
    let log: Log = Arc::default();
    let l = log.clone();
    let handler = move |d: Delivery| {
        let l = l.clone();
        async move {
            let body = String::from_utf8_lossy(d.payload()).into_owned();
            let n = {
                let mut g = l.lock().unwrap();
                let v = g.entry(body.clone()).or_default();
                v.push(d.attempt());
                v.len()
            };
            // Needs three real runs.
            if n < 3 {
                return Err(HandlerError::retry("not yet"));
            }
            HandlerResult::Ok(())
        }
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(sub.run(handler, async move {
        let _ = stopped.await;
    }));
    let p = c.publisher(&category).await.unwrap();
    for key in ["a", "b"] {
        p.publish(Message::new(key).with_key(key).unwrap().with_id(id.clone()))
            .await
            .unwrap();
    }
    let _ = wait_until("two keys with three attempts", Duration::from_secs(20), async || {
        log.lock().unwrap().values().filter(|v| v.len() >= 3).count() == 2
    })
    .await;
    let seen = log.lock().unwrap().clone();
    let _ = stop.send(());
    let _ = tokio::time::timeout(Duration::from_secs(10), run).await;
    assert_eq!(
        seen.values().cloned().collect::<Vec<_>>(),
        vec![vec![1, 2, 3], vec![1, 2, 3]],
        "each message's own attempts, 1 2 3: {seen:?}"
    );
}
