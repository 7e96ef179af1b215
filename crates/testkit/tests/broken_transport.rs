//! The checker is proven to fail on a deliberately broken transport: each
//! defect is caught by name.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use keyorder_core::{Client, KeySource};
use keyorder_testkit::broken::{BrokenTransport, Defect};
use keyorder_testkit::instance::{keys, publish_keys, wait_until, Instance, Switches};
use keyorder_testkit::{check, EventLog, Expectation, MemoryEventLog};

/// Publishes, runs `instances` ordered instances on the broken transport
/// until the log stops growing, and returns the checker's defect names.
async fn defects_of(
    defect: Defect,
    instances: usize,
    key_count: usize,
    per_key: u64,
    sleep_ms: u64,
) -> Vec<&'static str> {
    let client = Client::new(Arc::new(BrokenTransport::broken(defect)));
    let log = Arc::new(MemoryEventLog::default());
    let switches = Arc::new(Switches::default());
    let published = publish_keys(&client, "orders", &keys("k", key_count), per_key, sleep_ms)
        .await
        .unwrap();
    let mut running = Vec::new();
    let mut ids = Vec::new();
    for i in 0..instances {
        let id = format!("i{i}");
        let builder = client.subscribe("orders", "g").ordered_by(KeySource::routing_key());
        running.push(
            Instance::start(builder, &id, log.clone(), switches.clone())
                .await
                .unwrap(),
        );
        ids.push(id);
    }
    // Every delivery the broken transport hands over gets run: wait until the
    // log holds as many finished runs as the defect lets through.
    let expected_runs = match defect {
        Defect::Lose => published.len() - published.len() / 5,
        Defect::DoubleRun => published.len() * instances,
        Defect::Reorder => published.len(),
    };
    let l = log.clone();
    wait_until(
        "the broken transport's deliveries to run",
        Duration::from_secs(60),
        || {
            let l = l.clone();
            async move { l.events().await.unwrap().iter().filter(|e| e.ok).count() >= expected_runs }
        },
    )
    .await
    .unwrap();
    for i in running {
        i.stop().await.unwrap();
    }
    let verdict = check(
        &log.events().await.unwrap(),
        &Expectation {
            published,
            excused: HashSet::new(),
            spread_over: ids,
            ..Default::default()
        },
    );
    verdict.defects()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transport_that_reorders_is_caught_as_order() {
    let d = defects_of(Defect::Reorder, 1, 1, 20, 0).await;
    assert_eq!(d, vec!["order"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transport_that_loses_is_caught_as_loss() {
    let d = defects_of(Defect::Lose, 1, 4, 10, 0).await;
    assert_eq!(d, vec!["loss"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transport_that_runs_a_key_twice_at_once_is_caught_as_overlap() {
    // Both instances run all 10 messages of one key, 20 ms each, starting
    // together: their runs tile overlapping time spans.
    let d = defects_of(Defect::DoubleRun, 2, 1, 10, 20).await;
    assert!(d.contains(&"overlap"), "{d:?}");
}
