//! Several consumer groups on one category, on the real Redis server: a
//! group that is stopped keeps every message while another group
//! acknowledges, trims and reaps; a group that holds a key whose stream
//! another group reaped reads the key again once it is published again; the
//! groups are listed, and one is removed only while it has no live member.

// Shared set-up; this file uses only part of it.
#[allow(dead_code)]
mod common;

use common::url;
use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use keyorder_core::raw::Room;
use keyorder_core::{Error, Inbound, KeyRules, LeaseConfig, Message, SourceSpec, Transport, TransportSource};
use keyorder_redis::{Names, RedisTransport};
use redis::Value;

async fn transport(options: &str) -> RedisTransport {
    let url = format!("{}/?{options}", url().trim_end_matches('/'));
    common::connect(&url).await
}

fn spec(category: &str, group: &str, instance: &str) -> SourceSpec {
    SourceSpec {
        category: category.into(),
        correlated: Vec::new(),
        group: group.into(),
        instance: instance.into(),
        ordered: true,
        lease: LeaseConfig {
            ttl: Duration::from_secs(2),
            heartbeat: Duration::from_millis(500),
            margin: Duration::from_millis(700),
        },
        key_rules: KeyRules::default(),
    }
}

fn category(name: &str) -> String {
    format!("groups-{name}-{}", uuid::Uuid::new_v4().simple())
}

/// Publishes `per_key` messages to each key, ids `{key}/{seq}`.
async fn publish(t: &RedisTransport, category: &str, keys: &[String], seqs: std::ops::Range<u32>) -> Vec<String> {
    let p = t.publisher(category).await.unwrap();
    let mut ids = Vec::new();
    for seq in seqs {
        for key in keys {
            let id = format!("{key}/{seq}");
            p.publish(Message::new(id.clone()).with_key(key).unwrap().with_id(id.clone()))
                .await
                .unwrap();
            ids.push(id);
        }
    }
    ids
}

fn keys(prefix: &str, range: std::ops::Range<usize>) -> Vec<String> {
    range.map(|i| format!("{prefix}{i}")).collect()
}

/// Maintains, fetches and acknowledges until `want` ids were applied or the
/// deadline passed; returns every applied id in order (errors are retried,
/// and the last one is returned with what was applied).
async fn consume(
    source: &mut Box<dyn TransportSource>,
    want: &HashSet<String>,
    deadline: Duration,
) -> (Vec<String>, Option<Error>) {
    let until = tokio::time::Instant::now() + deadline;
    let mut applied = Vec::new();
    let mut last_error = None;
    while !want.iter().all(|id| applied.contains(id)) && tokio::time::Instant::now() < until {
        if let Err(e) = source.maintain().await {
            last_error = Some(e);
        }
        match source.fetch(&Room::up_to(100), Duration::from_millis(100)).await {
            Ok(batch) => {
                for d in batch {
                    ack(&d).await;
                    applied.push(d.message.id().to_owned());
                }
            }
            Err(e) => last_error = Some(e),
        }
    }
    (applied, last_error)
}

async fn ack(d: &Inbound) {
    d.settle.begin_attempt().await.unwrap();
    d.settle.ack().await.unwrap();
}

/// Per key, the applied sequence numbers in the order they were applied.
fn per_key(applied: &[String]) -> BTreeMap<String, Vec<u32>> {
    let mut out: BTreeMap<String, Vec<u32>> = BTreeMap::new();
    for id in applied {
        let (k, s) = id.split_once('/').unwrap();
        out.entry(k.to_owned()).or_default().push(s.parse().unwrap());
    }
    out
}

async fn index_len(names: &Names) -> usize {
    let mut conn = redis::Client::open(url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    redis::cmd("ZCARD")
        .arg(names.index())
        .query_async(&mut conn)
        .await
        .unwrap()
}

/// Defect: trimming and reaping considered only the groups already created
/// on a stream, so a stopped group lost every message of keys it had not
/// acquired yet (it received 50 of 100).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_group_keeps_every_message_while_another_group_trims_and_reaps() {
    let t = transport("reap_idle_ms=1000").await;
    let cat = category("stopped");
    let first = keys("k", 0..10);
    let all = keys("k", 0..20);

    let old = publish(&t, &cat, &first, 0..5).await;
    let mut shipping = t.open(&spec(&cat, "shipping", "s1")).await.unwrap();
    let (got, e) = consume(&mut shipping, &old.iter().cloned().collect(), Duration::from_secs(30)).await;
    assert_eq!(got.len(), 50, "shipping's first run: {e:?}");
    shipping.close().await.unwrap();
    drop(shipping);

    // shipping is stopped: 20 keys x 5 more, 10 of them new keys.
    let new = publish(&t, &cat, &all, 5..10).await;
    let mut billing = t.open(&spec(&cat, "billing", "b1")).await.unwrap();
    // billing is a group of its own: it gets what is retained when it first
    // subscribes (at least everything published since).
    let since: HashSet<String> = new.iter().cloned().collect();
    let (got, e) = consume(&mut billing, &since, Duration::from_secs(30)).await;
    assert!(since.iter().all(|id| got.contains(id)), "billing: {e:?}");
    // billing trims and (past reap_idle) reaps what every group it knows of
    // has passed; give it time for both, on its own heartbeat.
    let until = tokio::time::Instant::now() + Duration::from_secs(4);
    while tokio::time::Instant::now() < until {
        billing.maintain().await.unwrap();
        let _ = billing
            .fetch(&Room::up_to(100), Duration::from_millis(200))
            .await
            .unwrap();
    }
    billing.close().await.unwrap();
    drop(billing);

    // shipping comes back: it must receive every message published since.
    let mut shipping = t.open(&spec(&cat, "shipping", "s1")).await.unwrap();
    let want: HashSet<String> = new.iter().cloned().collect();
    let (got, e) = consume(&mut shipping, &want, Duration::from_secs(30)).await;
    let missing: Vec<&String> = new.iter().filter(|id| !got.contains(id)).collect();
    assert!(
        missing.is_empty(),
        "shipping lost {} of {} messages published while it was stopped (last error: {e:?})",
        missing.len(),
        new.len()
    );
    for (k, seqs) in per_key(&got) {
        assert!(seqs.windows(2).all(|w| w[0] < w[1]), "{k}: out of order {seqs:?}");
    }
    shipping.close().await.unwrap();
}

/// Defect: a group that still held a key whose stream another group reaped
/// failed every fenced read with NOGROUP once the key was published again,
/// forever, and the error carried the stream's name (a key) into logs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_holding_a_reaped_key_reads_it_again_after_a_publish() {
    let t = transport("reap_idle_ms=1000").await;
    let cat = category("reaped");
    let names = Names::new(&cat).unwrap();
    let ks = keys("secret-key-", 0..3);
    let first = publish(&t, &cat, &ks, 0..3).await;
    let mut a = t.open(&spec(&cat, "billing", "a1")).await.unwrap();
    let mut b = t.open(&spec(&cat, "shipping", "b1")).await.unwrap();
    let want: HashSet<String> = first.iter().cloned().collect();
    let (got, e) = consume(&mut a, &want, Duration::from_secs(30)).await;
    assert_eq!(got.len(), want.len(), "billing: {e:?}");
    let (got, e) = consume(&mut b, &want, Duration::from_secs(30)).await;
    assert_eq!(got.len(), want.len(), "shipping: {e:?}");

    // Both groups passed the end; one of them reaps the idle streams.
    let until = tokio::time::Instant::now() + Duration::from_secs(30);
    while index_len(&names).await > 0 {
        assert!(tokio::time::Instant::now() < until, "no stream was reaped");
        for s in [&mut a, &mut b] {
            s.maintain().await.unwrap();
            let _ = s.fetch(&Room::up_to(100), Duration::from_millis(100)).await.unwrap();
        }
    }

    // Published again: both groups must read the keys again.
    let again = publish(&t, &cat, &ks, 3..6).await;
    let want: HashSet<String> = again.iter().cloned().collect();
    for (name, s) in [("billing", &mut a), ("shipping", &mut b)] {
        let (got, e) = consume(s, &want, Duration::from_secs(20)).await;
        assert!(
            want.iter().all(|id| got.contains(id)),
            "{name} received {} of {} messages published after the reap (last error: {e:?})",
            want.iter().filter(|id| got.contains(*id)).count(),
            want.len()
        );
        if let Some(e) = e {
            assert!(!e.to_string().contains("secret-key-"), "an error names a key: {e}");
        }
    }
    a.close().await.unwrap();
    b.close().await.unwrap();
}

async fn xlen(stream: &str) -> usize {
    let mut conn = redis::Client::open(url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    redis::cmd("XLEN").arg(stream).query_async(&mut conn).await.unwrap()
}

/// The operator lists a category's groups and removes a stopped one; while
/// it has a live member the removal is refused; once removed, trimming no
/// longer waits for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn groups_are_listed_and_a_stopped_group_is_removed_by_the_operator() {
    let t = transport("").await;
    let admin = t.admin();
    let cat = category("remove");
    let names = Names::new(&cat).unwrap();
    let ks = keys("k", 0..3);
    let first = publish(&t, &cat, &ks, 0..3).await;
    let mut a = t.open(&spec(&cat, "billing", "a1")).await.unwrap();
    let mut b = t.open(&spec(&cat, "shipping", "b1")).await.unwrap();
    b.maintain().await.unwrap();
    let (got, e) = consume(&mut a, &first.iter().cloned().collect(), Duration::from_secs(30)).await;
    assert_eq!(got.len(), first.len(), "billing: {e:?}");
    // shipping read nothing: billing's trimming keeps every entry.
    a.maintain().await.unwrap();
    assert_eq!(xlen(&names.stream("k0")).await, 3);

    let groups = admin.groups(&cat).await.unwrap();
    let live: Vec<(&str, usize)> = groups.iter().map(|g| (g.name.as_str(), g.live_members)).collect();
    assert_eq!(live, [("billing", 1), ("shipping", 1)]);
    match admin.remove_group(&cat, "shipping").await {
        Err(Error::Config(why)) => assert!(why.contains("live member"), "{why}"),
        other => panic!("removing a live group: {other:?}"),
    }
    assert!(matches!(
        admin.remove_group(&cat, "nobody").await,
        Err(Error::NotFound(_))
    ));
    b.close().await.unwrap();
    drop(b);
    // Its member entry lapses with the lease TTL (2 s).
    let until = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        match admin.remove_group(&cat, "shipping").await {
            Ok(()) => break,
            Err(Error::Config(_)) if tokio::time::Instant::now() < until => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            other => panic!("removing the stopped group: {other:?}"),
        }
    }
    let names_left: Vec<String> = admin.groups(&cat).await.unwrap().into_iter().map(|g| g.name).collect();
    assert_eq!(names_left, ["billing"]);
    // billing's next acknowledgement trims what only shipping kept.
    let more = publish(&t, &cat, &ks, 3..4).await;
    let (got, e) = consume(&mut a, &more.iter().cloned().collect(), Duration::from_secs(30)).await;
    assert_eq!(got.len(), more.len(), "billing: {e:?}");
    let until = tokio::time::Instant::now() + Duration::from_secs(30);
    while xlen(&names.stream("k0")).await > 0 {
        assert!(
            tokio::time::Instant::now() < until,
            "billing never trimmed after the removal"
        );
        a.maintain().await.unwrap();
    }
    a.close().await.unwrap();
}

fn spec_ttl(category: &str, group: &str, instance: &str, ttl: Duration, ordered: bool) -> SourceSpec {
    SourceSpec {
        lease: LeaseConfig {
            ttl,
            heartbeat: ttl / 4,
            margin: ttl / 3,
        },
        ordered,
        ..spec(category, group, instance)
    }
}

async fn conn() -> redis::aio::MultiplexedConnection {
    redis::Client::open(url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

/// Review finding: an unordered (plain) group on the partitioned layout
/// stalled forever on NOGROUP once another group reaped a stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_group_reads_a_reaped_key_again_after_a_publish() {
    let t = transport("reap_idle_ms=1000").await;
    let cat = category("plain-reaped");
    let names = Names::new(&cat).unwrap();
    let ks = keys("k", 0..2);
    let first = publish(&t, &cat, &ks, 0..2).await;
    let mut billing = t.open(&spec(&cat, "billing", "b1")).await.unwrap();
    let mut audit = t
        .open(&spec_ttl(&cat, "audit", "a1", Duration::from_secs(2), false))
        .await
        .unwrap();
    let want: HashSet<String> = first.iter().cloned().collect();
    for s in [&mut billing, &mut audit] {
        let (got, e) = consume(s, &want, Duration::from_secs(30)).await;
        assert_eq!(got.len(), want.len(), "{e:?}");
    }
    let until = tokio::time::Instant::now() + Duration::from_secs(30);
    while index_len(&names).await > 0 {
        assert!(tokio::time::Instant::now() < until, "no stream was reaped");
        for s in [&mut billing, &mut audit] {
            s.maintain().await.unwrap();
            let _ = s.fetch(&Room::up_to(100), Duration::from_millis(100)).await;
        }
    }
    let again = publish(&t, &cat, &ks, 2..4).await;
    let want: HashSet<String> = again.iter().cloned().collect();
    let (got, e) = consume(&mut audit, &want, Duration::from_secs(20)).await;
    assert!(
        want.iter().all(|id| got.contains(id)),
        "the plain group received {} of {} (last error: {e:?})",
        want.iter().filter(|id| got.contains(*id)).count(),
        want.len()
    );
    billing.close().await.unwrap();
    audit.close().await.unwrap();
}

/// Review findings: liveness took the TTL of whichever member registered
/// last, and a stalled member's leases did not hold a removal off; a member
/// whose group was removed must stop, not recreate the group.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removal_waits_for_the_longest_ttl_and_leases_and_a_removed_member_stops() {
    let t = transport("").await;
    let admin = t.admin();
    let cat = category("ttl");
    publish(&t, &cat, &keys("k", 0..2), 0..1).await;
    // Y: a 30 s TTL; X: a 2 s TTL registered after it, then gone.
    let mut y = t
        .open(&spec_ttl(&cat, "g2", "y", Duration::from_secs(30), true))
        .await
        .unwrap();
    y.maintain().await.unwrap();
    let mut x = t
        .open(&spec_ttl(&cat, "g2", "x", Duration::from_secs(2), true))
        .await
        .unwrap();
    x.close().await.unwrap();
    drop(x);
    tokio::time::sleep(Duration::from_millis(2500)).await; // X's TTL lapses (a condition on time itself)
    assert!(
        matches!(admin.remove_group(&cat, "g2").await, Err(Error::Config(_))),
        "Y is live"
    );
    y.close().await.unwrap();
    drop(y);

    // A member that stalls past its TTL while holding a lease.
    let mut s = t
        .open(&spec_ttl(&cat, "g3", "s", Duration::from_secs(2), true))
        .await
        .unwrap();
    let _ = s.fetch(&Room::up_to(10), Duration::from_millis(200)).await.unwrap();
    let until = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        match admin.remove_group(&cat, "g3").await {
            Ok(()) => break,
            Err(Error::Config(_)) => {
                assert!(
                    tokio::time::Instant::now() < until,
                    "the stalled member's leases never expired"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            other => panic!("{other:?}"),
        }
    }
    match s.maintain().await {
        Err(Error::Config(why)) => assert!(why.contains("removed"), "{why}"),
        other => panic!("a removed group's member went on: {other:?}"),
    }
}

/// Review findings: a category written before the registry existed
/// registers its groups (from the keyless stream) on the first subscribe,
/// and a damaged registry entry does not break the operator's view.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgraded_category_registers_its_existing_groups() {
    let t = transport("").await;
    let cat = category("upgrade");
    let names = Names::new(&cat).unwrap();
    let old = publish(&t, &cat, &keys("k", 0..3), 0..2).await;
    let mut shipping = t.open(&spec(&cat, "shipping", "s1")).await.unwrap();
    let (got, e) = consume(&mut shipping, &old.iter().cloned().collect(), Duration::from_secs(30)).await;
    assert_eq!(got.len(), old.len(), "{e:?}");
    shipping.close().await.unwrap();
    drop(shipping);
    // As a version before the registry left it.
    let _: i64 = redis::cmd("DEL")
        .arg(names.groups())
        .query_async(&mut conn().await)
        .await
        .unwrap();

    let new = publish(&t, &cat, &keys("n", 0..3), 0..2).await;
    let mut billing = t.open(&spec(&cat, "billing", "b1")).await.unwrap();
    let (got, e) = consume(&mut billing, &new.iter().cloned().collect(), Duration::from_secs(30)).await;
    assert!(new.iter().all(|id| got.contains(id)), "{e:?}");
    // billing trims on its heartbeats (every 500 ms) what every group it
    // knows of acknowledged: run it through several.
    let until = tokio::time::Instant::now() + Duration::from_secs(2);
    while tokio::time::Instant::now() < until {
        billing.maintain().await.unwrap();
        let _ = billing
            .fetch(&Room::up_to(100), Duration::from_millis(100))
            .await
            .unwrap();
    }
    billing.close().await.unwrap();
    let mut shipping = t.open(&spec(&cat, "shipping", "s1")).await.unwrap();
    let want: HashSet<String> = new.iter().cloned().collect();
    let (got, e) = consume(&mut shipping, &want, Duration::from_secs(30)).await;
    assert!(
        want.iter().all(|id| got.contains(id)),
        "shipping lost messages after the upgrade: {e:?}"
    );
    shipping.close().await.unwrap();

    let _: i64 = redis::cmd("HSET")
        .arg(names.groups())
        .arg("damaged")
        .arg(r#"{"members":["x"],"ttl":1}"#)
        .query_async(&mut conn().await)
        .await
        .unwrap();
    let groups = t.admin().groups(&cat).await.unwrap();
    assert!(groups.iter().any(|g| g.name == "damaged"), "{groups:?}");
}

/// Second review: a plain (unordered) member whose group was removed while
/// it stalled must not recreate its group on a stream (that stream would
/// never be trimmed again); it stops with an error that says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_plain_member_recreates_nothing_and_stops() {
    let t = transport("").await;
    let cat = category("plain-removed");
    let names = Names::new(&cat).unwrap();
    publish(&t, &cat, &keys("k", 0..1), 0..2).await;
    let mut p = t
        .open(&spec_ttl(&cat, "p", "p1", Duration::from_secs(1), false))
        .await
        .unwrap();
    let (got, e) = consume(
        &mut p,
        &["k0/0".to_owned(), "k0/1".to_owned()].into(),
        Duration::from_secs(30),
    )
    .await;
    assert_eq!(got.len(), 2, "{e:?}");
    // p stalls past its TTL; the operator removes the group.
    let admin = t.admin();
    let until = tokio::time::Instant::now() + Duration::from_secs(30);
    while admin.remove_group(&cat, "p").await.is_err() {
        assert!(
            tokio::time::Instant::now() < until,
            "the stalled plain group was never removable"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    publish(&t, &cat, &keys("k", 0..1), 2..3).await;
    let mut stopped = None;
    for _ in 0..20 {
        // A fetch first: a member that resumes in the middle of its loop.
        let r = match p.fetch(&Room::up_to(10), Duration::from_millis(50)).await {
            Ok(_) => p.maintain().await.map(|_| ()),
            Err(e) => Err(e),
        };
        if let Err(Error::Config(why)) = r {
            stopped = Some(why);
            break;
        }
    }
    let why = stopped.expect("the removed plain member went on");
    assert!(why.contains("removed"), "{why}");
    let groups: Value = redis::cmd("XINFO")
        .arg("GROUPS")
        .arg(names.stream("k0"))
        .query_async(&mut conn().await)
        .await
        .unwrap();
    assert!(
        !format!("{groups:?}").contains("\"p\""),
        "the removed group came back: {groups:?}"
    );
}
