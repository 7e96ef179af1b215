//! The in-memory transport's group lifecycle: groups are listed with their
//! live members; a group is removed only once it has none, and retention
//! then no longer waits for it.

use std::time::Duration;

use keyorder_core::{Error, KeyRules, LeaseConfig, MemoryTransport, Message, SourceSpec, Transport};

fn spec(group: &str) -> SourceSpec {
    SourceSpec {
        category: "orders".into(),
        correlated: Vec::new(),
        group: group.into(),
        instance: format!("{group}-1"),
        ordered: true,
        lease: LeaseConfig::default(),
        key_rules: KeyRules::default(),
    }
}

#[tokio::test]
async fn a_group_is_listed_and_removed_only_without_live_members() {
    let t = MemoryTransport::new();
    let admin = t.admin();
    let mut billing = t.open(&spec("billing")).await.unwrap();
    let mut shipping = t.open(&spec("shipping")).await.unwrap();
    let p = t.publisher("orders").await.unwrap();
    p.publish(Message::new("m").with_key("k").unwrap()).await.unwrap();
    billing.maintain().await.unwrap();
    shipping.maintain().await.unwrap();

    let live: Vec<(String, usize)> = admin
        .groups("orders")
        .await
        .unwrap()
        .into_iter()
        .map(|g| (g.name, g.live_members))
        .collect();
    assert_eq!(live, [("billing".to_owned(), 1), ("shipping".to_owned(), 1)]);
    assert!(matches!(
        admin.remove_group("orders", "shipping").await,
        Err(Error::Config(_))
    ));
    assert!(matches!(
        admin.remove_group("orders", "nobody").await,
        Err(Error::NotFound(_))
    ));

    shipping.close().await.unwrap();
    admin.remove_group("orders", "shipping").await.unwrap();
    let names: Vec<String> = admin
        .groups("orders")
        .await
        .unwrap()
        .into_iter()
        .map(|g| g.name)
        .collect();
    assert_eq!(names, ["billing"]);
    // billing still receives the message.
    let got = billing
        .fetch(&keyorder_core::raw::Room::up_to(10), Duration::from_secs(1))
        .await
        .unwrap();
    assert_eq!(got.len(), 1);
    billing.close().await.unwrap();
}
