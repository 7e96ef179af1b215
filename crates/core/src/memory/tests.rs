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

/// The member's TTL the broker keeps (it expires the member after it).
fn member_ttl(t: &MemoryTransport, category: &str, group: &str, instance: &str) -> Option<Duration> {
    let st = t.broker.lock();
    st.categories
        .get(category)?
        .groups
        .get(group)?
        .members
        .get(instance)
        .map(|m| m.ttl)
}

/// `lease_ttl_ms=` in the URL is the lease a subscription that sets none
/// uses: the broker expires its member after that TTL; a lease set on the
/// builder wins over it.
#[tokio::test]
async fn the_url_lease_is_the_default_and_the_builder_wins() {
    let url = url::Url::parse("memory://?partitions=2&lease_ttl_ms=4000").unwrap();
    let t = MemoryTransport::from_url(&url).unwrap();
    let client = crate::Client::new(std::sync::Arc::new(t.clone()));
    let build = |group: &str, instance: &str| {
        client
            .subscribe("leases", group)
            .ordered_by(crate::KeySource::routing_key())
            .instance_id(instance)
    };
    let _a = build("g", "a").build().await.unwrap();
    assert_eq!(member_ttl(&t, "leases", "g", "a"), Some(Duration::from_secs(4)));
    let _b = build("h", "b")
        .lease(LeaseConfig::from_ttl(Duration::from_secs(7)))
        .build()
        .await
        .unwrap();
    assert_eq!(member_ttl(&t, "leases", "h", "b"), Some(Duration::from_secs(7)));
    // Without the option: the default lease.
    let plain_t = MemoryTransport::with_partitions(2);
    let plain = crate::Client::new(std::sync::Arc::new(plain_t.clone()));
    let _c = plain
        .subscribe("leases", "g")
        .ordered_by(crate::KeySource::routing_key())
        .instance_id("c")
        .build()
        .await
        .unwrap();
    assert_eq!(
        member_ttl(&plain_t, "leases", "g", "c"),
        Some(LeaseConfig::default().ttl)
    );
    // A builder's lease below the minimum is refused, naming the fix.
    let err = build("i", "c")
        .lease(LeaseConfig::from_ttl(Duration::from_millis(500)))
        .build()
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("ttl 500 ms is below the minimum of 1000 ms"), "{err}");
}

/// A bad lease option is refused with the option named; the unknown-option
/// error lists the lease options.
#[test]
fn memory_url_lease_errors_name_the_option() {
    let parse = |q: &str| MemoryTransport::from_url(&url::Url::parse(&format!("memory://?{q}")).unwrap());
    let err = parse("lease_ttl_ms=50").unwrap_err().to_string();
    assert!(
        err.contains("lease_ttl_ms=50: expected a whole number of milliseconds in 1000..=86400000"),
        "{err}"
    );
    let err = parse("lease_tll_ms=5000").unwrap_err().to_string();
    assert!(
        err.contains("lease_ttl_ms, lease_heartbeat_ms, lease_margin_ms"),
        "{err}"
    );
    assert_eq!(parse("").unwrap().lease, None);
}
