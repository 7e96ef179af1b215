//! The schema on the real server: embedded migrations applied once however
//! many processes start together, recorded per schema; the slot count held
//! per queue and per consumer group; the pooler options checked up front.

use futures::future::join_all;
use keyorder_core::{Error, KeyRules, LeaseConfig, SourceSpec, Transport};
use keyorder_postgres::{PgConfig, PgTransport};

fn url() -> String {
    std::env::var("POSTGRES_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

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
    let t4 = PgTransport::connect(config("schema=keyorder_schema_test&slots=4&migrate=true"))
        .await
        .expect("PostgreSQL must be reachable");
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
