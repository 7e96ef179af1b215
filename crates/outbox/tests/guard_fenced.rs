//! A handler behind a `SequenceGuard` whose store refuses a delivery's
//! fencing token (`HandlerError::fenced`): the guard records nothing, so the
//! redelivery runs; had it recorded the sequence, the redelivery would have
//! been dropped as stale and the message lost.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use keyorder_core::{Client, Delivery, HandlerError, HandlerResult, KeySource, LeaseConfig, MemoryTransport, Message};
use keyorder_outbox::{SequenceGuard, SEQ_HEADER};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_delivery_does_not_advance_the_guard() {
    let client = Client::new(Arc::new(MemoryTransport::with_partitions(1)));
    let publisher = client.publisher("orders").await.unwrap();
    for seq in 1..=3u64 {
        publisher
            .publish(
                Message::new(format!("s{seq}"))
                    .with_key("k")
                    .unwrap()
                    .with_header(SEQ_HEADER, seq.to_string()),
            )
            .await
            .unwrap();
    }
    let refused = Arc::new(AtomicBool::new(false));
    let applied: Arc<Mutex<Vec<String>>> = Arc::default();
    let (r, a) = (refused.clone(), applied.clone());
    let inner = move |d: Delivery| {
        let (r, a) = (r.clone(), a.clone());
        async move {
            let body = String::from_utf8_lossy(d.payload()).into_owned();
            if body == "s2" && !r.swap(true, Ordering::SeqCst) {
                return Err(HandlerError::fenced("store holds a newer token"));
            }
            a.lock().unwrap().push(body);
            HandlerResult::Ok(())
        }
    };
    let guard = SequenceGuard::in_memory(inner, 100);
    let stats = guard.stats();
    let sub = client
        .subscribe("orders", "g")
        .ordered_by(KeySource::routing_key())
        .lease(LeaseConfig {
            ttl: Duration::from_secs(2),
            heartbeat: Duration::from_millis(200),
            margin: Duration::from_millis(500),
        })
        .build()
        .await
        .unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(sub.run(guard, async move {
        let _ = stopped.await;
    }));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while applied.lock().unwrap().len() < 3 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "applied {:?}, dropped as stale {}",
            applied.lock().unwrap(),
            stats.dropped()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _ = stop.send(());
    run.await.unwrap().unwrap();
    assert!(refused.load(Ordering::SeqCst));
    assert_eq!(*applied.lock().unwrap(), ["s1", "s2", "s3"]);
    assert_eq!(stats.dropped(), 0);
}
