//! The schema on the real server: embedded migrations applied once however
//! many processes start together, recorded per schema; the slot count held
//! per queue and per consumer group; the pooler options checked up front.

// Shared set-up; this file uses only part of it.
#[allow(dead_code)]
mod common;

use common::url;
use futures::future::join_all;
use keyorder_core::{Error, KeyRules, LeaseConfig, SourceSpec, Transport};
use keyorder_postgres::{PgConfig, PgTransport};

fn config(query: &str) -> PgConfig {
    PgConfig::from_url(&format!("{}?{query}", url()).parse().unwrap()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrations_run_once_per_schema_from_many_starts_at_once() {
    let schema = format!("ko_mig_{}", &uuid::Uuid::new_v4().simple().to_string()[..16]);
    let transports: Vec<PgTransport> =
        join_all((0..4).map(|_| PgTransport::connect(config(&format!("schema={schema}")))))
            .await
            .into_iter()
            .map(|t| t.expect("PostgreSQL must be reachable"))
            .collect();
    let results = join_all(transports.iter().map(|t| t.migrate())).await;
    for r in results {
        r.expect("concurrent migrations take turns and all succeed");
    }
    transports[0].migrate().await.expect("a second migrate is a no-op");
    let pool = sqlx::PgPool::connect(&url()).await.unwrap();
    let applied: Vec<(i64, bool)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "select version, success from {schema}._sqlx_migrations order by version"
    )))
    .fetch_all(&pool)
    .await
    .unwrap();
    // Every embedded migration, once, each successful.
    let files = std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/migrations"))
        .unwrap()
        .filter(|f| f.as_ref().unwrap().path().extension().is_some_and(|e| e == "sql"))
        .count() as i64;
    let want: Vec<(i64, bool)> = (1..=files).map(|v| (v, true)).collect();
    assert_eq!(applied, want);
    sqlx::query(sqlx::AssertSqlSafe(format!("drop schema {schema} cascade")))
        .execute(&pool)
        .await
        .unwrap();
}

fn spec(queue: &str, group: &str) -> SourceSpec {
    SourceSpec {
        category: queue.to_owned(),
        correlated: Vec::new(),
        group: group.to_owned(),
        instance: "i1".to_owned(),
        ordered: true,
        lease: LeaseConfig::default(),
        key_rules: KeyRules::default(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_different_slot_count_is_refused_for_the_queue_and_for_a_group() {
    let t4 = common::connect(config("schema=keyorder_schema_test&slots=4&migrate=true")).await;
    let queue = format!("n-{}", uuid::Uuid::new_v4().simple());
    t4.publisher(&queue).await.unwrap();
    let first = spec(&queue, "g");
    drop(t4.open(&first).await.unwrap());
    // The queue keeps 4 slots: 8 would move keys.
    let t8 = PgTransport::connect(config("schema=keyorder_schema_test&slots=8"))
        .await
        .unwrap();
    match t8.publisher(&queue).await {
        Err(Error::Config(msg)) => assert!(msg.contains("?slots=4"), "names the fix: {msg}"),
        other => panic!("expected a configuration error, got {other:?}"),
    }
    // An operator re-slots the queue to 8: group `g` started with 4, its
    // leases and cursors are per slot, so it is refused; a new group starts.
    let pool = sqlx::PgPool::connect(&url()).await.unwrap();
    sqlx::query("update keyorder_schema_test.queues set slots = 8 where queue = $1")
        .bind(&queue)
        .execute(&pool)
        .await
        .unwrap();
    match t8.open(&first).await {
        Err(Error::Config(msg)) => assert!(msg.contains("started with 4 slots"), "{msg}"),
        other => panic!("expected a configuration error, got {:?}", other.map(|_| ())),
    }
    let fresh = spec(&queue, "g2");
    assert!(
        t8.open(&fresh).await.is_ok(),
        "a new group starts with the queue's count"
    );
    // Publishes wait until group `g` (4 slots) is removed: its keys would
    // move (C23).
    let p8 = t8.publisher(&queue).await.unwrap();
    match p8
        .publish(keyorder_core::Message::new("m").with_key("k").unwrap())
        .await
    {
        Err(Error::Config(msg)) => assert!(msg.contains("group `g`") && msg.contains("Fix"), "{msg}"),
        other => panic!("expected a configuration error, got {other:?}"),
    }
}

#[test]
fn a_transaction_pooler_needs_a_direct_url() {
    let bare = PgConfig::from_url(&"postgres://u@127.0.0.1:6432/test?pooler=transaction".parse().unwrap());
    match bare {
        Err(Error::Url(msg)) => assert!(msg.contains("direct="), "names the fix: {msg}"),
        other => panic!("expected a URL error, got {other:?}"),
    }
    let ok = PgConfig::from_url(
        &"postgres://u@127.0.0.1:6432/test?pooler=transaction&direct=postgres%3A%2F%2Fu%40127.0.0.1%3A5432%2Ftest"
            .parse()
            .unwrap(),
    )
    .unwrap();
    assert!(ok.pooled);
    assert_eq!(ok.direct.as_deref(), Some("postgres://u@127.0.0.1:5432/test"));
    assert_eq!(
        ok.url, "postgres://u@127.0.0.1:6432/test",
        "keyorder's options do not reach the driver"
    );
    assert!(PgConfig::from_url(&"postgres://u@h/test?pooler=session".parse().unwrap()).is_err());
}

/// A fenced publish: one statement records the scope's token and inserts
/// the event, or (a lower token than the scope has seen) inserts nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_publish_with_a_lower_token_is_refused_and_stores_nothing() {
    let schema = format!("ko_fence_{}", &uuid::Uuid::new_v4().simple().to_string()[..16]);
    let t = common::connect(config(&format!("schema={schema}"))).await;
    t.migrate().await.unwrap();
    let client = keyorder_core::Client::new(std::sync::Arc::new(t));
    let publisher = client.publisher("orders").await.unwrap();
    assert!(publisher.fences_publishes());
    let fence = |scope: &str, token| keyorder_core::PublishFence {
        scope: scope.into(),
        token,
    };
    let msg = |i: u32| keyorder_core::Message::new(format!("m{i}")).with_key("k").unwrap();
    publisher.publish_fenced(msg(1), &fence("outbox/s/1", 2)).await.unwrap();
    publisher.publish_fenced(msg(2), &fence("outbox/s/1", 2)).await.unwrap();
    let refused = publisher.publish_fenced(msg(3), &fence("outbox/s/1", 1)).await;
    assert!(
        matches!(refused, Err(Error::Fenced { generation: 1, .. })),
        "{refused:?}"
    );
    publisher.publish_fenced(msg(4), &fence("outbox/s/2", 1)).await.unwrap();
    publisher.publish_fenced(msg(5), &fence("outbox/s/1", 3)).await.unwrap();
    let refused = publisher.publish_fenced(msg(6), &fence("outbox/s/1", 2)).await;
    assert!(matches!(refused, Err(Error::Fenced { .. })), "{refused:?}");
    // The unfenced publish is unchanged.
    publisher.publish(msg(7)).await.unwrap();
    // A publisher that recorded token 3 for s/1 is refused once another
    // (a newer owner, its own client) moved the fence to 4.
    let t2 = PgTransport::connect(config(&format!("schema={schema}"))).await.unwrap();
    let newer = keyorder_core::Client::new(std::sync::Arc::new(t2));
    let newer = newer.publisher("orders").await.unwrap();
    newer.publish_fenced(msg(8), &fence("outbox/s/1", 4)).await.unwrap();
    let refused = publisher.publish_fenced(msg(9), &fence("outbox/s/1", 3)).await;
    assert!(
        matches!(refused, Err(Error::Fenced { generation: 3, .. })),
        "{refused:?}"
    );
    newer.publish_fenced(msg(10), &fence("outbox/s/1", 4)).await.unwrap();

    let pool = sqlx::PgPool::connect(&url()).await.unwrap();
    let payloads: Vec<Vec<u8>> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "select payload from {schema}.events where queue = 'orders' order by id"
    )))
    .fetch_all(&pool)
    .await
    .unwrap();
    let payloads: Vec<String> = payloads.into_iter().map(|p| String::from_utf8(p).unwrap()).collect();
    assert_eq!(
        payloads,
        ["m1", "m2", "m4", "m5", "m7", "m8", "m10"],
        "refused publishes stored nothing"
    );
    let tokens: Vec<(String, i64)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "select scope, token from {schema}.publish_fences order by scope"
    )))
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(tokens, [("outbox/s/1".to_owned(), 4), ("outbox/s/2".to_owned(), 1)]);
    sqlx::query(sqlx::AssertSqlSafe(format!("drop schema {schema} cascade")))
        .execute(&pool)
        .await
        .unwrap();
}
