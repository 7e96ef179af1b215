//! The lease-and-fence protocol on the real Redis server: a stale owner's
//! read and acknowledgement are rejected, a new owner applies the reclaimed
//! entries of earlier generations first and in stream order, attempt counts
//! survive an owner change, a read whose reply was lost is recovered from the
//! holder's own pending entries, and acknowledged entries are trimmed.

// Shared set-up; this file uses only part of it.
#[allow(dead_code)]
mod common;

use common::url;
use std::sync::Arc;
use std::time::Duration;

use keyorder_core::raw::Room;
use keyorder_core::{Error, Inbound, KeyRules, LeaseConfig, Message, SourceSpec, Transport, TransportSource};
use keyorder_redis::{Names, RedisTransport};
use keyorder_testkit::until;
use redis::AsyncCommands;

async fn transport(options: &str) -> RedisTransport {
    let url = format!("{}/?{options}", url().trim_end_matches('/'));
    common::connect(&url).await
}

fn lease() -> LeaseConfig {
    LeaseConfig {
        ttl: Duration::from_secs(2),
        heartbeat: Duration::from_millis(500),
        margin: Duration::from_millis(700),
    }
}

fn spec(category: &str, instance: &str) -> SourceSpec {
    SourceSpec {
        category: category.into(),
        correlated: Vec::new(),
        group: "g".into(),
        instance: instance.into(),
        ordered: true,
        lease: lease(),
        key_rules: KeyRules::default(),
    }
}

fn category(name: &str) -> String {
    format!("proto-{name}-{}", uuid::Uuid::new_v4().simple())
}

async fn publish(t: &RedisTransport, category: &str, key: &str, ids: std::ops::Range<u32>) {
    let p = t.publisher(category).await.unwrap();
    for i in ids {
        p.publish(
            Message::new(format!("{i}"))
                .with_key(key)
                .unwrap()
                .with_id(format!("m{i}")),
        )
        .await
        .unwrap();
    }
}

/// Fetches until `n` deliveries arrived (maintaining the source), or panics
/// at the deadline.
async fn fetch_n(source: &mut Box<dyn TransportSource>, n: usize) -> Vec<Inbound> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let mut out = Vec::new();
    while out.len() < n {
        assert!(
            tokio::time::Instant::now() < deadline,
            "only {} of {n} deliveries arrived",
            out.len()
        );
        source.maintain().await.unwrap();
        out.extend(
            source
                .fetch(&Room::up_to(n - out.len()), Duration::from_millis(100))
                .await
                .unwrap(),
        );
    }
    out
}

fn ids(batch: &[Inbound]) -> Vec<String> {
    batch.iter().map(|i| i.message.id().to_owned()).collect()
}

async fn conn() -> redis::aio::MultiplexedConnection {
    redis::Client::open(url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_owner_is_fenced_and_the_next_owner_applies_reclaimed_entries_first() {
    let t = transport("").await;
    let cat = category("fence");
    let names = Names::new(&cat).unwrap();
    publish(&t, &cat, "a", 0..5).await;

    let mut a = t.open(&spec(&cat, "A")).await.unwrap();
    let first = fetch_n(&mut a, 5).await;
    assert_eq!(ids(&first), ["m0", "m1", "m2", "m3", "m4"]);
    let gen_a = first[0].lease.generation();
    assert_eq!(first[1].settle.begin_attempt().await.unwrap(), 1);
    first[0].settle.begin_attempt().await.unwrap();
    first[0].settle.ack().await.unwrap();

    // A stalls: no heartbeat. Its lease expires on the server's clock.
    let mut c = conn().await;
    let lease_key = names.lease("a", "g");
    until("A's lease to expire", Duration::from_secs(30), || {
        let (mut c, k) = (c.clone(), lease_key.clone());
        async move { !c.exists::<_, bool>(&k).await.unwrap() }
    })
    .await;

    // B takes over: the four entries A left pending come first, in order.
    let mut b = t.open(&spec(&cat, "B")).await.unwrap();
    publish(&t, &cat, "a", 5..6).await;
    let second = fetch_n(&mut b, 5).await;
    assert_eq!(ids(&second), ["m1", "m2", "m3", "m4", "m5"]);
    let gen_b = second[0].lease.generation();
    assert!(gen_b > gen_a, "generation went from {gen_a} to {gen_b}");
    // The attempt A made on m1 survived the owner change.
    assert_eq!(second[0].settle.begin_attempt().await.unwrap(), 2);

    // A resumes with stale state: its acknowledgement and its read are refused.
    match first[1].settle.ack().await {
        Err(Error::Fenced { generation, .. }) => assert_eq!(generation, gen_a),
        other => panic!("a stale acknowledgement was not fenced: {other:?}"),
    }
    let late = a.fetch(&Room::up_to(10), Duration::from_millis(50)).await.unwrap();
    assert!(late.is_empty(), "a stale owner read {:?}", ids(&late));
    assert!(first[1].lease.is_lost(), "the stale owner's lease is not marked lost");

    // The broker agrees: m1..m5 are pending at B's consumer only.
    let pending: redis::Value = redis::cmd("XPENDING")
        .arg(names.stream("a"))
        .arg("g")
        .query_async(&mut c)
        .await
        .unwrap();
    let text = format!("{pending:?}");
    assert!(text.contains(&format!("B:{gen_b}")), "{text}");
    assert!(!text.contains(&format!("A:{gen_a}")), "{text}");
    for d in &second {
        d.settle.ack().await.unwrap();
    }
    b.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_whose_reply_was_lost_is_recovered_from_the_holders_pending_entries() {
    let t = transport("response_timeout_ms=300").await;
    let cat = category("lostreply");
    let mut a = t.open(&spec(&cat, "A")).await.unwrap();
    publish(&t, &cat, "k", 0..1).await;
    let first = fetch_n(&mut a, 1).await;
    first[0].settle.ack().await.unwrap();
    publish(&t, &cat, "k", 1..4).await;

    // Writes (and so scripts) wait for 1.5 s: the fenced read times out on
    // the client, then runs on the server and delivers to A's consumer.
    let mut c = conn().await;
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(1500)
        .arg("WRITE")
        .query_async(&mut c)
        .await
        .unwrap();
    let err = a.fetch(&Room::up_to(10), Duration::from_millis(10)).await;
    assert!(err.is_err(), "the read did not time out: {err:?}");
    let stream = Names::new(&cat).unwrap().stream("k");
    until(
        "the timed-out read to run on the server",
        Duration::from_secs(30),
        || {
            let (mut c, s) = (c.clone(), stream.clone());
            async move {
                let v: redis::Value = redis::cmd("XPENDING")
                    .arg(&s)
                    .arg("g")
                    .query_async(&mut c)
                    .await
                    .unwrap();
                matches!(&v, redis::Value::Array(a) if a.first() == Some(&redis::Value::Int(3)))
            }
        },
    )
    .await;
    // Nothing new is readable with `>`; the three come from the re-read.
    let again = fetch_n(&mut a, 3).await;
    assert_eq!(ids(&again), ["m1", "m2", "m3"]);
    for d in &again {
        d.settle.ack().await.unwrap();
    }
    a.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_entries_are_trimmed_and_a_cold_partition_is_reaped_then_rediscovered() {
    let t = transport("reap_idle_ms=400").await;
    let cat = category("reap");
    let names = Names::new(&cat).unwrap();
    let mut c = conn().await;
    let mut a = t.open(&spec(&cat, "A")).await.unwrap();
    publish(&t, &cat, "cold", 0..3).await;
    for d in fetch_n(&mut a, 3).await {
        d.settle.ack().await.unwrap();
    }
    // Trimmed once acknowledged by the only group, then reaped once idle.
    let (stream, index) = (names.stream("cold"), names.index());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let mut trimmed = false;
    loop {
        assert!(tokio::time::Instant::now() < deadline, "the partition was not reaped");
        a.maintain().await.unwrap();
        let len: usize = c.xlen(&stream).await.unwrap();
        trimmed |= len == 0;
        let indexed: Option<f64> = c.zscore(&index, "cold").await.unwrap();
        if indexed.is_none() {
            assert!(
                !c.exists::<_, bool>(&stream).await.unwrap(),
                "reaped but the stream is left"
            );
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(trimmed, "acknowledged entries were never trimmed");
    // Publishing again recreates the partition; it is found without a restart.
    publish(&t, &cat, "cold", 3..4).await;
    let back = fetch_n(&mut a, 1).await;
    assert_eq!(ids(&back), ["m3"]);
    back[0].settle.ack().await.unwrap();
    a.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publishes_racing_the_reaper_are_never_lost() {
    use keyorder_core::{Client, Delivery, HandlerResult, KeySource};
    let t = transport("reap_idle_ms=100").await;
    let cat = category("race");
    let client = Client::new(Arc::new(t.clone()));
    let seen = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let s = seen.clone();
    let sub = client
        .subscribe(&cat, "g")
        .ordered_by(KeySource::routing_key())
        .lease(lease())
        .build()
        .await
        .unwrap();
    let handler = move |d: Delivery| {
        let s = s.clone();
        async move {
            s.lock().unwrap().push(d.id().to_owned());
            HandlerResult::Ok(())
        }
    };
    let stop = Arc::new(tokio::sync::Notify::new());
    let stopper = stop.clone();
    let run = tokio::spawn(sub.run(handler, async move { stopper.notified().await }));
    let p = client.publisher(&cat).await.unwrap();
    // Bursts separated by pauses shorter and longer than the reaper's idle
    // time and the heartbeat it runs on: publishes land just before, during
    // and after reaps.
    const PAUSES_MS: [u64; 12] = [50, 150, 300, 600, 90, 700, 120, 450, 650, 80, 500, 700];
    let mut n = 0;
    for pause in PAUSES_MS {
        for _ in 0..3 {
            p.publish(Message::new("x").with_key("hot").unwrap().with_id(format!("m{n}")))
                .await
                .unwrap();
            n += 1;
        }
        tokio::time::sleep(Duration::from_millis(pause)).await;
    }
    until("every message to be applied", Duration::from_secs(30), || {
        let s = seen.clone();
        async move { s.lock().unwrap().len() >= n }
    })
    .await;
    let got = seen.lock().unwrap().clone();
    let want: Vec<String> = (0..n).map(|i| format!("m{i}")).collect();
    assert_eq!(got, want, "lost or reordered across reaps");
    // Each reap and re-acquire takes a new generation: the race happened.
    let generations: u64 = conn().await.get(Names::new(&cat).unwrap().generation()).await.unwrap();
    assert!(generations >= 2, "the partition was reaped {} times", generations - 1);
    stop.notify_one();
    run.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_correlated_subscription_partitions_every_category_by_its_key() {
    use keyorder_core::{Client, KeySource};
    let client = Client::new(Arc::new(transport("").await));
    let (orders, payments) = (category("orders"), category("payments"));
    let _ledger = client
        .subscribe(&payments, "ledger")
        .ordered_by(KeySource::header("account"))
        .lease(lease())
        .build()
        .await
        .unwrap();
    let err = client
        .subscribe(&orders, "saga")
        .correlated_with(&payments)
        .ordered_by(KeySource::routing_key())
        .lease(lease())
        .build()
        .await
        .unwrap_err();
    match err {
        Error::Registration(m) => assert!(m.contains(&payments), "{m}"),
        other => panic!("expected a registration error, got {other}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_read_renews_the_lease_it_confirms() {
    let t = transport("").await;
    let cat = category("renew");
    let lease_key = Names::new(&cat).unwrap().lease("r", "g");
    publish(&t, &cat, "r", 0..1).await;
    let mut a = t.open(&spec(&cat, "A")).await.unwrap();
    let got = fetch_n(&mut a, 1).await;
    let mut c = conn().await;
    // Let most of the lease run out without a heartbeat, then read.
    until("the lease to age", Duration::from_secs(30), || {
        let (mut c, k) = (c.clone(), lease_key.clone());
        async move { c.pttl::<_, i64>(&k).await.unwrap() < 1_000 }
    })
    .await;
    publish(&t, &cat, "r", 1..2).await;
    let more = a.fetch(&Room::up_to(10), Duration::from_millis(200)).await.unwrap();
    assert_eq!(ids(&more), ["m1"]);
    let left: i64 = c.pttl(&lease_key).await.unwrap();
    assert!(
        left > 1_500,
        "the read confirmed the scope but left the lease with {left} ms"
    );
    got[0].settle.ack().await.unwrap();
    more[0].settle.ack().await.unwrap();
    a.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_may_evict_keys_is_refused() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut server = std::process::Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", ""])
        .args(["--appendonly", "no", "--maxmemory-policy", "allkeys-lru"])
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("redis-server (run scripts/services)");
    let url = format!("redis://127.0.0.1:{port}");
    until("the evicting server to answer", Duration::from_secs(30), || {
        let url = url.clone();
        async move {
            match redis::Client::open(url.as_str())
                .unwrap()
                .get_multiplexed_async_connection()
                .await
            {
                Ok(mut c) => redis::cmd("PING").query_async::<String>(&mut c).await.is_ok(),
                Err(_) => false,
            }
        }
    })
    .await;
    let err = RedisTransport::from_url(&url.parse().unwrap()).await.unwrap_err();
    server.kill().unwrap();
    server.wait().unwrap();
    match err {
        Error::Config(m) => assert!(m.contains("noeviction") && m.contains("allkeys-lru"), "{m}"),
        other => panic!("expected a configuration error, got {other}"),
    }
}

/// A fenced publish: the script refuses (and stores nothing for) a token
/// below the highest the scope has seen; equal and higher tokens publish;
/// scopes are independent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_publish_with_a_lower_token_is_refused_and_stores_nothing() {
    let category = category("fence");
    let t = transport("").await;
    let client = keyorder_core::Client::new(Arc::new(t));
    let publisher = client.publisher(&category).await.unwrap();
    assert!(publisher.fences_publishes());
    let fence = |scope: &str, token| keyorder_core::PublishFence {
        scope: scope.into(),
        token,
    };
    let msg = |i: u32| Message::new(format!("m{i}")).with_key("k").unwrap();
    publisher.publish_fenced(msg(1), &fence("outbox/s/1", 2)).await.unwrap();
    publisher.publish_fenced(msg(2), &fence("outbox/s/1", 2)).await.unwrap();
    let refused = publisher.publish_fenced(msg(3), &fence("outbox/s/1", 1)).await;
    assert!(
        matches!(refused, Err(Error::Fenced { generation: 1, .. })),
        "{refused:?}"
    );
    // Another scope has its own fence.
    publisher.publish_fenced(msg(4), &fence("outbox/s/2", 1)).await.unwrap();
    publisher.publish_fenced(msg(5), &fence("outbox/s/1", 3)).await.unwrap();
    let refused = publisher.publish_fenced(msg(6), &fence("outbox/s/1", 2)).await;
    assert!(matches!(refused, Err(Error::Fenced { .. })), "{refused:?}");
    // A badly spelled scope fails before the broker.
    let bad = publisher.publish_fenced(msg(7), &fence("a b", 9)).await;
    assert!(matches!(bad, Err(Error::Config(_))), "{bad:?}");

    let names = Names::new(&category).unwrap();
    let mut conn = redis::Client::open(url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    type Entry = (String, Vec<(String, Vec<u8>)>);
    let entries: Vec<Entry> = conn.xrange_all(names.stream("k")).await.unwrap();
    let payloads: Vec<String> = entries
        .iter()
        .filter_map(|(_, fields)| {
            fields
                .iter()
                .find(|(f, _)| f == "p")
                .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
        })
        .collect();
    assert_eq!(payloads, ["m1", "m2", "m4", "m5"], "refused publishes stored nothing");
    let token: u64 = conn.get(names.fence("outbox/s/1")).await.unwrap();
    assert_eq!(token, 3);
}

/// A park whose reply was lost is retried by the dispatcher: the retry finds
/// the entry already settled and dead-letters nothing more, on the fenced
/// layout and on the plain single stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_park_dead_letters_its_entry_once() {
    for (options, ordered) in [("", true), ("layout=single", false)] {
        let t = transport(options).await;
        let cat = category("park");
        let names = Names::new(&cat).unwrap();
        publish(&t, &cat, "a", 0..2).await;
        let mut source = t
            .open(&SourceSpec {
                ordered,
                ..spec(&cat, "A")
            })
            .await
            .unwrap();
        let got = fetch_n(&mut source, 2).await;
        got[0].settle.park("poison").await.unwrap();
        got[0].settle.park("poison").await.unwrap();
        got[1].settle.ack().await.unwrap();
        let (stream, dlq) = if ordered {
            (names.stream("a"), names.dlq("a"))
        } else {
            (names.single(), names.keyless_dlq())
        };
        let mut c = conn().await;
        let dead: usize = c.xlen(&dlq).await.unwrap();
        assert_eq!(dead, 1, "{options:?}: dead letters of one parked entry");
        let pending: redis::Value = redis::cmd("XPENDING")
            .arg(&stream)
            .arg("g")
            .arg("-")
            .arg("+")
            .arg(10)
            .query_async(&mut c)
            .await
            .unwrap();
        assert_eq!(pending, redis::Value::Array(vec![]), "{options:?}: still pending");
        source.close().await.unwrap();
    }
}
