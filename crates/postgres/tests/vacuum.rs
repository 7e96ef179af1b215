//! `PgTransport::vacuum` reclaims the dead rows consumption leaves in
//! keyorder's tables and analyzes them, on the real server (where this
//! machine's configuration has autovacuum off, nothing else would).

use std::time::Duration;

use keyorder_core::{Message, Transport};
use keyorder_postgres::PgConfig;
use sqlx::Row;

// Shared set-up; this file uses only part of it.
#[allow(dead_code)]
mod common;
use common::url;

const SCHEMA: &str = "keyorder_vacuum";

/// `(dead rows, vacuums, analyzes)` of `SCHEMA.events` as the server's
/// statistics report them.
async fn events_stats(pool: &sqlx::PgPool) -> (i64, i64, i64) {
    let row = sqlx::query(
        "select n_dead_tup, vacuum_count, analyze_count from pg_stat_user_tables \
         where schemaname = $1 and relname = 'events'",
    )
    .bind(SCHEMA)
    .fetch_one(pool)
    .await
    .unwrap();
    (row.get(0), row.get(1), row.get(2))
}

/// Polls the statistics (they reach the shared view within about a second)
/// until `done` holds, or fails after 30 s with the last value.
async fn wait_stats(pool: &sqlx::PgPool, what: &str, done: impl Fn((i64, i64, i64)) -> bool) -> (i64, i64, i64) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let _ = sqlx::query("select pg_stat_clear_snapshot()").execute(pool).await;
        let s = events_stats(pool).await;
        if done(s) {
            return s;
        }
        assert!(tokio::time::Instant::now() < deadline, "{what}: stats stayed at {s:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vacuum_reclaims_the_dead_rows_of_a_deleted_queue() {
    let t = common::transport(SCHEMA, 2).await;
    let pool = sqlx::PgPool::connect(&url()).await.unwrap();
    // Whatever an earlier run left is reclaimed first, so the counts below
    // are this run's.
    t.vacuum().await.unwrap();
    let (_, vacuums, analyzes) = wait_stats(&pool, "the first vacuum", |(d, _, _)| d == 0).await;

    let queue = format!("vac-{}", uuid::Uuid::new_v4().simple());
    let publisher = t.publisher(&queue).await.unwrap();
    for i in 0..50 {
        publisher
            .publish(Message::new(format!("m{i}")).with_key(format!("k{}", i % 5)).unwrap())
            .await
            .unwrap();
    }
    let deleted = t.delete_queue(&queue).await.unwrap();
    assert!(deleted >= 50, "rows deleted: {deleted}");
    let (dead, _, _) = wait_stats(&pool, "the delete's dead rows", |(d, _, _)| d >= 50).await;
    assert!(dead >= 50);

    t.vacuum().await.unwrap();
    let after = wait_stats(&pool, "the vacuum", |(d, v, a)| d == 0 && v > vacuums && a > analyzes).await;
    assert_eq!(after.0, 0, "dead rows left in events: {after:?}");
    pool.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vacuum_of_a_schema_without_tables_names_the_fix() {
    let cfg = PgConfig::from_url(&format!("{}?schema=keyorder_never_migrated", url()).parse().unwrap()).unwrap();
    let t = common::connect(cfg).await;
    let e = t.vacuum().await.expect_err("no tables to vacuum");
    assert!(e.to_string().contains("migrate()"), "{e}");
}
