//! Slot leases kept through a slow link (C19's first phase, by hand): a
//! member behind a TCP proxy that adds 200 ms each way (400 ms round trips)
//! with a 3 s lease renewed every 500 ms keeps every slot it holds, at the
//! generation it took it with, while its loop reads, settles and maintains
//! as a subscription does; and a member that joins behind such a link takes
//! all its slots before the first of them expires. Renewals that waited
//! behind the reads and the one-by-one acquisitions lost the leases again
//! and again (issue 34).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use keyorder_core::raw::Room;
use keyorder_core::{LeaseConfig, LeaseState, Message, SourceSpec, Transport, TransportSource};
use keyorder_postgres::{PgConfig, PgTransport};
use keyorder_testkit::proxy::FaultProxy;
use tokio::time::Instant;

// Shared set-up; this file uses only part of it.
#[allow(dead_code)]
mod common;

const SCHEMA: &str = "keyorder_latency_leases";
const SLOTS: u32 = 16;
const LATENCY: Duration = Duration::from_millis(200);

/// The harness lease of the conformance runs.
fn lease() -> LeaseConfig {
    LeaseConfig {
        ttl: Duration::from_secs(3),
        heartbeat: Duration::from_millis(500),
        margin: Duration::from_secs(1),
    }
}

fn spec(queue: &str) -> SourceSpec {
    SourceSpec {
        lease: lease(),
        ..common::spec(queue)
    }
}

/// A proxy in front of the server under test, and a transport through it.
async fn proxied() -> (FaultProxy, PgTransport) {
    let server: url::Url = common::url().parse().unwrap();
    let upstream: SocketAddr =
        tokio::net::lookup_host((server.host_str().unwrap().to_owned(), server.port().unwrap_or(5432)))
            .await
            .unwrap()
            .next()
            .unwrap();
    let proxy = FaultProxy::start("127.0.0.1:0".parse().unwrap(), upstream)
        .await
        .unwrap();
    let mut via = server.clone();
    via.set_host(Some("127.0.0.1")).unwrap();
    via.set_port(Some(proxy.addr().port())).unwrap();
    let cfg = PgConfig::from_url(&format!("{via}?schema={SCHEMA}&slots={SLOTS}").parse().unwrap()).unwrap();
    let t = PgTransport::connect(cfg).await.unwrap();
    (proxy, t)
}

/// Slot -> generation of the live leases `owner` holds (on the direct link).
async fn held_by(t: &PgTransport, queue: &str, owner: &str) -> BTreeMap<String, u64> {
    t.admin()
        .scopes(queue, "g")
        .await
        .unwrap()
        .into_iter()
        .filter(|s| s.owner.as_deref() == Some(owner))
        .map(|s| (s.scope, s.generation))
        .collect()
}

/// Runs `source` like a subscription's loop (maintain, then fetch; each
/// delivery acknowledged off the loop, as the dispatcher's workers do)
/// until `until`; returns the deliveries' message ids, and fails on a
/// delivery whose lease the self-fence would not start (stale or lost).
async fn run(source: &mut Box<dyn TransportSource>, until: Instant) -> Vec<String> {
    let mut got = Vec::new();
    let mut acks = Vec::new();
    while Instant::now() < until {
        source.maintain().await.unwrap();
        for inbound in source
            .fetch(&Room::up_to(64), Duration::from_millis(100))
            .await
            .unwrap()
        {
            assert_eq!(
                inbound.lease.state(),
                LeaseState::Fresh,
                "a delivery of {} came under a lease that was not fresh",
                inbound.lease.scope()
            );
            got.push(inbound.message.id().to_owned());
            acks.push(tokio::spawn(async move { inbound.settle.ack().await }));
        }
    }
    for ack in acks {
        ack.await.unwrap().unwrap();
    }
    got
}

async fn publish(t: &PgTransport, queue: &str, n: usize, tag: &str) -> Vec<String> {
    let p = t.publisher(queue).await.unwrap();
    let mut ids = Vec::new();
    for i in 0..n {
        let m = Message::new("x")
            .with_key(format!("k{i}"))
            .unwrap()
            .with_id(format!("{tag}-{i}"));
        ids.push(m.id().to_owned());
        p.publish(m).await.unwrap();
    }
    ids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_survive_400_ms_round_trips() {
    let direct = common::transport(SCHEMA, SLOTS).await;
    let queue = format!("lat-{}", uuid::Uuid::new_v4().simple());
    let (proxy, t) = proxied().await;
    let mut source = t.open(&spec(&queue)).await.unwrap();
    let taken = held_by(&direct, &queue, "a").await;
    assert_eq!(taken.len(), SLOTS as usize, "the only member takes every slot");

    proxy.latency(LATENCY);
    let ids = publish(&direct, &queue, 24, "m").await;
    let got = run(&mut source, Instant::now() + Duration::from_secs(12)).await;
    let missing: Vec<_> = ids.iter().filter(|id| !got.contains(id)).collect();
    assert!(missing.is_empty(), "not delivered within 12 s: {missing:?}");
    assert_eq!(
        held_by(&direct, &queue, "a").await,
        taken,
        "every slot still held at the generation it was taken with"
    );
    proxy.latency(Duration::ZERO);
    source.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_joining_over_400_ms_round_trips_takes_and_keeps_every_slot() {
    let direct = common::transport(SCHEMA, SLOTS).await;
    let queue = format!("latj-{}", uuid::Uuid::new_v4().simple());
    // The queue and its group exist before the link slows (as when a
    // member restarts).
    direct.publisher(&queue).await.unwrap();
    let (proxy, t) = proxied().await;
    proxy.latency(LATENCY);
    let mut source = t.open(&spec(&queue)).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut taken = held_by(&direct, &queue, "a").await;
    while taken.len() < SLOTS as usize {
        assert!(
            Instant::now() < deadline,
            "held {} of {SLOTS} slots after 30 s",
            taken.len()
        );
        run(&mut source, Instant::now() + Duration::from_millis(500)).await;
        taken = held_by(&direct, &queue, "a").await;
    }
    let ids = publish(&direct, &queue, 8, "j").await;
    let got = run(&mut source, Instant::now() + Duration::from_secs(8)).await;
    let missing: Vec<_> = ids.iter().filter(|id| !got.contains(id)).collect();
    assert!(missing.is_empty(), "not delivered within 8 s: {missing:?}");
    assert_eq!(
        held_by(&direct, &queue, "a").await,
        taken,
        "every slot still held at the generation it was taken with"
    );
    proxy.latency(Duration::ZERO);
    source.close().await.unwrap();
}
