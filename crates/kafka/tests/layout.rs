//! A topic whose partition count is not its layout's (the state topic's,
//! which keyorder creates with the topic): publishers, subscriptions and
//! the operator's `scopes` refuse it, naming the fix (C23). The test broker
//! (tansu 0.6) refuses `CreatePartitions`, so partitions added to a topic
//! in use are shown here as a state topic with fewer partitions than the
//! topic, the state the addition leaves behind.

mod common;

use std::sync::Arc;
use std::time::Duration;

use keyorder_core::{Client, Error, KeySource, Message};
use keyorder_kafka::rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use keyorder_kafka::rdkafka::client::DefaultClientContext;
use keyorder_kafka::rdkafka::ClientConfig;
use keyorder_kafka::KafkaTransport;

fn names_the_change(e: &Error) -> bool {
    matches!(e, Error::Config(m) if m.contains("layout") && m.contains("Fix") && m.contains("4 partitions"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_topic_with_more_partitions_than_its_layout_is_refused_everywhere() {
    let cat = format!("layout-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let mut cfg = ClientConfig::new();
    cfg.set("bootstrap.servers", common::brokers());
    let admin: AdminClient<DefaultClientContext> = cfg.create().unwrap();
    let state = format!("{cat}.keyorder-state");
    let res = admin
        .create_topics(
            &[
                NewTopic::new(&cat, 4, TopicReplication::Fixed(1)),
                NewTopic::new(&state, 2, TopicReplication::Fixed(1)).set("cleanup.policy", "compact"),
            ],
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
        )
        .await
        .unwrap();
    for r in res {
        r.unwrap();
    }
    // In use: the state topic holds records (an empty one is taken for an
    // earlier attempt's, see tests/adopt.rs).
    let producer: keyorder_kafka::rdkafka::producer::FutureProducer = cfg.create().unwrap();
    producer
        .send(
            keyorder_kafka::rdkafka::producer::FutureRecord::<str, str>::to(&state)
                .partition(0)
                .key("keyorder-marker")
                .payload("in use"),
            Duration::from_secs(10),
        )
        .await
        .map_err(|(e, _)| e)
        .unwrap();
    let url = format!("kafka://{}?partitions=2", common::brokers());
    let t = KafkaTransport::from_url(&url.parse().unwrap()).await.unwrap();
    let client = Client::new(Arc::new(t));
    match client.publisher(&cat).await {
        Err(e) if names_the_change(&e) => {}
        Err(e) => panic!("the publisher failed otherwise: {e:?}"),
        Ok(p) => {
            let sent = p.publish(Message::new("m").with_key("k").unwrap()).await;
            panic!("a publisher was opened and published: {sent:?}");
        }
    }
    match client
        .subscribe(&cat, "g")
        .ordered_by(KeySource::routing_key())
        .lease(common::lease())
        .build()
        .await
    {
        Err(e) => assert!(names_the_change(&e), "{e:?}"),
        Ok(_) => panic!("a subscription was built on a topic outside its layout"),
    }
    match client.admin().scopes(&cat, "g").await {
        Err(e) => assert!(names_the_change(&e), "{e:?}"),
        Ok(s) => panic!("scopes showed {s:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_topic_created_beforehand_gives_its_state_topic_its_own_count() {
    use keyorder_kafka::rdkafka::consumer::{BaseConsumer, Consumer};
    let cat = format!("layout-own-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let mut cfg = ClientConfig::new();
    cfg.set("bootstrap.servers", common::brokers());
    let admin: AdminClient<DefaultClientContext> = cfg.create().unwrap();
    for r in admin
        .create_topics(
            &[NewTopic::new(&cat, 3, TopicReplication::Fixed(1))],
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
        )
        .await
        .unwrap()
    {
        r.unwrap();
    }
    // Configured with another count than the topic has.
    let url = format!("kafka://{}?partitions=2", common::brokers());
    let t = KafkaTransport::from_url(&url.parse().unwrap()).await.unwrap();
    let client = Client::new(Arc::new(t));
    let p = client
        .publisher(&cat)
        .await
        .expect("the topic's own count is its layout");
    p.publish(Message::new("m").with_key("k").unwrap()).await.unwrap();
    let probe: BaseConsumer = cfg.create().unwrap();
    let state = format!("{cat}.keyorder-state");
    let n = tokio::task::spawn_blocking(move || {
        probe
            .fetch_metadata(Some(&state), Duration::from_secs(10))
            .map(|md| md.topics().first().map_or(0, |t| t.partitions().len()))
    })
    .await
    .unwrap()
    .unwrap();
    assert_eq!(n, 3, "the state topic has the topic's count, not the configured one");
}
