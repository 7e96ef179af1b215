//! Typed payloads through a real subscription (feature `serde`): JSON
//! messages round-trip in per-key order, and a payload that does not decode
//! is poison: `Halt` stops its key at it on the first attempt (the key's
//! later messages wait, and run in order once an operator skips it), `Park`
//! dead-letters it on the first attempt and the key goes on. What is
//! asserted is what the handler applied and what the broker recorded
//! (`Admin::halted`, `Admin::dead_letters`), on the in-memory transport and
//! on PostgreSQL (feature `postgres`; `POSTGRES_URL`, else the loopback
//! server `scripts/services` starts).
//!
//! `cargo test --features serde,postgres --test typed`

use std::sync::{Arc, Mutex};
use std::time::Duration;

use keyorder::{
    Client, Delivery, HandlerResult, HeadAction, KeySource, LeaseConfig, Message, OrderingKey, PoisonPolicy,
    RetryPolicy, Settlement,
};
use keyorder_testkit::until;

#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
struct Step {
    key: String,
    seq: u32,
}

const GOOD: [&str; 2] = ["client-1", "client-2"];
/// The key whose second message does not decode. Its value must never
/// appear in what keyorder records or says about that message.
const BAD: &str = "customer-bad-7781";
const STEPS: u32 = 6;
/// The sequence number of `BAD`'s undecodable message.
const POISON_SEQ: u32 = 1;

/// What a run did: the steps the handler applied, in order, and each run
/// of the undecodable message (its attempt numbers).
#[derive(Default)]
struct Log {
    applied: Vec<(String, u32)>,
    poison_runs: Vec<u32>,
    settled: Vec<(String, Settlement)>,
}

fn applied(log: &Mutex<Log>, key: &str) -> Vec<u32> {
    let log = log.lock().unwrap();
    log.applied.iter().filter(|(k, _)| k == key).map(|(_, s)| *s).collect()
}

fn unique(prefix: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("{prefix}-{}-{nanos}", std::process::id())
}

/// Publishes `STEPS` typed steps for every key; `BAD`'s step `POISON_SEQ`
/// is a JSON object whose `seq` is the key's value (a string where the type
/// wants a number), so the codec's own error text quotes the key. Returns
/// that message's id.
async fn publish(client: &Client, category: &str) -> String {
    let publisher = client.publisher(category).await.unwrap();
    let mut poison_id = String::new();
    for seq in 0..STEPS {
        for key in GOOD.iter().chain([&BAD]) {
            let msg = if *key == BAD && seq == POISON_SEQ {
                let bad = Message::new(format!(r#"{{"key":"{BAD}","seq":"{BAD}"}}"#));
                poison_id = bad.id().to_owned();
                bad
            } else {
                Message::json(&Step {
                    key: (*key).to_owned(),
                    seq,
                })
                .unwrap()
            };
            publisher
                .publish(msg.with_key(key).unwrap().with_type("step"))
                .await
                .unwrap();
        }
    }
    poison_id
}

/// Starts a subscription of `category` with `policy` and five attempts
/// allowed (a retryable error would run five times) whose handler decodes
/// each step with `Delivery::json` and logs it; returns its stop signal
/// and its task.
async fn subscribe(
    client: &Client,
    category: &str,
    policy: PoisonPolicy,
    poison_id: &str,
    log: &Arc<Mutex<Log>>,
) -> (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<keyorder::Result<keyorder::RunReport>>,
) {
    let hook_log = log.clone();
    let subscription = client
        .subscribe(category, "g")
        .ordered_by(KeySource::routing_key())
        .poison(policy)
        .retry(RetryPolicy {
            max_attempts: 5,
            initial_backoff: Duration::from_millis(20),
            max_backoff: Duration::from_millis(50),
        })
        // A lease a loaded machine keeps: a lost one would redeliver what
        // was in flight (at-least-once), which is not what this tests.
        .lease(LeaseConfig {
            ttl: Duration::from_secs(15),
            heartbeat: Duration::from_millis(500),
            margin: Duration::from_secs(5),
        })
        .on_settled(move |s| hook_log.lock().unwrap().settled.push((s.id.clone(), s.settlement)))
        .build()
        .await
        .unwrap();
    let handler_log = log.clone();
    let poison_id = poison_id.to_owned();
    let handler = move |d: Delivery| {
        let log = handler_log.clone();
        let poison_id = poison_id.clone();
        async move {
            if d.id() == poison_id {
                log.lock().unwrap().poison_runs.push(d.attempt());
            }
            let step: Step = d.json()?;
            assert_eq!(Some(step.key.as_str()), d.key().map(OrderingKey::as_str));
            log.lock().unwrap().applied.push((step.key, step.seq));
            HandlerResult::Ok(())
        }
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(subscription.run(handler, async move {
        let _ = stopped.await;
    }));
    (stop, run)
}

/// What keyorder recorded about the undecodable message (a halt or park
/// reason) names the type, the message and the key's label, not the key.
fn assert_reason(reason: &str, poison_id: &str) {
    let label = OrderingKey::new(BAD).unwrap().label();
    for want in [std::any::type_name::<Step>(), poison_id, label.as_str(), "invalid type"] {
        assert!(
            reason.contains(want),
            "{want:?} missing from the recorded reason: {reason}"
        );
    }
    assert!(
        !reason.contains(BAD),
        "the key's value is in the recorded reason: {reason}"
    );
}

async fn halt_scenario(client: Client) {
    let category = unique("typed-halt");
    let poison_id = publish(&client, &category).await;
    let log: Arc<Mutex<Log>> = Arc::default();
    let (stop, run) = subscribe(&client, &category, PoisonPolicy::Halt, &poison_id, &log).await;
    let admin = client.admin();
    let halted = until(
        "the good keys to finish while the bad key halts",
        Duration::from_secs(60),
        async || {
            let halted = admin.halted(&category, "g").await.unwrap();
            let good = GOOD.iter().all(|k| applied(&log, k).len() == STEPS as usize);
            // The observer hears of the halt just after the broker records it.
            let reported = log
                .lock()
                .unwrap()
                .settled
                .contains(&(poison_id.clone(), Settlement::Halted));
            (good && reported && halted.len() == 1).then_some(halted)
        },
    )
    .await;
    let all: Vec<u32> = (0..STEPS).collect();
    for key in GOOD {
        assert_eq!(applied(&log, key), all, "{key}: every typed step, in order, once");
    }
    let head = &halted[0];
    assert_eq!(head.head_id, poison_id, "halted at the undecodable message");
    assert_eq!(head.label, OrderingKey::new(BAD).unwrap().label());
    assert_eq!(head.attempts, 1, "a decode failure is poison at once, not retried");
    assert_reason(&head.reason, &poison_id);
    assert_eq!(log.lock().unwrap().poison_runs, [1], "the undecodable message ran once");
    assert_eq!(
        applied(&log, BAD),
        [0],
        "nothing of the key applied past its halted head"
    );
    assert!(log
        .lock()
        .unwrap()
        .settled
        .contains(&(poison_id.clone(), Settlement::Halted)));

    // Held, not dropped: an operator skips the head (by its label) and the
    // key's later steps run, in order.
    admin
        .resolve(&category, "g", &head.label, HeadAction::Skip)
        .await
        .unwrap();
    let rest: Vec<u32> = (0..STEPS).filter(|s| *s != POISON_SEQ).collect();
    until("the held steps to run", Duration::from_secs(60), async || {
        applied(&log, BAD).len() >= rest.len()
    })
    .await;
    assert_eq!(applied(&log, BAD), rest, "released in order, each once");
    assert!(admin.halted(&category, "g").await.unwrap().is_empty());
    assert!(
        admin.dead_letters(&category, "g").await.unwrap().is_empty(),
        "skipped, not parked"
    );
    let _ = stop.send(());
    run.await.unwrap().unwrap();
    assert_eq!(
        log.lock().unwrap().poison_runs,
        [1],
        "the skipped message never ran again"
    );
}

async fn park_scenario(client: Client) {
    let category = unique("typed-park");
    let poison_id = publish(&client, &category).await;
    let log: Arc<Mutex<Log>> = Arc::default();
    let policy = PoisonPolicy::Park { max_attempts: 5 };
    let (stop, run) = subscribe(&client, &category, policy, &poison_id, &log).await;
    let admin = client.admin();
    let rest: Vec<u32> = (0..STEPS).filter(|s| *s != POISON_SEQ).collect();
    let parked = until(
        "every key to finish, the bad one past its park",
        Duration::from_secs(60),
        async || {
            let dead = admin.dead_letters(&category, "g").await.unwrap();
            let good = GOOD.iter().all(|k| applied(&log, k).len() == STEPS as usize);
            (good && applied(&log, BAD).len() == rest.len() && dead.len() == 1).then_some(dead)
        },
    )
    .await;
    let all: Vec<u32> = (0..STEPS).collect();
    for key in GOOD {
        assert_eq!(applied(&log, key), all, "{key}: every typed step, in order, once");
    }
    assert_eq!(
        applied(&log, BAD),
        rest,
        "the key went on past its parked message, in order"
    );
    assert_eq!(parked[0].id, poison_id, "the undecodable message was parked");
    assert_eq!(parked[0].label, OrderingKey::new(BAD).unwrap().label());
    assert_reason(&parked[0].reason, &poison_id);
    assert_eq!(
        log.lock().unwrap().poison_runs,
        [1],
        "parked on its first attempt, not after max_attempts"
    );
    assert!(log
        .lock()
        .unwrap()
        .settled
        .contains(&(poison_id.clone(), Settlement::Parked)));
    assert!(admin.halted(&category, "g").await.unwrap().is_empty());
    let _ = stop.send(());
    run.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_typed_halt() {
    halt_scenario(keyorder::connect("memory://").await.unwrap()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_typed_park() {
    park_scenario(keyorder::connect("memory://").await.unwrap()).await;
}

#[cfg(feature = "postgres")]
async fn postgres() -> Client {
    use keyorder_testkit::brokers::Broker;
    let base = Broker::Postgres.url();
    let url = format!("{base}?schema=keyorder_typed&slots=4&migrate=true");
    Broker::Postgres.require(&base, keyorder::connect(&url)).await
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_typed_halt() {
    halt_scenario(postgres().await).await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_typed_park() {
    park_scenario(postgres().await).await;
}
