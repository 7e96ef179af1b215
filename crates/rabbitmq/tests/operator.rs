//! RabbitMQ's own operator cases across processes on the real broker: hot
//! keys gathered through the control exchange, read-only commands that
//! declare nothing. Listing and skipping a halted head from another
//! transport runs on every adapter as the conformance scenario
//! `operator_from_another_transport`.

// Shared set-up; this file uses only part of it.
#[allow(dead_code)]
mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use keyorder_core::{Client, Delivery, HandlerResult, KeySource, LeaseConfig, Message};
use keyorder_rabbitmq::RabbitTransport;
use keyorder_testkit::until;

fn url() -> String {
    let base = keyorder_testkit::brokers::Broker::RabbitMq.url();
    // consumer_timeout_ms: what scripts/services configures.
    format!("{base}?topology=hash&queues=2&queue_type=classic&expires_ms=600000&consumer_timeout_ms=3600000")
}

async fn client() -> Client {
    let t = common::connect(&url()).await;
    Client::new(Arc::new(t))
}

/// Hot keys from another process: the consumers count, per key, the
/// deliveries they hold (delivered, not yet settled), and another
/// transport gathers them through the control exchange. A key whose
/// handler is stuck holds all its messages; a flowing key holds none once
/// applied; nothing is counted once everything is settled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_process_sees_the_keys_the_consumers_hold() {
    let category = format!("hot-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let owner = client().await;
    let operator = client().await;
    let subscription = owner
        .subscribe(&category, "g")
        .ordered_by(KeySource::routing_key())
        .lease(LeaseConfig {
            ttl: Duration::from_secs(4),
            heartbeat: Duration::from_millis(500),
            margin: Duration::from_millis(1500),
        })
        .build()
        .await
        .unwrap();
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let (log, wait) = (seen.clone(), gate.clone());
    let handler = move |d: Delivery| {
        let (log, wait) = (log.clone(), wait.clone());
        async move {
            let body = String::from_utf8_lossy(d.payload()).into_owned();
            if body.starts_with("stuck-") {
                // Held until the test opens the gate.
                wait.acquire().await.unwrap().forget();
            }
            log.lock().unwrap().push(body);
            HandlerResult::Ok(())
        }
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(subscription.run(handler, async move {
        let _ = stopped.await;
    }));
    let publisher = owner.publisher(&category).await.unwrap();
    for i in 0..10 {
        publisher
            .publish(Message::new(format!("stuck-{i}")).with_key("stuck").unwrap())
            .await
            .unwrap();
    }
    for i in 0..3 {
        publisher
            .publish(Message::new(format!("flow-{i}")).with_key("flow").unwrap())
            .await
            .unwrap();
    }
    until("the flowing key to be applied", Duration::from_secs(60), || async {
        seen.lock().unwrap().iter().filter(|s| s.starts_with("flow-")).count() == 3
    })
    .await;
    let admin = operator.admin();
    let stuck = keyorder_core::key::label("stuck");
    // The stuck key's ten messages are delivered (one running, nine
    // waiting behind it); the flowing key's are settled.
    until(
        "the other transport to see the stuck key's ten deliveries",
        Duration::from_secs(60),
        || async {
            admin
                .hot_keys(&category, "g", 10)
                .await
                .map(|h| h.len() == 1 && h[0].label == stuck && h[0].backlog == 10)
                .unwrap_or(false)
        },
    )
    .await;
    // The label, never the key itself.
    let hot = admin.hot_keys(&category, "g", 10).await.unwrap();
    assert!(hot.iter().all(|h| h.label != "stuck"), "{hot:?}");
    gate.add_permits(10);
    until("the stuck key to be applied", Duration::from_secs(60), || async {
        seen.lock().unwrap().iter().filter(|s| s.starts_with("stuck-")).count() == 10
    })
    .await;
    until("nothing held anywhere", Duration::from_secs(60), || async {
        admin
            .hot_keys(&category, "g", 10)
            .await
            .map(|h| h.is_empty())
            .unwrap_or(false)
    })
    .await;
    let stuck_order: Vec<String> = seen
        .lock()
        .unwrap()
        .iter()
        .filter(|s| s.starts_with("stuck-"))
        .cloned()
        .collect();
    assert_eq!(stuck_order, (0..10).map(|i| format!("stuck-{i}")).collect::<Vec<_>>());
    let _ = stop.send(());
    run.await.unwrap().unwrap();
}

/// Deletes the test's virtual host however the test ends.
struct DeleteVhost(String);

impl Drop for DeleteVhost {
    fn drop(&mut self) {
        let _ = std::process::Command::new("rabbitmqctl")
            .args(["delete_vhost", &self.0])
            .output();
    }
}

/// `rabbitmqctl` on the local node (as `scripts/services` runs it).
fn rabbitmqctl(args: &[&str]) -> String {
    let out = std::process::Command::new("rabbitmqctl")
        .args(args)
        .output()
        .expect("rabbitmqctl runs (scripts/services installs RabbitMQ)");
    assert!(
        out.status.success(),
        "rabbitmqctl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Read-only operator commands create nothing on the broker (issue 37):
/// in a virtual host of its own, nothing but the broker's own exchanges
/// exists after every one of them ran (before, the first of them declared
/// the control exchange they ask the consumers through).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_only_commands_create_nothing() {
    let vhost = format!("keyorder-ro-{}", &uuid::Uuid::new_v4().simple().to_string()[..10]);
    rabbitmqctl(&["add_vhost", &vhost]);
    let _cleanup = DeleteVhost(vhost.clone());
    rabbitmqctl(&["set_permissions", "-p", &vhost, "guest", ".*", ".*", ".*"]);
    let base = keyorder_testkit::brokers::Broker::RabbitMq.url();
    let mut url: url::Url = format!("{base}?topology=hash&queues=2&queue_type=classic&consumer_timeout_ms=3600000")
        .parse()
        .unwrap();
    url.set_path(&vhost);
    let t = RabbitTransport::from_url(&url).await.unwrap();
    let c = Client::new(Arc::new(t));
    keyorder_testkit::run_read_only_commands(&*c.admin(), "cat").await;
    let list = |what: &str| -> Vec<String> {
        rabbitmqctl(&[what, "-p", &vhost, "-q", "--no-table-headers", "name"])
            .lines()
            .map(str::trim)
            .filter(|n| !n.is_empty() && !n.starts_with("amq."))
            .map(str::to_owned)
            .collect()
    };
    let (exchanges, queues) = (list("list_exchanges"), list("list_queues"));
    drop(c);
    assert!(
        exchanges.is_empty() && queues.is_empty(),
        "read-only commands created exchanges {exchanges:?} and queues {queues:?}"
    );
}

/// Asking for the halted keys of a category with no consumer: the request
/// through the control exchange is unroutable, and the answer is an empty
/// list, not an error (moved here from the test that became the scenario
/// `operator_from_another_transport`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_halted_anywhere_is_an_empty_list() {
    let category = format!("op-empty-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let operator = client().await;
    assert!(operator.admin().halted(&category, "g").await.unwrap().is_empty());
}
