//! Closing a source frees every lease its instance holds, on the real
//! server, including one it never recorded: an `acquire` that committed
//! after its future was dropped (a subscription's loop is cancelled
//! mid-step at shutdown).

use keyorder_core::{Message, SourceSpec, Transport};
use sqlx::Row;

// Shared set-up; this file uses only part of it.
#[allow(dead_code)]
mod common;
use common::url;

const SCHEMA: &str = "keyorder_close_releases";

/// Slots of `queue` (group `g`) with a live lease held by `owner`.
async fn live_leases(queue: &str, owner: &str) -> i64 {
    let pool = sqlx::PgPool::connect(&url()).await.unwrap();
    let n = sqlx::query(sqlx::AssertSqlSafe(format!(
        "select count(*) from {SCHEMA}.slots where queue = $1 and grp = 'g' and owner = $2 \
         and lease_expiry > clock_timestamp()"
    )))
    .bind(queue)
    .bind(owner)
    .fetch_one(&pool)
    .await
    .unwrap()
    .get(0);
    pool.close().await;
    n
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_frees_a_lease_whose_acquire_was_never_recorded() {
    let t = common::transport(SCHEMA, 2).await;
    let queue = format!("close-{}", uuid::Uuid::new_v4().simple());
    t.publisher(&queue)
        .await
        .unwrap()
        .publish(Message::new("m").with_key("k").unwrap())
        .await
        .unwrap();

    // Another instance holds both slots, so `a` records none.
    let ghost_spec = SourceSpec {
        instance: "ghost".to_owned(),
        ..common::spec(&queue)
    };
    let mut ghost = t.open(&ghost_spec).await.unwrap();
    ghost.maintain().await.unwrap();
    assert_eq!(
        live_leases(&queue, "ghost").await,
        2,
        "the other instance holds both slots"
    );
    let mut a = t.open(&common::spec(&queue)).await.unwrap();
    a.maintain().await.unwrap();
    assert_eq!(live_leases(&queue, "a").await, 0);

    // What `a`'s acquire of slot 1 leaves at the database when it commits
    // after `a` stopped waiting for it: the lease is `a`'s, and `a` does
    // not know.
    let pool = sqlx::PgPool::connect(&url()).await.unwrap();
    let taken = sqlx::query(sqlx::AssertSqlSafe(format!(
        "update {SCHEMA}.slots set owner = 'a', generation = generation + 1, \
         lease_expiry = clock_timestamp() + interval '60 s' where queue = $1 and grp = 'g' and slot = 1"
    )))
    .bind(&queue)
    .execute(&pool)
    .await
    .unwrap()
    .rows_affected();
    pool.close().await;
    assert_eq!(taken, 1);
    assert_eq!(live_leases(&queue, "a").await, 1);

    a.close().await.unwrap();
    assert_eq!(
        live_leases(&queue, "a").await,
        0,
        "a closed instance left a live lease behind (its keys would wait for it to expire)"
    );
    // The other instance's lease of slot 0 is untouched by `a`'s close.
    assert_eq!(live_leases(&queue, "ghost").await, 1);
    ghost.close().await.unwrap();
    t.delete_queue(&queue).await.unwrap();
}
