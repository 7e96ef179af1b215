//! The state protocol on the test broker (`KAFKA_BROKERS`), one owner step
//! at a time, as the source takes them.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, CommitMode};

use super::claim::{advance, load, tombstone, Saved};
use super::incarnation::{newer_incarnation, register_incarnation};
use super::read::{append_markers, read_range, reader, Limit, Reader};
use super::record::{encode, ranks_above, record_key, record_of, Record};
use crate::broker::KafkaTransport;
use crate::config::{base_config, KafkaConfig};
use crate::names::Names;

struct Bench {
    t: KafkaTransport,
    names: Names,
    group_id: String,
    member: BaseConsumer,
    reader: Reader,
}

impl Bench {
    async fn new(what: &str) -> Bench {
        let brokers = std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into());
        let cfg = KafkaConfig {
            brokers,
            partitions: 1,
            ..KafkaConfig::default()
        };
        let t = KafkaTransport::connect(cfg).await.expect("the test broker answers");
        let nonce = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let names = Names::new(&format!("ko-state-{what}-{nonce}")).unwrap();
        t.ensure(&names).await.unwrap();
        let group_id = names.group_id("g");
        let mut c = base_config(&t.cfg);
        c.set("group.id", &group_id).set("enable.auto.commit", "false");
        let member: BaseConsumer = c.create().unwrap();
        let reader = reader(&t.cfg).unwrap();
        Bench {
            t,
            names,
            group_id,
            member,
            reader,
        }
    }

    /// Registers an incarnation of `instance` and returns its token and
    /// where its checks start.
    fn register(&self, instance: &str) -> (String, i64) {
        let token = uuid::Uuid::new_v4().simple().to_string();
        let at = register_incarnation(
            &self.t.state_producer,
            &self.names,
            &self.group_id,
            instance,
            0,
            &token,
            Duration::from_secs(10),
        )
        .unwrap();
        (token, at)
    }

    /// Checks `instance`'s incarnation `token` from `from`.
    fn newer(&self, instance: &str, token: &str, from: i64, first: bool) -> (bool, i64) {
        newer_incarnation(
            &self.reader,
            &self.t.state_producer,
            &self.names,
            &self.group_id,
            instance,
            0,
            token,
            from,
            first,
            Duration::from_secs(10),
            Limit::none(),
        )
        .unwrap()
    }

    /// An owner's claim: its saved state and its generation.
    fn claim(&self) -> (Saved, u64) {
        let s = load(
            &self.member,
            &self.reader,
            &self.t.state_producer,
            &self.names,
            &self.group_id,
            &[0],
            Duration::from_secs(10),
            Limit::none(),
        )
        .unwrap()
        .remove(0);
        let generation = s.generation + 1;
        (s, generation)
    }

    /// An owner's state round: one record, then its pointer.
    async fn round(&self, generation: u64, committed: i64) -> Vec<i32> {
        let key = record_key(&self.group_id, generation);
        let value = encode(generation, committed, "");
        let (_, at) = self
            .t
            .produce_state(&self.names.state(), 0, key.as_bytes(), value.as_bytes())
            .await
            .unwrap();
        advance(
            &self.member,
            &self.member,
            &self.reader,
            &self.t.state_producer,
            &self.names,
            &self.group_id,
            &[(0, generation, at)],
            &HashMap::new(),
            Duration::from_secs(10),
            CommitMode::Sync,
            Limit::none(),
        )
        .unwrap()
    }
}

/// Finding 1 of issue 35: a stalled owner's last round lands after the
/// next owner's; the owner after them must still restore the newest
/// owner's state and take a generation above every earlier one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_round_never_rolls_the_next_owner_back() {
    let b = Bench::new("stale").await;
    let (_, a) = b.claim();
    b.round(a, 10).await;
    let (saved, g2) = b.claim();
    assert_eq!(saved.committed, 10, "the second owner restores the first's state");
    assert!(g2 > a, "generations go up: {a} then {g2}");
    b.round(g2, 20).await;
    // The first owner, stalled with a round in flight, comes back.
    b.round(a, 15).await;
    let (saved, g3) = b.claim();
    assert_eq!(
        saved.committed, 20,
        "the third owner restores the second owner's state, not the stale first's"
    );
    assert!(g3 > g2, "generations never repeat: {a}, {g2}, then {g3}");
}

/// After the next owner's record is durable and its pointer checked,
/// it deletes the earlier owner's record key: compacted (a tombstone
/// removes its key), the partition keeps no key of that generation, and
/// a claim still restores the newest owner's state with a generation
/// above every earlier one, even after a stale owner's late record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tombstones_delete_earlier_generations_only() {
    let b = Bench::new("tombstone").await;
    let (_, a) = b.claim();
    b.round(a, 10).await;
    let (saved, g2) = b.claim();
    assert_eq!(saved.older, vec![a], "the claim found the first owner's records");
    assert!(b.round(g2, 20).await.is_empty(), "the pointer check passes");
    tombstone(&b.t.state_producer, &b.names, &b.group_id, 0, &saved.older)
        .await
        .unwrap();
    // The first owner, stalled, lands a late record after the tombstone.
    b.round(a, 15).await;
    let topic = b.names.state();
    let ends = append_markers(
        &b.t.state_producer,
        &topic,
        &[0],
        |_| "end".into(),
        Duration::from_secs(10),
        Limit::none(),
    )
    .unwrap();
    type Entry = (i64, Option<Vec<u8>>, Option<Vec<u8>>);
    let mut log: Vec<Entry> = Vec::new();
    read_range(
        &b.reader,
        &topic,
        &HashMap::from([(0, 0)]),
        &ends,
        Duration::from_secs(10),
        Limit::none(),
        |_, offset, key, value| log.push((offset, key.map(<[u8]>::to_vec), value.map(<[u8]>::to_vec))),
    )
    .unwrap();
    let first = record_key(&b.group_id, a).into_bytes();
    let tombstoned = log
        .iter()
        .position(|(_, k, v)| k.as_deref() == Some(&first[..]) && v.is_none())
        .expect("a tombstone for the first owner's key");
    assert!(
        !log.iter()
            .any(|(_, k, v)| k.as_deref() == Some(record_key(&b.group_id, g2).as_bytes()) && v.is_none()),
        "the newest owner's key is never deleted"
    );
    // Compaction: the newest entry of each key; a tombstone removes it.
    let mut newest: HashMap<Option<Vec<u8>>, i64> = HashMap::new();
    for (offset, key, _) in &log {
        newest.insert(key.clone(), *offset);
    }
    let kept: Vec<&Entry> = log
        .iter()
        .filter(|(o, k, v)| newest.get(k) == Some(o) && v.is_some())
        .collect();
    let mut best: Option<Record> = None;
    for (offset, key, value) in &kept {
        if let Some(r) = record_of(&b.group_id, *offset, key.as_deref(), value.as_deref()) {
            if ranks_above(&r, best.as_ref()) {
                best = Some(r);
            }
        }
    }
    let best = best.expect("the newest owner's record survives");
    assert_eq!((best.generation, best.committed), (g2, 20));
    assert!(
        kept.iter()
            .all(|(o, k, _)| k.as_deref() != Some(&first[..]) || *o > log[tombstoned].0),
        "only the first owner's late record (after the tombstone) keeps its key"
    );
    let (saved, g3) = b.claim();
    assert_eq!(saved.committed, 20, "a claim restores the newest owner's state");
    assert!(g3 > g2, "generations still go up: {g2} then {g3}");
}

/// A read waiting for records that do not come gives up as its limit
/// says: at once when stopped (a close), at its deadline (an
/// assignment's bound), not after its idle timeout or its budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_stops_when_told_and_at_its_deadline() {
    let b = Bench::new("stop").await;
    let topic = b.names.state();
    let end = append_markers(
        &b.t.state_producer,
        &topic,
        &[0],
        |_| "end".into(),
        Duration::from_secs(10),
        Limit::none(),
    )
    .unwrap()[&0];
    // Past the marker nothing comes: the read waits for an end it
    // never reaches.
    let starts = HashMap::from([(0, end + 1)]);
    let ends = HashMap::from([(0, end + 1_000)]);
    let idle = Duration::from_secs(30);
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let flag = stop.clone();
    let setter = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        flag.store(true, Ordering::SeqCst);
    });
    let started = Instant::now();
    let stopped = read_range(
        &b.reader,
        &topic,
        &starts,
        &ends,
        idle,
        Limit {
            until: None,
            stop: &stop,
        },
        |_, _, _, _| {},
    );
    setter.await.unwrap();
    assert!(stopped.is_err(), "a stopped read fails");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "stopped after {:?}",
        started.elapsed()
    );

    let never = AtomicBool::new(false);
    let started = Instant::now();
    let late = read_range(
        &b.reader,
        &topic,
        &starts,
        &ends,
        idle,
        Limit {
            until: Some(started + Duration::from_millis(500)),
            stop: &never,
        },
        |_, _, _, _| {},
    );
    assert!(late.is_err(), "a read past its deadline fails");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "gave up after {:?}",
        started.elapsed()
    );
}

/// Finding 2 of issue 35: the state topic is compacted (the newest
/// record of each key survives). After a stale owner's late record, the
/// partition as compaction leaves it must still rank the newest owner's
/// state first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compaction_keeps_the_newest_owners_state() {
    let b = Bench::new("compact").await;
    let (_, a) = b.claim();
    b.round(a, 10).await;
    let (_, g2) = b.claim();
    b.round(g2, 20).await;
    b.round(a, 15).await;
    // Everything the partition holds, up to a marker of our own.
    let topic = b.names.state();
    let ends = append_markers(
        &b.t.state_producer,
        &topic,
        &[0],
        |_| "end".into(),
        Duration::from_secs(10),
        Limit::none(),
    )
    .unwrap();
    type Entry = (i64, Option<Vec<u8>>, Option<Vec<u8>>);
    let mut log: Vec<Entry> = Vec::new();
    read_range(
        &b.reader,
        &topic,
        &HashMap::from([(0, 0)]),
        &ends,
        Duration::from_secs(10),
        Limit::none(),
        |_, offset, key, value| log.push((offset, key.map(<[u8]>::to_vec), value.map(<[u8]>::to_vec))),
    )
    .unwrap();
    // Compaction: the newest record of each key.
    let mut newest: HashMap<Option<Vec<u8>>, i64> = HashMap::new();
    for (offset, key, _) in &log {
        newest.insert(key.clone(), *offset);
    }
    let mut best: Option<Record> = None;
    for (offset, key, value) in &log {
        if newest.get(key) != Some(offset) {
            continue;
        }
        if let Some(r) = record_of(&b.group_id, *offset, key.as_deref(), value.as_deref()) {
            if ranks_above(&r, best.as_ref()) {
                best = Some(r);
            }
        }
    }
    let best = best.expect("a record survives compaction");
    assert_eq!(
        (best.generation, best.committed),
        (g2, 20),
        "after compaction the second owner's state still ranks first"
    );
}

/// A static member's incarnation check: a newer registration of its
/// instance id is found (from its own record, and from where its last
/// check ended), an older one or another instance's is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newer_incarnation_is_found_and_an_older_one_is_not() {
    let b = Bench::new("incarnation").await;
    let (old, old_from) = b.register("member-a");
    let (_, _) = b.register("member-b");
    let (alone, end) = b.newer("member-a", &old, old_from, true);
    assert!(!alone, "another instance's registration is not a newer incarnation");
    let (new, new_from) = b.register("member-a");
    let (found, _) = b.newer("member-a", &old, end, false);
    assert!(found, "the newer incarnation is found from where the last check ended");
    let (found_first, _) = b.newer("member-a", &old, old_from, true);
    assert!(found_first, "and from the older one's own record");
    let (newest, _) = b.newer("member-a", &new, new_from, true);
    assert!(!newest, "the older incarnation's record is not a newer one");
}
