//! The Kafka adapter against the real test broker (`KAFKA_BROKERS`,
//! started by `scripts/services`).

mod common;

use std::time::Duration;

use keyorder_core::{Message, Transport};
use keyorder_kafka::{partition_for, KafkaTransport};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::{ClientConfig, Message as _, Offset, TopicPartitionList};

use common::brokers;

async fn transport(partitions: i32) -> KafkaTransport {
    common::connect(&format!(
        "kafka://{}?partitions={partitions}&fetch_wait_ms=1",
        brokers()
    ))
    .await
}

fn topic(prefix: &str) -> String {
    format!("{prefix}-{}", &uuid::Uuid::new_v4().simple().to_string()[..10])
}

/// A consumer outside any group reading `partitions` of `topic` from the start.
fn reader(topic: &str, partitions: std::ops::Range<i32>) -> BaseConsumer {
    let c: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("group.id", "keyorder-test-reader")
        .set("fetch.wait.max.ms", "1")
        .create()
        .unwrap();
    let mut tpl = TopicPartitionList::new();
    for p in partitions {
        tpl.add_partition_offset(topic, p, Offset::Beginning).unwrap();
    }
    c.assign(&tpl).unwrap();
    c
}

/// Reads every record of `topic` (partitions 0..n): (partition, key).
fn read_all(topic: &str, n: i32, want: usize) -> Vec<(i32, String)> {
    let c = reader(topic, 0..n);
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

/// How many markers of `group_id` partition `p` of `state_topic` holds
/// (each owner reading the partition's saved state appends one).
fn markers(state_topic: &str, p: i32, group_id: &str) -> usize {
    let c = reader(state_topic, p..p + 1);
    let want = format!("{group_id}/{p}");
    let mut n = 0;
    let deadline = std::time::Instant::now() + Duration::from_secs(2);
    while std::time::Instant::now() < deadline {
        if let Some(Ok(m)) = c.poll(Duration::from_millis(100)) {
            // `<group>/<partition>#<claim token>`.
            let claim = m
                .payload()
                .and_then(|v| v.strip_prefix(want.as_bytes()))
                .is_some_and(|rest| rest.first() == Some(&b'#'));
            if m.key() == Some(b"keyorder-marker".as_slice()) && claim {
                n += 1;
            }
        }
    }
    n
}

/// An owner that took a partition and gave it up before saving anything
/// still held a generation (1: the first owner of a new topic). The next
/// owner's fencing token is higher, so a late record or completion of the
/// first never ties with it. The first instance takes both partitions and
/// delivers nothing; a second joins and is handed one; a message on each
/// partition is then delivered by its owner.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_that_saved_nothing_still_raises_the_next_generation() {
    use keyorder_core::{Client, Delivery, HandlerResult, KeySource};
    use std::sync::{Arc, Mutex};

    // KEYORDER_LOG=keyorder_kafka=debug shows assignments and generations.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_env("KEYORDER_LOG"))
        .with_test_writer()
        .try_init();
    let topic = topic("claim");
    let (state, group_id) = (format!("{topic}.keyorder-state"), format!("g.{topic}"));
    let count = |p: i32| {
        let (s, g) = (state.clone(), group_id.clone());
        async move { tokio::task::spawn_blocking(move || markers(&s, p, &g)).await.unwrap() }
    };
    /// (instance, body, token) of every delivery.
    type Seen = Arc<Mutex<Vec<(&'static str, String, u64)>>>;
    let seen: Seen = Arc::default();
    let start = |name: &'static str, client: Client| {
        let (topic, seen) = (topic.clone(), seen.clone());
        async move {
            let subscription = client
                .subscribe(&topic, "g")
                .ordered_by(KeySource::routing_key())
                .instance_id(name)
                .lease(common::lease())
                .build()
                .await
                .unwrap();
            let stats = subscription.stats();
            let handler = move |d: Delivery| {
                let seen = seen.clone();
                async move {
                    let body = String::from_utf8_lossy(d.payload()).into_owned();
                    seen.lock().unwrap().push((name, body, d.fencing_token()));
                    HandlerResult::Ok(())
                }
            };
            let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
            let run = tokio::spawn(subscription.run(handler, async move {
                let _ = stopped.await;
            }));
            (stop, run, stats)
        }
    };
    let a = Client::new(Arc::new(transport(2).await));
    let publisher = a.publisher(&topic).await.unwrap();
    let (stop_a, run_a, stats_a) = start("a", a.clone()).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while count(0).await < 1 || count(1).await < 1 {
        assert!(
            std::time::Instant::now() < deadline,
            "the first instance never read its state"
        );
    }
    let b = Client::new(Arc::new(transport(2).await));
    let (stop_b, run_b, _) = start("b", b).await;
    // The first instance hands a partition over to the second.
    let deadline = std::time::Instant::now() + Duration::from_secs(90);
    while stats_a.scopes_released.load(std::sync::atomic::Ordering::SeqCst) == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "no partition was handed to the second instance"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(seen.lock().unwrap().is_empty(), "nothing published yet");
    let key_of = |p: i32| {
        (0..)
            .map(|i| format!("k{i}"))
            .find(|k| partition_for(k.as_bytes(), 2) == p)
            .unwrap()
    };
    for p in 0..2 {
        publisher
            .publish(Message::new(format!("m{p}")).with_key(key_of(p)).unwrap())
            .await
            .unwrap();
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(90);
    while seen.lock().unwrap().len() < 2 {
        assert!(
            std::time::Instant::now() < deadline,
            "both messages delivered: {:?}",
            seen.lock().unwrap()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = stop_b.send(());
    let _ = stop_a.send(());
    run_b.await.unwrap().unwrap();
    run_a.await.unwrap().unwrap();
    let seen = seen.lock().unwrap().clone();
    let by_b: Vec<_> = seen.iter().filter(|(who, _, _)| *who == "b").collect();
    assert!(
        !by_b.is_empty(),
        "the second instance delivered its partition's message: {seen:?}"
    );
    for (_, body, token) in by_b {
        assert!(
            *token > 1,
            "{body}: the second owner's token ({token}) must exceed the first owner's (1): {seen:?}"
        );
    }
}
