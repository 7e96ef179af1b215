//! Commit-safe reads on the real server: identity order is not commit order.
//! A transaction that inserts an event with a *lower* id but holds a *higher*
//! transaction id commits after another one; the consumer, which has already
//! applied the other event, must still apply it (an id cursor would skip it).

// Shared set-up; this file uses only part of it.
#[allow(dead_code)]
mod common;

use common::url;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use keyorder_core::{Client, Delivery, HandlerResult, KeySource, LeaseConfig};
use keyorder_postgres::{slot_of, PgConfig};
use keyorder_testkit::until;

/// A transport on this file's schema (one slot), a client, a fresh queue
/// (created with its slot count) and a plain pool for raw statements.
async fn fresh(prefix: &str) -> (Client, String, sqlx::PgPool) {
    let cfg = PgConfig::from_url(
        &format!("{}?schema=keyorder_commit_safe&slots=1&migrate=true", url())
            .parse()
            .unwrap(),
    )
    .unwrap();
    let transport = common::connect(cfg.clone()).await;
    let queue = format!("{prefix}-{}", uuid::Uuid::new_v4().simple());
    let client = Client::new(Arc::new(transport));
    // Creates the queue row (1 slot) so raw inserts are valid.
    let _ = client.publisher(&queue).await.unwrap();
    let pool = sqlx::PgPool::connect(&cfg.url).await.unwrap();
    (client, queue, pool)
}

type Running = tokio::task::JoinHandle<keyorder_core::Result<keyorder_core::RunReport>>;

/// An ordered subscription to `queue` that records the ids it applies.
async fn consume(client: &Client, queue: &str) -> (Arc<Mutex<Vec<String>>>, tokio::sync::oneshot::Sender<()>, Running) {
    let applied = Arc::new(Mutex::new(Vec::<String>::new()));
    let subscription = client
        .subscribe(queue, "g")
        .ordered_by(KeySource::routing_key())
        .lease(LeaseConfig {
            ttl: Duration::from_secs(15),
            heartbeat: Duration::from_millis(500),
            margin: Duration::from_secs(5),
        })
        .build()
        .await
        .unwrap();
    let seen = applied.clone();
    let handler = move |d: Delivery| {
        let seen = seen.clone();
        async move {
            seen.lock().unwrap().push(d.id().to_owned());
            HandlerResult::Ok(())
        }
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(subscription.run(handler, async move {
        let _ = stopped.await;
    }));
    (applied, stop, run)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_commit_with_a_lower_id_is_not_skipped() {
    let (client, queue, pool) = fresh("late").await;
    let insert = "insert into keyorder_commit_safe.events (queue, slot, key, message_id, headers, payload) \
                  values ($1, $2, $3, $4, $5::jsonb, $6) returning id, txid::text";

    // T_other takes its transaction id first (the lower one) ...
    let mut other = pool.begin().await.unwrap();
    sqlx::query("select pg_current_xact_id()")
        .execute(&mut *other)
        .await
        .unwrap();
    // ... T_late inserts first: the lower event id, the higher transaction id.
    let mut late = pool.begin().await.unwrap();
    let key_late = keyorder_core::OrderingKey::new("late").unwrap();
    let (late_id, late_txid): (i64, String) = sqlx::query_as(insert)
        .bind(&queue)
        .bind(slot_of(Some(&key_late), "m-late", 1) as i32)
        .bind("late")
        .bind("m-late")
        .bind(r#"{"keyorder-key":"late"}"#)
        .bind(b"late".as_slice())
        .fetch_one(&mut *late)
        .await
        .unwrap();
    let (other_id, other_txid): (i64, String) = sqlx::query_as(insert)
        .bind(&queue)
        .bind(0i32)
        .bind("early")
        .bind("m-early")
        .bind(r#"{"keyorder-key":"early"}"#)
        .bind(b"early".as_slice())
        .fetch_one(&mut *other)
        .await
        .unwrap();
    assert!(late_id < other_id, "the late transaction holds the lower event id");
    assert!(
        late_txid.parse::<u64>().unwrap() > other_txid.parse::<u64>().unwrap(),
        "and the higher transaction id"
    );
    other.commit().await.unwrap();

    let (applied, stop, run) = consume(&client, &queue).await;
    // The other (committed) event is applied while the late transaction is
    // still open: the consumer's position is now past the late event's id ...
    until(
        "the committed event to be applied",
        Duration::from_secs(60),
        async || applied.lock().unwrap().contains(&"m-early".to_owned()),
    )
    .await;
    assert_eq!(applied.lock().unwrap().len(), 1);
    // ... and the late commit must still be delivered.
    late.commit().await.unwrap();
    until("both events applied", Duration::from_secs(60), async || {
        applied.lock().unwrap().len() >= 2
    })
    .await;
    let _ = stop.send(());
    run.await.unwrap().unwrap();
    let applied = applied.lock().unwrap().clone();
    assert_eq!(applied.len(), 2, "{applied:?}");
    assert!(
        applied.contains(&"m-late".to_owned()),
        "the late commit was skipped: {applied:?}"
    );
}

/// Transaction ids are ordered as numbers, never as their text: a read
/// that spans a change in digit count (99999 -> 100000, as every cluster
/// passes in time) keeps a key's events in order. The events carry chosen
/// transaction ids (below the snapshot's xmin, so they are committed and
/// readable) whose text order differs from their numeric order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transaction_ids_of_different_lengths_keep_a_keys_order() {
    let (client, queue, pool) = fresh("digits").await;
    let (xmin,): (String,) = sqlx::query_as("select pg_snapshot_xmin(pg_current_snapshot())::text")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(
        xmin.parse::<u64>().unwrap() > 1000,
        "the cluster has passed transaction id 1000"
    );
    // In numeric order 8, 9, 10, 99, 100; as text "10" < "100" < "8" < "9" < "99".
    let txids = ["8", "9", "10", "99", "100"];
    for (i, txid) in txids.iter().enumerate() {
        sqlx::query(
            "insert into keyorder_commit_safe.events (queue, slot, key, message_id, headers, payload, txid) \
             values ($1, 0, 'k', $2, '{\"keyorder-key\":\"k\"}'::jsonb, 'x', $3::text::xid8)",
        )
        .bind(&queue)
        .bind(format!("m-{i}"))
        .bind(txid)
        .execute(&pool)
        .await
        .unwrap();
    }
    let (applied, stop, run) = consume(&client, &queue).await;
    until("every event applied", Duration::from_secs(60), async || {
        applied.lock().unwrap().len() >= txids.len()
    })
    .await;
    let _ = stop.send(());
    run.await.unwrap().unwrap();
    let applied = applied.lock().unwrap().clone();
    let expected: Vec<String> = (0..txids.len()).map(|i| format!("m-{i}")).collect();
    assert_eq!(applied, expected, "the key's events in transaction-id order, each once");
}
