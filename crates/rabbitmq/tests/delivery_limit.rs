//! Quorum queues carry a delivery limit keyorder pins (RabbitMQ 4.x's
//! default of 20 would drop a halted head redelivered at every hand-over),
//! and a quorum queue an earlier version declared without it is used as it
//! is. Checked on the broker: RabbitMQ refuses a redeclaration whose
//! arguments differ, so a redeclaration with exactly the pinned arguments
//! succeeding, and one without the limit failing, shows what the queue has.

// Shared set-up; this file uses only part of it.
#[allow(dead_code)]
mod common;

use common::base;
use std::sync::Arc;

use keyorder_core::{Client, Message};
use keyorder_rabbitmq::{Names, RabbitTransport};
use lapin::options::QueueDeclareOptions;
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{Connection, ConnectionProperties};

const OPTIONS: &str = "topology=sac&queue_type=quorum&expires_ms=600000&consumer_timeout_ms=3600000&groups=g";

async fn client() -> (Client, Arc<RabbitTransport>) {
    let url = format!("{}?{OPTIONS}", base());
    let t = Arc::new(common::connect(&url).await);
    (Client::new(t.clone()), t)
}

fn category(prefix: &str) -> String {
    format!("{prefix}-{}", &uuid::Uuid::new_v4().simple().to_string()[..12])
}

fn args(limit: Option<i32>) -> FieldTable {
    let mut a = FieldTable::default();
    a.insert("x-expires".into(), AMQPValue::LongUInt(600_000));
    a.insert("x-queue-type".into(), AMQPValue::LongString(LongString::from("quorum")));
    a.insert("x-single-active-consumer".into(), AMQPValue::Boolean(true));
    if let Some(n) = limit {
        a.insert("x-delivery-limit".into(), AMQPValue::LongInt(n));
    }
    a
}

/// Declares `queue` with `args` on a channel of its own; the broker's error
/// text when it refuses.
async fn declare(conn: &Connection, queue: &str, args: FieldTable) -> Result<u32, String> {
    let ch = conn.create_channel().await.unwrap();
    let opts = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    let res = ch.queue_declare(queue.into(), opts, args).await;
    match res {
        Ok(q) => {
            let _ = ch.close(200, "done".into()).await;
            Ok(q.message_count())
        }
        Err(e) => Err(e.to_string()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quorum_queues_are_declared_with_a_delivery_limit_never_reached() {
    let conn = Connection::connect(&base(), ConnectionProperties::default())
        .await
        .unwrap();
    let cat = category("dlimit");
    let (c, t) = client().await;
    let publisher = c.publisher(&cat).await.unwrap();
    publisher
        .publish(Message::new("m").with_key("k").unwrap())
        .await
        .unwrap();
    let queue = Names::new(&cat).unwrap().group("g").unwrap().sac_queue();
    assert_eq!(
        declare(&conn, &queue, args(Some(i32::MAX))).await,
        Ok(1),
        "the queue has x-delivery-limit = i32::MAX and holds the message"
    );
    let refused = declare(&conn, &queue, args(None)).await.unwrap_err();
    assert!(refused.contains("x-delivery-limit"), "{refused}");
    t.delete_category(&cat).await.ok();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quorum_queue_declared_without_the_limit_is_used_as_it_is() {
    let conn = Connection::connect(&base(), ConnectionProperties::default())
        .await
        .unwrap();
    let cat = category("dlimit-old");
    let queue = Names::new(&cat).unwrap().group("g").unwrap().sac_queue();
    // As an earlier version declared it.
    declare(&conn, &queue, args(None)).await.unwrap();
    let (c, t) = client().await;
    let publisher = c
        .publisher(&cat)
        .await
        .expect("an existing queue without the limit is used");
    publisher
        .publish(Message::new("m").with_key("k").unwrap())
        .await
        .unwrap();
    assert_eq!(
        declare(&conn, &queue, args(None)).await,
        Ok(1),
        "the queue kept its arguments and got the message"
    );
    t.delete_category(&cat).await.ok();
}
