//! The memory transport's room tests.

use std::time::Duration;

use super::MemoryTransport;
use crate::key::{KeyRules, OrderingKey};
use crate::lease::LeaseConfig;
use crate::message::Message;
use crate::transport::{Inbound, Room, SourceSpec, Transport, TransportSource};

/// The partition a delivery came from (`category/pN`).
fn part(i: &Inbound) -> u32 {
    super::names::parse_scope(i.lease.scope()).expect("a partition scope")
}

/// A key of partition `p` of 2.
fn key_in(p: u64) -> String {
    (0..)
        .map(|i| format!("k{i}"))
        .find(|k| OrderingKey::new(k.as_str()).unwrap().stable_hash() % 2 == p)
        .unwrap()
}

/// The only (ordered) member of group `g` of `category`: it owns every partition.
async fn open(t: &MemoryTransport, category: &str) -> Box<dyn TransportSource> {
    let spec = SourceSpec {
        category: category.into(),
        correlated: Vec::new(),
        group: "g".into(),
        instance: "a".into(),
        ordered: true,
        lease: LeaseConfig::default(),
        key_rules: KeyRules::default(),
    };
    t.open(&spec).await.unwrap()
}

async fn fetch(src: &mut Box<dyn TransportSource>, max: usize) -> Vec<Inbound> {
    src.fetch(&Room::up_to(max), Duration::ZERO).await.expect("fetch")
}

/// A fetch lifts the partitions the dispatcher holds fewest of first
/// ([`Room::split`]), instead of splitting its room evenly: the partition
/// whose keys consumed what they had gets the most.
#[tokio::test]
async fn the_room_goes_to_the_partitions_holding_least() {
    let t = MemoryTransport::with_partitions(2);
    let (k0, k1) = (key_in(0), key_in(1));
    let publisher = t.publisher("room").await.unwrap();
    for i in 0..20 {
        for k in [&k0, &k1] {
            publisher
                .publish(Message::new(format!("{i}")).with_key(k).unwrap())
                .await
                .unwrap();
        }
    }
    let mut src = open(&t, "room").await;
    let first = fetch(&mut src, 8).await;
    let count = |batch: &[Inbound], p: u32| batch.iter().filter(|i| part(i) == p).count();
    assert_eq!(
        (count(&first, 0), count(&first, 1)),
        (4, 4),
        "both hold nothing: even shares"
    );
    // The dispatcher finished partition 1's deliveries; it still holds
    // partition 0's 4.
    let scope0 = first.iter().find(|i| part(i) == 0).unwrap().lease.scope().clone();
    let room = Room::up_to(8).holding([(scope0, 4)]);
    let second = src.fetch(&room, Duration::ZERO).await.expect("fetch");
    assert_eq!(
        (count(&second, 0), count(&second, 1)),
        (2, 6),
        "a floor of 1 each, then the rest evens the holdings: partition 1 (holding 0) gets 6"
    );
}

/// Room a partition cannot use (it has fewer entries left than its
/// share) goes to the others in the same fetch.
#[tokio::test]
async fn room_a_partition_cannot_use_goes_to_the_others() {
    let t = MemoryTransport::with_partitions(2);
    let publisher = t.publisher("left").await.unwrap();
    publisher
        .publish(Message::new("only").with_key(key_in(0)).unwrap())
        .await
        .unwrap();
    for i in 0..20 {
        publisher
            .publish(Message::new(format!("{i}")).with_key(key_in(1)).unwrap())
            .await
            .unwrap();
    }
    let mut src = open(&t, "left").await;
    let got = fetch(&mut src, 8).await;
    let count = |p: u32| got.iter().filter(|i| part(i) == p).count();
    assert_eq!((count(0), count(1)), (1, 7), "the fetch is filled from partition 1");
}
