//! Stored state written by hand or by a foreign client never stops a
//! subscription, its upkeep or an operator's command (issue 37): an index
//! member that is no text, an index member whose stream name holds a
//! string, a halted field and a dead-letter index member that are no text.
//! Each is skipped; the category's real keys keep flowing and the
//! operator's listings answer.

// Shared set-up; this file uses only part of it.
#[allow(dead_code)]
mod common;

use common::url;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use keyorder_core::{Client, Delivery, HandlerResult, KeySource, LeaseConfig, Message};
use keyorder_redis::Names;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_stored_entries_are_skipped_and_nothing_stops() {
    let category = format!("stored-{}", uuid::Uuid::new_v4().simple());
    let n = Names::new(&category).unwrap();
    let mut conn = redis::Client::open(url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    // A string where a partition's stream would be, indexed; index, halted
    // and dead-letter members that are no text.
    let _: () = redis::cmd("SET")
        .arg(n.stream("bogus"))
        .arg("x")
        .query_async(&mut conn)
        .await
        .unwrap();
    let _: () = redis::cmd("ZADD")
        .arg(n.index())
        .arg(0)
        .arg("bogus")
        .arg(0)
        .arg(&b"\xff\xfe"[..])
        .query_async(&mut conn)
        .await
        .unwrap();
    let _: () = redis::cmd("HSET")
        .arg(n.halted("g"))
        .arg(&b"\xff"[..])
        .arg(&b"\xfe"[..])
        .query_async(&mut conn)
        .await
        .unwrap();
    let _: () = redis::cmd("SADD")
        .arg(n.dlq_index())
        .arg(&b"\xff"[..])
        .query_async(&mut conn)
        .await
        .unwrap();

    let client = Client::new(Arc::new(common::connect(&url()).await));
    let publisher = client.publisher(&category).await.unwrap();
    for i in 0..5 {
        for k in ["a", "b"] {
            publisher
                .publish(Message::new(format!("{k}/{i}")).with_key(k).unwrap())
                .await
                .unwrap();
        }
    }
    let sub = client
        .subscribe(&category, "g")
        .ordered_by(KeySource::routing_key())
        .lease(LeaseConfig {
            ttl: Duration::from_secs(3),
            heartbeat: Duration::from_millis(500),
            margin: Duration::from_secs(1),
        })
        .build()
        .await
        .unwrap();
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let log = seen.clone();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(sub.run(
        move |d: Delivery| {
            let log = log.clone();
            async move {
                log.lock()
                    .unwrap()
                    .push(String::from_utf8_lossy(d.payload()).into_owned());
                HandlerResult::Ok(())
            }
        },
        async move {
            let _ = stopped.await;
        },
    ));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while seen.lock().unwrap().len() < 10 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the real keys stopped: {:?}",
            seen.lock().unwrap()
        );
        assert!(!run.is_finished(), "the subscription ended: {:?}", run.await);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The operator's listings answer, with the real keys.
    let admin = client.admin();
    let scopes = admin.scopes(&category, "g").await.expect("scopes answers");
    assert!(scopes.len() >= 2, "{scopes:?}");
    admin.halted(&category, "g").await.expect("halted answers");
    admin.hot_keys(&category, "g", 10).await.expect("hot keys answers");
    admin.dead_letters(&category, "g").await.expect("dead letters answer");
    let _ = stop.send(());
    run.await.unwrap().expect("the subscription ends cleanly");
    for k in ["a", "b"] {
        let mine: Vec<String> = seen
            .lock()
            .unwrap()
            .iter()
            .filter(|p| p.starts_with(&format!("{k}/")))
            .cloned()
            .collect();
        assert_eq!(
            mine,
            (0..5).map(|i| format!("{k}/{i}")).collect::<Vec<_>>(),
            "key {k} in order"
        );
    }
    // The string under a partition's name was left alone.
    let kind: String = redis::cmd("TYPE")
        .arg(n.stream("bogus"))
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(kind, "string");
}
