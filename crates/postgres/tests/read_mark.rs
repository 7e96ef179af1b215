//! Durable attempt counts without a write per first attempt, on the real
//! server: what an owner read before it died counts as attempted once for
//! the next owner; what it never read starts at attempt 1; a retry is
//! recorded before it runs.

use common::url;
use std::time::Duration;

use keyorder_core::{Inbound, KeyRules, LeaseConfig, Message, SourceSpec, Transport};
use keyorder_postgres::{PgConfig, PgTransport};

// Shared set-up; this file uses only part of it.
#[allow(dead_code)]
mod common;
use common::take;

fn spec(queue: &str, instance: &str) -> SourceSpec {
    SourceSpec {
        category: queue.to_owned(),
        correlated: Vec::new(),
        group: "g".to_owned(),
        instance: instance.to_owned(),
        ordered: true,
        lease: LeaseConfig {
            ttl: Duration::from_secs(2),
            heartbeat: Duration::from_millis(300),
            margin: Duration::from_millis(500),
        },
        key_rules: KeyRules::default(),
    }
}

fn body(i: &Inbound) -> String {
    String::from_utf8_lossy(i.message.payload()).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_dead_owner_read_counts_as_one_attempt() {
    let cfg = PgConfig::from_url(
        &format!("{}?schema=keyorder_read_mark&slots=1&migrate=true", url())
            .parse()
            .unwrap(),
    )
    .unwrap();
    let first = common::connect(cfg.clone()).await;
    let queue = format!("mark-{}", uuid::Uuid::new_v4().simple());
    let publisher = first.publisher(&queue).await.unwrap();
    for n in 0..4 {
        publisher
            .publish(Message::new(format!("{n}")).with_key("k").unwrap())
            .await
            .unwrap();
    }
    // The first owner reads two events and starts the first; then it dies
    // (no close, no release: its lease runs out).
    let mut dead = first.open(&spec(&queue, "dead")).await.unwrap();
    let read = take(&mut dead, 2).await;
    assert_eq!(read.iter().map(body).collect::<Vec<_>>(), ["0", "1"]);
    assert_eq!(read[0].settle.begin_attempt().await.unwrap(), 1, "a first attempt");
    std::mem::forget(dead);
    drop(read);

    let second = PgTransport::connect(cfg).await.unwrap();
    let mut source = second.open(&spec(&queue, "next")).await.unwrap();
    let all = take(&mut source, 4).await;
    assert_eq!(all.iter().map(body).collect::<Vec<_>>(), ["0", "1", "2", "3"]);
    let mut attempts = Vec::new();
    for d in &all {
        attempts.push(d.settle.begin_attempt().await.unwrap());
    }
    // Read by the dead owner: attempted once (started or not); never read: 1.
    assert_eq!(attempts, [2, 2, 1, 1]);
    // A retry is recorded before it runs: a third owner would see it.
    assert_eq!(all[2].settle.begin_attempt().await.unwrap(), 2);
    let pool = sqlx::PgPool::connect(&url()).await.unwrap();
    let recorded: Vec<i32> = sqlx::query_scalar(
        "select a.attempts from keyorder_read_mark.attempts a join keyorder_read_mark.events e \
         on e.id = a.event_id where e.queue = $1 order by e.id",
    )
    .bind(&queue)
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        recorded,
        [2, 2, 2],
        "events 0 and 1 (second attempts) and 2 (its retry)"
    );
    for d in &all {
        d.settle.ack().await.unwrap();
    }
}
