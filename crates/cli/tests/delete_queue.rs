//! `keyorder delete-queue` on the real PostgreSQL server: refused without
//! `--yes`, deletes every row of the category with it, and names what to do
//! on a transport it does not cover.

#![cfg(feature = "all-adapters")]

use std::process::Command;

use keyorder::postgres::sqlx::{self, Row};
use keyorder::postgres::PgTransport;
use keyorder::raw::Transport;
use keyorder::Message;

fn url() -> String {
    std::env::var("POSTGRES_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

fn keyorder(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_keyorder"))
        .args(args)
        .env_remove("KEYORDER_URL")
        .output()
        .expect("the keyorder binary runs")
}

async fn events_of(category: &str) -> i64 {
    let pool = sqlx::PgPool::connect(&url()).await.unwrap();
    let n: i64 = sqlx::query("select count(*) from keyorder.events where queue = $1")
        .bind(category)
        .fetch_one(&pool)
        .await
        .unwrap()
        .get(0);
    pool.close().await;
    n
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_queue_needs_yes_then_leaves_no_events() {
    let t = PgTransport::from_url(&format!("{}?migrate=true", url()).parse().unwrap())
        .await
        .expect("PostgreSQL must be reachable");
    let category = format!("cli-delete-{}", std::process::id());
    let publisher = t.publisher(&category).await.unwrap();
    for i in 0..3 {
        publisher
            .publish(Message::new(format!("m{i}")).with_key("k").unwrap())
            .await
            .unwrap();
    }
    assert_eq!(events_of(&category).await, 3);

    let u = url();
    let refused = keyorder(&["delete-queue", "--url", &u, "--category", &category]);
    assert!(!refused.status.success());
    let text = String::from_utf8_lossy(&refused.stderr);
    assert!(text.contains("--yes"), "{text}");
    assert_eq!(events_of(&category).await, 3, "nothing is deleted without --yes");

    let done = keyorder(&["delete-queue", "--url", &u, "--category", &category, "--yes"]);
    let out = String::from_utf8_lossy(&done.stdout);
    assert!(done.status.success(), "{out} {}", String::from_utf8_lossy(&done.stderr));
    assert!(out.contains("rows"), "{out}");
    assert_eq!(events_of(&category).await, 0);

    let other = keyorder(&["delete-queue", "--url", "memory://", "--category", &category, "--yes"]);
    assert!(!other.status.success());
    let text = String::from_utf8_lossy(&other.stderr);
    assert!(
        text.contains("delete_category") && text.contains("nothing was deleted"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_queue_removes_the_rabbitmq_topology_queues() {
    use keyorder::rabbitmq::lapin::options::QueueDeclareOptions;
    use keyorder::rabbitmq::lapin::{Connection, ConnectionProperties};
    use keyorder::rabbitmq::{Names, Topology};
    let base = std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    // Every group has queues of its own: the publisher declares two.
    let u = format!("{base}?topology=hash&queues=2&groups=g,h");
    let category = format!("cli-delete-{}", std::process::id());
    let client = keyorder::connect(&u).await.expect("RabbitMQ must be reachable");
    let publisher = client.publisher(&category).await.unwrap();
    publisher
        .publish(Message::new("m").with_key("k").unwrap())
        .await
        .unwrap();
    let names = Names::new(&category).unwrap();
    let mut queues = Vec::new();
    for g in ["g", "h"] {
        let g = names.group(g).unwrap();
        queues.extend(g.queues(Topology::ConsistentHash { queues: 2 }));
        queues.push(g.dlq());
    }
    queues.push(names.registry());
    assert_eq!(queues.len(), 7);
    let conn = Connection::connect(&base, ConnectionProperties::default())
        .await
        .unwrap();
    let exists = |q: String| {
        let conn = &conn;
        async move {
            let ch = conn.create_channel().await.unwrap();
            let passive = QueueDeclareOptions {
                passive: true,
                ..Default::default()
            };
            ch.queue_declare(q.as_str().into(), passive, Default::default())
                .await
                .is_ok()
        }
    };
    for q in &queues {
        assert!(exists(q.clone()).await, "{q} exists after a publish");
    }
    // A queue of the layout before consumer groups goes too.
    let old = format!("{category}.sac");
    let ch = conn.create_channel().await.unwrap();
    let durable = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    ch.queue_declare(old.as_str().into(), durable, Default::default())
        .await
        .unwrap();
    queues.push(old);
    let done = keyorder(&["delete-queue", "--url", &u, "--category", &category, "--yes"]);
    assert!(done.status.success(), "{}", String::from_utf8_lossy(&done.stderr));
    for q in &queues {
        assert!(!exists(q.clone()).await, "{q} is gone");
    }
    let _ = conn.close(200, "done".into()).await;
}

/// On RabbitMQ, as on PostgreSQL, delete-queue is refused while a group of
/// the category has a live member (issue 37: it deleted the queues under a
/// running subscription), and goes through once it stopped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_queue_is_refused_while_a_rabbitmq_group_runs() {
    let base = std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let u = format!("{base}?topology=hash&queues=2&queue_type=classic&expires_ms=600000&consumer_timeout_ms=3600000");
    let category = format!("cli-delete-live-{}", std::process::id());
    let client = keyorder::connect(&u).await.expect("RabbitMQ must be reachable");
    let sub = client
        .subscribe(&category, "g")
        .ordered_by(keyorder::KeySource::routing_key())
        .build()
        .await
        .unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(sub.run(
        |_d: keyorder::Delivery| async move { keyorder::HandlerResult::Ok(()) },
        async move {
            let _ = stopped.await;
        },
    ));
    // Until its member is live (the run joins the group).
    let admin = client.admin();
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(60);
    while !admin
        .groups(&category)
        .await
        .unwrap_or_default()
        .iter()
        .any(|g| g.live_members > 0)
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the group never had a live member"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let refused = keyorder(&["delete-queue", "--url", &u, "--category", &category, "--yes"]);
    assert!(!refused.status.success(), "deleted under a running subscription");
    let text = String::from_utf8_lossy(&refused.stderr);
    assert!(text.contains("live members"), "{text}");
    assert!(!run.is_finished(), "the subscription kept running");
    let _ = stop.send(());
    run.await.unwrap().unwrap();
    let done = keyorder(&["delete-queue", "--url", &u, "--category", &category, "--yes"]);
    assert!(done.status.success(), "{}", String::from_utf8_lossy(&done.stderr));
}
