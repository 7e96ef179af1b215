//! The outbox on the real PostgreSQL server (and Redis): staging (C12,
//! commit order), relaying to memory://, PostgreSQL and Redis with per-key
//! order and no loss, two relays that never publish one key at once, a
//! stalled relay fenced, abandon, crash, and the poison policies.

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use keyorder_core::{
    async_trait, Capabilities, Client, Error, LeaseConfig, MemoryTransport, Message, PoisonPolicy, PublishFence,
    Result, RetryPolicy, Transport, TransportPublisher,
};
use keyorder_outbox::sqlx;
use keyorder_outbox::{AppliedStore, MemoryApplied, Outbox, OutboxConfig, Outgoing, PgApplied, RelayConfig};
use keyorder_testkit::wrap::{send, Hooks, Wrapped};
use tokio::sync::Semaphore;
use tokio::time::Instant;

mod common;
use common::*;

fn redis_url() -> String {
    Broker::Redis.url()
}

/// A fresh, migrated outbox in a schema of its own.
async fn outbox() -> (Outbox, String) {
    outbox_in("ko_outbox_").await
}

fn lease() -> LeaseConfig {
    LeaseConfig {
        ttl: Duration::from_secs(3),
        heartbeat: Duration::from_millis(500),
        margin: Duration::from_secs(1),
    }
}

fn relay_cfg(name: &str) -> RelayConfig {
    RelayConfig {
        instance: Some(name.to_owned()),
        lease: lease(),
        poll: Duration::from_millis(20),
        retry: RetryPolicy {
            max_attempts: 3,
            initial_backoff: Duration::from_millis(20),
            max_backoff: Duration::from_millis(200),
        },
        // These tests look at the published rows: keep them.
        retention_batch: 0,
        ..RelayConfig::default()
    }
}

/// Per key, the applied sequences must be exactly 1..=n in order.
fn assert_order(seen: &[(String, u64, String)], expected: &BTreeMap<String, u64>) {
    let mut per_key: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    for (k, s, _) in seen {
        per_key.entry(k.clone()).or_default().push(*s);
    }
    for (key, n) in expected {
        let want: Vec<u64> = (1..=*n).collect();
        assert_eq!(per_key.get(key), Some(&want), "key {key}: order or loss");
    }
    assert_eq!(per_key.len(), expected.len(), "unexpected keys applied");
}

/// Stages `records` per key for `keys` keys, several keys per transaction
/// (with stage_many) and some one at a time.
async fn stage_load(outbox: &Outbox, category: &str, keys: usize, records: u64) -> BTreeMap<String, u64> {
    let mut expected = BTreeMap::new();
    for round in 0..records {
        let mut tx = outbox.pool().begin().await.unwrap();
        if round % 2 == 0 {
            // Keys given in reverse order: stage_many takes counters in key order.
            let batch: Vec<Outgoing> = (0..keys)
                .rev()
                .map(|k| Outgoing::new(category, format!("key-{k}"), format!("r{round}")))
                .collect();
            outbox.stage_many(&mut tx, batch).await.unwrap();
        } else {
            for k in 0..keys {
                outbox
                    .stage(
                        &mut tx,
                        Outgoing::new(category, format!("key-{k}"), format!("r{round}")),
                    )
                    .await
                    .unwrap();
            }
        }
        tx.commit().await.unwrap();
    }
    for k in 0..keys {
        expected.insert(format!("key-{k}"), records);
    }
    expected
}

// ---------------------------------------------------------------- staging

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c12_invalid_keys_fail_the_stage_call_and_store_nothing() {
    let (outbox, schema) = outbox().await;
    let long = "x".repeat(256);
    // Only empty and over-long keys are invalid (NUL, controls, `:` and lane
    // names are carried: `nul_keys_are_staged_and_relayed_under_their_own_key`).
    let bad = ["", long.as_str()];
    for key in bad {
        let mut tx = outbox.pool().begin().await.unwrap();
        let err = outbox
            .stage(&mut tx, Outgoing::new("orders", key, "payload"))
            .await
            .unwrap_err();
        assert!(matches!(err, Error::Key(_)), "{err}");
        assert!(
            !err.to_string().contains(key) || key.len() <= 8,
            "the error shows the key"
        );
        tx.commit().await.unwrap();
    }
    // One bad key among good ones: stage_many writes nothing.
    let mut tx = outbox.pool().begin().await.unwrap();
    let err = outbox
        .stage_many(
            &mut tx,
            vec![Outgoing::new("orders", "good", "p"), Outgoing::new("orders", "", "p")],
        )
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Key(_)));
    tx.commit().await.unwrap();
    let pool = outbox.pool();
    assert_eq!(count(pool, &format!("select count(*) from {schema}.records")).await, 0);
    assert_eq!(count(pool, &format!("select count(*) from {schema}.counters")).await, 0);
    // An invalid category name fails the call too.
    let mut tx = outbox.pool().begin().await.unwrap();
    assert!(outbox.stage(&mut tx, Outgoing::new("a b", "k", "p")).await.is_err());
    drop(tx);
    assert_eq!(count(pool, &format!("select count(*) from {schema}.records")).await, 0);
}

/// Same-key stagers in separate transactions serialise on the counter row:
/// the one that commits later gets the higher sequence, even when it took
/// the lower transaction id, and the relay publishes in sequence order even
/// while only the later record is readable (a transaction in between is
/// still open, holding the commit-safe horizon below the earlier record).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sequence_is_commit_order_with_concurrent_stagers() {
    let (outbox, schema) = outbox().await;
    let category = unique("seq-");
    let pool = outbox.pool().clone();
    // B takes the lowest transaction id, then X (unrelated, stays open), then A.
    let mut t_b = pool.begin().await.unwrap();
    sqlx::query("select pg_current_xact_id()")
        .execute(&mut *t_b)
        .await
        .unwrap();
    let mut t_x = pool.begin().await.unwrap();
    sqlx::query("select pg_current_xact_id()")
        .execute(&mut *t_x)
        .await
        .unwrap();
    let mut t_a = pool.begin().await.unwrap();
    let a = outbox
        .stage(&mut t_a, Outgoing::new(&category, "k", "a").with_id("a"))
        .await
        .unwrap();
    assert_eq!(a.seq, 1);
    // B stages the same key: it waits on A's counter row.
    let (ob, cat) = (outbox.clone(), category.clone());
    let b = tokio::spawn(async move {
        let staged = ob
            .stage(&mut t_b, Outgoing::new(&cat, "k", "b").with_id("b"))
            .await
            .unwrap();
        t_b.commit().await.unwrap();
        staged
    });
    until("B to wait on the counter row", Duration::from_secs(30), || {
        let pool = pool.clone();
        let schema = schema.clone();
        async move {
            count(
                &pool,
                &format!(
                    "select count(*) from pg_stat_activity where wait_event_type = 'Lock' \
                     and query like '%{schema}.counters%'"
                ),
            )
            .await
                == 1
        }
    })
    .await;
    t_a.commit().await.unwrap();
    let b = b.await.unwrap();
    assert_eq!(b.seq, 2, "the later committer has the higher sequence");
    let ids: Vec<(String, i64)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "select message_id, seq from {schema}.records order by txid"
    )))
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        ids,
        vec![("b".to_owned(), 2), ("a".to_owned(), 1)],
        "B holds the lower transaction id"
    );

    // Relay while X is open: only B's record (seq 2) is readable; the relay
    // must not publish it before A's (seq 1).
    let client = Client::memory();
    let consumer = consume(&client, &category, lease()).await;
    let relay = spawn_relay(outbox.relay(client.clone(), relay_cfg("r1")));
    until("the relay to hold back seq 2", Duration::from_secs(30), || async {
        relay.stats.snapshot().blocked >= 1
    })
    .await;
    assert!(consumer.seen().is_empty(), "seq 2 was published before seq 1");
    t_x.commit().await.unwrap();
    consumer.wait_for(2).await;
    relay.stop().await;
    let seen = consumer.stop().await;
    let order: Vec<&str> = seen.iter().map(|(_, _, id)| id.as_str()).collect();
    assert_eq!(order, ["a", "b"]);
}

/// stage_many takes counters in key order: a transaction that stages
/// (c, a) while another holds a and then wants c waits on a first, holding
/// nothing, instead of deadlocking.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stage_many_takes_counters_in_key_order() {
    let (outbox, schema) = outbox().await;
    let pool = outbox.pool().clone();
    let mut t1 = pool.begin().await.unwrap();
    outbox.stage(&mut t1, Outgoing::new("cat", "a", "t1")).await.unwrap();
    let ob = outbox.clone();
    let mut t2 = pool.begin().await.unwrap();
    let t2 = tokio::spawn(async move {
        let staged = ob
            .stage_many(
                &mut t2,
                vec![Outgoing::new("cat", "c", "t2"), Outgoing::new("cat", "a", "t2")],
            )
            .await
            .unwrap();
        t2.commit().await.unwrap();
        staged
    });
    until("T2 to wait on a's counter", Duration::from_secs(30), || {
        let pool = pool.clone();
        let schema = schema.clone();
        async move {
            count(
                &pool,
                &format!(
                    "select count(*) from pg_stat_activity where wait_event_type = 'Lock' \
                     and query like '%{schema}.counters%'"
                ),
            )
            .await
                == 1
        }
    })
    .await;
    // T1 now takes c: free, because T2 waits on a holding nothing.
    let c1 = outbox.stage(&mut t1, Outgoing::new("cat", "c", "t1")).await.unwrap();
    t1.commit().await.unwrap();
    let t2 = t2.await.unwrap();
    assert_eq!(c1.seq, 1);
    assert_eq!(
        t2.iter().map(|s| s.seq).collect::<Vec<_>>(),
        [2, 2],
        "T2 committed second on both keys"
    );
}

// ---------------------------------------------------------------- relaying

async fn end_to_end(client: Client, category: &str) {
    let (outbox, _) = outbox().await;
    let mut expected = stage_load(&outbox, category, 8, 15).await;
    let consumer = consume(&client, category, lease()).await;
    let relay = spawn_relay(outbox.relay(client.clone(), relay_cfg("r1")));
    // Records staged while the relay runs flow too.
    stage_load(&outbox, category, 8, 5).await;
    expected.values_mut().for_each(|n| *n += 5);
    consumer.wait_for(8 * 20).await;
    relay.stop().await;
    let dropped = consumer.guard.dropped();
    let seen = consumer.stop().await;
    assert_order(&seen, &expected);
    assert_eq!(dropped, 0, "one relay, no failure: nothing to drop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relays_to_memory_in_per_key_order() {
    end_to_end(Client::memory(), &unique("mem-")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relays_to_postgres_in_per_key_order() {
    let url = format!("{}?schema=keyorder_outbox_test&migrate=true", pg_url());
    let transport = keyorder_postgres::PgTransport::from_url(&url.parse().unwrap())
        .await
        .unwrap();
    end_to_end(Client::new(Arc::new(transport)), &unique("pg-")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relays_to_redis_in_per_key_order() {
    let url = redis_url();
    let transport = Broker::Redis
        .require(&url, keyorder_redis::RedisTransport::from_url(&url.parse().unwrap()))
        .await;
    end_to_end(Client::new(Arc::new(transport)), &unique("redis-")).await;
}

// ------------------------------------------------- a transport for the tests

/// One publish as a relay's transport saw it.
#[derive(Debug, Clone)]
struct Interval {
    relay: String,
    key: String,
    seq: u64,
    start: Instant,
    end: Instant,
}

/// Holds the publish of one message id until released.
#[derive(Debug)]
struct Hold {
    id: String,
    entered: AtomicBool,
    gate: Semaphore,
}

impl Hold {
    fn new(id: &str) -> Arc<Hold> {
        Arc::new(Hold {
            id: id.to_owned(),
            entered: AtomicBool::new(false),
            gate: Semaphore::new(0),
        })
    }
}

/// Wraps a transport: records publish intervals, can hold one message's
/// publish, and can fail the publishes of chosen ids.
#[derive(Debug, Clone)]
struct Wrap {
    inner: Arc<dyn Transport>,
    relay: String,
    log: Arc<Mutex<Vec<Interval>>>,
    hold: Option<Arc<Hold>>,
    fail: Arc<Mutex<HashSet<String>>>,
    /// Declare no publish fencing (the path of a broker without it).
    unfenced: bool,
}

impl Wrap {
    fn new(inner: Arc<dyn Transport>, relay: &str) -> Wrap {
        Wrap {
            inner,
            relay: relay.to_owned(),
            log: Arc::default(),
            hold: None,
            fail: Arc::default(),
            unfenced: false,
        }
    }
    fn unfenced(self) -> Wrap {
        Wrap { unfenced: true, ..self }
    }
    fn client(&self) -> Client {
        Client::new(Arc::new(Wrapped::new(self.inner.clone(), self.clone())))
    }
}

/// The wrapper's one change: what each publish does around the broker's.
#[async_trait]
impl Hooks for Wrap {
    fn capabilities(&self, inner: Capabilities) -> Capabilities {
        Capabilities {
            publish_fencing: inner.publish_fencing && !self.unfenced,
            ..inner
        }
    }

    async fn publish(
        &self,
        inner: &dyn TransportPublisher,
        message: Message,
        fence: Option<&PublishFence>,
    ) -> Result<()> {
        let start = Instant::now();
        if let Some(hold) = &self.hold {
            if hold.id == message.id() {
                hold.entered.store(true, Ordering::SeqCst);
                hold.gate.acquire().await.unwrap().forget();
            }
        }
        if self.fail.lock().unwrap().contains(message.id()) {
            return Err(Error::broker("test broker refuses this message"));
        }
        let key = message.key().map(|k| k.as_str().to_owned()).unwrap_or_default();
        let seq = keyorder_outbox::sequence_of(&message).unwrap_or(0);
        // Let other tasks run inside the interval, so overlaps could show.
        tokio::task::yield_now().await;
        send(inner, message, fence).await?;
        tokio::task::yield_now().await;
        self.log.lock().unwrap().push(Interval {
            relay: self.relay.clone(),
            key,
            seq,
            start,
            end: Instant::now(),
        });
        Ok(())
    }
}

async fn owners(outbox: &Outbox, schema: &str) -> i64 {
    count(
        outbox.pool(),
        &format!("select count(distinct owner) from {schema}.slots where lease_expiry > clock_timestamp()"),
    )
    .await
}

// ---------------------------------------------------------- several relays

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_relays_never_publish_one_key_at_once() {
    let (outbox, schema) = outbox().await;
    let category = unique("two-");
    let broker: Arc<dyn Transport> = Arc::new(MemoryTransport::new());
    let consumer = consume(&Client::new(broker.clone()), &category, lease()).await;
    let (wa, wb) = (Wrap::new(broker.clone(), "a"), Wrap::new(broker.clone(), "b"));
    let a = spawn_relay(outbox.relay(wa.client(), relay_cfg("a")));
    let b = spawn_relay(outbox.relay(wb.client(), relay_cfg("b")));
    until("both relays to hold slots", Duration::from_secs(30), || {
        owners_is(&outbox, &schema, 2)
    })
    .await;
    let expected = stage_load(&outbox, &category, 12, 20).await;
    consumer.wait_for(12 * 20).await;
    a.stop().await;
    b.stop().await;
    let seen = consumer.stop().await;
    assert_order(&seen, &expected);
    let mut all: Vec<Interval> = wa.log.lock().unwrap().clone();
    all.extend(wb.log.lock().unwrap().iter().cloned());
    let relays: HashSet<&str> = all.iter().map(|i| i.relay.as_str()).collect();
    assert_eq!(relays.len(), 2, "both relays published (spread)");
    let mut per_key: BTreeMap<&str, Vec<&Interval>> = BTreeMap::new();
    for i in &all {
        per_key.entry(i.key.as_str()).or_default().push(i);
    }
    for (key, mut list) in per_key {
        list.sort_by_key(|i| i.start);
        for pair in list.windows(2) {
            assert!(
                pair[0].end <= pair[1].start,
                "key {key}: seq {} ({}) and seq {} ({}) overlap",
                pair[0].seq,
                pair[0].relay,
                pair[1].seq,
                pair[1].relay
            );
        }
        let seqs: Vec<u64> = list.iter().map(|i| i.seq).collect();
        assert!(
            seqs.windows(2).all(|w| w[0] < w[1]),
            "key {key}: publish order {seqs:?}"
        );
    }
}

async fn owners_is(outbox: &Outbox, schema: &str, n: i64) -> bool {
    owners(outbox, schema).await == n
}

/// A relay that stalls inside a publish past its lease: another relay takes
/// its slots at a higher generation and publishes the key; on a broker
/// without publish fencing the stalled relay's late publish reaches the
/// broker and is dropped (and counted) by SequenceGuard; its late
/// confirmation marks nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_relays_late_publish_is_dropped_by_the_guard_without_publish_fencing() {
    stalled_relay(false).await;
}

/// The same stall on a broker that fences publishes (the in-memory one
/// does): the late publish is refused at the broker, so nothing reaches the
/// consumers for SequenceGuard to drop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_relays_late_publish_is_refused_by_a_fencing_broker() {
    stalled_relay(true).await;
}

async fn stalled_relay(fenced: bool) {
    let (outbox, schema) = outbox().await;
    let category = unique("stall-");
    let broker: Arc<dyn Transport> = Arc::new(MemoryTransport::new());
    let consumer = consume(&Client::new(broker.clone()), &category, lease()).await;
    let mut tx = outbox.pool().begin().await.unwrap();
    for i in 1..=3 {
        outbox
            .stage(
                &mut tx,
                Outgoing::new(&category, "k", format!("{i}")).with_id(format!("k-{i}")),
            )
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();

    let wrap = |relay| {
        let w = Wrap::new(broker.clone(), relay);
        if fenced {
            w
        } else {
            w.unfenced()
        }
    };
    let mut wa = wrap("a");
    let hold = Hold::new("k-1");
    wa.hold = Some(hold.clone());
    assert_eq!(
        wa.client().publisher(&category).await.unwrap().fences_publishes(),
        fenced
    );
    let mut a = outbox.relay(wa.client(), relay_cfg("a"));
    let a_stats = a.stats();
    // Drive A by hand until it is inside the publish of k-1 ...
    let deadline = Instant::now() + Duration::from_secs(30);
    while !hold.entered.load(Ordering::SeqCst) {
        assert!(Instant::now() < deadline, "relay A never started publishing");
        a.step().await.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // ... then stop calling it: A stalls (no heartbeat) holding k-1's publish.
    let wb = wrap("b");
    let b = spawn_relay(outbox.relay(wb.client(), relay_cfg("b")));
    consumer.wait_for(3).await;
    let applied: Vec<u64> = consumer.seen().iter().map(|(_, s, _)| *s).collect();
    assert_eq!(applied, [1, 2, 3], "B published the key in order after taking over");
    // A wakes up: its publish reaches the broker late, its mark is fenced.
    hold.gate.add_permits(1);
    if !fenced {
        until("the late publish to be dropped", Duration::from_secs(30), || async {
            consumer.guard.dropped() >= 1
        })
        .await;
    }
    // Fenced either way: by the broker refusing the late publish, or (where
    // it went through) by the relay's fence refusing its late confirmation.
    until("A's late publish to be fenced", Duration::from_secs(30), || async {
        a_stats.snapshot().fenced >= 1
    })
    .await;
    // How it ended: the wrapper logs a publish only when the broker took it.
    let a_published = wa.log.lock().unwrap().iter().any(|i| i.relay == "a" && i.seq == 1);
    assert_eq!(
        a_published, !fenced,
        "A's late publish of k-1 reached the broker: {a_published}, with publish fencing: {fenced}"
    );
    assert_eq!(a_stats.snapshot().published, 0, "A marked nothing published");
    let by_b = count(
        outbox.pool(),
        &format!("select count(*) from {schema}.records where state = 'published' and resolved_by like 'b:%'"),
    )
    .await;
    assert_eq!(by_b, 3, "every record was marked by B");
    b.stop().await;
    let consumer_dropped = consumer.guard.dropped();
    let seen = consumer.stop().await;
    let applied: Vec<u64> = seen.iter().map(|(_, s, _)| *s).collect();
    assert_eq!(applied, [1, 2, 3], "the late publish was not applied");
    if fenced {
        assert_eq!(
            consumer_dropped, 0,
            "the broker refused the late publish: nothing reached the consumers"
        );
    }
    drop(a);
}

/// Keys PostgreSQL `text` cannot hold as they are (NUL) and keys that look
/// like their stored form (a leading U+0001), beside ordinary ones.
const NUL_KEYS: &[&str] = &["nul\u{0}key", "\u{0}", "\u{1}0", "\u{1}", "customer:42", "a"];

/// Stages 4 records of every [`NUL_KEYS`] key (half with `stage_many`),
/// relays them through `client` and checks each was delivered under its own
/// key, in sequence order.
async fn nul_keys_end_to_end(client: Client, category: &str) {
    let (outbox, schema) = outbox().await;
    let mut expected = BTreeMap::new();
    for round in 0..4u64 {
        let mut tx = outbox.pool().begin().await.unwrap();
        let batch: Vec<Outgoing> = NUL_KEYS
            .iter()
            .enumerate()
            .map(|(i, k)| {
                // A header and a correlation id may hold NUL as well.
                Outgoing::new(category, *k, format!("{i}"))
                    .with_id(format!("k{i}-{round}"))
                    .with_header("tenant", *k)
                    .with_correlation_id(format!("c\u{0}{i}"))
            })
            .collect();
        if round % 2 == 0 {
            outbox.stage_many(&mut tx, batch).await.unwrap();
        } else {
            for m in batch {
                outbox.stage(&mut tx, m).await.unwrap();
            }
        }
        tx.commit().await.unwrap();
    }
    for k in NUL_KEYS {
        expected.insert((*k).to_owned(), 4u64);
    }
    assert_eq!(
        count(
            outbox.pool(),
            &format!("select count(distinct key) from {schema}.records")
        )
        .await,
        NUL_KEYS.len() as i64,
        "every key has a stored form of its own"
    );
    let consumer = consume(&client, category, lease()).await;
    let relay = spawn_relay(outbox.relay(client.clone(), relay_cfg("r1")));
    consumer.wait_for(4 * NUL_KEYS.len()).await;
    relay.stop().await;
    let seen = consumer.stop().await;
    for (key, _, id) in &seen {
        let i: usize = id[1..id.find('-').unwrap()].parse().unwrap();
        assert!(
            key == NUL_KEYS[i],
            "a record of key {} was delivered under key {}",
            keyorder_core::key::redact(NUL_KEYS[i]),
            keyorder_core::key::redact(key)
        );
    }
    assert_order(&seen, &expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nul_keys_are_staged_and_relayed_under_their_own_key() {
    nul_keys_end_to_end(Client::memory(), &unique("nul-mem-")).await;
    let url = format!("{}?schema=keyorder_outbox_nul_test&migrate=true", pg_url());
    let transport = keyorder_postgres::PgTransport::from_url(&url.parse().unwrap())
        .await
        .unwrap();
    nul_keys_end_to_end(Client::new(Arc::new(transport)), &unique("nul-pg-")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn applied_stores_keep_nul_keys_apart() {
    let (outbox, _) = outbox().await;
    let store = PgApplied::new(&outbox, "billing");
    for (seq, key) in NUL_KEYS.iter().enumerate() {
        store.set_applied(key, seq as u64 + 1).await.unwrap();
    }
    for (seq, key) in NUL_KEYS.iter().enumerate() {
        assert_eq!(store.last_applied(key).await.unwrap(), Some(seq as u64 + 1));
    }
    assert_eq!(store.last_applied("nul").await.unwrap(), None);
}

// ------------------------------------------------------------- failures

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_key_inserted_by_raw_sql_is_abandoned_and_others_flow() {
    let (outbox, schema) = outbox().await;
    let category = unique("abandon-");
    let long = "x".repeat(256);
    for (id, key) in [("bad-1", ""), ("bad-2", long.as_str())] {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "insert into {schema}.records (message_id, category, key, slot, seq, payload) \
             values ($1, $2, $3, $4, 1, 'x')"
        )))
        .bind(id)
        .bind(&category)
        .bind(key)
        .bind(Outbox::slot_of(key, 16) as i32)
        .execute(outbox.pool())
        .await
        .unwrap();
    }
    let expected = stage_load(&outbox, &category, 4, 5).await;
    let client = Client::memory();
    let consumer = consume(&client, &category, lease()).await;
    let relay = spawn_relay(outbox.relay(client.clone(), relay_cfg("r1")));
    consumer.wait_for(20).await;
    until("both bad records abandoned", Duration::from_secs(30), || async {
        count(
            outbox.pool(),
            &format!("select count(*) from {schema}.records where state = 'abandoned' and reason like 'abandoned: invalid ordering key%'"),
        )
        .await
            == 2
    })
    .await;
    let attempts = count(
        outbox.pool(),
        &format!("select coalesce(sum(attempts), 0) from {schema}.records where state = 'abandoned'"),
    )
    .await;
    assert_eq!(attempts, 0, "never attempted: abandoned at once");
    assert_eq!(relay.stats.snapshot().abandoned, 2);
    relay.stop().await;
    let seen = consumer.stop().await;
    assert!(
        seen.iter().all(|(_, _, id)| !id.starts_with("bad-")),
        "an abandoned record was published"
    );
    assert_order(&seen, &expected);
}

/// Abort a relay's task while it is in the middle of a batch (one publish
/// held): another relay takes over after the lease and publishes
/// everything; nothing is lost, the guard removes any repeat.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_relay_loses_nothing() {
    let (outbox, _) = outbox().await;
    let category = unique("crash-");
    let broker: Arc<dyn Transport> = Arc::new(MemoryTransport::new());
    let consumer = consume(&Client::new(broker.clone()), &category, lease()).await;
    let mut expected = BTreeMap::new();
    let mut tx = outbox.pool().begin().await.unwrap();
    for k in 0..6 {
        for i in 1..=6 {
            outbox
                .stage(
                    &mut tx,
                    Outgoing::new(&category, format!("key-{k}"), format!("{i}")).with_id(format!("key-{k}-{i}")),
                )
                .await
                .unwrap();
        }
        expected.insert(format!("key-{k}"), 6u64);
    }
    tx.commit().await.unwrap();
    let mut wa = Wrap::new(broker.clone(), "a");
    let hold = Hold::new("key-3-4");
    wa.hold = Some(hold.clone());
    let a = spawn_relay(outbox.relay(wa.client(), relay_cfg("a")));
    until("relay A to be inside a publish", Duration::from_secs(30), || async {
        hold.entered.load(Ordering::SeqCst)
    })
    .await;
    a.task.abort();
    assert!(a.task.await.unwrap_err().is_cancelled());
    let b = spawn_relay(outbox.relay(Wrap::new(broker.clone(), "b").client(), relay_cfg("b")));
    consumer.wait_for(36).await;
    b.stop().await;
    let seen = consumer.stop().await;
    assert_order(&seen, &expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_parks_or_halts_by_policy() {
    for policy in [PoisonPolicy::Park { max_attempts: 2 }, PoisonPolicy::Halt] {
        let (outbox, schema) = outbox().await;
        let category = unique("poison-");
        let broker: Arc<dyn Transport> = Arc::new(MemoryTransport::new());
        let consumer = consume(&Client::new(broker.clone()), &category, lease()).await;
        let mut tx = outbox.pool().begin().await.unwrap();
        for key in ["p", "q"] {
            for i in 1..=3 {
                outbox
                    .stage(
                        &mut tx,
                        Outgoing::new(&category, key, "x").with_id(format!("{key}-{i}")),
                    )
                    .await
                    .unwrap();
            }
        }
        tx.commit().await.unwrap();
        let w = Wrap::new(broker.clone(), "a");
        w.fail.lock().unwrap().insert("p-2".into());
        let cfg = RelayConfig {
            poison: policy,
            ..relay_cfg("a")
        };
        let relay = spawn_relay(outbox.relay(w.client(), cfg));
        let ids = |c: &Consumer| -> Vec<String> { c.seen().into_iter().map(|(_, _, id)| id).collect() };
        match policy {
            PoisonPolicy::Park { .. } => {
                consumer.wait_for(5).await;
                let parked = outbox.parked().await.unwrap();
                assert_eq!(parked.len(), 1);
                assert_eq!(parked[0].message_id, "p-2");
                assert_eq!(parked[0].seq, 2);
                assert!(parked[0].reason.contains("test broker refuses"), "{}", parked[0].reason);
                assert_eq!(relay.stats.snapshot().parked, 1);
                let seen = ids(&consumer);
                let p: Vec<&String> = seen.iter().filter(|i| i.starts_with("p-")).collect();
                assert_eq!(p, ["p-1", "p-3"], "the key went on after the park");
            }
            PoisonPolicy::Halt => {
                until("key p to halt", Duration::from_secs(30), || async {
                    !outbox.halted().await.unwrap().is_empty()
                })
                .await;
                consumer.wait_for(4).await;
                let halted = outbox.halted().await.unwrap();
                assert_eq!(halted[0].message_id, "p-2");
                assert!(halted[0].label.starts_with("k#"), "operators see a label, not the key");
                let pending = count(
                    outbox.pool(),
                    &format!("select count(*) from {schema}.records where state = 'pending'"),
                )
                .await;
                assert_eq!(pending, 2, "the halted head and the record after it wait");
                assert_eq!(
                    consumer.seen().len(),
                    4,
                    "p-1 and q-1..3, nothing after the halted head"
                );
                // The broker recovers; the operator resumes the key.
                w.fail.lock().unwrap().clear();
                outbox.resume(&category, "p").await.unwrap();
                consumer.wait_for(6).await;
                let seen = ids(&consumer);
                let p: Vec<&String> = seen.iter().filter(|i| i.starts_with("p-")).collect();
                assert_eq!(p, ["p-1", "p-2", "p-3"]);
            }
        }
        relay.stop().await;
        consumer.stop().await;
    }
}

// ----------------------------------------------------------------- guard

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn applied_stores_never_go_back() {
    let lru = MemoryApplied::new(2);
    lru.set_applied("a", 5).await.unwrap();
    lru.set_applied("a", 3).await.unwrap();
    assert_eq!(lru.last_applied("a").await.unwrap(), Some(5));
    lru.set_applied("b", 1).await.unwrap();
    lru.last_applied("a").await.unwrap(); // a is now the most recent
    lru.set_applied("c", 1).await.unwrap();
    assert_eq!(lru.len(), 2, "bounded");
    assert_eq!(lru.last_applied("b").await.unwrap(), None, "the least recent key went");
    assert_eq!(lru.last_applied("a").await.unwrap(), Some(5));

    let (outbox, _) = outbox().await;
    let store = PgApplied::new(&outbox, "billing");
    assert_eq!(store.last_applied("k").await.unwrap(), None);
    let mut tx = outbox.pool().begin().await.unwrap();
    assert!(store.record_in(&mut tx, "k", 2).await.unwrap());
    tx.commit().await.unwrap();
    let mut tx = outbox.pool().begin().await.unwrap();
    assert!(!store.record_in(&mut tx, "k", 2).await.unwrap(), "a repeat is stale");
    assert!(
        !store.record_in(&mut tx, "k", 1).await.unwrap(),
        "an older one is stale"
    );
    tx.rollback().await.unwrap();
    store.set_applied("k", 1).await.unwrap();
    assert_eq!(store.last_applied("k").await.unwrap(), Some(2));
}

/// The outbox's URL goes to the driver: an option it does not take is
/// refused by name, never logged with its value by the driver (issue 37).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_url_option_is_refused_without_its_value() {
    let Err(err) = Outbox::connect(
        "postgres://app@127.0.0.1:1/db?sslpassword=s3cret-e",
        1,
        OutboxConfig::default(),
    )
    .await
    else {
        panic!("refused");
    };
    let err = err.to_string();
    assert!(err.contains("`sslpassword`") && !err.contains("s3cret"), "{err}");
}
