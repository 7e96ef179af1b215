//! Interop with a foreign Kafka client (kafka-python, which `scripts/services`
//! installs): its keyed messages run in per-key order under keyorder, and
//! keyorder's messages read back with key and value untouched, on the
//! partition Java's default partitioner gives the key. Keys as real systems
//! have them: `customer:42`, 8-byte integers, bytes that are not UTF-8, a
//! key over 255 bytes.

mod common;

use std::collections::HashMap;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use keyorder_core::{Client, Delivery, HandlerResult, KeySource, Message, OrderingKey};
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

/// A run: the key it ran under and its payload.
type Run = (Option<OrderingKey>, String);

/// Keys real systems use, as raw bytes.
fn keys() -> Vec<Vec<u8>> {
    let mut keys: Vec<Vec<u8>> = (0..12).map(|i| format!("customer-{i}").into_bytes()).collect();
    keys.push(b"customer:42".to_vec());
    keys.push(b"{tenant}:7".to_vec());
    keys.push(42u64.to_be_bytes().to_vec());
    keys.push(7u64.to_be_bytes().to_vec());
    keys.push(vec![0xff, 0x00, 0x01]);
    keys.push(vec![0xc3, 0x28]);
    keys.push("é".repeat(150).into_bytes());
    keys.push((0..=255u8).cycle().take(300).collect());
    keys
}

/// How many warnings about misplaced keys name `topic`.
fn misplaced_warnings(topic: &str) -> usize {
    keyorder_testkit::logs::text()
        .lines()
        .filter(|l| l.contains(topic) && l.contains("another partition than Java's default partitioner"))
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_python_keyed_messages_run_in_per_key_order() {
    keyorder_testkit::logs::install();
    let topic = format!("interop-in-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    create(&topic, 6).await;
    let keys = keys();
    let mut args = vec!["produce".to_owned(), common::brokers(), topic.clone(), "10".to_owned()];
    args.extend(keys.iter().map(|k| hex(k)));
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
    // Each run: the key it ran under and its payload.
    let log: Arc<std::sync::Mutex<Vec<Run>>> = Arc::default();
    let seen = log.clone();
    let handler = move |d: Delivery| {
        let seen = seen.clone();
        async move {
            seen.lock()
                .unwrap()
                .push((d.key().cloned(), String::from_utf8_lossy(d.payload()).into_owned()));
            HandlerResult::Ok(())
        }
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(sub.run(handler, async move {
        let _ = stopped.await;
    }));
    let want = keys.len() * 10;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    while log.lock().unwrap().len() < want {
        assert!(
            tokio::time::Instant::now() < deadline,
            "kafka-python's messages: {} of {want} ran",
            log.lock().unwrap().len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = stop.send(());
    run.await.unwrap().unwrap();
    let by_hex: HashMap<String, &Vec<u8>> = keys.iter().map(|k| (hex(k), k)).collect();
    let mut per_key: HashMap<String, Vec<u32>> = HashMap::new();
    for (key, payload) in log.lock().unwrap().iter() {
        let (k, r) = payload.rsplit_once('/').unwrap();
        // Ran under the key its bytes give: never keyless, never another's.
        let raw = by_hex[k];
        assert_eq!(
            key.as_ref(),
            Some(&OrderingKey::from_bytes(raw).unwrap()),
            "key {k} ran under another key"
        );
        per_key.entry(k.to_owned()).or_default().push(r.parse().unwrap());
    }
    assert_eq!(per_key.len(), keys.len());
    for (k, rounds) in per_key {
        assert_eq!(rounds, (0..10).collect::<Vec<_>>(), "key {k}: once each, in order");
    }
    assert_eq!(
        misplaced_warnings(&topic),
        0,
        "murmur2 placed every key where keyorder would"
    );
}

/// A producer on another partitioner (CRC32, like librdkafka's default)
/// puts keys where keyorder's publisher would not: the user is told once,
/// with the fix, and the records still run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producer_on_another_partitioner_is_reported_once() {
    keyorder_testkit::logs::install();
    let topic = format!("interop-crc-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    create(&topic, 6).await;
    let keys: Vec<Vec<u8>> = (0..20).map(|i| format!("customer-{i}").into_bytes()).collect();
    let mut args = vec![
        "produce-crc32".to_owned(),
        common::brokers(),
        topic.clone(),
        "3".to_owned(),
    ];
    args.extend(keys.iter().map(|k| hex(k)));
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
    let stats = sub.stats();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(
        sub.run(|_d: Delivery| async move { HandlerResult::Ok(()) }, async move {
            let _ = stopped.await;
        }),
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    while stats.snapshot().applied < 60 {
        assert!(tokio::time::Instant::now() < deadline, "{:?}", stats.snapshot());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = stop.send(());
    run.await.unwrap().unwrap();
    assert_eq!(misplaced_warnings(&topic), 1, "told once, not per record");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keyorder_messages_read_back_untouched_on_the_java_partition() {
    let topic = format!("interop-out-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    create(&topic, 5).await;
    let url = format!("kafka://{}", common::brokers());
    let client = Client::new(Arc::new(KafkaTransport::from_url(&url.parse().unwrap()).await.unwrap()));
    let publisher = client.publisher(&topic).await.unwrap();
    // Keys as keyorder holds them: text, and the text form of bytes that
    // are no UTF-8 (as a consumer of such a record has its key), which goes
    // out as the original bytes.
    let keys: Vec<OrderingKey> = keys().iter().map(|k| OrderingKey::from_bytes(k).unwrap()).collect();
    for k in &keys {
        publisher
            .publish(
                Message::new(format!("{}/payload", hex(&k.to_bytes())))
                    .with_key(k.as_str())
                    .unwrap(),
            )
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
            .find(|k| hex(&k.to_bytes()) == key)
            .map(|k| hex(&k.to_bytes()))
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
