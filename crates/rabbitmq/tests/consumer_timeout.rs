//! RabbitMQ's `consumer_timeout` redelivers a delivery left unacknowledged
//! past it, and a halted head stays unacknowledged. From 3.11.15 on each
//! ordered consumer sets its own timeout; before (Debian's 3.10.8, which the
//! README installs), no client can set or read it: an ordered subscription
//! starts anyway, under the broker's setting (a head halted longer comes
//! back first of its key and halts again), and the URL may state it.

// Shared set-up; this file uses only part of it.
#[allow(dead_code)]
mod common;

use common::base;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use keyorder_core::{Client, Delivery, HandlerError, HandlerResult, KeySource, Message, PoisonPolicy, RetryPolicy};
use keyorder_rabbitmq::RabbitTransport;

async fn transport(options: &str) -> RabbitTransport {
    let url = format!(
        "{}?topology=hash&queues=2&queue_type=classic&expires_ms=60000{options}",
        base()
    );
    common::connect(&url).await
}

async fn build(t: RabbitTransport, category: &str) -> keyorder_core::Result<()> {
    let client = Client::new(Arc::new(t));
    let sub = client
        .subscribe(category, "g")
        .ordered_by(KeySource::routing_key())
        .build()
        .await?;
    drop(sub);
    Ok(())
}

/// An ordered subscription starts on any broker with or without
/// `consumer_timeout_ms` (before, a broker older than 3.11.15 refused a URL
/// without it); an unordered one never needed it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ordered_start_needs_no_consumer_timeout_in_the_url() {
    let category = format!("ct-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let unstated = transport("").await;
    let version = unstated.broker_version().await.expect("the broker tells its version");
    build(unstated, &category)
        .await
        .unwrap_or_else(|e| panic!("RabbitMQ {version}: an ordered subscription without consumer_timeout_ms: {e}"));
    // Stated (what scripts/services configures): it starts on any version.
    build(transport("&consumer_timeout_ms=3600000").await, &category)
        .await
        .expect("a stated consumer_timeout starts");
    build(transport("&consumer_timeout_ms=off").await, &category)
        .await
        .expect("consumer_timeout off starts");
    // An unordered (plain) subscription never halts: no check.
    let plain = RabbitTransport::from_url(&format!("{}?topology=plain&expires_ms=60000", base()).parse().unwrap())
        .await
        .unwrap();
    let client = Client::new(Arc::new(plain));
    client
        .subscribe(&format!("{category}-plain"), "g")
        .build()
        .await
        .expect("an unordered subscription starts without it");
}

/// Without `consumer_timeout_ms`, on the broker the README installs, a
/// poison head halts in place: its key's next message does not run, other
/// keys flow, and the operator's view lists the halted key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_consumer_timeout_ms_a_poison_head_halts_its_key_in_place() {
    let category = format!("ct-halt-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let client = Client::new(Arc::new(transport("").await));
    let sub = client
        .subscribe(&category, "g")
        .ordered_by(KeySource::routing_key())
        .poison(PoisonPolicy::Halt)
        .retry(RetryPolicy {
            max_attempts: 1,
            ..RetryPolicy::default()
        })
        .build()
        .await
        .expect("an ordered subscription starts without consumer_timeout_ms");
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let log = seen.clone();
    let handler = move |d: Delivery| {
        let log = log.clone();
        async move {
            let body = String::from_utf8_lossy(d.payload()).into_owned();
            log.lock().unwrap().push(body.clone());
            if body == "poison" {
                Err(HandlerError::poison("a poison head"))
            } else {
                HandlerResult::Ok(())
            }
        }
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(sub.run(handler, async move {
        let _ = stopped.await;
    }));
    let publisher = client.publisher(&category).await.unwrap();
    for (key, body) in [("held", "poison"), ("held", "after"), ("free", "other")] {
        publisher
            .publish(Message::new(body).with_key(key).unwrap())
            .await
            .unwrap();
    }
    let admin = client.admin();
    keyorder_testkit::until(
        "the poison head halted and the other key ran",
        Duration::from_secs(60),
        async || {
            let halted = admin.halted(&category, "g").await.map_err(|e| e.to_string())?;
            let ran = seen.lock().unwrap().clone();
            if halted.len() == 1 && ran.contains(&"other".to_owned()) {
                Ok(())
            } else {
                Err(format!("halted {}, ran {ran:?}", halted.len()))
            }
        },
    )
    .await;
    let ran = seen.lock().unwrap().clone();
    assert_eq!(ran.iter().filter(|b| *b == "poison").count(), 1, "{ran:?}");
    assert!(
        !ran.contains(&"after".to_owned()),
        "the halted key's next message ran: {ran:?}"
    );
    let _ = stop.send(());
    run.await.unwrap().unwrap();
}

#[test]
fn a_bad_value_names_the_accepted_ones() {
    for bad in ["5", "abc", "-1", "3000000000"] {
        let url = format!("{}?topology=hash&consumer_timeout_ms={bad}", base());
        let e = keyorder_rabbitmq::RabbitConfig::from_url(&url.parse().unwrap()).unwrap_err();
        assert!(e.to_string().contains("`off` or a whole number of ms"), "{bad}: {e}");
    }
}
