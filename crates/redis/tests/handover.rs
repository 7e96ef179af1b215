//! A joining instance gets its share of the keys at once, not at the
//! current owner's next heartbeat, on the real Redis server.
//!
//! Both instances heartbeat every 40 s. The first owns every key from its
//! first upkeep on; the second joins a few seconds later. An owner that
//! learnt of the join only from its own heartbeat would hand nothing over
//! for about 40 s: the second instance must run messages of its share
//! within 15 s. Every message is applied once, in per-key order, across
//! the hand-over.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use keyorder_core::{Client, Delivery, KeySource, LeaseConfig, Message, Subscription};
use keyorder_testkit::until;
use tokio::sync::oneshot;

const KEYS: usize = 40;

/// `(instance, key, sequence)` in the order handlers ran.
type Log = Arc<Mutex<Vec<(String, String, u64)>>>;

async fn start(sub: Subscription, who: &str, log: Log) -> (oneshot::Sender<()>, tokio::task::JoinHandle<()>) {
    let who = who.to_owned();
    let (stop, stopped) = oneshot::channel::<()>();
    let run = tokio::spawn(async move {
        sub.run(
            move |d: Delivery| {
                let (who, log) = (who.clone(), log.clone());
                async move {
                    let key = d.key().map(|k| k.as_str().to_owned()).unwrap_or_default();
                    let seq = std::str::from_utf8(d.payload()).unwrap().parse().unwrap();
                    log.lock().unwrap().push((who, key, seq));
                    Ok(())
                }
            },
            async move {
                let _ = stopped.await;
            },
        )
        .await
        .unwrap();
    });
    (stop, run)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_joining_instance_takes_its_share_before_the_next_heartbeat() {
    let url = common::url();
    let transport = Arc::new(common::connect(&url).await);
    let client = Client::new(transport.clone());
    let category = format!("handover-{}", uuid::Uuid::new_v4().simple());
    let lease = LeaseConfig {
        ttl: Duration::from_secs(120),
        heartbeat: Duration::from_secs(40),
        margin: Duration::from_secs(10),
    };
    let publisher = client.publisher(&category).await.unwrap();
    let keys: Vec<String> = (0..KEYS).map(|i| format!("key-{i}")).collect();
    let publish_round = async |seq: u64| {
        for k in &keys {
            publisher
                .publish(Message::new(seq.to_string()).with_key(k.as_str()).unwrap())
                .await
                .unwrap();
        }
    };
    publish_round(1).await;
    let log: Log = Arc::default();
    let subscribe = async |id: &str| {
        client
            .subscribe(&category, "g")
            .ordered_by(KeySource::routing_key())
            .lease(lease)
            .instance_id(id)
            .build()
            .await
            .unwrap()
    };
    let (stop_a, run_a) = start(subscribe("a").await, "a", log.clone()).await;
    let count = |who: &'static str, log: Log| move || log.lock().unwrap().iter().filter(|e| e.0 == who).count();
    let by_a = count("a", log.clone());
    until(
        "the first instance to apply every key's first message",
        Duration::from_secs(60),
        async || {
            let n = by_a();
            if n >= KEYS {
                Ok(())
            } else {
                Err(format!("{n} applied"))
            }
        },
    )
    .await;
    let joined = std::time::Instant::now();
    let (stop_b, run_b) = start(subscribe("b").await, "b", log.clone()).await;
    publish_round(2).await;
    let by_b = count("b", log.clone());
    until(
        "the joining instance to apply messages of its share (owner's heartbeat: 40 s)",
        Duration::from_secs(15),
        async || {
            let n = by_b();
            if n > 0 {
                Ok(())
            } else {
                Err(format!("{n} applied by the joining instance"))
            }
        },
    )
    .await;
    assert!(
        joined.elapsed() < Duration::from_secs(30),
        "the check ran past the owner's heartbeat"
    );
    until("every message applied", Duration::from_secs(60), async || {
        let n = log.lock().unwrap().len();
        if n >= 2 * KEYS {
            Ok(())
        } else {
            Err(format!("{n} of {} applied", 2 * KEYS))
        }
    })
    .await;
    let _ = stop_b.send(());
    let _ = stop_a.send(());
    run_b.await.unwrap();
    run_a.await.unwrap();
    let log = log.lock().unwrap().clone();
    let mut seen: HashMap<&str, Vec<u64>> = HashMap::new();
    for (_, k, seq) in &log {
        seen.entry(k.as_str()).or_default().push(*seq);
    }
    for k in &keys {
        assert_eq!(
            seen.get(k.as_str()),
            Some(&vec![1, 2]),
            "a key's messages, in the order applied"
        );
    }
    let _ = client.admin().delete_category(&category).await;
}

/// The ownership wake-up names its group: an instance of another group
/// joining (or releasing, or leaving) must not make this group's instances
/// run a full upkeep (heartbeat script, the whole partition index, trim and
/// reap) before their own heartbeat. Here group `g1`'s only member
/// heartbeats every 12 s; its member score (written by each upkeep) must
/// not move when instances of group `g2` come and go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_groups_hand_overs_do_not_wake_this_groups_upkeep() {
    let url = common::url();
    let transport = Arc::new(common::connect(&url).await);
    let client = Client::new(transport.clone());
    let category = format!("handover-storm-{}", uuid::Uuid::new_v4().simple());
    let lease = LeaseConfig {
        ttl: Duration::from_secs(60),
        heartbeat: Duration::from_secs(12),
        margin: Duration::from_secs(10),
    };
    let publisher = client.publisher(&category).await.unwrap();
    publisher
        .publish(Message::new("1").with_key("a").unwrap())
        .await
        .unwrap();
    let log: Log = Arc::default();
    let sub = client
        .subscribe(&category, "g1")
        .ordered_by(KeySource::routing_key())
        .lease(lease)
        .instance_id("x")
        .build()
        .await
        .unwrap();
    let (stop, run) = start(sub, "x", log.clone()).await;
    until("g1 applies its message", Duration::from_secs(30), async || {
        if !log.lock().unwrap().is_empty() {
            Ok(())
        } else {
            Err("none".into())
        }
    })
    .await;
    let redis = redis::Client::open(url.as_str()).unwrap();
    let mut conn = redis.get_multiplexed_async_connection().await.unwrap();
    let members = format!("{category}:__members__:g1");
    let score = async |conn: &mut redis::aio::MultiplexedConnection| -> f64 {
        redis::cmd("ZSCORE")
            .arg(&members)
            .arg("x")
            .query_async(conn)
            .await
            .unwrap()
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = score(&mut conn).await;
    // Instances of another group come and go (each open and close says
    // `__owners__` on the category's wake channel).
    let mut woken = 0;
    let mut last = before;
    for i in 0..10 {
        let other = client
            .subscribe(&category, "g2")
            .ordered_by(KeySource::routing_key())
            .lease(lease)
            .instance_id(format!("other-{i}"))
            .build()
            .await
            .unwrap();
        drop(other);
        tokio::time::sleep(Duration::from_millis(300)).await;
        let now = score(&mut conn).await;
        if now != last {
            woken += 1;
            last = now;
        }
    }
    let _ = stop.send(());
    run.await.unwrap();
    let _ = client.admin().delete_category(&category).await;
    // In ~3.5 s g1's own heartbeat (12 s) runs at most once.
    assert!(
        woken <= 1,
        "g1's upkeep ran {woken} times in ~3.5 s (heartbeat 12 s), each time because an instance of group g2 joined"
    );
}

/// Hand-overs at wake-up speed under churn: instances join and leave
/// (graceful) every few hundred ms while messages flow. A key never runs
/// on two instances at once, and its messages apply in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn churn_keeps_keys_exclusive_and_ordered() {
    use std::collections::HashSet;
    const N: usize = 60;
    let url = common::url();
    let transport = Arc::new(common::connect(&url).await);
    let client = Client::new(transport.clone());
    let category = format!("handover-churn-{}", uuid::Uuid::new_v4().simple());
    let lease = LeaseConfig {
        ttl: Duration::from_secs(120),
        heartbeat: Duration::from_secs(40),
        margin: Duration::from_secs(10),
    };
    let running: Arc<Mutex<HashSet<String>>> = Arc::default();
    let overlaps: Arc<Mutex<Vec<String>>> = Arc::default();
    let log: Log = Arc::default();
    let spawn = |id: String| {
        let client = client.clone();
        let category = category.clone();
        let (running, overlaps, log) = (running.clone(), overlaps.clone(), log.clone());
        async move {
            let sub = client
                .subscribe(&category, "g")
                .ordered_by(KeySource::routing_key())
                .lease(lease)
                .instance_id(id.clone())
                .build()
                .await
                .unwrap();
            let (stop, stopped) = oneshot::channel::<()>();
            let run = tokio::spawn(async move {
                sub.run(
                    move |d: Delivery| {
                        let (id, running, overlaps, log) = (id.clone(), running.clone(), overlaps.clone(), log.clone());
                        async move {
                            let key = d.key().map(|k| k.as_str().to_owned()).unwrap_or_default();
                            let seq: u64 = std::str::from_utf8(d.payload()).unwrap().parse().unwrap();
                            if !running.lock().unwrap().insert(key.clone()) {
                                overlaps.lock().unwrap().push(format!("{key} seq {seq} on {id}"));
                            }
                            tokio::time::sleep(Duration::from_millis(seq % 4)).await;
                            log.lock().unwrap().push((id, key.clone(), seq));
                            running.lock().unwrap().remove(&key);
                            Ok(())
                        }
                    },
                    async move {
                        let _ = stopped.await;
                    },
                )
                .await
                .unwrap();
            });
            (stop, run)
        }
    };
    let publisher = client.publisher(&category).await.unwrap();
    let keys: Vec<String> = (0..N).map(|i| format!("k{i}")).collect();
    let publishing = {
        let keys = keys.clone();
        tokio::spawn(async move {
            for seq in 1..=40u64 {
                for k in &keys {
                    publisher
                        .publish(Message::new(seq.to_string()).with_key(k.as_str()).unwrap())
                        .await
                        .unwrap();
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    let a = spawn("a".into()).await;
    let mut others = Vec::new();
    for round in 0..12 {
        others.push(spawn(format!("b{round}")).await);
        tokio::time::sleep(Duration::from_millis(250)).await;
        if others.len() > 2 {
            let (stop, run) = others.remove(0);
            let _ = stop.send(());
            run.await.unwrap();
        }
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    publishing.await.unwrap();
    until("every message applied", Duration::from_secs(120), async || {
        let seen: HashSet<(String, u64)> = log.lock().unwrap().iter().map(|e| (e.1.clone(), e.2)).collect();
        if seen.len() >= N * 40 {
            Ok(())
        } else {
            Err(format!("{} of {}", seen.len(), N * 40))
        }
    })
    .await;
    for (stop, run) in others {
        let _ = stop.send(());
        run.await.unwrap();
    }
    let _ = a.0.send(());
    a.1.await.unwrap();
    let _ = client.admin().delete_category(&category).await;
    let log = log.lock().unwrap().clone();
    let mut per: HashMap<&str, Vec<u64>> = HashMap::new();
    for (_, k, s) in &log {
        per.entry(k.as_str()).or_default().push(*s);
    }
    let mut dups = 0;
    let mut bad = Vec::new();
    for (k, seqs) in &per {
        let mut max = 0;
        for s in seqs {
            if *s == max {
                dups += 1;
            } else if *s < max {
                bad.push(format!("{k}: {s} after {max}"));
            } else {
                max = *s;
            }
        }
    }
    let overlaps = overlaps.lock().unwrap().clone();
    eprintln!("churn: {} applied, {dups} repeated", log.len());
    assert!(overlaps.is_empty(), "a key ran on two instances at once: {overlaps:?}");
    assert!(bad.is_empty(), "out of order: {bad:?}");
}

/// An ownership wake-up is not forgotten when the upkeep it caused fails:
/// the retry still runs at the wake-up's pace, not at the next heartbeat
/// (40 s here). The failure is made with one lease key of the owner turned
/// into a hash while the joiner opens (the heartbeat script then fails
/// with WRONGTYPE), and undone a second later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_upkeep_does_not_forget_the_join() {
    let url = common::url();
    let transport = Arc::new(common::connect(&url).await);
    let client = Client::new(transport.clone());
    let category = format!("handover-lostwake-{}", uuid::Uuid::new_v4().simple());
    let lease = LeaseConfig {
        ttl: Duration::from_secs(120),
        heartbeat: Duration::from_secs(40),
        margin: Duration::from_secs(10),
    };
    let publisher = client.publisher(&category).await.unwrap();
    let keys: Vec<String> = (0..KEYS).map(|i| format!("key-{i}")).collect();
    for k in &keys {
        publisher
            .publish(Message::new("1").with_key(k.as_str()).unwrap())
            .await
            .unwrap();
    }
    let log: Log = Arc::default();
    let subscribe = async |id: &str| {
        client
            .subscribe(&category, "g")
            .ordered_by(KeySource::routing_key())
            .lease(lease)
            .instance_id(id)
            .build()
            .await
            .unwrap()
    };
    let (stop_a, run_a) = start(subscribe("a").await, "a", log.clone()).await;
    until(
        "a applies every key's first message",
        Duration::from_secs(30),
        async || {
            let n = log.lock().unwrap().len();
            if n >= KEYS {
                Ok(())
            } else {
                Err(format!("{n}"))
            }
        },
    )
    .await;
    let redis = redis::Client::open(url.as_str()).unwrap();
    let mut conn = redis.get_multiplexed_async_connection().await.unwrap();
    let leases: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{category}:*__lease__:g"))
        .query_async(&mut conn)
        .await
        .unwrap();
    let victim = leases[0].clone();
    let held: String = redis::cmd("GET").arg(&victim).query_async(&mut conn).await.unwrap();
    let () = redis::cmd("DEL").arg(&victim).query_async(&mut conn).await.unwrap();
    let _: i64 = redis::cmd("HSET")
        .arg(&victim)
        .arg("x")
        .arg("y")
        .query_async(&mut conn)
        .await
        .unwrap();
    let (stop_b, run_b) = start(subscribe("b").await, "b", log.clone()).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    // Undone: the owner's lease is back as it was.
    let () = redis::cmd("DEL").arg(&victim).query_async(&mut conn).await.unwrap();
    let () = redis::cmd("SET")
        .arg(&victim)
        .arg(&held)
        .arg("PX")
        .arg(120_000)
        .query_async(&mut conn)
        .await
        .unwrap();
    for k in &keys {
        publisher
            .publish(Message::new("2").with_key(k.as_str()).unwrap())
            .await
            .unwrap();
    }
    let by_b = || log.lock().unwrap().iter().filter(|e| e.0 == "b").count();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while by_b() == 0 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let got = by_b();
    let _ = stop_b.send(());
    let _ = stop_a.send(());
    let _ = run_b.await;
    let _ = run_a.await;
    let _ = client.admin().delete_category(&category).await;
    assert!(
        got > 0,
        "the joining instance got none of its share within 10 s of a transient upkeep failure (owner's heartbeat 40 s)"
    );
}
