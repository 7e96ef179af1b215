//! A park retried after its commit (its outcome unknown to the caller, say a
//! dropped connection) stores the dead letter once, on the real server.

use keyorder_core::{Message, Transport};

mod common;
use common::one;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_park_stores_one_dead_letter() {
    let t = common::transport("keyorder_park_once", 1).await;
    let queue = format!("park-{}", uuid::Uuid::new_v4().simple());
    let publisher = t.publisher(&queue).await.unwrap();
    publisher
        .publish(Message::new("poison").with_key("k").unwrap())
        .await
        .unwrap();
    let spec = common::spec(&queue);
    let mut source = t.open(&spec).await.unwrap();
    let delivery = one(&mut source).await;
    assert_eq!(delivery.settle.begin_attempt().await.unwrap(), 1);
    delivery.settle.park("bad input").await.unwrap();
    // The same park again, as a retry after an unknown outcome would send it.
    delivery.settle.park("bad input").await.unwrap();
    let dead = t.admin().dead_letters(&queue, "g").await.unwrap();
    assert_eq!(dead.len(), 1, "one dead letter per event: {dead:?}");
    assert_eq!(dead[0].reason, "bad input");
    source.close().await.unwrap();
}
