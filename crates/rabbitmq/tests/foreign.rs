//! Foreign producers (issue 36, finding 4): a plain AMQP publisher that
//! knows nothing of keyorder's headers. A message carrying only a routing
//! key is ordered by it; a header key source may name an `x-` header; a
//! keyorder-published keyless message stays keyless.

use common::base;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

mod common;
use common::Run;

use keyorder_core::{Client, Delivery, HandlerResult, KeySource, Message};
use keyorder_rabbitmq::lapin::options::BasicPublishOptions;
use keyorder_rabbitmq::lapin::types::{AMQPValue, FieldTable, ShortString};
use keyorder_rabbitmq::lapin::{BasicProperties, Connection, ConnectionProperties};
use tokio::time::Instant;

const HASH: &str = "topology=hash&queues=4&queue_type=classic&expires_ms=600000&consumer_timeout_ms=3600000";
const SAC: &str = "topology=sac&queue_type=classic&expires_ms=600000&consumer_timeout_ms=3600000";

async fn client(options: &str) -> Client {
    let t = common::connect(&format!("{}?{options}", base())).await;
    Client::new(Arc::new(t))
}

fn category(prefix: &str) -> String {
    format!("{prefix}-{}", &uuid::Uuid::new_v4().simple().to_string()[..12])
}

/// Publishes as a plain AMQP client would: to the category's entry
/// exchange, routing key `routing`, payload `key/seq`, with `headers`.
async fn foreign_publish(category: &str, messages: &[(String, String, FieldTable)]) {
    let conn = Connection::connect(&base(), ConnectionProperties::default())
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(Default::default()).await.unwrap();
    let entry = format!("{category}:entry");
    for (routing, payload, headers) in messages {
        ch.basic_publish(
            entry.as_str().into(),
            routing.as_str().into(),
            BasicPublishOptions::default(),
            payload.as_bytes(),
            BasicProperties::default()
                .with_delivery_mode(2)
                .with_headers(headers.clone()),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    }
    let _ = conn.close(200, "done".into()).await;
}

fn rounds(keys: usize, rounds: usize, headers: impl Fn(&str) -> FieldTable) -> Vec<(String, String, FieldTable)> {
    let mut out = Vec::new();
    for r in 0..rounds {
        for k in 0..keys {
            let key = format!("customer-{k}");
            out.push((key.clone(), format!("{key}/{r}"), headers(&key)));
        }
    }
    out
}

/// Per key (from the payload), the sequence numbers in run order.
fn per_key(seen: &[(Option<String>, String)]) -> HashMap<String, Vec<usize>> {
    let mut out: HashMap<String, Vec<usize>> = HashMap::new();
    for (_, p) in seen {
        let (k, s) = p.rsplit_once('/').unwrap();
        out.entry(k.to_owned()).or_default().push(s.parse().unwrap());
    }
    out
}

/// A plain AMQP producer sets only the routing key: each message is
/// delivered with that key (ordered by it, not keyless), in per-key order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_routing_key_alone_orders_a_foreign_message() {
    let cat = category("foreign-rk");
    let c = client(HASH).await;
    let sub = c
        .subscribe(&cat, "g")
        .ordered_by(KeySource::routing_key())
        .build()
        .await
        .unwrap();
    let stats = sub.stats();
    let run = Run::start(sub);
    let msgs = rounds(20, 10, |_| FieldTable::default());
    foreign_publish(&cat, &msgs).await;
    run.until(msgs.len(), 60).await;
    let (seen, _) = run.stop().await;
    for (key, payload) in &seen {
        let want = payload.rsplit_once('/').unwrap().0;
        assert_eq!(key.as_deref(), Some(want), "the delivery's key is its routing key");
    }
    for (k, s) in per_key(&seen) {
        assert_eq!(s, (0..10).collect::<Vec<_>>(), "key {k} in order, once each");
    }
    let snap = stats.snapshot();
    assert_eq!(snap.keyless, 0, "none was taken for keyless: {snap:?}");
    assert_eq!(snap.key_mismatches, 0, "{snap:?}");
}

/// A header key source may name an `x-` header a foreign producer sets
/// (routing key = the same value).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_header_key_source_may_name_an_x_header() {
    let cat = category("foreign-x");
    let c = client(SAC).await;
    let sub = c
        .subscribe(&cat, "g")
        .ordered_by(KeySource::header("x-tenant"))
        .build()
        .await
        .unwrap();
    let stats = sub.stats();
    let run = Run::start(sub);
    let msgs = rounds(10, 5, |k| {
        let mut h = FieldTable::default();
        h.insert(
            ShortString::from("x-tenant"),
            AMQPValue::LongString(k.as_bytes().into()),
        );
        h
    });
    foreign_publish(&cat, &msgs).await;
    run.until(msgs.len(), 60).await;
    let (seen, _) = run.stop().await;
    for (key, payload) in &seen {
        assert_eq!(key.as_deref(), Some(payload.rsplit_once('/').unwrap().0));
    }
    for (k, s) in per_key(&seen) {
        assert_eq!(s, (0..5).collect::<Vec<_>>(), "key {k} in order, once each");
    }
    let snap = stats.snapshot();
    assert_eq!(snap.parked, 0, "nothing dead-lettered: {snap:?}");
}

/// A message keyorder published without a key stays keyless (its routing
/// key is a hash of its id, not a key).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyorder_keyless_message_stays_keyless() {
    let cat = category("foreign-keyless");
    let c = client(HASH).await;
    let sub = c
        .subscribe(&cat, "g")
        .ordered_by(KeySource::routing_key())
        .build()
        .await
        .unwrap();
    let stats = sub.stats();
    let run = Run::start(sub);
    let p = c.publisher(&cat).await.unwrap();
    for i in 0..20 {
        p.publish(Message::new(format!("none/{i}"))).await.unwrap();
    }
    run.until(20, 60).await;
    let (seen, _) = run.stop().await;
    assert!(seen.iter().all(|(k, _)| k.is_none()), "{seen:?}");
    assert_eq!(stats.snapshot().keyless, 20);
}

/// A routing key as real systems have them (`tenant:1`, which wave 1
/// refused) orders its messages under itself, and a `keyorder-key` header
/// that differs from the routing key the message was placed by is parked,
/// never run under it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn colon_and_conflicting_routing_keys() {
    let cat = category("foreign-bad");
    let c = client(HASH).await;
    let sub = c
        .subscribe(&cat, "g")
        .ordered_by(KeySource::routing_key())
        .build()
        .await
        .unwrap();
    let stats = sub.stats();
    let run = Run::start(sub);
    let mut msgs = Vec::new();
    for i in 0..5 {
        msgs.push(("tenant:1".to_owned(), format!("tenant/{i}"), FieldTable::default()));
    }
    for i in 0..5 {
        let mut h = FieldTable::default();
        h.insert(
            ShortString::from("keyorder-key"),
            AMQPValue::LongString("customer-1".as_bytes().into()),
        );
        msgs.push(("customer-2".to_owned(), format!("conflict/{i}"), h));
    }
    foreign_publish(&cat, &msgs).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let s = stats.snapshot();
        if s.applied >= 5 && s.key_mismatches >= 5 {
            break;
        }
        assert!(Instant::now() < deadline, "{s:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (seen, _) = run.stop().await;
    let ran: Vec<&str> = seen.iter().map(|(_, p)| p.as_str()).collect();
    assert_eq!(
        ran,
        (0..5).map(|i| format!("tenant/{i}")).collect::<Vec<_>>(),
        "only tenant:1's ran, in order"
    );
    assert!(
        seen.iter().all(|(k, _)| k.as_deref() == Some("tenant:1")),
        "under their routing key: {seen:?}"
    );
    assert_eq!(stats.snapshot().keyless, 0);
    let dead = c.admin().dead_letters(&cat, "g").await.unwrap();
    assert_eq!(dead.len(), 5, "{dead:?}");
}

/// A foreign message parked by the poison policy keeps its key in the
/// dead-letter queue (it was routed by its routing key alone).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_foreign_message_keeps_its_key() {
    let cat = category("foreign-park");
    let c = client(HASH).await;
    let sub = c
        .subscribe(&cat, "g")
        .ordered_by(KeySource::routing_key())
        .poison(keyorder_core::PoisonPolicy::Park { max_attempts: 1 })
        .build()
        .await
        .unwrap();
    let handler = |_d: Delivery| async move { HandlerResult::Err(keyorder_core::HandlerError::poison("boom")) };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(sub.run(handler, async move {
        let _ = stopped.await;
    }));
    foreign_publish(
        &cat,
        &[(
            "customer-7".to_owned(),
            "customer-7/0".to_owned(),
            FieldTable::default(),
        )],
    )
    .await;
    let deadline = Instant::now() + Duration::from_secs(60);
    let dead = loop {
        let dead = c.admin().dead_letters(&cat, "g").await.unwrap();
        if !dead.is_empty() {
            break dead;
        }
        assert!(Instant::now() < deadline, "nothing was parked");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let _ = stop.send(());
    run.await.unwrap().unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(
        dead[0].label,
        keyorder_core::key::label("customer-7"),
        "the dead letter keeps its key"
    );
}

/// A publisher cannot forge how often a message was tried (issue 37): an
/// `x-delivery-count` of 1000 set by the publisher on a classic queue is
/// not the broker's, so the message runs as a first attempt, once, under
/// the poison policy's full budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_set_delivery_count_is_not_an_attempt_count() {
    let cat = category("foreign-count");
    let c = client(HASH).await;
    let sub = c
        .subscribe(&cat, "g")
        .ordered_by(KeySource::routing_key())
        .poison(keyorder_core::PoisonPolicy::Halt)
        .build()
        .await
        .unwrap();
    let stats = sub.stats();
    let attempts: Arc<std::sync::Mutex<Vec<u32>>> = Arc::default();
    let seen = attempts.clone();
    let handler = move |d: Delivery| {
        let seen = seen.clone();
        async move {
            seen.lock().unwrap().push(d.attempt());
            HandlerResult::Ok(())
        }
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(sub.run(handler, async move {
        let _ = stopped.await;
    }));
    let mut h = FieldTable::default();
    h.insert(ShortString::from("x-delivery-count"), AMQPValue::LongLongInt(1000));
    foreign_publish(&cat, &[("customer-1".to_owned(), "forged/0".to_owned(), h)]).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    while stats.snapshot().applied < 1 {
        assert!(Instant::now() < deadline, "{:?}", stats.snapshot());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = stop.send(());
    run.await.unwrap().unwrap();
    assert_eq!(*attempts.lock().unwrap(), vec![1], "one first attempt");
    assert_eq!(stats.snapshot().halts, 0);
}
