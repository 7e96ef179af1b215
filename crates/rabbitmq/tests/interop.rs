//! Interop with a foreign AMQP client (pika, which `scripts/services`
//! installs): messages it publishes with a routing key alone run in per-key
//! order under keyorder, and keyorder's messages read back by it carry the
//! key as routing key and `keyorder-key` header, the body untouched.

use common::base;
use std::collections::HashMap;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

mod common;
use common::Run;

use keyorder_core::{Client, KeySource, Message};
use keyorder_rabbitmq::lapin::options::{QueueBindOptions, QueueDeclareOptions};
use keyorder_rabbitmq::lapin::types::FieldTable;
use keyorder_rabbitmq::lapin::{Connection, ConnectionProperties};

const HASH: &str = "topology=hash&queues=4&queue_type=classic&expires_ms=600000&consumer_timeout_ms=3600000";

fn python(args: &[String]) -> String {
    let script = format!("{}/../../tests/interop/amqp_client.py", env!("CARGO_MANIFEST_DIR"));
    let out = Command::new("python3")
        .arg(script)
        .args(args)
        .output()
        .expect("python3 runs (scripts/services installs pika)");
    assert!(
        out.status.success(),
        "amqp_client.py {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

async fn client() -> Client {
    let t = common::connect(&format!("{}?{HASH}", base())).await;
    Client::new(Arc::new(t))
}

/// Keys as real systems have them (wave 1 refused the last six).
fn keys() -> Vec<String> {
    let mut keys: Vec<String> = (0..14).map(|i| format!("customer-{i}")).collect();
    keys.extend(
        [
            "customer:42",
            "{tenant}:7",
            "42",
            "dlq",
            "__partitions__",
            "tab\tkey",
            "ключ",
        ]
        .iter()
        .map(|k| (*k).to_owned()),
    );
    keys
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pika_routing_keys_run_in_per_key_order() {
    let cat = format!("interop-in-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let c = client().await;
    let sub = c
        .subscribe(&cat, "g")
        .ordered_by(KeySource::routing_key())
        .build()
        .await
        .unwrap();
    let run = Run::start(sub);
    let keys = keys();
    let mut args = vec!["produce".to_owned(), base(), format!("{cat}:entry"), "10".to_owned()];
    args.extend(keys.iter().cloned());
    tokio::task::spawn_blocking(move || python(&args)).await.unwrap();
    run.until(keys.len() * 10, 60).await;
    let (seen, _) = run.stop().await;
    let mut per_key: HashMap<String, Vec<u32>> = HashMap::new();
    for (key, body) in &seen {
        let (k, r) = body.rsplit_once('/').unwrap();
        assert_eq!(key.as_deref(), Some(k), "ordered by its routing key");
        per_key.entry(k.to_owned()).or_default().push(r.parse().unwrap());
    }
    assert_eq!(per_key.len(), keys.len());
    for (k, rounds) in per_key {
        assert_eq!(rounds, (0..10).collect::<Vec<_>>(), "key {k}: once each, in order");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keyorder_messages_read_back_by_pika_untouched() {
    let cat = format!("interop-out-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let c = client().await;
    // A keyorder group declares the category's entry exchange; the foreign
    // consumer binds a queue of its own to it.
    let _sub = c
        .subscribe(&cat, "g")
        .ordered_by(KeySource::routing_key())
        .build()
        .await
        .unwrap();
    let queue = format!("{cat}-foreign");
    let conn = Connection::connect(&base(), ConnectionProperties::default())
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    ch.queue_declare(
        queue.as_str().into(),
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.queue_bind(
        queue.as_str().into(),
        format!("{cat}:entry").as_str().into(),
        "".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let publisher = c.publisher(&cat).await.unwrap();
    let keys = keys();
    for k in &keys {
        publisher
            .publish(Message::new(format!("{k}/payload")).with_key(k.as_str()).unwrap())
            .await
            .unwrap();
    }
    let args = vec!["consume".to_owned(), base(), queue.clone(), keys.len().to_string()];
    let out = tokio::task::spawn_blocking(move || python(&args)).await.unwrap();
    let mut seen = 0;
    for line in out.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let rk = v["routing_key"].as_str().unwrap();
        assert!(keys.iter().any(|k| k == rk), "routed by its key");
        assert_eq!(v["key"].as_str(), Some(rk), "the keyorder-key header is the key");
        assert_eq!(v["body"].as_str().unwrap(), format!("{rk}/payload"), "body untouched");
        seen += 1;
    }
    assert_eq!(seen, keys.len());
    let _ = ch.queue_delete(queue.as_str().into(), Default::default()).await;
    let _ = conn.close(200, "done".into()).await;
}

/// A foreign producer may set a routing key that is no UTF-8 (AMQP
/// forbids it; RabbitMQ routes it): the AMQP client cannot read such a
/// delivery and closes the connection on it, so the message stops its
/// queue. The user is told once, naming the fix; once the message is
/// removed as told, every other key runs, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_routing_key_that_is_no_utf8_is_reported_and_its_removal_frees_the_queue() {
    keyorder_testkit::logs::install();
    let cat = format!("interop-bin-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let c = client().await;
    let build = || c.subscribe(&cat, "g").ordered_by(KeySource::routing_key()).build();
    let run = Run::start(build().await.unwrap());
    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    let mut args = vec!["produce-hex".to_owned(), base(), format!("{cat}:entry"), "5".to_owned()];
    args.push(hex(&[0xff, 0x01, b'a']));
    args.extend(keys().iter().map(|k| hex(k.as_bytes())));
    tokio::task::spawn_blocking(move || python(&args)).await.unwrap();
    let reported = || {
        keyorder_testkit::logs::text()
            .lines()
            .filter(|l| l.contains(&cat) && l.contains("could not be read") && l.contains("Reject requeue false"))
            .count()
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while reported() == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the unreadable delivery was not reported"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Whatever ran meanwhile (other queues between reconnects) counts.
    let (before, _) = run.stop().await;
    assert_eq!(reported(), 1, "reported once per subscription, not per reconnect");
    // The fix the report names: a client that reads raw bytes removes it.
    let mut args = vec!["drop-unreadable".to_owned(), base()];
    args.extend((0..4).map(|i| format!("{cat}:g.hash.{i}")));
    let dropped = tokio::task::spawn_blocking(move || python(&args)).await.unwrap();
    assert_eq!(dropped.trim(), "5", "the five unreadable messages were removed");
    let run = Run::start(build().await.unwrap());
    let good = keys().len() * 5;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let mut per_key: HashMap<String, Vec<u32>> = HashMap::new();
        for (_, body) in before.iter().cloned().chain(run.snapshot()) {
            let (k, r) = body.rsplit_once('/').unwrap();
            per_key.entry(k.to_owned()).or_default().push(r.parse().unwrap());
        }
        let done = per_key.values().map(Vec::len).sum::<usize>() >= good;
        if done {
            for k in keys() {
                assert_eq!(
                    per_key.get(&hex(k.as_bytes())),
                    Some(&(0..5).collect::<Vec<_>>()),
                    "key {k}"
                );
            }
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{} of {good} ran after the removal",
            per_key.values().map(Vec::len).sum::<usize>()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    run.stop().await;
}
