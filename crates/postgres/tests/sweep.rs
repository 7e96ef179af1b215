//! Acknowledgement rows do not pile up, on the real server: once the slot's
//! cursor has passed them, the owner's housekeeping deletes them; an
//! acknowledgement above the cursor (behind an unsettled event of another
//! key) stays until the cursor passes it too.

use std::time::Duration;

use keyorder_core::{Message, Transport, TransportSource};
use sqlx::Row;

// Shared set-up; this file uses only part of it.
#[allow(dead_code)]
mod common;
use common::{spec, take, transport, url};

const SCHEMA: &str = "keyorder_sweep";

/// `(acknowledgement rows, the slot's cursor event id)` of `queue`.
async fn state(pool: &sqlx::PgPool, queue: &str) -> (i64, i64) {
    let row = sqlx::query(sqlx::AssertSqlSafe(format!(
        "select (select count(*) from {SCHEMA}.acked where queue = $1), \
         (select cursor_id from {SCHEMA}.slots where queue = $1 and grp = 'g' and slot = 0)"
    )))
    .bind(queue)
    .fetch_one(pool)
    .await
    .unwrap();
    (row.get(0), row.get(1))
}

/// Maintains `source` until `done` holds for the queue's state, or fails
/// after 60 s with the last state.
async fn maintain_until(
    source: &mut Box<dyn TransportSource>,
    pool: &sqlx::PgPool,
    queue: &str,
    what: &str,
    done: impl Fn((i64, i64)) -> bool,
) -> (i64, i64) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        source.maintain().await.unwrap();
        let s = state(pool, queue).await;
        if done(s) {
            return s;
        }
        assert!(tokio::time::Instant::now() < deadline, "{what}: last state {s:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledgements_behind_the_cursor_are_swept() {
    let t = transport(SCHEMA, 1).await;
    let queue = format!("sweep-{}", uuid::Uuid::new_v4().simple());
    let publisher = t.publisher(&queue).await.unwrap();
    // Key `a` first, then ten events of key `b`, all in the one slot.
    publisher
        .publish(Message::new("a0").with_key("a").unwrap())
        .await
        .unwrap();
    for n in 0..10 {
        publisher
            .publish(Message::new(format!("b{n}")).with_key("b").unwrap())
            .await
            .unwrap();
    }
    let pool = sqlx::PgPool::connect(&url()).await.unwrap();
    let mut source = t.open(&spec(&queue)).await.unwrap();
    let all = take(&mut source, 11).await;
    assert_eq!(all[0].message.payload(), &b"a0"[..]);
    // Every `b` acknowledged, `a0` not: the cursor cannot pass `a0`, so the
    // ten rows stay however often the owner heartbeats.
    for d in &all[1..] {
        d.settle.ack().await.unwrap();
    }
    assert_eq!(state(&pool, &queue).await.0, 10, "ten acknowledgements recorded");
    let ids: Vec<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "select id from {SCHEMA}.events where queue = $1 order by id"
    )))
    .bind(&queue)
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(ids.len(), 11);
    // The cursor comes to rest just below `a0`, so the ten rows stay
    // however often the owner heartbeats.
    maintain_until(&mut source, &pool, &queue, "the cursor reaches `a0`", |(_, c)| {
        c == ids[0] - 1
    })
    .await;
    let started = tokio::time::Instant::now();
    while started.elapsed() < Duration::from_secs(3) {
        source.maintain().await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        state(&pool, &queue).await,
        (10, ids[0] - 1),
        "nothing swept while the cursor waits below `a0`"
    );
    // `a0` settles: the cursor passes all eleven, and the rows go.
    all[0].settle.ack().await.unwrap();
    maintain_until(&mut source, &pool, &queue, "the cursor passes every event", |(_, c)| {
        c == ids[10]
    })
    .await;
    maintain_until(
        &mut source,
        &pool,
        &queue,
        "the acknowledgements are swept",
        |(rows, _)| rows == 0,
    )
    .await;
    source.close().await.unwrap();
    pool.close().await;
}
