//! A handler whose own store refuses the fencing token: nothing is
//! acknowledged, it is counted, the application's observer hears of it per
//! delivery, and the same attempt runs again (no poison policy) while the
//! broker still gives this instance the scope. A panicking observer changes
//! nothing.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use keyorder_core::{
    Client, Delivery, HandlerError, HandlerResult, KeySource, LeaseConfig, MemoryTransport, Message, Settlement,
    Subscription,
};

async fn three(client: &Client) {
    let publisher = client.publisher("orders").await.unwrap();
    for i in 0..3 {
        publisher
            .publish(
                Message::new(format!("m{i}"))
                    .with_key("k")
                    .unwrap()
                    .with_id(format!("m{i}")),
            )
            .await
            .unwrap();
    }
}

/// Runs `sub` with `handler` until `done` holds, then stops it; the run must
/// drain and return.
async fn run_until<H: keyorder_core::Handler>(sub: Subscription, handler: H, done: impl Fn() -> bool) {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(sub.run(handler, async move {
        let _ = stopped.await;
    }));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !done() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the run did not finish its work"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _ = stop.send(());
    tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .expect("the run drains and returns")
        .unwrap()
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_handler_acknowledges_nothing_and_the_same_attempt_runs_again() {
    let client = Client::new(Arc::new(MemoryTransport::with_partitions(1)));
    three(&client).await;
    let settled: Arc<Mutex<Vec<(String, Settlement)>>> = Arc::default();
    let seen = settled.clone();
    let sub = client
        .subscribe("orders", "g")
        .ordered_by(KeySource::routing_key())
        .lease(LeaseConfig {
            ttl: Duration::from_secs(2),
            heartbeat: Duration::from_millis(200),
            margin: Duration::from_millis(500),
        })
        .on_settled(move |s| seen.lock().unwrap().push((s.id.clone(), s.settlement)))
        .build()
        .await
        .unwrap();
    let stats = sub.stats();
    // The store refuses m1 once (as if a newer owner had written).
    let refused_once = Arc::new(AtomicBool::new(false));
    let applied: Arc<Mutex<Vec<(String, u32)>>> = Arc::default();
    let (r, a) = (refused_once.clone(), applied.clone());
    let handler = move |d: Delivery| {
        let (r, a) = (r.clone(), a.clone());
        async move {
            if d.id() == "m1" && !r.swap(true, Ordering::SeqCst) {
                return Err(HandlerError::fenced("store holds a newer token"));
            }
            a.lock().unwrap().push((d.id().to_owned(), d.attempt()));
            HandlerResult::Ok(())
        }
    };
    let progress = applied.clone();
    run_until(sub, handler, move || progress.lock().unwrap().len() >= 3).await;

    let ran = applied.lock().unwrap().clone();
    assert_eq!(
        ran,
        [("m0".to_owned(), 1), ("m1".to_owned(), 1), ("m2".to_owned(), 1)],
        "in order, m1 applied once, its refused run not counted as an attempt"
    );
    let snap = stats.snapshot();
    assert_eq!(snap.handler_fenced, 1);
    assert_eq!(snap.applied, 3, "the refused run was not acknowledged");
    assert_eq!((snap.halts, snap.parked, snap.retries), (0, 0, 0));
    let log = settled.lock().unwrap().clone();
    let of = |id: &str| log.iter().filter(|(i, _)| i == id).map(|(_, s)| *s).collect::<Vec<_>>();
    assert_eq!(of("m0"), [Settlement::Acknowledged]);
    assert_eq!(of("m1"), [Settlement::Fenced, Settlement::Acknowledged], "{log:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_observer_changes_nothing() {
    let client = Client::new(Arc::new(MemoryTransport::with_partitions(1)));
    three(&client).await;
    let panicked = Arc::new(AtomicBool::new(false));
    let p = panicked.clone();
    let sub = client
        .subscribe("orders", "g")
        .ordered_by(KeySource::routing_key())
        .on_settled(move |_| {
            if !p.swap(true, Ordering::SeqCst) {
                panic!("observer bug (test)");
            }
        })
        .build()
        .await
        .unwrap();
    let stats = sub.stats();
    let s = stats.clone();
    run_until(
        sub,
        |_d: Delivery| async move { HandlerResult::Ok(()) },
        move || s.snapshot().applied >= 3,
    )
    .await;
    assert!(panicked.load(Ordering::SeqCst));
}
