//! Adopting a topic another client created and filled (issue 36, finding 1):
//! its real partition count, an empty state topic an earlier attempt left
//! with another count, and where partitions this group never consumed
//! start (`start=earliest|latest|group:<id>`).

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use common::Recording;
use keyorder_core::{Client, Error, KeySource};
use keyorder_kafka::rdkafka::admin::{NewTopic, TopicReplication};
use keyorder_kafka::rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use keyorder_kafka::rdkafka::producer::{FutureProducer, FutureRecord};
use keyorder_kafka::rdkafka::{ClientConfig, Message as _, Offset, TopicPartitionList};
use keyorder_kafka::KafkaTransport;

fn foreign() -> ClientConfig {
    let mut cfg = ClientConfig::new();
    cfg.set("bootstrap.servers", common::brokers());
    cfg
}

/// A foreign producer on Java's partitioner: `rounds` rounds, each one
/// message `key/round` per key, a round after the other.
async fn produce(topic: &str, keys: &[String], rounds: std::ops::Range<u32>) {
    let producer: FutureProducer = foreign()
        .set("partitioner", "murmur2_random")
        .set("linger.ms", "0")
        .create()
        .unwrap();
    for r in rounds {
        for k in keys {
            let payload = format!("{k}/{r}");
            producer
                .send(
                    FutureRecord::to(topic).key(k.as_str()).payload(payload.as_str()),
                    Duration::from_secs(10),
                )
                .await
                .map_err(|(e, _)| e)
                .unwrap();
        }
    }
}

fn keys(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("k{i}")).collect()
}

/// Per key, the rounds applied, in run order.
fn by_key(log: &[String]) -> HashMap<String, Vec<u32>> {
    let mut out: HashMap<String, Vec<u32>> = HashMap::new();
    for p in log {
        let (k, r) = p.rsplit_once('/').unwrap();
        out.entry(k.to_owned()).or_default().push(r.parse().unwrap());
    }
    out
}

/// Builds group `g`'s subscription of `cat`, ordered by the record key.
async fn build(client: &Client, cat: &str) -> keyorder_core::Result<keyorder_core::Subscription> {
    client
        .subscribe(cat, "g")
        .ordered_by(KeySource::routing_key())
        .lease(common::lease())
        .build()
        .await
}

async fn client(query: &str) -> Client {
    let url = format!("kafka://{}{query}", common::brokers());
    Client::new(Arc::new(KafkaTransport::from_url(&url.parse().unwrap()).await.unwrap()))
}

fn category(prefix: &str) -> String {
    format!("{prefix}-{}", &uuid::Uuid::new_v4().simple().to_string()[..12])
}

/// The topic had 12 partitions and an earlier attempt left an empty
/// 8-partition state topic: the default URL refuses, naming the one
/// option, which then recreates the state topic and consumes everything in
/// per-key order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_state_topic_with_another_count_is_recreated_with_reset_layout() {
    let cat = category("adopt-reset");
    let (state, dlq) = (format!("{cat}.keyorder-state"), format!("{cat}.dlq"));
    common::create_topics(&[
        NewTopic::new(&cat, 12, TopicReplication::Fixed(1)),
        NewTopic::new(&state, 8, TopicReplication::Fixed(1)).set("cleanup.policy", "compact"),
        NewTopic::new(&dlq, 8, TopicReplication::Fixed(1)),
    ])
    .await;
    let keys = keys(50);
    produce(&cat, &keys, 0..10).await;

    let plain = client("").await;
    let err = match build(&plain, &cat).await {
        Err(e) => e,
        Ok(_) => panic!("a subscription was built over a state topic with another count"),
    };
    assert!(
        matches!(&err, Error::Config(m) if m.contains("reset_layout=true") && m.contains("no records")),
        "the refusal names the option: {err}"
    );

    let reset = client("?reset_layout=true").await;
    let sub = build(&reset, &cat)
        .await
        .expect("reset_layout=true recreates the empty state topic");
    let rec = Recording::start(sub);
    rec.until(500, Duration::from_secs(90), "the adopted topic").await;
    let log = rec.stop().await;
    let per_key = by_key(&log);
    assert_eq!(per_key.len(), 50);
    for (k, rounds) in per_key {
        assert_eq!(
            rounds,
            (0..10).collect::<Vec<_>>(),
            "key {k}: every message once, in order"
        );
    }
    let probe: BaseConsumer = foreign().create().unwrap();
    let n = tokio::task::spawn_blocking(move || {
        probe
            .fetch_metadata(Some(&state), Duration::from_secs(10))
            .map(|md| md.topics().first().map_or(0, |t| t.partitions().len()))
    })
    .await
    .unwrap()
    .unwrap();
    assert_eq!(n, 12, "the state topic now has the topic's count");
}

/// A state topic that holds records is never recreated, even with the
/// option: partitions were added while it was in use.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reset_layout_never_recreates_a_state_topic_in_use() {
    let cat = category("adopt-inuse");
    let state = format!("{cat}.keyorder-state");
    common::create_topics(&[
        NewTopic::new(&cat, 4, TopicReplication::Fixed(1)),
        NewTopic::new(&state, 2, TopicReplication::Fixed(1)).set("cleanup.policy", "compact"),
    ])
    .await;
    let producer: FutureProducer = foreign().create().unwrap();
    producer
        .send(
            FutureRecord::<str, str>::to(&state)
                .partition(1)
                .key("keyorder-marker")
                .payload("in use"),
            Duration::from_secs(10),
        )
        .await
        .map_err(|(e, _)| e)
        .unwrap();
    let reset = client("?reset_layout=true").await;
    match reset.publisher(&cat).await {
        Err(Error::Config(m)) if m.contains("partitions were added while it was in use") => {}
        Err(e) => panic!("refused otherwise: {e}"),
        Ok(_) => panic!("a publisher opened on a topic whose layout changed in use"),
    }
}

/// `start=group:<id>`: partitions this group never consumed start where the
/// named group (a consumer that ran before keyorder) committed: nothing it
/// processed runs again, everything after runs once, in per-key order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_from_another_groups_committed_offsets() {
    let cat = category("adopt-group");
    common::create_topics(&[NewTopic::new(&cat, 4, TopicReplication::Fixed(1))]).await;
    let keys = keys(20);
    produce(&cat, &keys, 0..10).await;

    // The legacy consumer processed rounds 0..5 of every partition and
    // committed the offset of the first message it did not process.
    let legacy = category("legacy");
    let (topic, group) = (cat.clone(), legacy.clone());
    tokio::task::spawn_blocking(move || {
        let c: BaseConsumer = foreign()
            .set("group.id", &group)
            .set("enable.auto.commit", "false")
            .set("auto.offset.reset", "earliest")
            .create()
            .unwrap();
        let mut tpl = TopicPartitionList::new();
        for p in 0..4 {
            tpl.add_partition_offset(&topic, p, Offset::Beginning).unwrap();
        }
        c.assign(&tpl).unwrap();
        let mut first_unprocessed: HashMap<i32, i64> = HashMap::new();
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while first_unprocessed.len() < 4 {
            assert!(
                std::time::Instant::now() < deadline,
                "the legacy consumer read {first_unprocessed:?}"
            );
            let Some(m) = c.poll(Duration::from_millis(100)) else {
                continue;
            };
            let m = m.unwrap();
            let payload = std::str::from_utf8(m.payload().unwrap()).unwrap();
            let round: u32 = payload.rsplit_once('/').unwrap().1.parse().unwrap();
            if round >= 5 {
                first_unprocessed.entry(m.partition()).or_insert(m.offset());
            }
        }
        let mut commit = TopicPartitionList::new();
        for (p, o) in first_unprocessed {
            commit.add_partition_offset(&topic, p, Offset::Offset(o)).unwrap();
        }
        c.commit(&commit, CommitMode::Sync).unwrap();
    })
    .await
    .unwrap();

    // A misspelt group is refused rather than replaying the topic.
    let typo = client("?start=group:no-such-group-x").await;
    match build(&typo, &cat).await {
        Err(Error::Config(m)) if m.contains("no committed offsets") => {}
        Err(e) => panic!("refused otherwise: {e}"),
        Ok(_) => panic!("a group without committed offsets was taken as a start"),
    }

    let from_group = client(&format!("?start=group:{legacy}")).await;
    let sub = build(&from_group, &cat).await.unwrap();
    let rec = Recording::start(sub);
    rec.until(100, Duration::from_secs(90), "the rounds the legacy group left")
        .await;
    // A replay of rounds 0..5 would run first in each partition: it would
    // be among the first 100.
    let log = rec.stop().await;
    let per_key = by_key(&log);
    assert_eq!(per_key.len(), 20);
    for (k, rounds) in per_key {
        assert_eq!(
            rounds,
            (5..10).collect::<Vec<_>>(),
            "key {k}: exactly what the legacy group did not process, in order"
        );
    }

    // Once every partition has saved progress the option no longer
    // matters: a restart after the legacy group's offsets expired (here: a
    // group that never existed) still opens.
    let later = client("?start=group:no-such-group-y").await;
    build(&later, &cat)
        .await
        .expect("saved progress wins over the start option");
}

/// `start=latest`: messages published before a partition's first
/// assignment are skipped; everything after runs in per-key order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_at_latest_skips_what_came_before_the_first_assignment() {
    let cat = category("adopt-latest");
    let n = 4;
    common::create_topics(&[NewTopic::new(&cat, n, TopicReplication::Fixed(1))]).await;
    let keys = keys(20);
    produce(&cat, &keys, 0..5).await;

    let latest = client("?start=latest").await;
    let sub = build(&latest, &cat).await.unwrap();
    let rec = Recording::start(sub);
    // One canary key per partition, published until each ran: then every
    // partition is assigned and started at its end.
    let canaries: Vec<String> = (0..n)
        .map(|p| {
            (0..)
                .map(|i| format!("canary{i}"))
                .find(|k| keyorder_kafka::partition_for(k.as_bytes(), n) == p)
                .unwrap()
        })
        .collect();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    let mut round = 0;
    loop {
        produce(&cat, &canaries, round..round + 1).await;
        round += 1;
        let ran: std::collections::HashSet<String> = rec
            .snapshot()
            .iter()
            .filter_map(|p| p.strip_prefix("canary"))
            .map(|p| p.split('/').next().unwrap().to_owned())
            .collect();
        if ran.len() == canaries.len() {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "canaries ran on {ran:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    produce(&cat, &keys, 5..10).await;
    rec.until_matching(100, |p| p.starts_with('k'), Duration::from_secs(90), "the later rounds")
        .await;
    let log = rec.stop().await;
    let mine: Vec<String> = log.into_iter().filter(|p| p.starts_with('k')).collect();
    let per_key = by_key(&mine);
    assert_eq!(per_key.len(), 20);
    for (k, rounds) in per_key {
        assert_eq!(
            rounds,
            (5..10).collect::<Vec<_>>(),
            "key {k}: only what came after the first assignment, in order"
        );
    }
}
