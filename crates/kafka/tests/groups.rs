//! The group lifecycle on the test Kafka broker: a second group on a topic
//! receives every message (a new group starts at the earliest retained
//! offset); the topic's groups are listed with their live members; a group
//! is removed only once it has none.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::Recording;
use keyorder_core::{Client, Error, KeySource, Message};

async fn client() -> Client {
    let url = format!("kafka://{}?partitions=2&fetch_wait_ms=10", common::brokers());
    let t = common::connect(&url).await;
    Client::new(Arc::new(t))
}

async fn run(client: &Client, category: &str, group: &str) -> Recording {
    let sub = client
        .subscribe(category, group)
        .ordered_by(KeySource::routing_key())
        .lease(common::lease())
        .build()
        .await
        .unwrap();
    Recording::start(sub)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn groups_are_listed_each_gets_every_message_and_a_stopped_one_is_removed() {
    let category = format!("groups-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let c = client().await;
    let publisher = c.publisher(&category).await.unwrap();
    for i in 0..10 {
        publisher
            .publish(Message::new(format!("m{i}")).with_key(format!("k{}", i % 3)).unwrap())
            .await
            .unwrap();
    }
    let billing = run(&c, &category, "billing").await;
    billing.until(10, Duration::from_secs(60), "billing").await;
    let shipping = run(&c, &category, "shipping").await;
    shipping
        .until(10, Duration::from_secs(60), "shipping, a group that started later")
        .await;

    let admin = c.admin();
    let groups = admin.groups(&category).await.unwrap();
    let live: Vec<(&str, usize)> = groups.iter().map(|g| (g.name.as_str(), g.live_members)).collect();
    assert_eq!(live, [("billing", 1), ("shipping", 1)]);
    match admin.remove_group(&category, "shipping").await {
        Err(Error::Config(why)) => assert!(why.contains("live member"), "{why}"),
        other => panic!("removing a live group: {other:?}"),
    }
    assert!(matches!(
        admin.remove_group(&category, "nobody").await,
        Err(Error::NotFound(_))
    ));
    shipping.stop().await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        match admin.remove_group(&category, "shipping").await {
            Ok(()) => break,
            Err(Error::Config(_)) if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            other => panic!("removing the stopped group: {other:?}"),
        }
    }
    let names: Vec<String> = admin
        .groups(&category)
        .await
        .unwrap()
        .into_iter()
        .map(|g| g.name)
        .collect();
    assert_eq!(names, ["billing"]);
    billing.stop().await;
}
