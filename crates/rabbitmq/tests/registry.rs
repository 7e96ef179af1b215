//! The group registry on the real RabbitMQ: drift refused with and without
//! `declare`, after a lost registry, registry queues that never expire, a
//! lock held only to read and record, records that cannot be read, groups
//! removed by another process, and publish input that AMQP cannot carry.

// Shared set-up; this file uses only part of it.
#[allow(dead_code)]
mod common;

use common::base;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use keyorder_core::{Client, Delivery, Error, HandlerResult, KeySource, LeaseConfig, Message};
use keyorder_rabbitmq::{Names, RabbitTransport};
use lapin::options::{BasicPublishOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};

fn url(options: &str) -> String {
    format!(
        "{}?{options}&queue_type=classic&expires_ms=600000&consumer_timeout_ms=3600000",
        base()
    )
}

async fn transport(url: &str) -> RabbitTransport {
    common::connect(url).await
}

async fn client(url: &str) -> Client {
    Client::new(Arc::new(transport(url).await))
}

fn category(prefix: &str) -> String {
    format!("{prefix}-{}", &uuid::Uuid::new_v4().simple().to_string()[..12])
}

fn lease() -> LeaseConfig {
    LeaseConfig {
        ttl: Duration::from_secs(4),
        heartbeat: Duration::from_millis(500),
        margin: Duration::from_millis(1500),
    }
}

async fn raw() -> (Connection, Channel) {
    let conn = Connection::connect(&base(), ConnectionProperties::default())
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    (conn, ch)
}

/// Whether `queue` exists (a passive declaration on a channel of its own).
async fn exists(conn: &Connection, queue: &str) -> bool {
    let ch = conn.create_channel().await.unwrap();
    let passive = QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    let found = ch
        .queue_declare(queue.into(), passive, FieldTable::default())
        .await
        .is_ok();
    if found {
        let _ = ch.close(200, "checked".into()).await;
    }
    found
}

/// `(messages ready, consumers)` of an existing queue.
async fn state(conn: &Connection, queue: &str) -> (u32, u32) {
    let ch = conn.create_channel().await.unwrap();
    let passive = QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    let q = ch
        .queue_declare(queue.into(), passive, FieldTable::default())
        .await
        .unwrap_or_else(|e| panic!("{queue}: {e}"));
    let _ = ch.close(200, "checked".into()).await;
    (q.message_count(), q.consumer_count())
}

async fn subscribe(client: &Client, cat: &str, group: &str) -> keyorder_core::Result<keyorder_core::Subscription> {
    client
        .subscribe(cat, group)
        .ordered_by(KeySource::routing_key())
        .lease(lease())
        .build()
        .await
}

/// 1: a group declared with hash:4 is refused to a `declare=false`
/// subscription with queues=2 (it would never consume queues 2 and 3),
/// and to one with another topology.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn declare_false_refuses_another_queue_count_or_topology() {
    let cat = category("verify");
    let _publisher = client(&format!("{}&groups=g", url("topology=hash&queues=4")))
        .await
        .publisher(&cat)
        .await
        .unwrap();
    for other in ["topology=hash&queues=2&declare=false", "topology=sac&declare=false"] {
        let err = subscribe(&client(&url(other)).await, &cat, "g").await.unwrap_err();
        let text = err.to_string();
        assert!(
            matches!(err, Error::Config(_)) && text.contains("topology=hash&queues=4"),
            "{other}: {text}"
        );
    }
    // The declared topology itself verifies.
    let sub = subscribe(&client(&url("topology=hash&queues=4&declare=false")).await, &cat, "g")
        .await
        .unwrap();
    drop(sub);
    transport(&url("topology=hash&queues=4"))
        .await
        .delete_category(&cat)
        .await
        .unwrap();
}

/// 2a: with `expires_ms`, the registry, its lock and the group's dead-letter
/// queue are declared without `x-expires` (nothing consumes them while the
/// group runs): a declaration without it is accepted, not a 406.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registry_lock_and_dead_letters_never_expire() {
    let cat = category("expiry");
    let u = format!(
        "{}?topology=hash&queues=2&queue_type=classic&expires_ms=5000&consumer_timeout_ms=3600000&groups=g",
        base()
    );
    let t = transport(&u).await;
    let _publisher = Client::new(Arc::new(t.clone())).publisher(&cat).await.unwrap();
    let n = Names::new(&cat).unwrap();
    let g = n.group("g").unwrap();
    let (conn, _) = raw().await;
    for q in [n.registry(), n.registry_lock(), g.dlq()] {
        let ch = conn.create_channel().await.unwrap();
        let mut args = FieldTable::default();
        args.insert(
            "x-queue-type".into(),
            AMQPValue::LongString(LongString::from("classic")),
        );
        let res = ch
            .queue_declare(
                q.as_str().into(),
                QueueDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                args,
            )
            .await;
        assert!(res.is_ok(), "`{q}` must have no x-expires: {res:?}");
    }
    t.delete_category(&cat).await.unwrap();
    let _ = conn.close(200, "done".into()).await;
}

/// 2b: a registry that lost its records (deleted, expired under an older
/// version, lost with its node) while the group's queues exist: another
/// queue count (more or fewer) or another topology is refused, the
/// group's own is recorded again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_registry_still_refuses_drift() {
    let cat = category("lost");
    let first = client(&format!("{}&groups=g", url("topology=hash&queues=3"))).await;
    let _publisher = first.publisher(&cat).await.unwrap();
    let n = Names::new(&cat).unwrap();
    let (conn, ch) = raw().await;
    ch.queue_delete(n.registry().as_str().into(), Default::default())
        .await
        .unwrap();
    for other in ["topology=hash&queues=4", "topology=hash&queues=2", "topology=sac"] {
        let err = client(&format!("{}&groups=g", url(other)))
            .await
            .publisher(&cat)
            .await
            .unwrap_err();
        assert!(
            matches!(err, Error::Config(_)) && err.to_string().contains("topology=hash&queues=3"),
            "{other}: {err}"
        );
        let err = subscribe(&client(&url(other)).await, &cat, "g").await.unwrap_err();
        assert!(err.to_string().contains("topology=hash&queues=3"), "{other}: {err}");
    }
    let g = n.group("g").unwrap();
    assert!(!exists(&conn, &g.hash_queue(3)).await, "no queue was added to the ring");
    assert!(!exists(&conn, &g.sac_queue()).await, "no sac queue was bound");
    // The group's own topology is recorded again, and then enforced.
    let admin = client(&url("topology=hash&queues=3")).await.admin();
    let sub = subscribe(&client(&url("topology=hash&queues=3")).await, &cat, "g")
        .await
        .unwrap();
    assert_eq!(
        admin
            .groups(&cat)
            .await
            .unwrap()
            .iter()
            .map(|g| g.name.clone())
            .collect::<Vec<_>>(),
        vec!["g".to_owned()]
    );
    drop(sub);
    transport(&url("topology=hash&queues=3"))
        .await
        .delete_category(&cat)
        .await
        .unwrap();
    let _ = conn.close(200, "done".into()).await;
}

/// 3: the registry lock is held only to read and record a group, not
/// while its queues are declared: another group of the category is
/// declared while a 1024-queue group still declares its queues.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_group_declaration_does_not_hold_the_registry_lock() {
    let cat = category("lock");
    let n = Names::new(&cat).unwrap();
    let big = n.group("big").unwrap();
    let big_client = client(&format!("{}&groups=big", url("topology=hash&queues=1024"))).await;
    let c = cat.clone();
    let declaring = tokio::spawn(async move { big_client.publisher(&c).await.map(|_| tokio::time::Instant::now()) });
    let (conn, _) = raw().await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while !exists(&conn, &big.hash_queue(0)).await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the big group never started declaring"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let small = client(&format!("{}&groups=small", url("topology=hash&queues=1"))).await;
    let _publisher = small.publisher(&cat).await.unwrap();
    let small_done = tokio::time::Instant::now();
    let big_done = declaring.await.unwrap().unwrap();
    assert!(
        small_done < big_done,
        "the small group waited for the big group's whole declaration ({:?} after it)",
        small_done - big_done
    );
    transport(&url("topology=hash&queues=1"))
        .await
        .delete_category(&cat)
        .await
        .unwrap();
    let _ = conn.close(200, "done".into()).await;
}

/// 4: a message id, correlation id or header name that AMQP cannot carry
/// (over 255 bytes) is refused in the `publish` call, naming the limit;
/// nothing is stored. A keyless message with the longest id is carried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_refuses_what_amqp_cannot_carry_without_panicking() {
    let cat = category("long");
    let t = transport(&format!("{}&groups=g", url("topology=hash&queues=2"))).await;
    let publisher = Client::new(Arc::new(t.clone())).publisher(&cat).await.unwrap();
    let long = "x".repeat(256);
    let cases = [
        ("message id", Message::new("m").with_id(long.clone())),
        ("keyless message id", Message::new("m").with_id(long.clone())),
        (
            "correlation id",
            Message::new("m")
                .with_key("k")
                .unwrap()
                .with_correlation_id(long.clone()),
        ),
        (
            "header name",
            Message::new("m").with_key("k").unwrap().with_header(long.clone(), "v"),
        ),
    ];
    for (what, m) in cases {
        let publisher = publisher.clone();
        let res = tokio::spawn(async move { publisher.publish(m).await }).await;
        let err = res
            .unwrap_or_else(|e| panic!("{what}: publish panicked: {e}"))
            .unwrap_err();
        assert!(matches!(&err, Error::Config(t) if t.contains("255")), "{what}: {err:?}");
    }
    let (conn, _) = raw().await;
    let g = Names::new(&cat).unwrap().group("g").unwrap();
    let stored = state(&conn, &g.hash_queue(0)).await.0 + state(&conn, &g.hash_queue(1)).await.0;
    assert_eq!(stored, 0, "nothing refused was stored");
    // The longest id AMQP carries, keyless: routed by a hash of it.
    publisher
        .publish(Message::new("m").with_id("y".repeat(255)))
        .await
        .unwrap();
    let stored = state(&conn, &g.hash_queue(0)).await.0 + state(&conn, &g.hash_queue(1)).await.0;
    assert_eq!(stored, 1);
    t.delete_category(&cat).await.unwrap();
    let _ = conn.close(200, "done".into()).await;
}

/// 5: a registry record that cannot be read (a name outside the rules,
/// not JSON) is skipped: `groups` lists the others and `delete_category`
/// deletes the category.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreadable_registry_record_is_skipped() {
    let cat = category("badrecord");
    let t = transport(&format!("{}&groups=good", url("topology=hash&queues=2"))).await;
    let c = Client::new(Arc::new(t.clone()));
    let _publisher = c.publisher(&cat).await.unwrap();
    let n = Names::new(&cat).unwrap();
    let (conn, ch) = raw().await;
    for body in [
        r#"{"group":"bad:name","topology":"hash:2"}"#,
        r#"{"group":"odd","topology":"hash:x"}"#,
        "not json",
    ] {
        ch.basic_publish(
            "".into(),
            n.registry().as_str().into(),
            BasicPublishOptions::default(),
            body.as_bytes(),
            BasicProperties::default().with_delivery_mode(2),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while state(&conn, &n.registry()).await.0 < 4 {
        assert!(tokio::time::Instant::now() < deadline, "records not stored");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let groups = c.admin().groups(&cat).await.unwrap();
    assert_eq!(
        groups.iter().map(|g| g.name.clone()).collect::<Vec<_>>(),
        vec!["good".to_owned()]
    );
    let gone = t.delete_category(&cat).await.unwrap();
    assert!(gone.contains(&n.group("good").unwrap().hash_queue(0)), "{gone:?}");
    assert!(!exists(&conn, &n.registry()).await);
    let _ = conn.close(200, "done".into()).await;
}

/// 6: a group removed by another process is declared again when this
/// process, which declared it earlier, builds its subscription again; and
/// `delete_category` leaves none of the group's queues and exchanges.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_removed_elsewhere_restarts_here() {
    let cat = category("removed");
    let u = url("topology=hash&queues=2");
    let t = transport(&u).await;
    let c = Client::new(Arc::new(t.clone()));
    // Declared (and cached as declared) here, then stopped.
    let sub = subscribe(&c, &cat, "g").await.unwrap();
    drop(sub);
    let other = client(&u).await.admin();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        match other.remove_group(&cat, "g").await {
            Ok(()) => break,
            Err(e) => assert!(tokio::time::Instant::now() < deadline, "not removed: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Built again here: declared anew, and it receives what is published.
    let sub = subscribe(&c, &cat, "g").await.unwrap();
    let applied: Arc<Mutex<Vec<String>>> = Arc::default();
    let log = applied.clone();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(sub.run(
        move |d: Delivery| {
            let log = log.clone();
            async move {
                log.lock()
                    .unwrap()
                    .push(String::from_utf8_lossy(d.payload()).into_owned());
                HandlerResult::Ok(())
            }
        },
        async move {
            let _ = stop_rx.await;
        },
    ));
    c.publisher(&cat)
        .await
        .unwrap()
        .publish(Message::new("after").with_key("k").unwrap())
        .await
        .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while applied.lock().unwrap().is_empty() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the re-declared group received nothing"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = stop_tx.send(());
    run.await.unwrap().unwrap();
    t.delete_category(&cat).await.unwrap();
    let (conn, _) = raw().await;
    let n = Names::new(&cat).unwrap();
    let g = n.group("g").unwrap();
    for q in [g.members(), g.dlq(), g.hash_queue(0), n.registry(), n.registry_lock()] {
        assert!(!exists(&conn, &q).await, "`{q}` left behind");
    }
    let ch = conn.create_channel().await.unwrap();
    let presence = ch
        .exchange_declare(
            g.presence().as_str().into(),
            lapin::ExchangeKind::Fanout,
            lapin::options::ExchangeDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await;
    assert!(presence.is_err(), "the presence exchange was left behind");
    let _ = conn.close(200, "done".into()).await;
}
