//! Kafka's own operator cases across processes on the test broker: a
//! foreign record's binary or long key halts and is resolved by its label,
//! read-only commands create no topic, a bad setting is named without its
//! value. Listing and skipping a halted head from another transport runs on
//! every adapter as the conformance scenario `operator_from_another_transport`.
mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use keyorder_core::{Client, Delivery, HandlerError, HandlerResult, HeadAction, KeySource, PoisonPolicy, RetryPolicy};
use keyorder_kafka::KafkaTransport;
use keyorder_testkit::until;

fn url() -> String {
    format!("kafka://{}?partitions=2&fetch_wait_ms=10", common::brokers())
}

async fn client() -> Client {
    let t = common::connect(&url()).await;
    Client::new(Arc::new(t))
}

/// A foreign record's key that keyorder names by its text form (bytes that
/// are no UTF-8, a key over 255 bytes) halts under that key: listed with
/// that key's label, resolved by it, and released, so its later records
/// run. Before, the head was held (and listed) under a lossy decoding of
/// the bytes: a resolve by the listed label found no owner, or released a
/// key the dispatcher did not hold.
async fn foreign_key_halts_and_resolves(name: &str, raw: Vec<u8>) {
    use keyorder_kafka::rdkafka::producer::{FutureProducer, FutureRecord};
    let category = format!("op-{name}-{}", &uuid::Uuid::new_v4().simple().to_string()[..10]);
    let c = client().await;
    let key = keyorder_core::OrderingKey::from_bytes(&raw).unwrap();
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let sub = c
        .subscribe(&category, "g")
        .ordered_by(KeySource::routing_key())
        .poison(PoisonPolicy::Halt)
        .retry(RetryPolicy {
            max_attempts: 2,
            initial_backoff: Duration::from_millis(20),
            max_backoff: Duration::from_millis(100),
        })
        .lease(common::lease())
        .build()
        .await
        .unwrap();
    let log = seen.clone();
    let handler = move |d: Delivery| {
        let log = log.clone();
        async move {
            let body = String::from_utf8_lossy(d.payload()).into_owned();
            if body == "k-2" {
                return Err(HandlerError::retry("poison (test)"));
            }
            log.lock().unwrap().push(body);
            HandlerResult::Ok(())
        }
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(sub.run(handler, async move {
        let _ = stopped.await;
    }));
    // The topic exists once the subscription is built; a foreign producer
    // writes the raw key bytes on the key's murmur2 partition.
    let mut cfg = keyorder_kafka::rdkafka::ClientConfig::new();
    cfg.set("bootstrap.servers", common::brokers());
    let producer: FutureProducer = cfg.create().unwrap();
    let partition = keyorder_kafka::partition_for(&raw, 2);
    for i in 1..=4 {
        let body = format!("k-{i}");
        producer
            .send(
                FutureRecord::to(&category)
                    .key(&raw[..])
                    .payload(&body)
                    .partition(partition),
                Duration::from_secs(10),
            )
            .await
            .unwrap();
    }
    let admin = c.admin();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let halted = loop {
        let h = admin.halted(&category, "g").await.unwrap_or_default();
        if !h.is_empty() {
            break h;
        }
        assert!(tokio::time::Instant::now() < deadline, "{name}: no halt listed");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(halted[0].label, key.label(), "{name}: listed under its key's label");
    tokio::time::timeout(
        Duration::from_secs(40),
        admin.resolve(&category, "g", &halted[0].label, HeadAction::Skip),
    )
    .await
    .expect("the resolve answers")
    .expect("the owner resolves it");
    until(
        &format!("{name}: the key's later records to run"),
        Duration::from_secs(90),
        || {
            let seen = seen.clone();
            async move { seen.lock().unwrap().len() >= 3 }
        },
    )
    .await;
    assert_eq!(*seen.lock().unwrap(), vec!["k-1", "k-3", "k-4"], "{name}");
    let _ = stop.send(());
    run.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_halted_foreign_binary_key_is_resolved_by_its_label() {
    foreign_key_halts_and_resolves("bin", vec![0xff, 0x00, 0x41]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_halted_foreign_long_key_is_resolved_by_its_label() {
    foreign_key_halts_and_resolves("long", "é".repeat(150).into_bytes()).await;
}

/// Read-only operator commands create nothing (issue 37): on a category
/// that does not exist, listing scopes, halted keys, hot keys and dead
/// letters fails or finds nothing, and afterwards no topic of the category
/// exists (a metadata request for a named topic let the broker create it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_only_commands_create_nothing() {
    let category = format!("op-none-{}", &uuid::Uuid::new_v4().simple().to_string()[..10]);
    let c = client().await;
    keyorder_testkit::run_read_only_commands(&*c.admin(), &category).await;
    // Every topic the broker has, without naming one (which could create it).
    let mut cfg = keyorder_kafka::rdkafka::ClientConfig::new();
    cfg.set("bootstrap.servers", common::brokers());
    let probe: keyorder_kafka::rdkafka::consumer::BaseConsumer = cfg.create().unwrap();
    let found: Vec<String> = tokio::task::spawn_blocking(move || {
        use keyorder_kafka::rdkafka::consumer::Consumer;
        probe
            .fetch_metadata(None, Duration::from_secs(10))
            .unwrap()
            .topics()
            .iter()
            .map(|t| t.name().to_owned())
            .filter(|n| n.starts_with("op-none-"))
            .collect()
    })
    .await
    .unwrap();
    assert!(
        !found.iter().any(|t| t.starts_with(&category)),
        "read-only commands created {found:?}"
    );
}

/// A configuration built in code is checked as a URL's is (issue 37): a
/// bad pass-through setting is named, its value never shown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_setting_in_code_is_named_without_its_value() {
    let mut cfg = keyorder_kafka::KafkaConfig {
        brokers: common::brokers(),
        ..Default::default()
    };
    cfg.extra.insert("sasl.passwrd".into(), "s3cretProg".into());
    let Err(err) = KafkaTransport::connect(cfg).await else {
        panic!("refused");
    };
    let err = err.to_string();
    assert!(err.contains("sasl.passwrd") && !err.contains("s3cret"), "{err}");
}
