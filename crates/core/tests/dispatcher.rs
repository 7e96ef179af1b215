//! The keyed dispatcher's behaviour, observed through what its handler and
//! settlements actually did.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use keyorder_core::{
    Delivery, DispatchConfig, Dispatcher, Error, GlobalBackoff, HandlerError, HandlerResult, Inbound, Job, LeaseConfig,
    Message, OrderingKey, PoisonPolicy, RetryPolicy, ScopeLease, Settle, Stats, Submit, Widening,
};
use tokio::sync::Notify;
use tokio::time::Instant;

/// What the broker saw.
#[derive(Default, Debug)]
struct Broker {
    settled: Mutex<Vec<(String, &'static str)>>,
    attempts: Mutex<HashMap<String, u32>>,
    fenced: AtomicBool,
    /// Messages delivered before without being settled (suspects).
    suspects: Mutex<Vec<String>>,
}

impl Broker {
    fn settled(&self) -> Vec<(String, &'static str)> {
        self.settled.lock().unwrap().clone()
    }
    fn count(&self, what: &str) -> usize {
        self.settled().iter().filter(|(_, w)| *w == what).count()
    }
}

#[derive(Debug)]
struct TestSettle {
    id: String,
    broker: Arc<Broker>,
}

impl TestSettle {
    fn record(&self, what: &'static str) -> keyorder_core::Result<()> {
        if self.broker.fenced.load(Ordering::SeqCst) {
            return Err(Error::Fenced {
                scope: "s".into(),
                generation: 1,
            });
        }
        self.broker.settled.lock().unwrap().push((self.id.clone(), what));
        Ok(())
    }
}

#[async_trait]
impl Settle for TestSettle {
    async fn begin_attempt(&self) -> keyorder_core::Result<u32> {
        if self.broker.fenced.load(Ordering::SeqCst) {
            return Err(Error::Fenced {
                scope: "s".into(),
                generation: 1,
            });
        }
        let mut a = self.broker.attempts.lock().unwrap();
        let n = a.entry(self.id.clone()).or_insert(0);
        *n += 1;
        Ok(*n)
    }
    async fn ack(&self) -> keyorder_core::Result<()> {
        self.record("ack")
    }
    async fn park(&self, _: &str) -> keyorder_core::Result<()> {
        self.record("park")
    }
    async fn halt(&self, _: &str) -> keyorder_core::Result<()> {
        self.record("halt")
    }
    fn delivered_before(&self) -> bool {
        self.broker.suspects.lock().unwrap().contains(&self.id)
    }
}

fn lease() -> Arc<ScopeLease> {
    ScopeLease::new("scope-0", 7, &LeaseConfig::default(), Instant::now())
}

fn job(broker: &Arc<Broker>, lease: &Arc<ScopeLease>, key: Option<&str>, id: &str) -> Job {
    let key = key.map(|k| OrderingKey::new(k).unwrap());
    let mut message = Message::new(id.to_owned()).with_id(id);
    if let Some(k) = &key {
        message = message.with_ordering_key(k.clone());
    }
    Job::new(
        Inbound {
            message,
            lease: lease.clone(),
            settle: Box::new(TestSettle {
                id: id.to_owned(),
                broker: broker.clone(),
            }),
        },
        key,
    )
}

fn cfg() -> DispatchConfig {
    DispatchConfig {
        concurrency: 8,
        per_key_depth: 4,
        budget: 64,
        retry: RetryPolicy {
            max_attempts: 3,
            initial_backoff: Duration::from_millis(5),
            max_backoff: Duration::from_millis(20),
        },
        poison: PoisonPolicy::Halt,
        global_backoff: GlobalBackoff {
            distinct_keys: 0,
            ..GlobalBackoff::default()
        },
    }
}

async fn until(what: &str, cond: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn submit_all(d: &Dispatcher, jobs: Vec<Job>) {
    for j in jobs {
        assert!(matches!(d.submit(j), Submit::Accepted));
    }
}

/// Records (key, payload) order and the number of handlers running per key and overall.
#[derive(Default)]
struct Probe {
    order: Mutex<Vec<(String, String)>>,
    per_key: Mutex<HashMap<String, usize>>,
    max_per_key: AtomicUsize,
    running: AtomicUsize,
    max_running: AtomicUsize,
}

fn probing_handler(
    probe: Arc<Probe>,
    gate: Arc<Notify>,
    hold: Arc<AtomicBool>,
) -> impl Fn(Delivery) -> std::pin::Pin<Box<dyn std::future::Future<Output = HandlerResult> + Send>> + Send + Sync {
    move |d: Delivery| {
        let (probe, gate, hold) = (probe.clone(), gate.clone(), hold.clone());
        Box::pin(async move {
            let key = d.key().map_or("-".into(), |k| k.as_str().to_owned());
            {
                let mut pk = probe.per_key.lock().unwrap();
                let n = pk.entry(key.clone()).or_default();
                *n += 1;
                probe.max_per_key.fetch_max(*n, Ordering::SeqCst);
            }
            let r = probe.running.fetch_add(1, Ordering::SeqCst) + 1;
            probe.max_running.fetch_max(r, Ordering::SeqCst);
            if hold.load(Ordering::SeqCst) && key == "slow" {
                gate.notified().await;
            } else {
                tokio::task::yield_now().await;
            }
            probe
                .order
                .lock()
                .unwrap()
                .push((key.clone(), String::from_utf8_lossy(d.payload()).into_owned()));
            probe.running.fetch_sub(1, Ordering::SeqCst);
            *probe.per_key.lock().unwrap().get_mut(&key).unwrap() -= 1;
            Ok(())
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_key_fifo_one_at_a_time_different_keys_concurrent() {
    let broker = Arc::new(Broker::default());
    let probe = Arc::new(Probe::default());
    let d = Dispatcher::new(
        DispatchConfig {
            per_key_depth: 64,
            budget: 1000,
            ..cfg()
        },
        Arc::new(probing_handler(probe.clone(), Arc::new(Notify::new()), Arc::default())),
        Arc::new(Stats::default()),
    );
    let l = lease();
    let mut jobs = Vec::new();
    for seq in 0..20 {
        for k in 0..8 {
            jobs.push(job(&broker, &l, Some(&format!("k{k}")), &format!("k{k}-{seq:02}")));
        }
    }
    submit_all(&d, jobs);
    until("all acked", || broker.count("ack") == 160).await;
    assert_eq!(probe.max_per_key.load(Ordering::SeqCst), 1, "a key ran twice at once");
    assert!(
        probe.max_running.load(Ordering::SeqCst) > 1,
        "different keys never ran concurrently"
    );
    let order = probe.order.lock().unwrap().clone();
    for k in 0..8 {
        let key = format!("k{k}");
        let seqs: Vec<&String> = order.iter().filter(|(kk, _)| *kk == key).map(|(_, p)| p).collect();
        let mut sorted = seqs.clone();
        sorted.sort();
        assert_eq!(seqs, sorted, "key {key} out of order");
    }
    // Memory is independent of key cardinality: nothing is held once done.
    until("state to empty", || d.held() == 0 && d.hot_keys(10).is_empty()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_key_does_not_block_others_and_its_depth_widens_back_pressure() {
    let broker = Arc::new(Broker::default());
    let probe = Arc::new(Probe::default());
    let gate = Arc::new(Notify::new());
    let hold = Arc::new(AtomicBool::new(true));
    let d = Dispatcher::new(
        cfg(),
        Arc::new(probing_handler(probe.clone(), gate.clone(), hold.clone())),
        Arc::new(Stats::default()),
    );
    let l = lease();
    submit_all(
        &d,
        (0..4)
            .map(|i| job(&broker, &l, Some("slow"), &format!("slow-{i}")))
            .collect(),
    );
    // The slow key is full at its depth: its next message is handed back.
    match d.submit(job(&broker, &l, Some("slow"), "slow-4")) {
        Submit::Full(_, Widening::KeyDepth) => {}
        other => panic!("expected KeyDepth, got {other:?}"),
    }
    // Other keys flow while the slow one is stuck inside its handler.
    submit_all(
        &d,
        (0..10)
            .map(|i| job(&broker, &l, Some(&format!("k{i}")), &format!("fast-{i}")))
            .collect(),
    );
    until("fast keys to finish", || broker.count("ack") == 10).await;
    assert_eq!(d.held_in_scope("scope-0"), 4);
    assert_eq!(d.hot_keys(1)[0].backlog, 4, "the slow key is the hot key");
    assert!(
        d.hot_keys(1)[0].label.starts_with("k#"),
        "hot keys never show the value"
    );
    hold.store(false, Ordering::SeqCst);
    gate.notify_one();
    until("slow key to finish", || broker.count("ack") == 14).await;
    let order: Vec<String> = probe
        .order
        .lock()
        .unwrap()
        .iter()
        .filter(|(k, _)| k == "slow")
        .map(|(_, p)| p.clone())
        .collect();
    assert_eq!(order, vec!["slow-0", "slow-1", "slow-2", "slow-3"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_budget_bounds_everything_held() {
    let broker = Arc::new(Broker::default());
    let gate = Arc::new(Notify::new());
    let d = Dispatcher::new(
        DispatchConfig {
            budget: 5,
            per_key_depth: 64,
            ..cfg()
        },
        Arc::new(probing_handler(Arc::default(), gate, Arc::new(AtomicBool::new(true)))),
        Arc::new(Stats::default()),
    );
    let l = lease();
    submit_all(
        &d,
        (0..5)
            .map(|i| job(&broker, &l, Some("slow"), &format!("a{i}")))
            .collect(),
    );
    let mut refused = 0;
    for i in 0..100 {
        let next = job(&broker, &l, Some(&format!("n{i}")), &format!("n{i}"));
        if let Submit::Full(_, Widening::Budget) = d.submit(next) {
            refused += 1;
        }
    }
    assert_eq!(d.held(), 5);
    assert_eq!(refused, 100, "work beyond the budget was taken");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_back_off_then_halt_holds_the_key_and_release_resumes_in_order() {
    let broker = Arc::new(Broker::default());
    let fail_until = Arc::new(AtomicUsize::new(usize::MAX));
    let seen = Arc::new(Mutex::new(Vec::<(String, u32)>::new()));
    let handler = {
        let (fail_until, seen) = (fail_until.clone(), seen.clone());
        move |d: Delivery| {
            let (fail_until, seen) = (fail_until.clone(), seen.clone());
            async move {
                seen.lock().unwrap().push((d.id().to_owned(), d.attempt()));
                if d.id() == "p-1" && (d.attempt() as usize) < fail_until.load(Ordering::SeqCst) {
                    return Err(HandlerError::retry("dependency down"));
                }
                Ok(())
            }
        }
    };
    let stats = Arc::new(Stats::default());
    let d = Dispatcher::new(cfg(), Arc::new(handler), stats.clone());
    let l = lease();
    submit_all(
        &d,
        (0..3).map(|i| job(&broker, &l, Some("p"), &format!("p-{i}"))).collect(),
    );
    until("the key to halt", || broker.count("halt") == 1).await;
    let attempts: Vec<u32> = seen
        .lock()
        .unwrap()
        .iter()
        .filter(|(id, _)| id == "p-1")
        .map(|(_, a)| *a)
        .collect();
    assert_eq!(attempts, vec![1, 2, 3], "three attempts, counted durably");
    assert_eq!(broker.count("ack"), 1, "only p-0 applied; p-2 is held behind the head");
    assert_eq!(stats.snapshot().halted_now, 1);
    // Resume: the head runs again (attempts reset at the broker) and succeeds.
    broker.attempts.lock().unwrap().remove("p-1");
    fail_until.store(0, Ordering::SeqCst);
    assert!(d.release("p", false));
    until("the key to finish", || broker.count("ack") == 3).await;
    let acked: Vec<String> = broker
        .settled()
        .into_iter()
        .filter(|(_, w)| *w == "ack")
        .map(|(id, _)| id)
        .collect();
    assert_eq!(acked, vec!["p-0", "p-1", "p-2"]);
    assert_eq!(stats.snapshot().halted_now, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn park_dead_letters_the_head_and_releases_the_key_and_a_panic_is_poison() {
    let broker = Arc::new(Broker::default());
    let handler = |d: Delivery| async move {
        if d.id() == "p-1" {
            panic!("handler bug");
        }
        HandlerResult::Ok(())
    };
    let stats = Arc::new(Stats::default());
    let d = Dispatcher::new(
        DispatchConfig {
            poison: PoisonPolicy::Park { max_attempts: 5 },
            ..cfg()
        },
        Arc::new(handler),
        stats.clone(),
    );
    let l = lease();
    submit_all(
        &d,
        (0..3).map(|i| job(&broker, &l, Some("p"), &format!("p-{i}"))).collect(),
    );
    until("all settled", || broker.settled().len() == 3).await;
    assert_eq!(
        broker.settled(),
        vec![("p-0".into(), "ack"), ("p-1".into(), "park"), ("p-2".into(), "ack")]
    );
    assert_eq!(
        broker.attempts.lock().unwrap()["p-1"],
        1,
        "a panic is poison: parked at once"
    );
    let s = stats.snapshot();
    assert_eq!((s.panics, s.parked), (1, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_across_many_keys_back_off_the_whole_subscription_instead_of_halting() {
    let broker = Arc::new(Broker::default());
    let down = Arc::new(AtomicBool::new(true));
    let handler = {
        let down = down.clone();
        move |_d: Delivery| {
            let down = down.clone();
            async move {
                if down.load(Ordering::SeqCst) {
                    Err(HandlerError::retry("database unreachable"))
                } else {
                    Ok(())
                }
            }
        }
    };
    let stats = Arc::new(Stats::default());
    let d = Dispatcher::new(
        DispatchConfig {
            global_backoff: GlobalBackoff {
                window: Duration::from_secs(30),
                distinct_keys: 5,
                pause: Duration::from_millis(100),
            },
            ..cfg()
        },
        Arc::new(handler),
        stats.clone(),
    );
    let l = lease();
    submit_all(
        &d,
        (0..8)
            .map(|i| job(&broker, &l, Some(&format!("k{i}")), &format!("m{i}")))
            .collect(),
    );
    until("the global back-off to trip", || stats.snapshot().global_backoffs >= 1).await;
    until("attempts past the per-key limit", || {
        broker.attempts.lock().unwrap().values().filter(|n| **n > 3).count() >= 5
    })
    .await;
    assert_eq!(broker.count("halt"), 0, "healthy keys were halted during an outage");
    down.store(false, Ordering::SeqCst);
    until("all applied after recovery", || broker.count("ack") == 8).await;
    assert_eq!(broker.count("halt"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_self_fence_pauses_a_stale_scope_and_discards_a_lost_one() {
    let broker = Arc::new(Broker::default());
    let ran = Arc::new(AtomicUsize::new(0));
    let handler = {
        let ran = ran.clone();
        move |_d: Delivery| {
            let ran = ran.clone();
            async move {
                ran.fetch_add(1, Ordering::SeqCst);
                HandlerResult::Ok(())
            }
        }
    };
    let stats = Arc::new(Stats::default());
    let d = Dispatcher::new(cfg(), Arc::new(handler), stats.clone());
    let lc = LeaseConfig {
        ttl: Duration::from_secs(4),
        heartbeat: Duration::from_secs(1),
        margin: Duration::from_secs(1),
    };
    // Last confirmed 5 s ago: older than ttl - margin.
    let stale = ScopeLease::new("scope-0", 3, &lc, Instant::now() - Duration::from_secs(5));
    submit_all(
        &d,
        vec![
            job(&broker, &stale, Some("a"), "a-0"),
            job(&broker, &stale, Some("a"), "a-1"),
        ],
    );
    until("a self-fence pause", || stats.snapshot().self_fence_pauses >= 1).await;
    assert_eq!(
        ran.load(Ordering::SeqCst),
        0,
        "a handler started on an unconfirmed scope"
    );
    // A fenced round trip succeeds again: work resumes.
    stale.confirm(Instant::now());
    until("both applied", || broker.count("ack") == 2).await;

    // Lost: buffered deliveries are discarded, never run, never acked.
    let lost = ScopeLease::new("scope-1", 4, &lc, Instant::now() - Duration::from_secs(5));
    submit_all(
        &d,
        (0..3)
            .map(|i| job(&broker, &lost, Some("b"), &format!("b-{i}")))
            .collect(),
    );
    until("a pause on the second scope", || {
        stats.snapshot().self_fence_pauses >= 2
    })
    .await;
    lost.lose();
    until("the lost scope's work to be discarded", || d.held() == 0).await;
    assert_eq!(ran.load(Ordering::SeqCst), 2);
    assert_eq!(broker.count("ack"), 2);
    assert_eq!(stats.snapshot().self_fence_discards, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_ack_loses_the_scope_and_nothing_more_of_it_starts() {
    let broker = Arc::new(Broker::default());
    let gate = Arc::new(Notify::new());
    let ran = Arc::new(AtomicUsize::new(0));
    let handler = {
        let (gate, ran) = (gate.clone(), ran.clone());
        move |_d: Delivery| {
            let (gate, ran) = (gate.clone(), ran.clone());
            async move {
                ran.fetch_add(1, Ordering::SeqCst);
                gate.notified().await;
                HandlerResult::Ok(())
            }
        }
    };
    let stats = Arc::new(Stats::default());
    let d = Dispatcher::new(cfg(), Arc::new(handler), stats.clone());
    let l = lease();
    submit_all(
        &d,
        (0..3).map(|i| job(&broker, &l, Some("a"), &format!("a-{i}"))).collect(),
    );
    until("the first handler to start", || ran.load(Ordering::SeqCst) == 1).await;
    // Another owner took the scope while a-0 ran: its ack is rejected.
    broker.fenced.store(true, Ordering::SeqCst);
    gate.notify_one();
    until("the scope's work to be discarded", || d.held() == 0).await;
    assert_eq!(ran.load(Ordering::SeqCst), 1, "the stale owner started another message");
    assert!(l.is_lost());
    let s = stats.snapshot();
    assert_eq!((s.fence_rejections, s.applied), (1, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_finishes_running_handlers_and_leaves_waiting_ones_unacked() {
    let broker = Arc::new(Broker::default());
    let gate = Arc::new(Notify::new());
    let started = Arc::new(AtomicUsize::new(0));
    let handler = {
        let (gate, started) = (gate.clone(), started.clone());
        move |_d: Delivery| {
            let (gate, started) = (gate.clone(), started.clone());
            async move {
                started.fetch_add(1, Ordering::SeqCst);
                gate.notified().await;
                HandlerResult::Ok(())
            }
        }
    };
    let d = Dispatcher::new(cfg(), Arc::new(handler), Arc::new(Stats::default()));
    let l = lease();
    submit_all(
        &d,
        (0..3).map(|i| job(&broker, &l, Some("a"), &format!("a-{i}"))).collect(),
    );
    until("the first handler to start", || started.load(Ordering::SeqCst) == 1).await;
    let drain = tokio::spawn({
        let d = d.clone();
        async move { d.drain().await }
    });
    // Shutdown refuses new work and waits for the running handler ...
    until("draining to start", || d.is_draining()).await;
    assert!(matches!(
        d.submit(job(&broker, &l, Some("z"), "z")),
        Submit::Full(_, Widening::Stopping)
    ));
    assert!(!drain.is_finished());
    gate.notify_one();
    let dropped = drain.await.unwrap();
    // ... acks it, and leaves the two waiting ones to the broker.
    assert_eq!(broker.settled(), vec![("a-0".into(), "ack")]);
    assert_eq!(dropped, 2);
    assert_eq!(started.load(Ordering::SeqCst), 1);
    assert_eq!(d.held(), 0);
}

/// A settlement fenced by its own lease (as a broker fences a generation).
#[derive(Debug)]
struct LeaseSettle {
    id: String,
    lease: Arc<ScopeLease>,
    broker: Arc<Broker>,
}

#[async_trait]
impl Settle for LeaseSettle {
    async fn begin_attempt(&self) -> keyorder_core::Result<u32> {
        Ok(1)
    }
    async fn ack(&self) -> keyorder_core::Result<()> {
        if self.lease.is_lost() {
            return Err(Error::Fenced {
                scope: "s".into(),
                generation: self.lease.generation(),
            });
        }
        self.broker.settled.lock().unwrap().push((self.id.clone(), "ack"));
        Ok(())
    }
    async fn park(&self, _: &str) -> keyorder_core::Result<()> {
        Ok(())
    }
    async fn halt(&self, _: &str) -> keyorder_core::Result<()> {
        Ok(())
    }
}

fn lease_job(broker: &Arc<Broker>, lease: &Arc<ScopeLease>, key: &str, id: &str) -> Job {
    let key = OrderingKey::new(key).unwrap();
    Job::new(
        Inbound {
            message: Message::new(id.to_owned()).with_id(id).with_ordering_key(key.clone()),
            lease: lease.clone(),
            settle: Box::new(LeaseSettle {
                id: id.to_owned(),
                lease: lease.clone(),
                broker: broker.clone(),
            }),
        },
        Some(key),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_generation_drops_only_its_own_jobs_not_the_next_generations() {
    let broker = Arc::new(Broker::default());
    let gate = Arc::new(Notify::new());
    let handler = {
        let gate = gate.clone();
        move |d: Delivery| {
            let gate = gate.clone();
            async move {
                if d.id() == "old-0" {
                    gate.notified().await;
                }
                HandlerResult::Ok(())
            }
        }
    };
    let d = Dispatcher::new(cfg(), Arc::new(handler), Arc::new(Stats::default()));
    // Same scope, two generations: the slot was lost and re-acquired while
    // old-0 ran; the new owner re-read it and what follows.
    let old = ScopeLease::new("scope-0", 1, &LeaseConfig::default(), Instant::now());
    let new = ScopeLease::new("scope-0", 2, &LeaseConfig::default(), Instant::now());
    submit_all(&d, vec![lease_job(&broker, &old, "a", "old-0")]);
    until("old-0 to start", || d.held() == 1 && d.hot_keys(1).len() == 1).await;
    submit_all(
        &d,
        vec![
            lease_job(&broker, &new, "a", "new-0"),
            lease_job(&broker, &new, "a", "new-1"),
        ],
    );
    old.lose();
    gate.notify_one();
    until("the new generation to be applied", || broker.count("ack") == 2).await;
    let acked: Vec<String> = broker.settled().into_iter().map(|(id, _)| id).collect();
    assert_eq!(
        acked,
        vec!["new-0", "new-1"],
        "old-0's ack is fenced; the new generation runs in order"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_does_not_wait_forever_on_an_unconfirmed_scope() {
    let broker = Arc::new(Broker::default());
    let d = Dispatcher::new(
        cfg(),
        Arc::new(|_d: Delivery| async { HandlerResult::Ok(()) }),
        Arc::new(Stats::default()),
    );
    let lc = LeaseConfig {
        ttl: Duration::from_secs(4),
        heartbeat: Duration::from_secs(1),
        margin: Duration::from_secs(1),
    };
    let stale = ScopeLease::new("scope-0", 3, &lc, Instant::now() - Duration::from_secs(5));
    submit_all(&d, vec![job(&broker, &stale, Some("a"), "a-0")]);
    until("the self-fence to pause", || {
        d.stats().snapshot().self_fence_pauses == 1
    })
    .await;
    let dropped = tokio::time::timeout(Duration::from_secs(20), d.drain())
        .await
        .expect("drain must not hang on a scope nobody confirms any more");
    assert_eq!(dropped, 0);
    assert_eq!(broker.count("ack"), 0, "nothing started on the unconfirmed scope");
    assert_eq!(d.held(), 0);
}

/// What ran while a suspect (a message delivered before without being
/// settled) ran: (suspect id, attempt, handlers running at its start and at
/// its end), and whether any other handler started while one ran.
#[derive(Default)]
struct Alone {
    running: AtomicUsize,
    suspect_running: AtomicBool,
    overlaps: Mutex<Vec<String>>,
    suspect_runs: Mutex<Vec<(String, u32, usize, usize)>>,
    /// Acknowledgements seen when s-0's second run started.
    acks_at_second_run: Mutex<Option<usize>>,
    s_runs: AtomicUsize,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redelivered_message_runs_alone_and_its_back_off_holds_no_other_key() {
    let broker = Arc::new(Broker::default());
    broker
        .suspects
        .lock()
        .unwrap()
        .extend(["s-0".to_owned(), "t-0".to_owned()]);
    let alone = Arc::new(Alone::default());
    let handler = {
        let (alone, broker) = (alone.clone(), broker.clone());
        move |d: Delivery| {
            let (alone, broker) = (alone.clone(), broker.clone());
            async move {
                let id = d.id().to_owned();
                let suspect = id == "s-0" || id == "t-0";
                let at_start = alone.running.fetch_add(1, Ordering::SeqCst) + 1;
                let s_run = if id == "s-0" {
                    alone.s_runs.fetch_add(1, Ordering::SeqCst) + 1
                } else {
                    0
                };
                if suspect {
                    alone.suspect_running.store(true, Ordering::SeqCst);
                    if s_run == 2 {
                        *alone.acks_at_second_run.lock().unwrap() = Some(broker.count("ack"));
                    }
                } else if alone.suspect_running.load(Ordering::SeqCst) {
                    alone.overlaps.lock().unwrap().push(id.clone());
                }
                // Work that takes a while, so overlaps would show.
                tokio::time::sleep(Duration::from_millis(if suspect { 100 } else { 5 })).await;
                let at_end = alone.running.load(Ordering::SeqCst);
                if suspect {
                    alone
                        .suspect_runs
                        .lock()
                        .unwrap()
                        .push((id.clone(), d.attempt(), at_start, at_end));
                    alone.suspect_running.store(false, Ordering::SeqCst);
                }
                alone.running.fetch_sub(1, Ordering::SeqCst);
                // s-0's store refuses its first run (a fenced run, run again
                // after a back-off) and its second fails (a local retry):
                // neither back-off may keep the other keys waiting.
                match s_run {
                    1 => return Err(HandlerError::fenced("the store saw a newer token")),
                    2 => return Err(HandlerError::retry("dependency down")),
                    _ => {}
                }
                Ok(())
            }
        }
    };
    let mut c = cfg();
    // Back-offs long enough that every other key finishes during them.
    c.retry.initial_backoff = Duration::from_secs(3);
    c.retry.max_backoff = Duration::from_secs(3);
    let stats = Arc::new(Stats::default());
    let d = Dispatcher::new(c, Arc::new(handler), stats.clone());
    let l = lease();
    let mut jobs = vec![job(&broker, &l, Some("s"), "s-0")];
    jobs.extend((0..6).map(|i| job(&broker, &l, Some(&format!("k{i}")), &format!("k{i}-0"))));
    jobs.push(job(&broker, &l, Some("t"), "t-0"));
    jobs.extend((0..6).map(|i| job(&broker, &l, Some(&format!("k{i}")), &format!("k{i}-1"))));
    submit_all(&d, jobs);
    until("every message to be applied", || broker.count("ack") == 14).await;
    let overlaps = alone.overlaps.lock().unwrap().clone();
    assert!(
        overlaps.is_empty(),
        "handlers started while a suspect ran: {overlaps:?}"
    );
    let runs = alone.suspect_runs.lock().unwrap().clone();
    for (id, attempt, at_start, at_end) in &runs {
        assert_eq!(
            (*at_start, *at_end),
            (1, 1),
            "{id} attempt {attempt} ran beside {} other handler(s)",
            at_start.max(at_end) - 1
        );
    }
    assert!(runs.iter().any(|(id, _, _, _)| id == "t-0"), "t-0 ran: {runs:?}");
    assert_eq!(alone.s_runs.load(Ordering::SeqCst), 3, "s-0: fenced, failed, applied");
    assert_eq!(
        *alone.acks_at_second_run.lock().unwrap(),
        Some(13),
        "every other message was applied during s-0's back-off after its fenced run"
    );
    assert_eq!(stats.snapshot().isolated, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_suspect_behind_a_hung_handler_runs_beside_it_after_the_isolation_wait() {
    let broker = Arc::new(Broker::default());
    broker.suspects.lock().unwrap().push("s-0".into());
    let release = Arc::new(Notify::new());
    let handler = {
        let release = release.clone();
        move |d: Delivery| {
            let release = release.clone();
            async move {
                if d.id() == "slow-0" {
                    release.notified().await;
                }
                Ok(())
            }
        }
    };
    let d = Dispatcher::new(cfg(), Arc::new(handler), Arc::new(Stats::default()));
    let l = lease();
    submit_all(&d, vec![job(&broker, &l, Some("slow"), "slow-0")]);
    until("slow-0 to start", || d.hot_keys(1).len() == 1).await;
    submit_all(&d, vec![job(&broker, &l, Some("s"), "s-0")]);
    submit_all(
        &d,
        (0..6)
            .map(|i| job(&broker, &l, Some(&format!("k{i}")), &format!("k{i}-0")))
            .collect(),
    );
    // A hung handler stops no key for longer than the isolation wait.
    until("the suspect and every fresh key beside the hung handler", || {
        broker.count("ack") == 7
    })
    .await;
    assert!(!broker.settled().iter().any(|(id, _)| id == "slow-0"));
    release.notify_waiters();
    until("the hung handler to finish", || broker.count("ack") == 8).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dispatchers_sharing_the_process_gate_run_their_suspects_one_at_a_time() {
    let running = Arc::new(AtomicUsize::new(0));
    let max = Arc::new(AtomicUsize::new(0));
    let mk = || {
        let (running, max) = (running.clone(), max.clone());
        move |_d: Delivery| {
            let (running, max) = (running.clone(), max.clone());
            async move {
                let n = running.fetch_add(1, Ordering::SeqCst) + 1;
                max.fetch_max(n, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(200)).await;
                running.fetch_sub(1, Ordering::SeqCst);
                Ok(())
            }
        }
    };
    let broker = Arc::new(Broker::default());
    broker
        .suspects
        .lock()
        .unwrap()
        .extend(["a-0".to_owned(), "b-0".to_owned()]);
    // Dispatchers made to share the process's gate.
    let d1 = Dispatcher::new_in_process(cfg(), Arc::new(mk()), Arc::new(Stats::default()));
    let d2 = Dispatcher::new_in_process(cfg(), Arc::new(mk()), Arc::new(Stats::default()));
    let l = lease();
    submit_all(&d1, vec![job(&broker, &l, Some("a"), "a-0")]);
    submit_all(&d2, vec![job(&broker, &l, Some("b"), "b-0")]);
    until("both suspects to be applied", || broker.count("ack") == 2).await;
    assert_eq!(max.load(Ordering::SeqCst), 1, "two suspects of one process ran at once");
}

/// A key's value may read like another key's label (`k#<hash>`, keys are
/// user data): releasing it by value releases that key, never the other
/// halted one whose label it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn releasing_a_key_by_value_never_releases_the_key_whose_label_it_reads_like() {
    let broker = Arc::new(Broker::default());
    let failing = Arc::new(AtomicBool::new(true));
    let handler = {
        let failing = failing.clone();
        move |d: Delivery| {
            let failing = failing.clone();
            async move {
                if d.id().ends_with("-0") && failing.load(Ordering::SeqCst) {
                    return Err(HandlerError::poison("head fails"));
                }
                Ok(())
            }
        }
    };
    let d = Dispatcher::new(cfg(), Arc::new(handler), Arc::new(Stats::default()));
    let l = lease();
    // Pairs of halted keys: `x{i}` and the key whose value is its label.
    let pairs: Vec<(String, String)> = (0..8)
        .map(|i| {
            let x = format!("x{i}");
            let y = keyorder_core::key::label(&x);
            (x, y)
        })
        .collect();
    for (x, y) in &pairs {
        submit_all(
            &d,
            vec![
                job(&broker, &l, Some(x), &format!("{x}-0")),
                job(&broker, &l, Some(y), &format!("{y}-0")),
            ],
        );
    }
    until("every key to halt", || broker.count("halt") == 16).await;
    failing.store(false, Ordering::SeqCst);
    for (_, y) in &pairs {
        assert!(d.release(y, false));
    }
    until("the released keys to finish", || broker.count("ack") == 8).await;
    let acked: Vec<String> = broker
        .settled()
        .into_iter()
        .filter(|(_, w)| *w == "ack")
        .map(|(id, _)| id)
        .collect();
    for (x, y) in &pairs {
        assert!(acked.contains(&format!("{y}-0")), "{y} was not released");
        assert!(
            !acked.contains(&format!("{x}-0")),
            "{x} was released by another key's value"
        );
    }
}
