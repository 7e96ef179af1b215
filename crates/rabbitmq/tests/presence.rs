//! Presence cannot be forged (issue 37), on the real RabbitMQ: anyone who
//! may publish on a `hash` group's presence exchange used to add members at
//! will (`started:who`), and `started=0` made a forged member the leader, so
//! the only live instance gave its queues away to ghosts and they went
//! unconsumed for as long as the forger kept on. Now an announcement counts
//! only while the broker holds the member's live queue (exclusive to its
//! connection): the ghosts are ignored and reported, and a real second
//! instance still joins.

// Shared set-up; this file uses only part of it.
#[allow(dead_code)]
mod common;

use common::base;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use keyorder_core::{Client, Delivery, HandlerResult, KeySource, LeaseConfig, Message};
use keyorder_rabbitmq::Names;
use lapin::options::{BasicPublishOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Connection, ConnectionProperties};

const QUEUES: u16 = 4;
const TTL: Duration = Duration::from_secs(4);

fn url() -> String {
    format!(
        "{}?topology=hash&queues={QUEUES}&queue_type=classic&expires_ms=600000&consumer_timeout_ms=3600000&groups=g",
        base()
    )
}

async fn client() -> Client {
    let t = common::connect(&url()).await;
    Client::new(Arc::new(t))
}

/// The consumer count of each of the group's hash queues (the broker's view).
async fn consumers(conn: &Connection, queues: &[String]) -> Vec<u32> {
    let ch = conn.create_channel().await.unwrap();
    let mut counts = Vec::new();
    for q in queues {
        let d = ch
            .queue_declare(
                q.as_str().into(),
                QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap();
        counts.push(d.consumer_count());
    }
    let _ = ch.close(200, "done".into()).await;
    counts
}

type Applied = Arc<Mutex<Vec<(String, String)>>>;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_announcements_take_no_queue_and_a_real_member_still_joins() {
    keyorder_testkit::logs::install();
    let category = format!("presence-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let names = Names::new(&category).unwrap().group("g").unwrap();
    let queues: Vec<String> = (0..QUEUES).map(|i| names.hash_queue(i)).collect();
    let a = client().await;
    let publisher = a.publisher(&category).await.unwrap();
    let applied: Applied = Arc::default();
    let start = |client: Client, id: &'static str| {
        let (applied, category) = (applied.clone(), category.clone());
        async move {
            let sub = client
                .subscribe(&category, "g")
                .ordered_by(KeySource::routing_key())
                .instance_id(id)
                .lease(LeaseConfig {
                    ttl: TTL,
                    heartbeat: Duration::from_millis(500),
                    margin: Duration::from_millis(1500),
                })
                .build()
                .await
                .unwrap();
            let handler = move |d: Delivery| {
                let applied = applied.clone();
                async move {
                    let body = String::from_utf8_lossy(d.payload()).into_owned();
                    applied.lock().unwrap().push((body, id.to_owned()));
                    HandlerResult::Ok(())
                }
            };
            let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
            let run = tokio::spawn(sub.run(handler, async move {
                let _ = stopped.await;
            }));
            (stop, run)
        }
    };
    let conn = Connection::connect(&base(), ConnectionProperties::default())
        .await
        .unwrap();
    let (stop_a, run_a) = start(a, "a").await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while consumers(&conn, &queues).await != vec![1; QUEUES as usize] {
        assert!(tokio::time::Instant::now() < deadline, "a never consumed every queue");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // The forger, on a thread and runtime of its own, every 100 ms: 12
    // ghosts never heard before and the same 12 again each time (more than
    // the 16 confirmations asked per heartbeat), each claiming to be the
    // oldest member, and the real members' own ids with a made-up join
    // claim; half of them with a nonce header.
    let forging = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let forger = std::thread::spawn({
        let (forging, presence, base) = (forging.clone(), names.presence(), base());
        move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let conn = Connection::connect(&base, ConnectionProperties::default())
                    .await
                    .unwrap();
                let ch = conn.create_channel().await.unwrap();
                let mut round = 0;
                while forging.load(std::sync::atomic::Ordering::SeqCst) {
                    round += 1;
                    let mut bodies: Vec<String> = (0..12).map(|i| format!("0:ghost-{round}-{i}")).collect();
                    bodies.extend((0..12).map(|i| format!("0:ghost-again-{i}")));
                    bodies.push("0:a".into());
                    bodies.push("0:b".into());
                    for (i, body) in bodies.iter().enumerate() {
                        let mut headers = FieldTable::default();
                        if i % 2 == 0 {
                            headers.insert(
                                "x-keyorder-nonce".into(),
                                AMQPValue::LongString(format!("{:032x}", i).into()),
                            );
                        }
                        ch.basic_publish(
                            presence.as_str().into(),
                            "".into(),
                            BasicPublishOptions::default(),
                            body.as_bytes(),
                            BasicProperties::default().with_headers(headers),
                        )
                        .await
                        .unwrap();
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            })
        }
    });

    // a sees through the ghosts (it says so)...
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while !keyorder_testkit::logs::text().contains("not confirmed by the broker") {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the forged announcements were neither followed nor reported"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // ... and, for three lease TTLs while the forger goes on, every message
    // published is applied within a few heartbeats (a queue given to a ghost
    // would hold its keys back).
    let round_trip = |tag: &'static str, keys: usize| {
        let (publisher, applied) = (publisher.clone(), applied.clone());
        async move {
            let mut round = 0;
            let until = tokio::time::Instant::now() + TTL * 3;
            while tokio::time::Instant::now() < until {
                round += 1;
                let before = applied.lock().unwrap().len();
                for k in 0..keys {
                    publisher
                        .publish(
                            Message::new(format!("{tag}{round}-{k}"))
                                .with_key(format!("k{k}"))
                                .unwrap(),
                        )
                        .await
                        .unwrap();
                }
                let deadline = tokio::time::Instant::now() + TTL * 2;
                while applied.lock().unwrap().len() < before + keys {
                    assert!(
                        tokio::time::Instant::now() < deadline,
                        "{tag}: round {round} not applied within two lease TTLs while forged announcements \
                         arrive ({} of {keys})",
                        applied.lock().unwrap().len() - before
                    );
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    };
    round_trip("alone-", 16).await;

    // A real second member is confirmed and given queues, ghosts or not,
    // and from then on both together keep every queue consumed.
    let (stop_b, run_b) = start(client().await, "b").await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    let mut round = 0;
    while !applied.lock().unwrap().iter().any(|(_, by)| by == "b") {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the real member b was never given a queue"
        );
        round += 1;
        for k in 0..16 {
            publisher
                .publish(Message::new(format!("r{round}-{k}")).with_key(format!("k{k}")).unwrap())
                .await
                .unwrap();
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    round_trip("pair-", 16).await;
    let by = |who: &str| {
        applied
            .lock()
            .unwrap()
            .iter()
            .filter(|(body, by)| body.starts_with("pair-") && by == who)
            .count()
    };
    assert!(
        by("a") > 0 && by("b") > 0,
        "both members work: a {} b {}",
        by("a"),
        by("b")
    );
    forging.store(false, std::sync::atomic::Ordering::SeqCst);
    forger.join().unwrap();
    let log = keyorder_testkit::logs::text();
    assert!(log.contains("ghost-"), "the ignored announcements are named: {log}");
    for (stop, run) in [(stop_a, run_a), (stop_b, run_b)] {
        let _ = stop.send(());
        run.await.unwrap().unwrap();
    }
}
