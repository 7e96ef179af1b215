//! The Kafka adapter against the real test broker (`KAFKA_BROKERS`,
//! started by `scripts/services`).

use std::time::Duration;

use keyorder_core::{Message, Transport};
use keyorder_kafka::{partition_for, KafkaTransport};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::{ClientConfig, Message as _, Offset, TopicPartitionList};

fn brokers() -> String {
    std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into())
}

async fn transport(partitions: i32) -> KafkaTransport {
    let url = url::Url::parse(&format!(
        "kafka://{}?partitions={partitions}&fetch_wait_ms=1",
        brokers()
    ))
    .unwrap();
    KafkaTransport::from_url(&url)
        .await
        .expect("the test broker answers (run scripts/services)")
}

fn topic(prefix: &str) -> String {
    format!("{prefix}-{}", &uuid::Uuid::new_v4().simple().to_string()[..10])
}

/// Reads every record of `topic` (partitions 0..n): (partition, key).
fn read_all(topic: &str, n: i32, want: usize) -> Vec<(i32, String)> {
    let c: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("group.id", "keyorder-test-reader")
        .set("fetch.wait.max.ms", "1")
        .create()
        .unwrap();
    let mut tpl = TopicPartitionList::new();
    for p in 0..n {
        tpl.add_partition_offset(topic, p, Offset::Beginning).unwrap();
    }
    c.assign(&tpl).unwrap();
    let mut out = Vec::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while out.len() < want && std::time::Instant::now() < deadline {
        if let Some(Ok(m)) = c.poll(Duration::from_millis(100)) {
            out.push((
                m.partition(),
                String::from_utf8_lossy(m.key().unwrap_or_default()).into_owned(),
            ));
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keyed_records_land_where_the_java_partitioner_puts_them() {
    let t = transport(6).await;
    let topic = topic("partitioner");
    let publisher = t.publisher(&topic).await.unwrap();
    let keys: Vec<String> = (0..60).map(|i| format!("customer-{i}")).collect();
    for k in &keys {
        publisher.publish(Message::new("x").with_key(k).unwrap()).await.unwrap();
    }
    let read = tokio::task::spawn_blocking(move || read_all(&topic, 6, 60))
        .await
        .unwrap();
    assert_eq!(read.len(), 60);
    let mut used = std::collections::HashSet::new();
    for (p, k) in read {
        assert_eq!(p, partition_for(k.as_bytes(), 6), "key {k}");
        used.insert(p);
    }
    assert!(used.len() > 1, "keys spread over partitions");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publishing_is_acknowledged_in_order_per_key() {
    let t = transport(4).await;
    let topic = topic("publish");
    let publisher = t.publisher(&topic).await.unwrap();
    let started = std::time::Instant::now();
    for i in 0..200 {
        publisher
            .publish(Message::new(format!("{i}")).with_key("k").unwrap())
            .await
            .unwrap();
    }
    eprintln!("200 sequential publishes: {:?}", started.elapsed());
    let read = tokio::task::spawn_blocking(move || read_all(&topic, 4, 200))
        .await
        .unwrap();
    assert_eq!(read.len(), 200);
}
