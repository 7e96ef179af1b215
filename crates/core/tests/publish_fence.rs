//! The in-memory broker's publish fence: a publish with a token below the
//! highest its scope has seen is refused and stores nothing.

use std::time::Duration;

use keyorder_core::{Client, Delivery, Error, HandlerResult, KeySource, Message, PublishFence};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_publish_with_a_lower_token_is_refused_and_stores_nothing() {
    let client = Client::memory();
    let publisher = client.publisher("orders").await.unwrap();
    assert!(publisher.fences_publishes());
    let fence = |scope: &str, token| PublishFence {
        scope: scope.into(),
        token,
    };
    let msg = |i: u32| Message::new(format!("m{i}")).with_key("k").unwrap();
    publisher.publish_fenced(msg(1), &fence("s/1", 2)).await.unwrap();
    let refused = publisher.publish_fenced(msg(2), &fence("s/1", 1)).await;
    assert!(
        matches!(refused, Err(Error::Fenced { generation: 1, .. })),
        "{refused:?}"
    );
    publisher.publish_fenced(msg(3), &fence("s/2", 1)).await.unwrap();
    publisher.publish_fenced(msg(4), &fence("s/1", 2)).await.unwrap();
    let bad = publisher.publish_fenced(msg(5), &fence("", 3)).await;
    assert!(matches!(bad, Err(Error::Config(_))), "{bad:?}");

    let subscription = client
        .subscribe("orders", "g")
        .ordered_by(KeySource::routing_key())
        .build()
        .await
        .unwrap();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let handler = move |d: Delivery| {
        let tx = tx.clone();
        async move {
            let _ = tx.send(String::from_utf8_lossy(d.payload()).into_owned());
            HandlerResult::Ok(())
        }
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(subscription.run(handler, async move {
        let _ = stopped.await;
    }));
    let mut seen = Vec::new();
    while seen.len() < 3 {
        let next = tokio::time::timeout(Duration::from_secs(30), rx.recv()).await;
        seen.push(next.expect("a delivery within 30 s").expect("the handler is alive"));
    }
    let _ = stop.send(());
    run.await.unwrap().unwrap();
    assert_eq!(seen, ["m1", "m3", "m4"], "the refused publish stored nothing");
    assert!(rx.try_recv().is_err(), "nothing more was delivered");
}
