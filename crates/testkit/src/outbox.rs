//! The outbox end to end: records staged in PostgreSQL by `keyorder-outbox`,
//! handed to a broker by **two relays**, applied by **two ordered consumer
//! instances** behind a [`SequenceGuard`] whose last applied sequences live
//! in PostgreSQL ([`PgApplied`], shared by both instances). The runner turns
//! [`OutboxScenario::ALL`] × adapters into trials named
//! `outbox-<adapter>::<slug>`.
//!
//! Relays are separate OS processes wherever the adapter's broker is shared
//! between processes (the runner re-executes itself, see
//! [`run_if_relay`]), so `c6_relay_crash` is a real `kill -9` and
//! `c7_relay_stall` a real `SIGSTOP`/`SIGCONT`. The in-memory transport
//! lives in one process, so there the relays are tasks: the crash aborts
//! the relay's task (its in-flight publishes with it) and the stall stops
//! driving it (no heartbeat, no confirmation), which is what the relay
//! would see of a `SIGSTOP`.
//!
//! The event log records what the consumers' handlers applied (after the
//! guard); the one [`crate::checker`] judges order, loss and overlap, and
//! every trial also requires that no record was applied twice.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use keyorder_core::{
    Admin, Capabilities, Client, Delivery, Error, HandlerError, HandlerResult, KeySource, LeaseConfig, Message,
    PublishFence, Result, RetryPolicy, SourceSpec, Transport, TransportPublisher, TransportSource,
};
use keyorder_outbox::sqlx::{self, AssertSqlSafe, PgPool};
use keyorder_outbox::{
    GuardStats, Outbox, OutboxConfig, Outgoing, PgApplied, RelayConfig, RelayStatsSnapshot, SequenceGuard, Staged,
};
use serde::{Deserialize, Serialize};
use tokio::sync::{oneshot, Semaphore};
use tokio::task::JoinHandle;

use crate::checker::{check, Expectation, Published};
use crate::eventlog::{EventLog, EventStart, MemoryEventLog};
use crate::instance::{wait_until, Instance, Payload};
use crate::Harness;
use keyorder_check::worker::{run_from_env, Connector, WorkerProcess, HOLDING_LINE, RELEASED_LINE};

type Outcome = std::result::Result<(), String>;

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// The environment variable that carries a relay process's configuration.
pub const RELAY_ENV: &str = "KEYORDER_TESTKIT_RELAY";

/// Relay slots in the trials' outboxes.
const SLOTS: u32 = 16;

/// The relays' slot lease: seconds, so a loaded 2-core machine keeps it.
const RELAY_LEASE_MS: (u64, u64, u64) = (5_000, 500, 1_500);

/// The end-to-end outbox scenarios.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutboxScenario {
    /// Per-key order from commit to handler; nothing lost, nothing applied twice.
    C1,
    /// Both relays publish, both consumers apply, no key runs twice at once.
    C2,
    /// `kill -9` of a relay holding a published but unconfirmed record.
    C6,
    /// `SIGSTOP` of a relay past its lease inside a publish, then `SIGCONT`.
    C7,
    /// Unsafe keys fail the staging call; one that reached the table anyway
    /// is abandoned by the relay, never published.
    C12,
    /// Concurrent stagers of shared keys, and a late commit with a lower
    /// transaction id.
    C15,
}

impl OutboxScenario {
    /// Every end-to-end scenario, in order.
    pub const ALL: [OutboxScenario; 6] = [
        OutboxScenario::C1,
        OutboxScenario::C2,
        OutboxScenario::C6,
        OutboxScenario::C7,
        OutboxScenario::C12,
        OutboxScenario::C15,
    ];

    /// The trial name's scenario part.
    pub fn slug(self) -> &'static str {
        match self {
            OutboxScenario::C1 => "c1_per_key_order",
            OutboxScenario::C2 => "c2_single_processor",
            OutboxScenario::C6 => "c6_relay_crash",
            OutboxScenario::C7 => "c7_relay_stall",
            OutboxScenario::C12 => "c12_unsafe_keys",
            OutboxScenario::C15 => "c15_concurrent_stagers",
        }
    }

    /// Runs the scenario over `harness`'s broker, with the outbox in a
    /// fresh schema on the harness's PostgreSQL event-log server (dropped
    /// when the trial passes, kept for a look when it fails).
    pub async fn run(self, harness: &dyn Harness) -> Outcome {
        let mut t = Trial::new(harness, self).await?;
        let res = match self {
            OutboxScenario::C1 => c1(&mut t).await,
            OutboxScenario::C2 => c2(&mut t).await,
            OutboxScenario::C6 => c6(&mut t).await,
            OutboxScenario::C7 => c7(&mut t).await,
            OutboxScenario::C12 => c12(&mut t).await,
            OutboxScenario::C15 => c15(&mut t).await,
        };
        if res.is_ok() {
            let _ = sqlx::query(AssertSqlSafe(format!("drop schema if exists {} cascade", t.schema)))
                .execute(t.pool())
                .await;
        }
        res
    }
}

// ------------------------------------------------------------------ holds

/// Where a relay holds one publish: the first record with a per-key
/// sequence of at least `from_seq`, before or after the broker confirmed it.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct HoldRule {
    /// The first record whose sequence is at least this one is held.
    pub from_seq: u64,
    /// `true`: hold after the broker confirmed it (published, not yet
    /// marked); `false`: hold before it reaches the broker.
    pub after_publish: bool,
}

#[derive(Debug)]
struct HoldState {
    rule: Option<HoldRule>,
    taken: AtomicBool,
    held: Mutex<Option<String>>,
    release: Semaphore,
    announce: bool,
    /// How the held publish ended once let go (`ok`, `fenced`, `error: ...`).
    released: Mutex<Option<String>>,
}

impl HoldState {
    fn new(rule: Option<HoldRule>, announce: bool) -> Arc<HoldState> {
        Arc::new(HoldState {
            rule,
            taken: AtomicBool::new(false),
            held: Mutex::new(None),
            release: Semaphore::new(0),
            announce,
            released: Mutex::new(None),
        })
    }

    async fn hold(&self, id: &str) {
        *self.held.lock().unwrap() = Some(id.to_owned());
        if self.announce {
            println!("{HOLDING_LINE}{id}");
        }
        if let Ok(permit) = self.release.acquire().await {
            permit.forget();
        }
    }

    fn released(&self, res: &Result<()>) {
        let outcome = match res {
            Ok(()) => "ok".to_owned(),
            Err(Error::Fenced { .. }) => "fenced".to_owned(),
            Err(e) => format!("error: {e}"),
        };
        if self.announce {
            println!("{RELEASED_LINE}{outcome}");
        }
        *self.released.lock().unwrap() = Some(outcome);
    }
}

/// A transport whose publisher holds one publish by a [`HoldRule`].
#[derive(Debug, Clone)]
struct HoldTransport {
    inner: Arc<dyn Transport>,
    state: Arc<HoldState>,
}

#[derive(Debug)]
struct HoldPublisher {
    inner: Arc<dyn TransportPublisher>,
    state: Arc<HoldState>,
}

#[async_trait]
impl TransportPublisher for HoldPublisher {
    async fn publish(&self, message: Message) -> Result<()> {
        self.go(message, None).await
    }

    fn fences_publishes(&self) -> bool {
        self.inner.fences_publishes()
    }

    async fn publish_fenced(&self, message: Message, fence: &PublishFence) -> Result<()> {
        self.go(message, Some(fence)).await
    }
}

impl HoldPublisher {
    async fn send(&self, message: Message, fence: Option<&PublishFence>) -> Result<()> {
        match fence {
            Some(f) => self.inner.publish_fenced(message, f).await,
            None => self.inner.publish(message).await,
        }
    }

    async fn go(&self, message: Message, fence: Option<&PublishFence>) -> Result<()> {
        let state = &self.state;
        let rule = state
            .rule
            .filter(|r| keyorder_outbox::sequence_of(&message).is_some_and(|s| s >= r.from_seq))
            .filter(|_| !state.taken.swap(true, Ordering::SeqCst));
        let Some(rule) = rule else {
            return self.send(message, fence).await;
        };
        let id = message.id().to_owned();
        if rule.after_publish {
            if let Err(e) = self.send(message, fence).await {
                state.taken.store(false, Ordering::SeqCst);
                return Err(e);
            }
            state.hold(&id).await;
            Ok(())
        } else {
            state.hold(&id).await;
            let res = self.send(message, fence).await;
            state.released(&res);
            res
        }
    }
}

#[async_trait]
impl Transport for HoldTransport {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
    fn affinity_fix(&self) -> String {
        self.inner.affinity_fix()
    }
    async fn publisher(&self, category: &str) -> Result<Arc<dyn TransportPublisher>> {
        Ok(Arc::new(HoldPublisher {
            inner: self.inner.publisher(category).await?,
            state: self.state.clone(),
        }))
    }
    async fn open(&self, spec: &SourceSpec) -> Result<Box<dyn TransportSource>> {
        self.inner.open(spec).await
    }
    fn admin(&self) -> Arc<dyn Admin> {
        self.inner.admin()
    }
}

fn holding_client(client: &Client, state: Arc<HoldState>) -> Client {
    Client::new(Arc::new(HoldTransport {
        inner: client.transport().clone(),
        state,
    }))
    .with_key_rules(client.key_rules().clone())
}

fn relay_config(instance: &str, lease_ms: (u64, u64, u64)) -> RelayConfig {
    RelayConfig {
        instance: Some(instance.to_owned()),
        lease: LeaseConfig {
            ttl: Duration::from_millis(lease_ms.0),
            heartbeat: Duration::from_millis(lease_ms.1),
            margin: Duration::from_millis(lease_ms.2),
        },
        poll: Duration::from_millis(20),
        retry: RetryPolicy {
            max_attempts: 20,
            initial_backoff: Duration::from_millis(50),
            max_backoff: Duration::from_secs(1),
        },
        // The trials read the published rows afterwards: keep them.
        retention_batch: 0,
        ..RelayConfig::default()
    }
}

fn relay_stats_json(s: &RelayStatsSnapshot) -> serde_json::Value {
    serde_json::json!({
        "published": s.published,
        "fenced": s.fenced,
        "abandoned": s.abandoned,
        "slots_lost": s.slots_lost,
        "retries": s.retries,
    })
}

// ------------------------------------------------------- relay processes

/// What a relay process runs.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RelayWorkerConfig {
    /// The adapter URL the relay publishes to.
    pub url: String,
    /// The outbox's PostgreSQL URL.
    pub outbox_url: String,
    /// The outbox's schema.
    pub schema: String,
    /// The relay's instance id.
    pub instance: String,
    /// Slot lease TTL, heartbeat and margin in ms.
    pub lease_ms: (u64, u64, u64),
    /// Where to hold a publish (released by `SIGUSR1`).
    pub hold: Option<HoldRule>,
}

/// If this process was spawned as an outbox relay, runs it and exits.
/// [`crate::worker::run_if_worker`] calls it first.
pub fn run_if_relay(connect: Connector) {
    run_from_env(RELAY_ENV, "relay", |cfg: RelayWorkerConfig| async move {
        relay_main(cfg, connect).await.map(|s| relay_stats_json(&s))
    });
}

async fn relay_main(cfg: RelayWorkerConfig, connect: Connector) -> Result<RelayStatsSnapshot> {
    use tokio::signal::unix::{signal, SignalKind};
    let client = connect(cfg.url.clone()).await?;
    let state = HoldState::new(cfg.hold, true);
    let client = holding_client(&client, state.clone());
    let outbox = Outbox::connect(
        &cfg.outbox_url,
        4,
        OutboxConfig {
            schema: cfg.schema.clone(),
            slots: SLOTS,
            key_rules: client.key_rules().clone(),
        },
    )
    .await?;
    let relay = outbox.relay(client, relay_config(&cfg.instance, cfg.lease_ms));
    let sig = |kind: SignalKind, name: &str| signal(kind).map_err(|e| Error::Config(format!("{name} handler: {e}")));
    let mut term = sig(SignalKind::terminate(), "SIGTERM")?;
    let mut usr1 = sig(SignalKind::user_defined1(), "SIGUSR1")?;
    tokio::spawn(async move {
        while usr1.recv().await.is_some() {
            state.release.add_permits(1);
        }
    });
    println!("KEYORDER_WORKER_READY");
    relay
        .run(async move {
            term.recv().await;
        })
        .await
}

/// A relay in this process (the in-memory transport's trials): a task that
/// drives [`keyorder_outbox::Relay::step`] unless paused.
#[derive(Debug)]
struct TaskRelay {
    pause: Arc<AtomicBool>,
    state: Arc<HoldState>,
    stop: Option<oneshot::Sender<()>>,
    join: JoinHandle<Result<RelayStatsSnapshot>>,
}

/// A relay under test: a process or a task.
#[derive(Debug)]
enum RelayUnderTest {
    Process(Box<WorkerProcess>),
    Task(TaskRelay),
}

impl RelayUnderTest {
    /// The id of the message it holds, once it holds one.
    fn held(&self) -> Option<String> {
        match self {
            RelayUnderTest::Process(p) => p.held(),
            RelayUnderTest::Task(t) => t.state.held.lock().unwrap().clone(),
        }
    }

    /// How its held publish ended once let go (`ok`, `fenced`, `error: ...`).
    fn released(&self) -> Option<String> {
        match self {
            RelayUnderTest::Process(p) => p.released(),
            RelayUnderTest::Task(t) => t.state.released.lock().unwrap().clone(),
        }
    }

    /// `kill -9` (a process) or an abort with every in-flight publish (a task).
    async fn crash(self) -> Outcome {
        match self {
            RelayUnderTest::Process(p) => (*p).kill9().await,
            RelayUnderTest::Task(t) => {
                t.join.abort();
                match t.join.await {
                    Err(e) if e.is_cancelled() => Ok(()),
                    other => Err(format!("the relay task ended before the crash: {other:?}")),
                }
            }
        }
    }

    /// `SIGSTOP` (a process) or no more driving (a task).
    fn stall(&self) -> Outcome {
        match self {
            RelayUnderTest::Process(p) => p.stop(),
            RelayUnderTest::Task(t) => {
                t.pause.store(true, Ordering::SeqCst);
                Ok(())
            }
        }
    }

    /// Lets the held publish go on and the relay run again.
    fn resume(&self) -> Outcome {
        match self {
            RelayUnderTest::Process(p) => {
                p.release()?;
                p.cont()
            }
            RelayUnderTest::Task(t) => {
                t.state.release.add_permits(1);
                t.pause.store(false, Ordering::SeqCst);
                Ok(())
            }
        }
    }

    /// Graceful stop (the relay drains); its final counters.
    async fn stop(self) -> std::result::Result<serde_json::Value, String> {
        match self {
            RelayUnderTest::Process(p) => (*p).terminate().await,
            RelayUnderTest::Task(mut t) => {
                if let Some(stop) = t.stop.take() {
                    let _ = stop.send(());
                }
                let stats = tokio::time::timeout(Duration::from_secs(60), t.join)
                    .await
                    .map_err(|_| "the relay task did not drain within 60 s".to_owned())?
                    .map_err(err)?
                    .map_err(err)?;
                Ok(relay_stats_json(&stats))
            }
        }
    }
}

// ------------------------------------------------------------ the trial

struct Trial<'a> {
    h: &'a dyn Harness,
    ns: String,
    category: String,
    schema: String,
    outbox: Outbox,
    log: Arc<MemoryEventLog>,
    applied: Arc<PgApplied>,
    guards: Vec<Arc<GuardStats>>,
}

impl<'a> Trial<'a> {
    async fn new(h: &'a dyn Harness, s: OutboxScenario) -> std::result::Result<Trial<'a>, String> {
        let tag = uuid::Uuid::new_v4().simple().to_string();
        let ns = format!("ob{}-{}", s.slug().split('_').next().unwrap_or("c"), &tag[..10]);
        let schema = format!("ko_e2e_{}", &tag[..12]);
        let client = h.client().await.map_err(err)?;
        let outbox = Outbox::connect(
            &h.event_log_url(),
            8,
            OutboxConfig {
                schema: schema.clone(),
                slots: SLOTS,
                key_rules: client.key_rules().clone(),
            },
        )
        .await
        .map_err(|e| format!("the outbox needs PostgreSQL at the event-log URL: {e}"))?;
        outbox.migrate().await.map_err(err)?;
        let applied = Arc::new(PgApplied::new(&outbox, "g"));
        Ok(Trial {
            h,
            category: format!("{ns}-orders"),
            ns,
            schema,
            outbox,
            log: Arc::new(MemoryEventLog::default()),
            applied,
            guards: Vec::new(),
        })
    }

    fn pool(&self) -> &PgPool {
        self.outbox.pool()
    }

    async fn count(&self, sql: &str) -> std::result::Result<i64, String> {
        sqlx::query_scalar(AssertSqlSafe(sql.to_owned()))
            .fetch_one(self.pool())
            .await
            .map_err(err)
    }

    /// Starts relay `id` (a process where the broker allows, else a task).
    async fn relay(&self, id: &str, hold: Option<HoldRule>) -> std::result::Result<RelayUnderTest, String> {
        if let Some(url) = self.h.worker_url() {
            let cfg = RelayWorkerConfig {
                url,
                outbox_url: self.h.event_log_url(),
                schema: self.schema.clone(),
                instance: id.to_owned(),
                lease_ms: RELAY_LEASE_MS,
                hold,
            };
            let json = serde_json::to_string(&cfg).map_err(err)?;
            return Ok(RelayUnderTest::Process(Box::new(
                WorkerProcess::spawn_with(RELAY_ENV, json, id).await?,
            )));
        }
        let state = HoldState::new(hold, false);
        let client = holding_client(&self.h.client().await.map_err(err)?, state.clone());
        let mut relay = self.outbox.relay(client, relay_config(id, RELAY_LEASE_MS));
        let pause = Arc::new(AtomicBool::new(false));
        let paused = pause.clone();
        let (stop, mut stopped) = oneshot::channel::<()>();
        let join = tokio::spawn(async move {
            loop {
                tokio::select! {
                    biased;
                    _ = &mut stopped => break,
                    () = tokio::time::sleep(Duration::from_millis(20)) => {}
                }
                if paused.load(Ordering::SeqCst) {
                    continue;
                }
                match relay.step().await {
                    Ok(()) | Err(Error::Broker(_)) => {}
                    Err(e) => return Err(e),
                }
            }
            relay.run(std::future::ready(())).await
        });
        Ok(RelayUnderTest::Task(TaskRelay {
            pause,
            state,
            stop: Some(stop),
            join,
        }))
    }

    /// The live slot owners and how many slots each holds.
    async fn owners(&self) -> std::result::Result<BTreeMap<String, Vec<u32>>, String> {
        let rows: Vec<(String, i32)> = sqlx::query_as(AssertSqlSafe(format!(
            "select owner, slot from {}.slots where owner is not null and lease_expiry > clock_timestamp()",
            self.schema
        )))
        .fetch_all(self.pool())
        .await
        .map_err(err)?;
        let mut out: BTreeMap<String, Vec<u32>> = BTreeMap::new();
        for (owner, slot) in rows {
            out.entry(owner).or_default().push(slot as u32);
        }
        Ok(out)
    }

    /// Waits until relays `ids` hold every slot, evenly; returns the slots of each.
    async fn wait_split(&self, ids: &[&str]) -> std::result::Result<BTreeMap<String, Vec<u32>>, String> {
        let share = SLOTS as usize / ids.len();
        let found = Mutex::new(BTreeMap::new());
        wait_until("the relays to split the slots evenly", self.h.deadline(), || async {
            let owners = self.owners().await.unwrap_or_default();
            let even =
                owners.len() == ids.len() && ids.iter().all(|id| owners.get(*id).is_some_and(|s| s.len() == share));
            *found.lock().unwrap() = owners;
            even
        })
        .await
        .map_err(|e| format!("{e}: owners now {:?}", found.lock().unwrap()))?;
        Ok(found.into_inner().unwrap())
    }

    /// `n` keys whose slots `slots` holds, and `n` whose slots it does not.
    fn keys_split(&self, slots: &[u32], n: usize) -> Vec<String> {
        let mine: HashSet<u32> = slots.iter().copied().collect();
        let (mut inside, mut outside) = (Vec::new(), Vec::new());
        for i in 0.. {
            let key = format!("k-{i}");
            let list = if mine.contains(&Outbox::slot_of(&key, SLOTS)) {
                &mut inside
            } else {
                &mut outside
            };
            if list.len() < n {
                list.push(key);
            }
            if inside.len() == n && outside.len() == n {
                break;
            }
        }
        inside.extend(outside);
        inside
    }

    /// Starts ordered consumer instances `c0..c{n-1}`, each behind a
    /// `SequenceGuard` over the shared `PgApplied` store.
    async fn consumers(&mut self, n: usize) -> std::result::Result<Vec<Instance>, String> {
        let mut out = Vec::new();
        for i in 0..n {
            let id = format!("c{i}");
            let client = self.h.client().await.map_err(err)?;
            let builder = client
                .subscribe(&self.category, "g")
                .ordered_by(KeySource::routing_key())
                .lease(self.h.lease())
                .concurrency(8)
                .retry(RetryPolicy {
                    max_attempts: 5,
                    initial_backoff: Duration::from_millis(20),
                    max_backoff: Duration::from_millis(500),
                });
            let guard = SequenceGuard::new(applying_handler(self.log.clone(), id.clone()), self.applied.clone());
            self.guards.push(guard.stats());
            out.push(Instance::start_with(builder, &id, guard).await.map_err(err)?);
        }
        Ok(out)
    }

    fn dropped(&self) -> u64 {
        self.guards.iter().map(|g| g.dropped()).sum()
    }

    fn outgoing(&self, key: &str, sleep_ms: u64) -> Outgoing {
        let payload = Payload {
            key: key.to_owned(),
            seq: 0,
            sleep_ms,
            poison: false,
        };
        Outgoing::new(&self.category, key, payload.encode())
    }

    /// Stages one record per key and round, a transaction per round: even
    /// rounds with `stage_many` (keys given in reverse), odd ones a record
    /// at a time.
    async fn stage(&self, keys: &[String], rounds: u64, sleep_ms: u64) -> std::result::Result<Vec<Published>, String> {
        let mut out = Vec::new();
        for round in 0..rounds {
            let mut tx = self.pool().begin().await.map_err(err)?;
            let mut staged = Vec::new();
            if round % 2 == 0 {
                let batch: Vec<Outgoing> = keys.iter().rev().map(|k| self.outgoing(k, sleep_ms)).collect();
                let keys_rev: Vec<&String> = keys.iter().rev().collect();
                let done = self.outbox.stage_many(&mut tx, batch).await.map_err(err)?;
                staged.extend(keys_rev.into_iter().cloned().zip(done));
            } else {
                for k in keys {
                    let s = self
                        .outbox
                        .stage(&mut tx, self.outgoing(k, sleep_ms))
                        .await
                        .map_err(err)?;
                    staged.push((k.clone(), s));
                }
            }
            tx.commit().await.map_err(err)?;
            out.extend(staged.into_iter().map(|(k, s)| as_published(&k, &s)));
        }
        Ok(out)
    }

    /// Waits until every id of `published` was applied.
    async fn wait_applied(&self, published: &[Published]) -> Outcome {
        let want: HashSet<&str> = published.iter().map(|p| p.id.as_str()).collect();
        let missing = std::sync::atomic::AtomicUsize::new(want.len());
        wait_until("every staged record to be applied", self.h.deadline(), || async {
            let events = self.log.events().await.unwrap_or_default();
            let done: HashSet<&str> = events.iter().filter(|e| e.ok).map(|e| e.message_id.as_str()).collect();
            let n = want.iter().filter(|id| !done.contains(**id)).count();
            missing.store(n, Ordering::Relaxed);
            n == 0
        })
        .await
        .map_err(|e| {
            format!(
                "{e} ({} of {} still missing)",
                missing.load(Ordering::Relaxed),
                want.len()
            )
        })
    }

    /// Waits until the consumers' guards dropped at least `n` stale deliveries.
    async fn wait_dropped(&self, n: u64, why: &str) -> Outcome {
        wait_until(why, self.h.deadline(), || async { self.dropped() >= n }).await
    }

    /// The checker's verdict, plus: nothing applied twice.
    async fn judge(&self, published: Vec<Published>, spread_over: Vec<String>) -> Outcome {
        let events = self.log.events().await.map_err(err)?;
        // Every delivery carried its record's sequence (the header made it
        // through the broker) and the key it was staged with.
        let staged: std::collections::HashMap<&str, &Published> =
            published.iter().map(|p| (p.id.as_str(), p)).collect();
        for e in &events {
            let want = staged.get(e.message_id.as_str()).map(|p| (p.seq, p.key.as_str()));
            ensure(want == Some((e.seq, e.key.as_str())), || {
                format!(
                    "a delivery does not match its staged record (id {}: delivered seq {}, staged {:?}): \
                     the sequence header or the key did not survive the broker",
                    e.message_id,
                    e.seq,
                    want.map(|w| w.0)
                )
            })?;
        }
        let v = check(
            &events,
            &Expectation {
                published,
                spread_over,
                ..Default::default()
            },
        );
        v.assert_ok()?;
        if v.duplicates > 0 {
            return Err(format!(
                "{} records were applied twice: the guard let a repeat through ({v})",
                v.duplicates
            ));
        }
        Ok(())
    }

    /// Records of the trial's category in `state`.
    async fn in_state(&self, state: &str) -> std::result::Result<i64, String> {
        self.count(&format!(
            "select count(*) from {}.records where category = '{}' and state = '{state}'",
            self.schema, self.category
        ))
        .await
    }

    /// Who marked message `id` (`resolved_by` is `<relay>:<generation>`).
    async fn resolved_by(&self, id: &str) -> std::result::Result<Option<String>, String> {
        sqlx::query_scalar(AssertSqlSafe(format!(
            "select resolved_by from {}.records where message_id = $1",
            self.schema
        )))
        .bind(id)
        .fetch_one(self.pool())
        .await
        .map_err(err)
    }

    async fn all_published(&self, n: usize) -> Outcome {
        let done = self.in_state("published").await?;
        if done == n as i64 {
            Ok(())
        } else {
            Err(format!("{done} of {n} records are marked published"))
        }
    }
}

fn as_published(key: &str, s: &Staged) -> Published {
    Published {
        id: s.message_id.clone(),
        key: key.to_owned(),
        seq: s.seq,
    }
}

/// The consumers' inner handler: logs start and end with the record's
/// per-key sequence (its header), sleeping as the payload asks.
fn applying_handler(
    log: Arc<dyn EventLog>,
    instance: String,
) -> impl Fn(Delivery) -> Pin<Box<dyn Future<Output = HandlerResult> + Send>> + Send + Sync + 'static {
    move |d: Delivery| {
        let (log, instance) = (log.clone(), instance.clone());
        Box::pin(async move {
            let sleep_ms = Payload::decode(d.payload()).map_or(0, |p| p.sleep_ms);
            let id = log
                .start(EventStart {
                    message_id: d.id().to_owned(),
                    key: d.key().map_or_else(String::new, |k| k.as_str().to_owned()),
                    seq: keyorder_outbox::sequence_of(d.message()).unwrap_or(0),
                    instance,
                    generation: d.fencing_token(),
                })
                .await
                .map_err(HandlerError::retry)?;
            if sleep_ms > 0 {
                tokio::time::sleep(Duration::from_millis(sleep_ms)).await;
            }
            log.end(id, true).await.map_err(HandlerError::retry)?;
            Ok(())
        })
    }
}

async fn stop_instances(instances: Vec<Instance>) -> Outcome {
    for i in instances {
        i.stop().await?;
    }
    Ok(())
}

async fn stop_relays(relays: Vec<RelayUnderTest>) -> std::result::Result<Vec<serde_json::Value>, String> {
    let mut out = Vec::new();
    for r in relays {
        out.push(r.stop().await?);
    }
    Ok(out)
}

fn ensure(cond: bool, what: impl FnOnce() -> String) -> Outcome {
    if cond {
        Ok(())
    } else {
        Err(what())
    }
}

// -------------------------------------------------------------- scenarios

/// C1: two relays, two consumers; a backlog staged before the consumers
/// start and more while they run, several keys per transaction; every key's
/// records are applied in sequence order, none lost, none twice, and every
/// record is marked published.
async fn c1(t: &mut Trial<'_>) -> Outcome {
    let relays = vec![t.relay("r1", None).await?, t.relay("r2", None).await?];
    t.wait_split(&["r1", "r2"]).await?;
    let ks = crate::instance::keys("k", 16);
    let mut published = t.stage(&ks, 6, 0).await?;
    let consumers = t.consumers(2).await?;
    published.extend(t.stage(&ks, 6, 1).await?);
    t.wait_applied(&published).await?;
    stop_instances(consumers).await?;
    stop_relays(relays).await?;
    t.all_published(published.len()).await?;
    t.judge(published, Vec::new()).await
}

/// C2: both relays publish (each holds half the slots and half the keys),
/// both consumers apply, and no key is ever in two handlers at once.
async fn c2(t: &mut Trial<'_>) -> Outcome {
    let relays = vec![t.relay("r1", None).await?, t.relay("r2", None).await?];
    let split = t.wait_split(&["r1", "r2"]).await?;
    let ks = t.keys_split(&split["r1"], 8);
    let consumers = t.consumers(2).await?;
    let published = t.stage(&ks, 10, 2).await?;
    t.wait_applied(&published).await?;
    stop_instances(consumers).await?;
    stop_relays(relays).await?;
    t.all_published(published.len()).await?;
    for r in ["r1", "r2"] {
        let n = t
            .count(&format!(
                "select count(*) from {}.records where resolved_by like '{r}:%'",
                t.schema
            ))
            .await?;
        ensure(n > 0, || format!("relay {r} published nothing"))?;
    }
    let spread = if t.h.spreads() {
        vec!["c0".to_owned(), "c1".to_owned()]
    } else {
        Vec::new()
    };
    t.judge(published, spread).await
}

/// C6 and C7's start: relays r1 (holding its first publish of a record
/// with sequence 4 or more, before or after the broker confirmed it) and r2
/// split the slots; two consumers; 6 keys of r1's slots and 6 of r2's, 8
/// records each; returns once r1 holds.
struct Held {
    r1: RelayUnderTest,
    r2: RelayUnderTest,
    consumers: Vec<Instance>,
    published: Vec<Published>,
    /// The id of the record r1 holds.
    held: String,
}

async fn held_by_r1(t: &mut Trial<'_>, after_publish: bool) -> std::result::Result<Held, String> {
    let hold = HoldRule {
        from_seq: 4,
        after_publish,
    };
    let r1 = t.relay("r1", Some(hold)).await?;
    let r2 = t.relay("r2", None).await?;
    let split = t.wait_split(&["r1", "r2"]).await?;
    let ks = t.keys_split(&split["r1"], 6);
    let consumers = t.consumers(2).await?;
    let published = t.stage(&ks, 8, 0).await?;
    wait_until("r1 to hold a publish", t.h.deadline(), || async { r1.held().is_some() }).await?;
    let held = r1.held().unwrap_or_default();
    Ok(Held {
        r1,
        r2,
        consumers,
        published,
        held,
    })
}

/// C6: relay r1 is held right after the broker confirmed one of its
/// records (published, not yet marked) and is killed there (`kill -9`).
/// r2 takes r1's slots once the lease ends and publishes the rest, the
/// held record again; the consumers drop that repeat. Nothing lost, order
/// kept, nothing applied twice.
async fn c6(t: &mut Trial<'_>) -> Outcome {
    let Held {
        r1,
        r2,
        consumers,
        published,
        held,
    } = held_by_r1(t, true).await?;
    r1.crash().await?;
    t.wait_applied(&published).await?;
    t.wait_dropped(1, "the consumers to drop the republished copy of the held record")
        .await?;
    stop_instances(consumers).await?;
    stop_relays(vec![r2]).await?;
    let by = t.resolved_by(&held).await?.unwrap_or_default();
    ensure(by.starts_with("r2:"), || {
        format!("the held record was marked by {by:?}, not by r2 after the takeover")
    })?;
    t.all_published(published.len()).await?;
    t.judge(published, Vec::new()).await
}

/// C7: relay r1 is held inside a publish (the record not yet at the
/// broker) and stopped (`SIGSTOP`) past its lease. r2 takes over and
/// publishes the key, the held record included; the consumers apply all of
/// it. r1 continues (`SIGCONT`) and its late publish goes out: a broker
/// that fences publishes (memory, Redis, PostgreSQL) refuses it, because r2
/// published for the slot at a higher generation; elsewhere (RabbitMQ,
/// Kafka) it reaches the broker and the consumers drop it (its sequence is
/// not above the last applied). Either way the relay's fence refuses r1's
/// late confirmation. No stale record is applied; nothing lost or applied
/// twice.
async fn c7(t: &mut Trial<'_>) -> Outcome {
    let Held {
        r1,
        r2,
        consumers,
        published,
        held,
    } = held_by_r1(t, false).await?;
    r1.stall()?;
    let key = published
        .iter()
        .find(|p| p.id == held)
        .map(|p| p.key.clone())
        .ok_or_else(|| format!("r1 held {held}, which the trial never staged"))?;
    let of_key: Vec<Published> = published.iter().filter(|p| p.key == key).cloned().collect();
    t.wait_applied(&of_key).await?;
    let dropped_before = t.dropped();
    let fences =
        t.h.client()
            .await
            .map_err(err)?
            .publisher(&t.category)
            .await
            .map_err(err)?
            .fences_publishes();
    r1.resume()?;
    wait_until("r1's held publish to return after SIGCONT", t.h.deadline(), || async {
        r1.released().is_some()
    })
    .await?;
    let late = r1.released().unwrap_or_default();
    if fences {
        // The broker refuses it: r2 published for the slot at a higher generation.
        ensure(late == "fenced", || {
            format!("the broker fences publishes, yet r1's late publish ended with `{late}`")
        })?;
    } else {
        ensure(late == "ok", || format!("r1's late publish ended with `{late}`"))?;
        t.wait_dropped(
            dropped_before + 1,
            "the consumers to drop r1's late publish after SIGCONT",
        )
        .await?;
    }
    t.wait_applied(&published).await?;
    let stats = stop_relays(vec![r1, r2]).await?;
    stop_instances(consumers).await?;
    ensure(stats[0]["fenced"].as_u64().unwrap_or(0) >= 1, || {
        format!("r1's late confirmation was not refused by the fence: {}", stats[0])
    })?;
    let by = t.resolved_by(&held).await?.unwrap_or_default();
    ensure(by.starts_with("r2:"), || {
        format!("the held record was marked by {by:?}, not by r2")
    })?;
    t.all_published(published.len()).await?;
    t.judge(published, Vec::new()).await
}

/// C12: an empty or over-long key fails the staging call with a key error
/// that does not echo it, and nothing is stored (one bad key among good
/// ones in `stage_many` stores none of them). Records with such keys
/// written around the API are abandoned by a relay at once, never
/// published, while every other key, those wave 1 refused (`a:b`, control
/// characters, NUL, `dlq`, ...) included, flows end to end under its own key.
async fn c12(t: &mut Trial<'_>) -> Outcome {
    let long = "x".repeat(256);
    let unsafe_keys = ["", long.as_str()];
    for key in unsafe_keys {
        let mut tx = t.pool().begin().await.map_err(err)?;
        let res = t.outbox.stage(&mut tx, t.outgoing(key, 0)).await;
        tx.commit().await.map_err(err)?;
        match res {
            Err(Error::Key(e)) => ensure(key.len() < 16 || !e.to_string().contains(key), || {
                "the key error shows the whole key".into()
            })?,
            other => return Err(format!("staging an unsafe key ({} bytes) gave {other:?}", key.len())),
        }
    }
    let mut tx = t.pool().begin().await.map_err(err)?;
    let res = t
        .outbox
        .stage_many(&mut tx, vec![t.outgoing("good", 0), t.outgoing(&long, 0)])
        .await;
    tx.commit().await.map_err(err)?;
    ensure(matches!(res, Err(Error::Key(_))), || {
        format!("stage_many with one unsafe key gave {res:?}")
    })?;
    let stored = t.count(&format!("select count(*) from {}.records", t.schema)).await?;
    ensure(stored == 0, || {
        format!("{stored} records were stored by failed staging calls")
    })?;

    // Around the API: raw inserts with unsafe keys.
    for (id, key) in [("bad-empty", ""), ("bad-long", long.as_str())] {
        sqlx::query(AssertSqlSafe(format!(
            "insert into {}.records (message_id, category, key, slot, seq, payload) values ($1, $2, $3, $4, 1, 'x')",
            t.schema
        )))
        .bind(format!("{}-{id}", t.ns))
        .bind(&t.category)
        .bind(key)
        .bind(Outbox::slot_of(key, SLOTS) as i32)
        .execute(t.pool())
        .await
        .map_err(err)?;
    }
    let relays = vec![t.relay("r1", None).await?, t.relay("r2", None).await?];
    let consumers = t.consumers(2).await?;
    let mut carried = crate::instance::keys("k", 6);
    carried.extend(crate::scenarios::C12_CARRIED_KEYS.iter().map(|k| (*k).to_owned()));
    let published = t.stage(&carried, 3, 0).await?;
    t.wait_applied(&published).await?;
    wait_until("both unsafe records to be abandoned", t.h.deadline(), || async {
        t.in_state("abandoned").await.unwrap_or(0) == 2
    })
    .await?;
    stop_instances(consumers).await?;
    stop_relays(relays).await?;
    let attempted = t
        .count(&format!(
            "select coalesce(sum(attempts), 0) from {}.records where state = 'abandoned'",
            t.schema
        ))
        .await?;
    ensure(attempted == 0, || {
        format!("unsafe records were attempted {attempted} times before being abandoned")
    })?;
    let reasons = t
        .count(&format!(
            "select count(*) from {}.records where state = 'abandoned' and reason like '%invalid ordering key%'",
            t.schema
        ))
        .await?;
    ensure(reasons == 2, || {
        "an abandoned record does not name the invalid key as its reason".into()
    })?;
    let events = t.log.events().await.map_err(err)?;
    ensure(events.iter().all(|e| !e.message_id.contains("-bad-")), || {
        "a record with an unsafe key reached a handler".into()
    })?;
    // Each record ran under the key it was staged with.
    let sent: std::collections::HashMap<&str, &str> =
        published.iter().map(|p| (p.id.as_str(), p.key.as_str())).collect();
    if let Some(e) = events
        .iter()
        .find(|e| sent.get(e.message_id.as_str()).is_some_and(|k| *k != e.key))
    {
        return Err(format!(
            "a record ran under key {}, not the key it was staged with",
            keyorder_core::key::redact(&e.key)
        ));
    }
    t.all_published(published.len()).await?;
    t.judge(published, Vec::new()).await
}

/// C15: four stagers write shared keys at once (each transaction two keys,
/// `stage_many`), so same-key stagers serialise on the key's counter row;
/// and one transaction takes its transaction id first, stays open while
/// the others stage and commit, then stages a key and commits last: its
/// record has the key's highest sequence under the lowest transaction id.
/// Every key is applied in sequence order (its commit order), the late
/// record after the earlier ones, nothing lost.
async fn c15(t: &mut Trial<'_>) -> Outcome {
    let relays = vec![t.relay("r1", None).await?, t.relay("r2", None).await?];
    let consumers = t.consumers(2).await?;
    let ks = crate::instance::keys("k", 6);
    let mut late = t.pool().begin().await.map_err(err)?;
    sqlx::query("select pg_current_xact_id()")
        .execute(&mut *late)
        .await
        .map_err(err)?;
    let t_ref: &Trial<'_> = t;
    let stagers = (0..4).map(|w| {
        let ks = ks.clone();
        async move {
            let mut out = Vec::new();
            for i in 0..15usize {
                let pair: BTreeSet<&String> = [&ks[(w + i) % ks.len()], &ks[(w * 2 + i * 5 + 1) % ks.len()]]
                    .into_iter()
                    .collect();
                let mut tx = t_ref.pool().begin().await.map_err(err)?;
                let batch: Vec<Outgoing> = pair.iter().map(|k| t_ref.outgoing(k, 0)).collect();
                let done = t_ref.outbox.stage_many(&mut tx, batch).await.map_err(err)?;
                tx.commit().await.map_err(err)?;
                out.extend(pair.iter().zip(done).map(|(k, s)| as_published(k, &s)));
            }
            Ok::<_, String>(out)
        }
    });
    let mut published = Vec::new();
    for part in futures::future::join_all(stagers).await {
        published.extend(part?);
    }
    let staged = t.outbox.stage(&mut late, t.outgoing(&ks[0], 0)).await.map_err(err)?;
    let max_before = published
        .iter()
        .filter(|p| p.key == ks[0])
        .map(|p| p.seq)
        .max()
        .unwrap_or(0);
    ensure(staged.seq > max_before, || {
        format!(
            "the late transaction's record has seq {} though {max_before} were committed before it",
            staged.seq
        )
    })?;
    late.commit().await.map_err(err)?;
    published.push(as_published(&ks[0], &staged));
    // The late record has the lowest transaction id of the trial.
    let lowest: String = sqlx::query_scalar(AssertSqlSafe(format!(
        "select message_id from {}.records where category = $1 order by txid, id limit 1",
        t.schema
    )))
    .bind(&t.category)
    .fetch_one(t.pool())
    .await
    .map_err(err)?;
    ensure(lowest == staged.message_id, || {
        "the late transaction's record does not hold the lowest transaction id".into()
    })?;
    t.wait_applied(&published).await?;
    stop_instances(consumers).await?;
    stop_relays(relays).await?;
    t.all_published(published.len()).await?;
    t.judge(published, Vec::new()).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slugs_are_distinct_and_numbered() {
        let slugs: HashSet<&str> = OutboxScenario::ALL.iter().map(|s| s.slug()).collect();
        assert_eq!(slugs.len(), OutboxScenario::ALL.len());
        assert!(slugs.iter().all(|s| s.starts_with('c')));
    }

    #[test]
    fn a_relay_config_round_trips() {
        let cfg = RelayWorkerConfig {
            url: "redis://127.0.0.1:6379".into(),
            outbox_url: "postgres://x".into(),
            schema: "s".into(),
            instance: "r1".into(),
            lease_ms: RELAY_LEASE_MS,
            hold: Some(HoldRule {
                from_seq: 4,
                after_publish: true,
            }),
        };
        let back: RelayWorkerConfig = serde_json::from_str(&serde_json::to_string(&cfg).unwrap()).unwrap();
        assert_eq!(back.hold.map(|h| h.from_seq), Some(4));
    }
}
