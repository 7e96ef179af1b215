//! `PgTransport::delete_queue` removes every row kept for a queue, on the
//! real server, and refuses while the queue has a live owner.

use keyorder_core::{Message, Transport};

mod common;
use common::{one, url};

const SCHEMA: &str = "keyorder_delete_queue";

/// Rows of `queue` in each of the schema's tables that have a `queue` column.
async fn rows_of(queue: &str) -> Vec<(String, i64)> {
    use sqlx::Row;
    let pool = sqlx::PgPool::connect(&url()).await.unwrap();
    let tables: Vec<String> = sqlx::query(
        "select table_name::text from information_schema.columns where table_schema = $1 \
         and column_name = 'queue' order by 1",
    )
    .bind(SCHEMA)
    .fetch_all(&pool)
    .await
    .unwrap()
    .iter()
    .map(|r| r.get(0))
    .collect();
    assert!(tables.len() >= 12, "the schema's queue tables: {tables:?}");
    let mut out = Vec::new();
    for t in tables {
        let n: i64 = sqlx::query(sqlx::AssertSqlSafe(format!(
            "select count(*) from {SCHEMA}.{t} where queue = $1"
        )))
        .bind(queue)
        .fetch_one(&pool)
        .await
        .unwrap()
        .get(0);
        out.push((t, n));
    }
    pool.close().await;
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_queue_leaves_no_rows_and_a_live_one_is_refused() {
    let t = common::transport(SCHEMA, 2).await;
    let queue = format!("del-{}", uuid::Uuid::new_v4().simple());
    let other = format!("keep-{}", uuid::Uuid::new_v4().simple());
    for q in [&queue, &other] {
        let publisher = t.publisher(q).await.unwrap();
        for i in 0..6 {
            publisher
                .publish(Message::new(format!("m{i}")).with_key(format!("k{}", i % 3)).unwrap())
                .await
                .unwrap();
        }
    }
    let spec = common::spec(&queue);
    let mut source = t.open(&spec).await.unwrap();
    // One delivery acknowledged, one parked: rows in `acked` and `dead`.
    let a = one(&mut source).await;
    assert_eq!(a.settle.begin_attempt().await.unwrap(), 1);
    a.settle.ack().await.unwrap();
    let b = one(&mut source).await;
    assert_eq!(b.settle.begin_attempt().await.unwrap(), 1);
    b.settle.park("bad").await.unwrap();

    let refused = t
        .delete_queue(&queue)
        .await
        .expect_err("a live owner must refuse the delete");
    assert!(refused.to_string().contains("stop its subscriptions"), "{refused}");
    let before = rows_of(&queue).await;
    for table in ["events", "slots", "acked", "dead", "queues", "groups", "read_marks"] {
        let n = before.iter().find(|(t, _)| t == table).map_or(0, |(_, n)| *n);
        assert!(n > 0, "the refused delete kept `{table}`: {before:?}");
    }

    source.close().await.unwrap();
    let closed = rows_of(&queue).await;
    let deleted = t.delete_queue(&queue).await.unwrap();
    let total: i64 = closed.iter().map(|(_, n)| n).sum();
    assert_eq!(deleted as i64, total, "rows deleted against rows counted: {closed:?}");
    let after = rows_of(&queue).await;
    assert!(after.iter().all(|(_, n)| *n == 0), "rows left: {after:?}");
    let kept = rows_of(&other).await;
    assert_eq!(
        kept.iter().find(|(t, _)| t == "events").unwrap().1,
        6,
        "another queue's events: {kept:?}"
    );
    t.delete_queue(&other).await.unwrap();
}
