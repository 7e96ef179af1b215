//! Resolving a halt while the other keys of its slot flow, on the real
//! server (conformance C18 in focus): every resolution rewinds the slot's
//! read to the halted head, and the re-read must deliver nothing that was
//! acknowledged meanwhile. An acknowledgement that committed after the
//! re-read's snapshot, but was settled in memory before the re-read's rows
//! were handled, used to be in neither of the two places the re-read
//! consults, and its message ran again behind the key's next one
//! (`b1, b2, b1`).

// Shared set-up; this file uses only part of it.
#[allow(dead_code)]
mod common;

use common::url;
use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use keyorder_core::{
    Admin, Client, Delivery, HandlerError, HandlerResult, HeadAction, KeySource, LeaseConfig, Message, RetryPolicy,
    SubscriptionBuilder,
};
use keyorder_postgres::{PgConfig, PgTransport};
use keyorder_testkit::until;

/// Healthy keys sharing the poison key's slot (one slot: all of them).
const HEALTHY: usize = 16;
/// Resolutions: skip, resume and dead-letter, each `ROUNDS / 3` times.
const ROUNDS: usize = 90;

/// Per key (index into the healthy keys), the sequence numbers applied, in
/// the order they were applied.
type Applied = Arc<Mutex<BTreeMap<usize, Vec<u64>>>>;

/// `slots` slots, a client, an operator working through a transport of its
/// own (as from another process), and a fresh queue named after `prefix`.
async fn setup(prefix: &str, slots: u64) -> (Client, Arc<dyn Admin>, String) {
    let cfg = PgConfig::from_url(
        &format!("{}?schema=keyorder_resolve&slots={slots}&migrate=true", url())
            .parse()
            .unwrap(),
    )
    .unwrap();
    let client = Client::new(Arc::new(common::connect(cfg.clone()).await));
    let admin: Arc<dyn Admin> = Client::new(Arc::new(PgTransport::connect(cfg).await.unwrap())).admin();
    (client, admin, format!("{prefix}-{}", uuid::Uuid::new_v4().simple()))
}

/// The subscription the tests run: one attempt (the first failure
/// halts), reads of 32, and a lease a loaded machine keeps (a lost one
/// would redeliver what was in flight, which is at-least-once and not what
/// this tests); the heartbeat is when resolutions are picked up.
fn subscription(client: &Client, queue: &str, concurrency: usize) -> SubscriptionBuilder {
    client
        .subscribe(queue, "g")
        .ordered_by(KeySource::routing_key())
        .concurrency(concurrency)
        .batch(32)
        .retry(RetryPolicy {
            max_attempts: 1,
            initial_backoff: Duration::from_millis(10),
            max_backoff: Duration::from_millis(10),
        })
        .lease(LeaseConfig {
            ttl: Duration::from_secs(15),
            heartbeat: Duration::from_millis(100),
            margin: Duration::from_secs(5),
        })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resolving_a_halt_under_flow_never_runs_an_acknowledged_message_again() {
    let (client, admin, queue) = setup("resolve", 1).await;
    let publisher = client.publisher(&queue).await.unwrap();
    let key_name = |i: usize| format!("k{i:02}");
    // The poison key's messages come first: each resolution rewinds the
    // slot's read to a head older than all of the flow, so every read until
    // it caught up again goes over messages in flight.
    for seq in 0..ROUNDS as u64 + 2 {
        publisher
            .publish(Message::new(seq.to_string()).with_key("p").unwrap())
            .await
            .unwrap();
    }

    let subscription = subscription(&client, &queue, 16).build().await.unwrap();

    let healthy: Applied = Arc::default();
    let poison_applied: Arc<Mutex<Vec<u64>>> = Arc::default();
    let poison_failed: Arc<Mutex<HashSet<u64>>> = Arc::default();
    let handler = {
        let (healthy, poison_applied, poison_failed) = (healthy.clone(), poison_applied.clone(), poison_failed.clone());
        move |d: Delivery| {
            let (healthy, poison_applied, poison_failed) =
                (healthy.clone(), poison_applied.clone(), poison_failed.clone());
            async move {
                let key = d.key().map(|k| k.as_str().to_owned()).unwrap_or_default();
                let seq: u64 = String::from_utf8_lossy(d.payload()).parse().unwrap();
                if key == "p" {
                    // Every poison-key message fails its first attempt (a
                    // halt), and succeeds once resumed.
                    if poison_failed.lock().unwrap().insert(seq) {
                        return Err(HandlerError::poison("first attempt fails"));
                    }
                    poison_applied.lock().unwrap().push(seq);
                    return HandlerResult::Ok(());
                }
                let i: usize = key[1..].parse().unwrap();
                healthy.lock().unwrap().entry(i).or_default().push(seq);
                // A short handler: acknowledgements are always in flight.
                tokio::time::sleep(Duration::from_millis(1)).await;
                HandlerResult::Ok(())
            }
        }
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(subscription.run(handler, async move {
        let _ = stopped.await;
    }));

    // The flow: every healthy key, until told to stop; returns how many
    // messages each key got.
    let publishing = Arc::new(AtomicBool::new(true));
    let flow = {
        let (publisher, publishing) = (publisher.clone(), publishing.clone());
        tokio::spawn(async move {
            let mut seq = 0u64;
            while publishing.load(Ordering::Relaxed) {
                for i in 0..HEALTHY {
                    publisher
                        .publish(Message::new(seq.to_string()).with_key(key_name(i)).unwrap())
                        .await
                        .unwrap();
                }
                seq += 1;
            }
            seq
        })
    };

    // The operator: waits for the poison key's halt, resolves it, and again.
    let actions = [HeadAction::Skip, HeadAction::Resume, HeadAction::DeadLetter];
    for round in 0..ROUNDS {
        until(
            &format!("the poison key's halt #{round}"),
            Duration::from_secs(90),
            async || admin.halted(&queue, "g").await.unwrap().len() == 1,
        )
        .await;
        admin.resolve(&queue, "g", "p", actions[round % 3]).await.unwrap();
    }
    publishing.store(false, Ordering::Relaxed);
    let seqs = flow.await.unwrap();
    until(
        "every healthy message to be applied",
        Duration::from_secs(90),
        async || {
            let applied = healthy.lock().unwrap();
            (0..HEALTHY).all(|i| {
                applied
                    .get(&i)
                    .is_some_and(|s| s.iter().copied().collect::<HashSet<_>>().len() as u64 == seqs)
            })
        },
    )
    .await;
    // The poison key halted again behind the last resolution.
    until("the poison key's last halt", Duration::from_secs(90), async || {
        admin.halted(&queue, "g").await.unwrap().len() == 1
    })
    .await;
    let _ = stop.send(());
    run.await.unwrap().unwrap();

    // No healthy key ever applied a message at or below one it had applied.
    let applied = healthy.lock().unwrap().clone();
    let mut violations = Vec::new();
    for (i, seqs) in applied.iter() {
        for w in seqs.windows(2) {
            if w[1] <= w[0] {
                violations.push(format!("healthy key #{i}: seq {} applied after {}", w[1], w[0]));
            }
        }
    }
    assert!(
        violations.is_empty(),
        "{} order violations after {ROUNDS} resolutions, the first ones: {:?}",
        violations.len(),
        &violations[..violations.len().min(8)]
    );
    // The poison key: each resolution let it go on, in order.
    let poison = poison_applied.lock().unwrap().clone();
    assert!(
        poison.windows(2).all(|w| w[0] < w[1]),
        "the poison key ran in order after each resolution: {poison:?}"
    );
    assert_eq!(
        poison.len(),
        ROUNDS / 3,
        "each resumed head ran once, and nothing else of the poison key succeeded: {poison:?}"
    );
    assert_eq!(
        admin.dead_letters(&queue, "g").await.unwrap().len(),
        ROUNDS / 3,
        "each dead-lettered head is stored once"
    );
}

/// A halted key's later messages that wait behind a paused scope (back-pressure
/// widened from another key that is at its depth) are handed back with the
/// rest when the halt is resolved: the re-read from the head then delivers
/// the key's messages in order. Submitted from the paused queue after the
/// release, they used to run ahead of the earlier ones the halt had handed
/// back to the database (`p0, p2` instead of `p0, p1`), and once `p2`
/// halted, the cursor passed `p1` for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_halted_keys_messages_behind_a_paused_scope_run_in_order_after_the_resolution() {
    let (client, admin, queue) = setup("resolve-paused", 1).await;
    let publisher = client.publisher(&queue).await.unwrap();
    // One read takes them all. With a depth of 2, `p0, p1` fill the poison
    // key, `b0, b1` the blocked key, and `b2` widens: the scope pauses with
    // `b2, p2, p3` waiting behind `b2`, which waits for the blocked key.
    let mut ids = BTreeMap::new();
    for (key, seq) in [("p", 0), ("p", 1), ("b", 0), ("b", 1), ("b", 2), ("p", 2), ("p", 3)] {
        let m = Message::new(seq.to_string()).with_key(key).unwrap();
        ids.insert((key, seq), m.id().to_owned());
        publisher.publish(m).await.unwrap();
    }

    let subscription = subscription(&client, &queue, 4).per_key_depth(2).build().await.unwrap();
    // The blocked key's handlers wait for this.
    let (open, opened) = tokio::sync::watch::channel(false);
    let poison_runs: Arc<Mutex<Vec<u64>>> = Arc::default();
    let poison_failed: Arc<Mutex<HashSet<u64>>> = Arc::default();
    let blocked_applied: Arc<Mutex<Vec<u64>>> = Arc::default();
    let handler = {
        let (poison_runs, poison_failed, blocked_applied) =
            (poison_runs.clone(), poison_failed.clone(), blocked_applied.clone());
        move |d: Delivery| {
            let (poison_runs, poison_failed, blocked_applied, mut opened) = (
                poison_runs.clone(),
                poison_failed.clone(),
                blocked_applied.clone(),
                opened.clone(),
            );
            async move {
                let key = d.key().map(|k| k.as_str().to_owned()).unwrap_or_default();
                let seq: u64 = String::from_utf8_lossy(d.payload()).parse().unwrap();
                if key == "p" {
                    poison_runs.lock().unwrap().push(seq);
                    if poison_failed.lock().unwrap().insert(seq) {
                        return Err(HandlerError::poison("first attempt fails"));
                    }
                    return HandlerResult::Ok(());
                }
                let _ = opened.wait_for(|open| *open).await;
                blocked_applied.lock().unwrap().push(seq);
                HandlerResult::Ok(())
            }
        }
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(subscription.run(handler, async move {
        let _ = stopped.await;
    }));

    let head = async || {
        let halted = admin.halted(&queue, "g").await.unwrap();
        halted.first().map(|h| h.head_id.clone())
    };
    until("the poison key's halt at p0", Duration::from_secs(30), async || {
        head().await.as_deref() == Some(ids[&("p", 0)].as_str())
    })
    .await;
    admin.resolve(&queue, "g", "p", HeadAction::Skip).await.unwrap();
    // The owner took the resolution (its heartbeat deletes the halted row
    // and releases the key in the same step) while `b2, p2, p3` still wait.
    until(
        "the owner to take the resolution",
        Duration::from_secs(30),
        async || admin.scopes(&queue, "g").await.unwrap().iter().all(|s| s.halted == 0),
    )
    .await;
    open.send(true).unwrap();

    // The key halts again at its next message, then at each one after it.
    let mut resolved = ids[&("p", 0)].clone();
    for seq in 1..=3u64 {
        let at = until(
            &format!("the poison key's halt at p{seq}"),
            Duration::from_secs(30),
            async || head().await.filter(|h| *h != resolved),
        )
        .await;
        let runs = poison_runs.lock().unwrap().clone();
        assert_eq!(
            at,
            ids[&("p", seq)],
            "the poison key halted at another message than p{seq} (first attempts so far: {runs:?})"
        );
        admin.resolve(&queue, "g", "p", HeadAction::Skip).await.unwrap();
        resolved = at;
    }
    until(
        "the blocked key's messages to be applied and the last resolution taken",
        Duration::from_secs(30),
        async || {
            blocked_applied.lock().unwrap().len() == 3
                && admin.scopes(&queue, "g").await.unwrap().iter().all(|s| s.halted == 0)
        },
    )
    .await;
    let _ = stop.send(());
    run.await.unwrap().unwrap();
    assert_eq!(
        *poison_runs.lock().unwrap(),
        vec![0, 1, 2, 3],
        "each poison message ran once, in order"
    );
    assert_eq!(*blocked_applied.lock().unwrap(), vec![0, 1, 2]);
}

/// Resolving a key whose value reads like another key's label
/// (`k#<hash>`, keys are user data) hands back only that key's paused
/// messages: the other key's, in another slot that no resolution rewinds,
/// were handed back too and never read again (lost).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resolution_hands_back_only_the_resolved_keys_paused_messages() {
    let slots = 2u64;
    let other = (0..)
        .map(|i| format!("x{i}"))
        .find(|x| {
            keyorder_core::key::stable_hash(x.as_bytes()) % slots
                != keyorder_core::key::stable_hash(keyorder_core::key::label(x).as_bytes()) % slots
        })
        .unwrap();
    let poison = keyorder_core::key::label(&other);
    let (client, admin, queue) = setup("resolve-label", slots).await;
    let publisher = client.publisher(&queue).await.unwrap();
    // Depth 2: `o0` runs (blocked), `o1` waits, `o2` widens: the other
    // key's slot pauses with `o2, o3`. The poison key halts in its slot.
    for (key, seq) in [(&other, 0), (&other, 1), (&other, 2), (&other, 3), (&poison, 0)] {
        publisher
            .publish(Message::new(seq.to_string()).with_key(key.as_str()).unwrap())
            .await
            .unwrap();
    }
    let subscription = subscription(&client, &queue, 4).per_key_depth(2).build().await.unwrap();
    let (open, opened) = tokio::sync::watch::channel(false);
    let applied: Arc<Mutex<Vec<u64>>> = Arc::default();
    let handler = {
        let (applied, poison) = (applied.clone(), poison.clone());
        move |d: Delivery| {
            let (applied, poison, mut opened) = (applied.clone(), poison.clone(), opened.clone());
            async move {
                let key = d.key().map(|k| k.as_str().to_owned()).unwrap_or_default();
                if key == poison {
                    return Err(HandlerError::poison("poison"));
                }
                let _ = opened.wait_for(|open| *open).await;
                applied
                    .lock()
                    .unwrap()
                    .push(String::from_utf8_lossy(d.payload()).parse().unwrap());
                HandlerResult::Ok(())
            }
        }
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(subscription.run(handler, async move {
        let _ = stopped.await;
    }));
    until("the poison key's halt", Duration::from_secs(30), async || {
        !admin.halted(&queue, "g").await.unwrap().is_empty()
    })
    .await;
    admin.resolve(&queue, "g", &poison, HeadAction::Skip).await.unwrap();
    until(
        "the owner to take the resolution",
        Duration::from_secs(30),
        async || admin.scopes(&queue, "g").await.unwrap().iter().all(|s| s.halted == 0),
    )
    .await;
    open.send(true).unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while applied.lock().unwrap().len() < 4 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _ = stop.send(());
    run.await.unwrap().unwrap();
    assert_eq!(
        *applied.lock().unwrap(),
        vec![0, 1, 2, 3],
        "the other key's messages all ran, in order"
    );
}
