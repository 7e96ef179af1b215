//! Interop with a foreign AMQP client (pika, which `scripts/services`
//! installs): messages it publishes with a routing key alone run in per-key
//! order under keyorder, and keyorder's messages read back by it carry the
//! key as routing key and `keyorder-key` header, the body untouched.

use std::collections::HashMap;
use std::process::Command;
use std::sync::Arc;

mod common;
use common::Run;

use keyorder_core::{Client, KeySource, Message};
use keyorder_rabbitmq::lapin::options::{QueueBindOptions, QueueDeclareOptions};
use keyorder_rabbitmq::lapin::types::FieldTable;
use keyorder_rabbitmq::lapin::{Connection, ConnectionProperties};
use keyorder_rabbitmq::RabbitTransport;

fn base() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

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
    let t = RabbitTransport::from_url(&format!("{}?{HASH}", base()).parse().unwrap())
        .await
        .expect("RabbitMQ must be reachable (run scripts/services)");
    Client::new(Arc::new(t))
}

fn keys() -> Vec<String> {
    (0..20).map(|i| format!("customer-{i}")).collect()
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
    run.until(200, 60).await;
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
