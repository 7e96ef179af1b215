//! Retention on the real server: events every group passed are deleted in
//! bounded batches; a halted key's head and the events behind it are kept.

// Shared set-up; this file uses only part of it.
#[allow(dead_code)]
mod common;

use common::url;
use std::sync::Arc;
use std::time::Duration;

use keyorder_core::{Client, Delivery, HandlerError, HandlerResult, KeySource, LeaseConfig, Message, RetryPolicy};
use keyorder_postgres::PgConfig;

async fn count(pool: &sqlx::PgPool, sql: &'static str, queue: &str) -> i64 {
    sqlx::query_scalar(sql).bind(queue).fetch_one(pool).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passed_events_are_deleted_and_a_halted_key_is_kept() {
    let cfg = PgConfig::from_url(
        &format!(
            "{}?schema=keyorder_retention&slots=4&migrate=true&retention_batch=7",
            url()
        )
        .parse()
        .unwrap(),
    )
    .unwrap();
    let client = Client::new(Arc::new(common::connect(cfg.clone()).await));
    let pool = sqlx::PgPool::connect(&cfg.url).await.unwrap();
    let queue = format!("ret-{}", uuid::Uuid::new_v4().simple());
    let publisher = client.publisher(&queue).await.unwrap();
    for seq in 0..10 {
        for key in ["a", "b", "c", "bad"] {
            let body = if key == "bad" && seq == 3 {
                "poison".to_owned()
            } else {
                format!("{seq}")
            };
            publisher
                .publish(Message::new(body).with_key(key).unwrap())
                .await
                .unwrap();
        }
    }
    let subscription = client
        .subscribe(&queue, "g")
        .ordered_by(KeySource::routing_key())
        .retry(RetryPolicy {
            max_attempts: 1,
            initial_backoff: Duration::from_millis(10),
            max_backoff: Duration::from_millis(10),
        })
        .lease(LeaseConfig {
            ttl: Duration::from_secs(15),
            heartbeat: Duration::from_millis(500),
            margin: Duration::from_secs(5),
        })
        .build()
        .await
        .unwrap();
    let handler = |d: Delivery| async move {
        if d.payload().as_ref() == b"poison" {
            return Err(HandlerError::poison("bad message"));
        }
        HandlerResult::Ok(())
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(subscription.run(handler, async move {
        let _ = stopped.await;
    }));
    // The halted head holds its slot's cursor: everything below it, and
    // everything in the other slots, goes in batches of at most 7 per slot
    // and heartbeat; the head and what follows it in its slot stay.
    let passed = "select count(*) from keyorder_retention.events e where e.queue = $1 and \
                  (e.slot <> (select slot from keyorder_retention.events where queue = $1 and key = 'bad' limit 1) \
                   or e.id < (select h.event_id from keyorder_retention.halted h where h.queue = $1))";
    let bad_left = "select count(*) from keyorder_retention.events where queue = $1 and key = 'bad'";
    let halted = "select count(*) from keyorder_retention.halted where queue = $1";
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let is_halted = count(&pool, halted, &queue).await == 1;
        let left = count(&pool, passed, &queue).await;
        if is_halted && left == 0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "retention did not delete passed events ({left} left)"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        count(&pool, bad_left, &queue).await,
        7,
        "the halted head (seq 3) and seq 4-9 are kept"
    );
    assert_eq!(client.admin().halted(&queue, "g").await.unwrap().len(), 1);
    let _ = stop.send(());
    run.await.unwrap().unwrap();
}
