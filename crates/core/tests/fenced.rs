//! A handler whose own store refuses the fencing token: nothing is
//! acknowledged, the scope is given up, it is counted, the application's
//! observer hears of it per delivery, and the message comes back to run
//! again (here, under the next generation the store accepts).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use keyorder_core::{
    Client, Delivery, HandlerError, HandlerResult, KeySource, LeaseConfig, MemoryTransport, Message, Settlement,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_handler_acknowledges_nothing_and_the_message_runs_again() {
    let client = Client::new(Arc::new(MemoryTransport::with_partitions(1)));
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
    let settled: Arc<Mutex<Vec<(String, Settlement, u64)>>> = Arc::default();
    let seen = settled.clone();
    let sub = client
        .subscribe("orders", "g")
        .ordered_by(KeySource::routing_key())
        .lease(LeaseConfig {
            ttl: Duration::from_secs(2),
            heartbeat: Duration::from_millis(200),
            margin: Duration::from_millis(500),
        })
        .on_settled(move |s| {
            seen.lock().unwrap().push((s.id.clone(), s.settlement, s.fencing_token));
        })
        .build()
        .await
        .unwrap();
    let stats = sub.stats();
    // The store refuses m1 once (as if a newer owner had written).
    let refused_once = Arc::new(AtomicBool::new(false));
    let applied: Arc<Mutex<Vec<String>>> = Arc::default();
    let (r, a) = (refused_once.clone(), applied.clone());
    let handler = move |d: Delivery| {
        let (r, a) = (r.clone(), a.clone());
        async move {
            if d.id() == "m1" && !r.swap(true, Ordering::SeqCst) {
                return Err(HandlerError::fenced("store holds a newer token"));
            }
            a.lock().unwrap().push(d.id().to_owned());
            HandlerResult::Ok(())
        }
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(sub.run(handler, async move {
        let _ = stopped.await;
    }));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while applied.lock().unwrap().len() < 3 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "applied: {:?}",
            applied.lock().unwrap()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _ = stop.send(());
    run.await.unwrap().unwrap();

    assert_eq!(
        *applied.lock().unwrap(),
        ["m0", "m1", "m2"],
        "in order, m1 once applied"
    );
    let snap = stats.snapshot();
    assert_eq!(snap.handler_fenced, 1);
    assert_eq!(snap.applied, 3, "the fenced run was not acknowledged");
    let log = settled.lock().unwrap().clone();
    let of = |id: &str| {
        log.iter()
            .filter(|(i, _, _)| i == id)
            .map(|(_, s, _)| *s)
            .collect::<Vec<_>>()
    };
    assert_eq!(of("m0"), [Settlement::Acknowledged]);
    assert_eq!(of("m1").first(), Some(&Settlement::Fenced), "{log:?}");
    assert_eq!(of("m1").last(), Some(&Settlement::Acknowledged), "{log:?}");
    // It ran again under a newer generation than the one the store refused.
    let tokens: Vec<u64> = log.iter().filter(|(i, _, _)| i == "m1").map(|(_, _, t)| *t).collect();
    assert!(tokens.windows(2).all(|w| w[1] > w[0]), "{tokens:?}");
}
