//! The plain layout on the real server (`layout=plain`): the unordered
//! `FOR UPDATE SKIP LOCKED` competing-consumer baseline. Competing consumers
//! take every message exactly once; an expired lock is reclaimed and the
//! stale consumer's acknowledgement is fenced; a renewed lock is kept; park
//! moves the row to `dead`; dropped and closed deliveries go back at once.

use common::url;
use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use keyorder_core::raw::Room;
use keyorder_core::{
    Client, Delivery, Error, HandlerResult, KeyRules, LeaseConfig, Message, SourceSpec, Transport, TransportPublisher,
};
use keyorder_postgres::{Layout, PgConfig, PgTransport};

// Shared set-up; this file uses only part of it.
#[allow(dead_code)]
mod common;
use common::take;

const SCHEMA: &str = "keyorder_plain";

fn config() -> PgConfig {
    let cfg = PgConfig::from_url(
        &format!("{}?schema={SCHEMA}&migrate=true&layout=plain", url())
            .parse()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(cfg.layout, Layout::Plain);
    cfg
}

async fn transport() -> PgTransport {
    common::connect(config()).await
}

fn queue(name: &str) -> String {
    format!("{name}-{}", uuid::Uuid::new_v4().simple())
}

fn lease(ttl_ms: u64) -> LeaseConfig {
    LeaseConfig {
        ttl: Duration::from_millis(ttl_ms),
        heartbeat: Duration::from_millis(200),
        margin: Duration::from_millis(300),
    }
}

fn spec(queue: &str, instance: &str, lease: LeaseConfig) -> SourceSpec {
    SourceSpec {
        category: queue.to_owned(),
        correlated: Vec::new(),
        group: "g".into(),
        instance: instance.into(),
        ordered: false,
        lease,
        key_rules: KeyRules::default(),
    }
}

async fn publish(p: &Arc<dyn TransportPublisher>, key: &str, body: &str) -> String {
    let msg = Message::new(body.to_owned()).with_key(key).unwrap();
    let id = msg.id().to_owned();
    p.publish(msg).await.unwrap();
    id
}

async fn pool() -> sqlx::PgPool {
    sqlx::PgPool::connect(&config().url).await.unwrap()
}

async fn rows_of(pool: &sqlx::PgPool, queue: &str) -> i64 {
    sqlx::query_scalar("select count(*) from keyorder_plain.plain_events where queue = $1")
        .bind(queue)
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn competing_plain_sources_take_every_message_exactly_once() {
    const N: usize = 400;
    let (t1, t2) = (transport().await, transport().await);
    let queue = queue("plain-once");
    let publisher = t1.publisher(&queue).await.unwrap();
    let delivered: Arc<Mutex<Vec<(usize, String)>>> = Arc::default();
    let mut consumers = Vec::new();
    for (i, t) in [t1.clone(), t2.clone()].into_iter().enumerate() {
        let mut source = t.open(&spec(&queue, &format!("c{i}"), lease(5000))).await.unwrap();
        let delivered = delivered.clone();
        consumers.push(tokio::spawn(async move {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
            while delivered.lock().unwrap().len() < N {
                assert!(tokio::time::Instant::now() < deadline, "timed out consuming");
                source.maintain().await.unwrap();
                for d in source.fetch(&Room::up_to(8), Duration::from_millis(50)).await.unwrap() {
                    assert_eq!(d.settle.begin_attempt().await.unwrap(), 1, "a first delivery");
                    // A little handler work, so both consumers get their share.
                    tokio::time::sleep(Duration::from_micros(200)).await;
                    d.settle.ack().await.unwrap();
                    delivered.lock().unwrap().push((i, d.message.id().to_owned()));
                }
            }
            source.close().await.unwrap();
        }));
    }
    // Half the backlog before the consumers run, half while they do (woken
    // by NOTIFY).
    let mut published = Vec::new();
    for n in 0..N {
        published.push(publish(&publisher, &format!("key-{}", n % 7), &n.to_string()).await);
    }
    for c in consumers {
        c.await.unwrap();
    }
    let delivered = delivered.lock().unwrap().clone();
    let ids: Vec<&String> = delivered.iter().map(|(_, id)| id).collect();
    let unique: HashSet<&String> = ids.iter().copied().collect();
    assert_eq!(unique.len(), ids.len(), "a message was delivered twice");
    let expected: HashSet<&String> = published.iter().collect();
    assert_eq!(unique, expected, "every published message, nothing else");
    for i in 0..2 {
        assert!(
            delivered.iter().any(|(c, _)| *c == i),
            "consumer {i} took nothing: not competing"
        );
    }
    assert_eq!(rows_of(&pool().await, &queue).await, 0, "acknowledged rows are deleted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_lock_is_reclaimed_and_the_stale_ack_is_fenced() {
    let (t1, t2) = (transport().await, transport().await);
    let queue = queue("plain-fence");
    let publisher = t1.publisher(&queue).await.unwrap();
    let id = publish(&publisher, "k", "slow").await;
    let mut a = t1.open(&spec(&queue, "stale", lease(1000))).await.unwrap();
    let mut b = t2.open(&spec(&queue, "fresh", lease(1000))).await.unwrap();
    let stale = take(&mut a, 1).await.pop().unwrap();
    assert_eq!(stale.message.id(), id);
    assert_eq!(stale.settle.begin_attempt().await.unwrap(), 1);
    // `a` stalls (no renewal): once its lock expired, `b` claims the row.
    let fresh = take(&mut b, 1).await.pop().unwrap();
    assert_eq!(fresh.message.id(), id);
    assert_eq!(
        fresh.settle.begin_attempt().await.unwrap(),
        2,
        "the claim counts attempts"
    );
    assert_eq!(fresh.lease.generation(), 2, "the claim is the fencing token");
    // `a` resumes: its renewal finds the row taken, its lease is lost ...
    a.maintain().await.unwrap();
    assert!(
        stale.lease.is_lost(),
        "the stale consumer's lease is lost at its next renewal"
    );
    // ... and its acknowledgement changes nothing.
    match stale.settle.ack().await {
        Err(Error::Fenced { .. }) => {}
        other => panic!("the stale ack must be fenced, got {other:?}"),
    }
    assert_eq!(
        rows_of(&pool().await, &queue).await,
        1,
        "the fenced ack deleted nothing"
    );
    fresh.settle.ack().await.unwrap();
    assert_eq!(rows_of(&pool().await, &queue).await, 0);
    a.close().await.unwrap();
    b.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewed_lock_is_kept_by_a_slow_consumer() {
    let (t1, t2) = (transport().await, transport().await);
    let queue = queue("plain-renew");
    let publisher = t1.publisher(&queue).await.unwrap();
    publish(&publisher, "k", "slow").await;
    let mut a = t1.open(&spec(&queue, "slow", lease(1000))).await.unwrap();
    let mut b = t2.open(&spec(&queue, "other", lease(1000))).await.unwrap();
    let held = take(&mut a, 1).await.pop().unwrap();
    held.settle.begin_attempt().await.unwrap();
    // Three lock TTLs of a slow handler, renewed by `a`'s heartbeat: `b`
    // never gets the row.
    let until = tokio::time::Instant::now() + Duration::from_secs(3);
    while tokio::time::Instant::now() < until {
        a.maintain().await.unwrap();
        let got = b.fetch(&Room::up_to(10), Duration::from_millis(50)).await.unwrap();
        assert!(got.is_empty(), "a renewed row was claimed by another consumer");
    }
    assert!(!held.lease.is_lost());
    assert_eq!(held.lease.state(), keyorder_core::LeaseState::Fresh);
    held.settle.ack().await.unwrap();
    assert_eq!(rows_of(&pool().await, &queue).await, 0);
    a.close().await.unwrap();
    b.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn park_moves_the_row_into_dead() {
    let t = transport().await;
    let queue = queue("plain-park");
    let publisher = t.publisher(&queue).await.unwrap();
    let id = publish(&publisher, "poison-key", "poison").await;
    let mut source = t.open(&spec(&queue, "c", lease(5000))).await.unwrap();
    let d = take(&mut source, 1).await.pop().unwrap();
    d.settle.begin_attempt().await.unwrap();
    d.settle.park("bad payload").await.unwrap();
    let pool = pool().await;
    assert_eq!(rows_of(&pool, &queue).await, 0, "the parked row left the queue");
    let dead: Vec<(String, String, Option<String>, String)> =
        sqlx::query_as("select grp, message_id, key, reason from keyorder_plain.dead where queue = $1")
            .bind(&queue)
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(
        dead,
        vec![("g".into(), id.clone(), Some("poison-key".into()), "bad payload".into())]
    );
    let letters = t.admin().dead_letters(&queue, "g").await.unwrap();
    assert_eq!(letters.len(), 1);
    assert_eq!(letters[0].id, id);
    // Settled: a second park (a stale one) is fenced and adds nothing.
    assert!(matches!(d.settle.park("again").await, Err(Error::Fenced { .. })));
    assert!(matches!(d.settle.halt("no").await, Err(Error::Unsupported { .. })));
    source.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_and_closed_deliveries_go_back_at_once() {
    let (t1, t2) = (transport().await, transport().await);
    let queue = queue("plain-back");
    let publisher = t1.publisher(&queue).await.unwrap();
    for n in 0..5 {
        publish(&publisher, &format!("k{n}"), "x").await;
    }
    // A long lock: only a release, never an expiry, can hand rows over here.
    let mut a = t1.open(&spec(&queue, "a", lease(60_000))).await.unwrap();
    let mut b = t2.open(&spec(&queue, "b", lease(60_000))).await.unwrap();
    let mut got = take(&mut a, 5).await;
    let started = got.pop().unwrap();
    started.settle.begin_attempt().await.unwrap();
    // Two dropped unsettled (a discarded delivery): back at `a`'s next heartbeat.
    got.truncate(2);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let mut back = Vec::new();
    while back.len() < 2 {
        assert!(tokio::time::Instant::now() < deadline, "dropped rows not handed back");
        a.maintain().await.unwrap();
        back.extend(b.fetch(&Room::up_to(5), Duration::from_millis(50)).await.unwrap());
    }
    assert_eq!(back.len(), 2, "only the dropped rows came back");
    // Closing `a` hands back the rest; the started one keeps its attempt.
    a.close().await.unwrap();
    back.extend(take(&mut b, 3).await);
    drop(got);
    let mut attempts = Vec::new();
    for d in &back {
        attempts.push((
            d.message.id() == started.message.id(),
            d.settle.begin_attempt().await.unwrap(),
        ));
        d.settle.ack().await.unwrap();
    }
    attempts.sort();
    assert_eq!(
        attempts,
        vec![(false, 1), (false, 1), (false, 1), (false, 1), (true, 2)]
    );
    assert!(matches!(started.settle.ack().await, Err(Error::Fenced { .. })));
    assert_eq!(rows_of(&pool().await, &queue).await, 0);
    b.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unordered_subscriptions_consume_exactly_once_and_ordered_ones_are_refused() {
    const N: usize = 300;
    let queue = queue("plain-sub");
    let clients = [
        Client::new(Arc::new(transport().await)),
        Client::new(Arc::new(transport().await)),
    ];
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let mut runs = Vec::new();
    for (i, client) in clients.iter().enumerate() {
        let subscription = client
            .subscribe(&queue, "g")
            .concurrency(8)
            .instance_id(format!("sub-{i}"))
            .build()
            .await
            .unwrap();
        let seen = seen.clone();
        let handler = move |d: Delivery| {
            let seen = seen.clone();
            async move {
                seen.lock().unwrap().push(d.id().to_owned());
                HandlerResult::Ok(())
            }
        };
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        runs.push((
            stop,
            tokio::spawn(subscription.run(handler, async move {
                let _ = stopped.await;
            })),
        ));
    }
    let publisher = clients[0].publisher(&queue).await.unwrap();
    let mut published = HashSet::new();
    for n in 0..N {
        let msg = Message::new(n.to_string()).with_key(format!("key-{}", n % 10)).unwrap();
        published.insert(msg.id().to_owned());
        publisher.publish(msg).await.unwrap();
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while seen.lock().unwrap().len() < N {
        assert!(tokio::time::Instant::now() < deadline, "timed out consuming");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for (stop, run) in runs {
        let _ = stop.send(());
        run.await.unwrap().unwrap();
    }
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), N, "a message was handled twice");
    assert_eq!(seen.into_iter().collect::<HashSet<_>>(), published);
    assert_eq!(rows_of(&pool().await, &queue).await, 0);

    let t = transport().await;
    let mut ordered = spec(&queue, "o", lease(5000));
    ordered.ordered = true;
    match t.open(&ordered).await {
        Err(Error::Config(msg)) => assert!(msg.contains("layout=slots"), "names the fix: {msg}"),
        other => panic!("an ordered source on layout=plain must be refused, got {other:?}"),
    }
    let bad = PgConfig::from_url(&format!("{}?layout=unordered", url()).parse().unwrap());
    assert!(matches!(bad, Err(Error::Url(_))));
    let default = PgConfig::from_url(&url().parse().unwrap()).unwrap();
    assert_eq!(default.layout, Layout::Slots);
}
