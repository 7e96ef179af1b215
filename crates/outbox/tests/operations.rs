//! Outbox operations on the real PostgreSQL server: status numbers against
//! the table, retention in bounded batches (published records only), and
//! the operator's retry and discard, with what the consumer actually got.

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use keyorder_core::{
    async_trait, Client, Error, LeaseConfig, MemoryTransport, Message, PoisonPolicy, PublishFence, Result, RetryPolicy,
    Transport, TransportPublisher,
};
use keyorder_outbox::sqlx;
use keyorder_outbox::{Outbox, Outgoing, RecordState, RelayConfig, Staged};
use keyorder_testkit::wrap::{send, Hooks, Wrapped};

mod common;
use common::*;

/// A fresh, migrated outbox in a schema of its own.
async fn outbox() -> (Outbox, String) {
    outbox_in("ko_outbox_ops_").await
}

async fn state_count(outbox: &Outbox, schema: &str, state: &str) -> i64 {
    count(
        outbox.pool(),
        &format!("select count(*) from {schema}.records where state = '{state}'"),
    )
    .await
}

async fn state_of(outbox: &Outbox, schema: &str, id: i64) -> String {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "select state from {schema}.records where id = $1"
    )))
    .bind(id)
    .fetch_one(outbox.pool())
    .await
    .unwrap()
}

fn lease() -> LeaseConfig {
    LeaseConfig {
        ttl: Duration::from_secs(3),
        heartbeat: Duration::from_millis(300),
        margin: Duration::from_secs(1),
    }
}

fn relay_cfg(name: &str) -> RelayConfig {
    RelayConfig {
        instance: Some(name.to_owned()),
        lease: lease(),
        poll: Duration::from_millis(20),
        retry: RetryPolicy {
            max_attempts: 2,
            initial_backoff: Duration::from_millis(20),
            max_backoff: Duration::from_millis(100),
        },
        retention_batch: 0,
        ..RelayConfig::default()
    }
}

/// Stages `n` records of each key, ids `{key}-{i}`, in one transaction.
async fn stage(outbox: &Outbox, category: &str, keys: &[&str], n: u32) -> BTreeMap<String, Staged> {
    let mut out = BTreeMap::new();
    let mut tx = outbox.pool().begin().await.unwrap();
    for key in keys {
        for i in 1..=n {
            let id = format!("{key}-{i}");
            let staged = outbox
                .stage(&mut tx, Outgoing::new(category, *key, "x").with_id(id.clone()))
                .await
                .unwrap();
            out.insert(id, staged);
        }
    }
    tx.commit().await.unwrap();
    out
}

/// A record with an invalid (empty) key, as a tool writing raw SQL could
/// insert it (the relay abandons it at once).
async fn insert_invalid(outbox: &Outbox, schema: &str, category: &str) {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "insert into {schema}.records (message_id, category, key, slot, seq, payload) \
         values ('bad-1', $1, '', $2, 1, 'x')"
    )))
    .bind(category)
    .bind(Outbox::slot_of("", 16) as i32)
    .execute(outbox.pool())
    .await
    .unwrap();
}

// ------------------------------------------------- a failing transport

/// Wraps a transport and fails the publishes of chosen message ids, and
/// refuses the keys of chosen keys (as a broker whose key rules are
/// stricter would: a key error).
#[derive(Debug, Clone)]
struct Failing {
    inner: Arc<dyn Transport>,
    fail: Arc<Mutex<HashSet<String>>>,
    refuse: Arc<HashSet<String>>,
}

impl Failing {
    fn new(inner: Arc<dyn Transport>, ids: &[&str]) -> Failing {
        Failing {
            inner,
            fail: Arc::new(Mutex::new(ids.iter().map(|s| (*s).to_owned()).collect())),
            refuse: Arc::default(),
        }
    }
    fn refusing(inner: Arc<dyn Transport>, keys: &[&str]) -> Failing {
        Failing {
            refuse: Arc::new(keys.iter().map(|s| (*s).to_owned()).collect()),
            ..Failing::new(inner, &[])
        }
    }
    fn client(&self) -> Client {
        Client::new(Arc::new(Wrapped::new(self.inner.clone(), self.clone())))
    }
}

/// The wrapper's one change: chosen publishes fail.
#[async_trait]
impl Hooks for Failing {
    async fn publish(
        &self,
        inner: &dyn TransportPublisher,
        message: Message,
        fence: Option<&PublishFence>,
    ) -> Result<()> {
        if self.fail.lock().unwrap().contains(message.id()) {
            return Err(Error::broker("test broker refuses this message"));
        }
        if message.key().is_some_and(|k| self.refuse.contains(k.as_str())) {
            // A key error as the broker's stricter rules would give it.
            return Err(Error::Key(keyorder_core::OrderingKey::new("").unwrap_err()));
        }
        send(inner, message, fence).await
    }
}

// ---------------------------------------------------------------- status

/// `status()` agrees with the table: pending (held ones included), the
/// oldest pending record's age, abandoned, parked, held keys; the relay's
/// published and abandoned counters agree with the rows it marked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_matches_the_table() {
    let (outbox, schema) = outbox().await;
    let category = unique("status-");
    let empty = outbox.status().await.unwrap();
    assert_eq!((empty.pending, empty.oldest_pending_age), (0, None));
    stage(&outbox, &category, &["a", "b", "c"], 4).await;
    stage(&outbox, &category, &["h"], 3).await;
    insert_invalid(&outbox, &schema, &category).await;
    let status = outbox.status().await.unwrap();
    assert_eq!(status.pending, 16);
    assert_eq!(status.pending as i64, state_count(&outbox, &schema, "pending").await);

    let broker: Arc<dyn Transport> = Arc::new(MemoryTransport::new());
    let consumer = consume(&Client::new(broker.clone()), &category, lease()).await;
    let failing = Failing::new(broker.clone(), &["h-2"]);
    let relay = spawn_relay(outbox.relay(failing.client(), relay_cfg("r1")));
    // a, b, c (12) and h-1; then h halts on h-2 and the bad record is abandoned.
    consumer.wait_for(13).await;
    until(
        "key h held and the bad record abandoned",
        Duration::from_secs(30),
        || async {
            let s = outbox.status().await.unwrap();
            s.held_keys == 1 && s.abandoned == 1
        },
    )
    .await;
    // Age the waiting records by two minutes.
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "update {schema}.records set created_at = created_at - interval '120 seconds' where state = 'pending'"
    )))
    .execute(outbox.pool())
    .await
    .unwrap();
    let status = outbox.status().await.unwrap();
    assert_eq!(status.pending as i64, state_count(&outbox, &schema, "pending").await);
    assert_eq!(status.pending, 2, "the held head h-2 and h-3 behind it");
    assert_eq!(
        status.abandoned as i64,
        state_count(&outbox, &schema, "abandoned").await
    );
    assert_eq!(status.abandoned, 1);
    assert_eq!(status.parked, 0);
    assert_eq!(
        status.held_keys as i64,
        count(outbox.pool(), &format!("select count(*) from {schema}.halted")).await
    );
    let age = status.oldest_pending_age.expect("records are pending");
    assert!(
        age >= Duration::from_secs(120) && age < Duration::from_secs(600),
        "{age:?}"
    );
    let stats = relay.stats.snapshot();
    assert_eq!(stats.published as i64, state_count(&outbox, &schema, "published").await);
    assert_eq!(stats.published, 13);
    assert_eq!(stats.abandoned, 1);
    assert_eq!(stats.halted, 1);
    assert_eq!(consumer.guard.dropped(), 0);
    relay.stop().await;
    consumer.stop().await;
}

// ------------------------------------------------------------- retention

/// Retention deletes published records only, a bounded batch at a time;
/// held, pending and abandoned records stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_deletes_only_published_records_in_batches() {
    let (outbox, schema) = outbox().await;
    let category = unique("retain-");
    stage(&outbox, &category, &["a", "b", "c", "d", "e"], 5).await;
    stage(&outbox, &category, &["h"], 3).await;
    insert_invalid(&outbox, &schema, &category).await;
    let broker: Arc<dyn Transport> = Arc::new(MemoryTransport::new());
    let consumer = consume(&Client::new(broker.clone()), &category, lease()).await;
    let failing = Failing::new(broker.clone(), &["h-2"]);
    let relay = spawn_relay(outbox.relay(failing.client(), relay_cfg("r1")));
    consumer.wait_for(26).await;
    until(
        "key h held and the bad record abandoned",
        Duration::from_secs(30),
        || async {
            let s = outbox.status().await.unwrap();
            s.held_keys == 1 && s.abandoned == 1
        },
    )
    .await;
    relay.stop().await;
    assert_eq!(state_count(&outbox, &schema, "published").await, 26);
    let others = format!("select count(*) from {schema}.records where state <> 'published'");
    assert_eq!(count(outbox.pool(), &others).await, 3);

    // By hand: bounded batches, oldest first.
    assert_eq!(outbox.delete_published(0).await.unwrap(), 0, "0 deletes nothing");
    let mut batches = Vec::new();
    loop {
        let n = outbox.delete_published(10).await.unwrap();
        batches.push(n);
        assert_eq!(count(outbox.pool(), &others).await, 3, "only published records go");
        if n == 0 {
            break;
        }
    }
    assert_eq!(batches, [10, 10, 6, 0]);
    assert_eq!(state_count(&outbox, &schema, "published").await, 0);

    // By the relay: batches of 4, every heartbeat and again while full.
    stage(&outbox, &category, &["a", "f", "g"], 7).await;
    let cfg = RelayConfig {
        retention_batch: 4,
        ..relay_cfg("r2")
    };
    let relay = spawn_relay(outbox.relay(failing.client(), cfg));
    consumer.wait_for(26 + 21).await;
    until("every published record deleted", Duration::from_secs(30), || async {
        state_count(&outbox, &schema, "published").await == 0 && relay.stats.snapshot().published == 21
    })
    .await;
    assert_eq!(relay.stats.snapshot().retention_deleted, 21);
    assert_eq!(state_count(&outbox, &schema, "pending").await, 2, "the held key waits");
    assert_eq!(state_count(&outbox, &schema, "abandoned").await, 1);
    assert_eq!(outbox.halted().await.unwrap().len(), 1);
    relay.stop().await;
    // The counters stay: a key's next record continues its sequence.
    let next = stage(&outbox, &category, &["a"], 1).await;
    assert_eq!(next["a-1"].seq, 13);
    consumer.stop().await;
}

// ------------------------------------------------------- retry and discard

/// Records abandoned by a relay whose broker rejects their key (a key
/// error) are retried by an operator once the broker is fixed: a running
/// relay reads them again and publishes them in sequence order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retried_abandoned_records_are_published_in_order() {
    let (outbox, schema) = outbox().await;
    let category = unique("retry-");
    let broker: Arc<dyn Transport> = Arc::new(MemoryTransport::new());
    let consumer = consume(&Client::new(broker.clone()), &category, lease()).await;
    let strict = Failing::refusing(broker.clone(), &["retired"]).client();
    let a = spawn_relay(outbox.relay(strict, relay_cfg("a")));
    let staged = stage(&outbox, &category, &["retired", "other"], 3).await;
    consumer.wait_for(3).await;
    until(
        "the three records of `retired` abandoned",
        Duration::from_secs(30),
        || async { outbox.status().await.unwrap().abandoned == 3 },
    )
    .await;
    a.stop().await;
    let listed = outbox.abandoned(0, 100).await.unwrap();
    assert_eq!(listed.len(), 3);
    for (r, i) in listed.iter().zip(1..) {
        assert_eq!(r.record_id, staged[&format!("retired-{i}")].record_id);
        assert_eq!((r.seq, r.state), (i, RecordState::Abandoned));
        assert!(r.label.starts_with("k#") && !r.label.contains("retired"), "{}", r.label);
        assert!(r.reason.contains("abandoned"), "{}", r.reason);
    }
    assert_eq!(
        outbox.abandoned(listed[0].record_id, 1).await.unwrap()[0].seq,
        2,
        "pages"
    );

    // A relay with the fixed rules runs; it reads a later record of the
    // same slot, so its read position there is past the abandoned ones.
    let b = spawn_relay(outbox.relay(Client::new(broker.clone()), relay_cfg("b")));
    let slot = Outbox::slot_of("retired", 16);
    let neighbour = (0..)
        .map(|i| format!("n{i}"))
        .find(|k| Outbox::slot_of(k, 16) == slot)
        .unwrap();
    stage(&outbox, &category, &[neighbour.as_str()], 1).await;
    consumer.wait_for(4).await;
    for i in 1..=3 {
        let acted = outbox.retry(staged[&format!("retired-{i}")].record_id).await.unwrap();
        assert_eq!((acted.seq, acted.was), (i, RecordState::Abandoned));
    }
    consumer.wait_for(7).await;
    until(
        "the retried records marked published",
        Duration::from_secs(30),
        || async { state_count(&outbox, &schema, "published").await == 7 },
    )
    .await;
    assert_eq!(consumer.ids_of("retired"), ["retired-1", "retired-2", "retired-3"]);
    assert_eq!(consumer.guard.dropped(), 0);
    let status = outbox.status().await.unwrap();
    assert_eq!((status.abandoned, status.pending), (0, 0));
    // Wrong state and unknown id: errors that name the fix.
    let err = outbox.retry(staged["retired-1"].record_id).await.unwrap_err();
    assert!(
        matches!(&err, Error::NotFound(m) if m.contains("already published")),
        "{err}"
    );
    let err = outbox.retry(i64::MAX).await.unwrap_err();
    assert!(
        matches!(&err, Error::NotFound(m) if m.contains("keyorder outbox abandoned")),
        "{err}"
    );
    let err = outbox.discard(staged["other-1"].record_id).await.unwrap_err();
    assert!(
        matches!(&err, Error::NotFound(m) if m.contains("already published")),
        "{err}"
    );
    b.stop().await;
    consumer.stop().await;
}

/// Halt: discarding the held head releases the key's later records;
/// retrying another held head publishes it and then its successors.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn discard_releases_a_held_key_and_retry_resumes_one() {
    let (outbox, schema) = outbox().await;
    let category = unique("held-");
    let broker: Arc<dyn Transport> = Arc::new(MemoryTransport::new());
    let consumer = consume(&Client::new(broker.clone()), &category, lease()).await;
    let failing = Failing::new(broker.clone(), &["p-2", "r-1"]);
    let staged = stage(&outbox, &category, &["p", "q", "r"], 3).await;
    let relay = spawn_relay(outbox.relay(failing.client(), relay_cfg("a")));
    until("keys p and r held", Duration::from_secs(30), || async {
        outbox.status().await.unwrap().held_keys == 2
    })
    .await;
    consumer.wait_for(4).await; // p-1, q-1..3
    let held = outbox.halted().await.unwrap();
    let ids: HashSet<i64> = held.iter().map(|h| h.record_id).collect();
    assert_eq!(ids, HashSet::from([staged["p-2"].record_id, staged["r-1"].record_id]));
    // Only the held head is acted on.
    let err = outbox.discard(staged["p-3"].record_id).await.unwrap_err();
    assert!(
        matches!(&err, Error::NotFound(m) if m.contains("held on record")),
        "{err}"
    );
    let err = outbox.retry(staged["p-3"].record_id).await.unwrap_err();
    assert!(
        matches!(&err, Error::NotFound(m) if m.contains("held on record")),
        "{err}"
    );

    let acted = outbox.discard(staged["p-2"].record_id).await.unwrap();
    assert_eq!(acted.was, RecordState::Held);
    until("p-3 published", Duration::from_secs(30), || async {
        consumer.ids_of("p").len() == 2
    })
    .await;
    assert_eq!(consumer.ids_of("p"), ["p-1", "p-3"]);
    assert_eq!(state_of(&outbox, &schema, staged["p-2"].record_id).await, "discarded");

    failing.fail.lock().unwrap().clear();
    let acted = outbox.retry(staged["r-1"].record_id).await.unwrap();
    assert_eq!(acted.was, RecordState::Held);
    until("r published", Duration::from_secs(30), || async {
        consumer.ids_of("r").len() == 3
    })
    .await;
    assert_eq!(consumer.ids_of("r"), ["r-1", "r-2", "r-3"]);
    until("nothing held or pending", Duration::from_secs(30), || async {
        let status = outbox.status().await.unwrap();
        (status.held_keys, status.pending) == (0, 0)
    })
    .await;
    relay.stop().await;
    consumer.stop().await;
}

/// Halted keys holding NUL: listed under their own label, resumed by their
/// value, retried by record id; each record reaches the consumer under its
/// own key, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn halted_nul_keys_are_resumed_and_retried() {
    let (outbox, _) = outbox().await;
    let category = unique("nulheld-");
    let broker: Arc<dyn Transport> = Arc::new(MemoryTransport::new());
    let consumer = consume(&Client::new(broker.clone()), &category, lease()).await;
    let failing = Failing::new(broker.clone(), &["n-2", "z-1"]);
    // Ids without NUL: the message id is not a key.
    let (n_key, z_key) = ("n\u{0}a", "\u{0}");
    let mut staged = BTreeMap::new();
    let mut tx = outbox.pool().begin().await.unwrap();
    for (name, key) in [("n", n_key), ("z", z_key)] {
        for i in 1..=3 {
            let id = format!("{name}-{i}");
            let s = outbox
                .stage(&mut tx, Outgoing::new(&category, key, "x").with_id(id.clone()))
                .await
                .unwrap();
            staged.insert(id, s);
        }
    }
    tx.commit().await.unwrap();
    let relay = spawn_relay(outbox.relay(failing.client(), relay_cfg("a")));
    until("both keys held", Duration::from_secs(30), || async {
        outbox.status().await.unwrap().held_keys == 2
    })
    .await;
    consumer.wait_for(1).await; // n-1
    let held = outbox.halted().await.unwrap();
    let labels: HashSet<String> = held.iter().map(|h| h.label.clone()).collect();
    assert_eq!(
        labels,
        HashSet::from([keyorder_core::key::label(n_key), keyorder_core::key::label(z_key)])
    );

    failing.fail.lock().unwrap().clear();
    outbox.resume(&category, n_key).await.unwrap();
    until("n published", Duration::from_secs(30), || async {
        consumer.ids_of(n_key).len() == 3
    })
    .await;
    assert_eq!(consumer.ids_of(n_key), ["n-1", "n-2", "n-3"]);
    let acted = outbox.retry(staged["z-1"].record_id).await.unwrap();
    assert_eq!(acted.was, RecordState::Held);
    assert_eq!(acted.label, keyorder_core::key::label(z_key));
    until("z published", Duration::from_secs(30), || async {
        consumer.ids_of(z_key).len() == 3
    })
    .await;
    assert_eq!(consumer.ids_of(z_key), ["z-1", "z-2", "z-3"]);
    until("nothing held or pending", Duration::from_secs(30), || async {
        let status = outbox.status().await.unwrap();
        (status.held_keys, status.pending) == (0, 0)
    })
    .await;
    relay.stop().await;
    consumer.stop().await;
}

/// Park: the key went on, so the parked record cannot be retried in order
/// (refused, naming discard); discarding it clears the dead table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_record_is_refused_out_of_order_and_discarded() {
    let (outbox, schema) = outbox().await;
    let category = unique("park-");
    let broker: Arc<dyn Transport> = Arc::new(MemoryTransport::new());
    let consumer = consume(&Client::new(broker.clone()), &category, lease()).await;
    let failing = Failing::new(broker.clone(), &["s-2"]);
    let staged = stage(&outbox, &category, &["s"], 3).await;
    let cfg = RelayConfig {
        poison: PoisonPolicy::Park { max_attempts: 2 },
        ..relay_cfg("a")
    };
    let relay = spawn_relay(outbox.relay(failing.client(), cfg));
    consumer.wait_for(2).await;
    until("s-2 parked", Duration::from_secs(30), || async {
        outbox.status().await.unwrap().parked == 1
    })
    .await;
    let listed = outbox.abandoned(0, 10).await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].state, RecordState::Parked);
    let id = staged["s-2"].record_id;
    let err = outbox.retry(id).await.unwrap_err();
    assert!(
        matches!(&err, Error::NotFound(m) if m.contains("out of order") && m.contains("discard")),
        "{err}"
    );
    assert_eq!(outbox.discard(id).await.unwrap().was, RecordState::Parked);
    assert_eq!(state_of(&outbox, &schema, id).await, "discarded");
    assert!(outbox.parked().await.unwrap().is_empty(), "the dead row went too");
    assert!(outbox.abandoned(0, 10).await.unwrap().is_empty());
    let err = outbox.discard(id).await.unwrap_err();
    assert!(
        matches!(&err, Error::NotFound(m) if m.contains("already discarded")),
        "{err}"
    );
    relay.stop().await;
    assert_eq!(consumer.stop().await.len(), 2);
}

/// A schema made before `discarded` existed is upgraded by `migrate`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_upgrades_an_old_state_check() {
    let (outbox, schema) = outbox().await;
    let pool = outbox.pool();
    for stmt in [
        format!("alter table {schema}.records drop constraint records_state"),
        format!(
            "alter table {schema}.records add constraint records_state_check \
             check (state in ('pending', 'published', 'abandoned', 'parked'))"
        ),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(stmt)).execute(pool).await.unwrap();
    }
    outbox.migrate().await.unwrap();
    outbox.migrate().await.unwrap();
    let staged = stage(&outbox, "cat", &["k"], 1).await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "update {schema}.records set state = 'discarded' where id = $1"
    )))
    .bind(staged["k-1"].record_id)
    .execute(pool)
    .await
    .unwrap();
    let checks = count(
        pool,
        &format!("select count(*) from pg_constraint where conrelid = '{schema}.records'::regclass and contype = 'c'"),
    )
    .await;
    assert_eq!(checks, 1);
}
