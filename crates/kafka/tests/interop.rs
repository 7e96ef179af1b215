//! Interop with a foreign Kafka client (kafka-python, which `scripts/services`
//! installs): its keyed messages run in per-key order under keyorder, and
//! keyorder's messages read back with key and value untouched, on the
//! partition Java's default partitioner gives the key.

mod common;

use std::collections::HashMap;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use common::Recording;
use keyorder_core::{Client, KeySource, Message};
use keyorder_kafka::rdkafka::admin::{NewTopic, TopicReplication};
use keyorder_kafka::KafkaTransport;

fn script() -> String {
    format!("{}/../../tests/interop/kafka_client.py", env!("CARGO_MANIFEST_DIR"))
}

fn python(args: &[String]) -> String {
    let out = Command::new("python3")
        .arg(script())
        .args(args)
        .output()
        .expect("python3 runs (scripts/services installs kafka-python)");
    assert!(
        out.status.success(),
        "kafka_client.py {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

async fn create(topic: &str, partitions: i32) {
    common::create_topics(&[NewTopic::new(topic, partitions, TopicReplication::Fixed(1))]).await;
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The keys real systems use that every adapter carries today.
fn keys() -> Vec<String> {
    (0..20).map(|i| format!("customer-{i}")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_python_keyed_messages_run_in_per_key_order() {
    let topic = format!("interop-in-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    create(&topic, 6).await;
    let keys = keys();
    let mut args = vec!["produce".to_owned(), common::brokers(), topic.clone(), "10".to_owned()];
    args.extend(keys.iter().map(|k| hex(k.as_bytes())));
    tokio::task::spawn_blocking(move || python(&args)).await.unwrap();

    let url = format!("kafka://{}", common::brokers());
    let client = Client::new(Arc::new(KafkaTransport::from_url(&url.parse().unwrap()).await.unwrap()));
    let sub = client
        .subscribe(&topic, "g")
        .ordered_by(KeySource::routing_key())
        .lease(common::lease())
        .build()
        .await
        .unwrap();
    let rec = Recording::start(sub);
    rec.until(200, Duration::from_secs(90), "kafka-python's messages").await;
    let log = rec.stop().await;
    let mut per_key: HashMap<String, Vec<u32>> = HashMap::new();
    for p in &log {
        let (k, r) = p.rsplit_once('/').unwrap();
        per_key.entry(k.to_owned()).or_default().push(r.parse().unwrap());
    }
    assert_eq!(per_key.len(), keys.len());
    for (k, rounds) in per_key {
        assert_eq!(rounds, (0..10).collect::<Vec<_>>(), "key {k}: once each, in order");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keyorder_messages_read_back_untouched_on_the_java_partition() {
    let topic = format!("interop-out-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    create(&topic, 5).await;
    let url = format!("kafka://{}", common::brokers());
    let client = Client::new(Arc::new(KafkaTransport::from_url(&url.parse().unwrap()).await.unwrap()));
    let publisher = client.publisher(&topic).await.unwrap();
    let keys = keys();
    for k in &keys {
        publisher
            .publish(Message::new(format!("{k}/payload")).with_key(k.as_str()).unwrap())
            .await
            .unwrap();
    }
    let args = vec![
        "consume".to_owned(),
        common::brokers(),
        topic.clone(),
        keys.len().to_string(),
    ];
    let out = tokio::task::spawn_blocking(move || python(&args)).await.unwrap();
    let mut seen = 0;
    for line in out.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let key = v["key"].as_str().unwrap();
        let key_text = keys
            .iter()
            .find(|k| hex(k.as_bytes()) == key)
            .expect("a key keyorder published");
        assert_eq!(
            v["value"].as_str().unwrap(),
            format!("{key_text}/payload"),
            "value untouched"
        );
        assert_eq!(
            v["partition"], v["java_partition"],
            "key {key_text}: on the partition Java's partitioner gives it"
        );
        seen += 1;
    }
    assert_eq!(seen, keys.len());
}
