//! The benchmark baseline (`RelayConfig::ignore_ordering`) on the real
//! PostgreSQL server and `memory://`: it ignores per-key order, but it must
//! still publish every record once and mark every record published, or the
//! comparison in `keyorder outbox bench` would be unfair.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use keyorder_core::{Client, Delivery, HandlerResult};
use keyorder_outbox::sqlx;
use keyorder_outbox::{Outgoing, RelayConfig};
use tokio::sync::oneshot;
use tokio::time::Instant;

mod common;
use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_unordered_baseline_publishes_every_record_once() {
    let (outbox, schema) = outbox_in("ko_obase_").await;
    let category = unique("baseline-");

    // 5 keys x 40 records, several records of a key per transaction, so a
    // key has many pending records the baseline publishes at once.
    let (keys, per_key) = (5usize, 40u64);
    let mut ids = HashSet::new();
    for round in 0..per_key / 10 {
        let mut tx = outbox.pool().begin().await.unwrap();
        let batch: Vec<Outgoing> = (0..keys)
            .flat_map(|k| (0..10).map(move |i| (k, i)))
            .map(|(k, i)| Outgoing::new(&category, format!("key-{k}"), format!("{round}-{i}")))
            .collect();
        for s in outbox.stage_many(&mut tx, batch).await.unwrap() {
            ids.insert(s.message_id);
        }
        tx.commit().await.unwrap();
    }
    let total = keys * per_key as usize;
    assert_eq!(ids.len(), total);

    // What reaches the broker: a plain (unordered) subscription.
    let client = Client::memory();
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let log = seen.clone();
    let subscription = client.subscribe(&category, "check").build().await.unwrap();
    let (stop_sub, sub_stopped) = oneshot::channel::<()>();
    let sub = tokio::spawn(subscription.run(
        move |d: Delivery| {
            let log = log.clone();
            async move {
                log.lock().unwrap().push(d.id().to_owned());
                HandlerResult::Ok(())
            }
        },
        async move {
            let _ = sub_stopped.await;
        },
    ));

    let relay = outbox.relay(
        client.clone(),
        RelayConfig {
            ignore_ordering: true,
            retention_batch: 0,
            poll: Duration::from_millis(20),
            ..RelayConfig::default()
        },
    );
    let stats = relay.stats();
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(relay.run(async move {
        let _ = stopped.await;
    }));

    let published_sql = format!("select count(*) from {schema}.records where state = 'published'");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let published: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(published_sql.clone()))
            .fetch_one(outbox.pool())
            .await
            .unwrap();
        if published as usize == total && seen.lock().unwrap().len() >= total {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "timed out: {published} of {total} marked published, {} delivered",
            seen.lock().unwrap().len()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _ = stop.send(());
    let snapshot = task.await.unwrap().unwrap();
    let _ = stop_sub.send(());
    sub.await.unwrap().unwrap();

    // Every record marked published exactly once, nothing else.
    assert_eq!(snapshot.published as usize, total);
    assert_eq!(
        stats.snapshot().blocked,
        0,
        "the baseline never waits for a key's earlier record"
    );
    let other: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "select count(*) from {schema}.records where state <> 'published'"
    )))
    .fetch_one(outbox.pool())
    .await
    .unwrap();
    assert_eq!(other, 0);
    // Every staged message reached the broker, once (memory:// delivers
    // each publish once to a healthy subscriber).
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), total, "a record was published twice");
    assert_eq!(seen.into_iter().collect::<HashSet<_>>(), ids);

    sqlx::query(sqlx::AssertSqlSafe(format!("drop schema {schema} cascade")))
        .execute(outbox.pool())
        .await
        .unwrap();
}
