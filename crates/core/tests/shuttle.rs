//! The keyed dispatcher under the shuttle schedule explorer: many random
//! interleavings of submitters, workers, handlers, an operator, a shutdown
//! and a lost lease, checked against what actually happened (an event log).
//!
//! Only in builds with `RUSTFLAGS='--cfg keyorder_shuttle'`; see SHUTTLE.md
//! beside this file for the properties, the bounds and the commands.
#![cfg(keyorder_shuttle)]

use std::collections::HashMap;
// The test's own bookkeeping uses std locks on purpose: they are never held
// across an await, and they add no scheduling points of their own, so a log
// entry is written atomically with the step it records.
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use keyorder_core::{
    Delivery, DispatchConfig, Dispatcher, Error, GlobalBackoff, HandlerError, HandlerResult, Inbound, Job, LeaseConfig,
    Message, OrderingKey, PoisonPolicy, RetryPolicy, ScopeLease, Settle, Stats, Submit, Widening,
};
use shuttle::future::{block_on, spawn, yield_now};
use shuttle::rand::Rng;
use tokio::time::Instant;

/// Random schedules per test: the CI bound (see SHUTTLE.md).
fn iterations() -> usize {
    std::env::var("KEYORDER_SHUTTLE_ITERATIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000)
}

/// Runs `body` under `iterations()` random schedules.
fn explore<F, Fut>(body: F)
where
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    shuttle::check_random(move || block_on(body()), iterations());
}

/// A job id: `{key}.{lane}.{seq}.{generation}`; `key` `-` is keyless.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct Id {
    key: String,
    lane: u32,
    seq: u32,
    gen: u64,
}

impl Id {
    fn new(key: &str, lane: u32, seq: u32, gen: u64) -> Self {
        Id {
            key: key.to_owned(),
            lane,
            seq,
            gen,
        }
    }
    fn text(&self) -> String {
        format!("{}.{}.{}.{}", self.key, self.lane, self.seq, self.gen)
    }
    fn parse(s: &str) -> Self {
        let p: Vec<&str> = s.split('.').collect();
        Id::new(
            p[0],
            p[1].parse().unwrap(),
            p[2].parse().unwrap(),
            p[3].parse().unwrap(),
        )
    }
    fn keyed(&self) -> bool {
        self.key != "-"
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Ev {
    /// The broker counted an attempt (the durable increment before a start).
    Attempt(Id, u32),
    /// A handler started.
    Start(Id, u32),
    /// A settlement reached the broker: `ack`, `park`, `halt`, or `fenced`.
    Settled(Id, &'static str),
    /// A test milestone.
    Mark(&'static str),
}

/// What the handler does for a job on an attempt.
#[derive(Debug, Clone, Copy)]
enum Fail {
    /// Fails retryably on attempts up to and including `n`.
    Retry(u32),
    /// Fails as poison on attempts up to and including `n`.
    Poison(u32),
}

/// The shared record of one execution.
#[derive(Default)]
struct World {
    log: Mutex<Vec<Ev>>,
    violations: Mutex<Vec<String>>,
    /// Handlers of a key between their start and their settlement.
    in_flight: Mutex<HashMap<String, usize>>,
    /// The broker's durable attempt counts.
    attempts: Mutex<HashMap<Id, u32>>,
    fail: Mutex<HashMap<Id, Fail>>,
    /// Set once the dispatcher exists, so handlers can check its bounds.
    dispatcher: Mutex<Option<Dispatcher>>,
    budget: usize,
    depth: usize,
}

impl World {
    fn new(cfg: &DispatchConfig) -> Arc<Self> {
        Arc::new(World {
            budget: cfg.budget,
            depth: cfg.per_key_depth,
            ..World::default()
        })
    }

    fn push(&self, ev: Ev) {
        self.log.lock().unwrap().push(ev);
    }

    fn log(&self) -> Vec<Ev> {
        self.log.lock().unwrap().clone()
    }

    /// Records a broken property. Handlers and settlements record instead of
    /// panicking: the dispatcher catches a handler's panic (it is poison).
    fn violated(&self, what: String) {
        self.violations.lock().unwrap().push(what);
    }

    /// Fails the run on the first broken property recorded.
    fn check(&self) {
        let first = self.violations.lock().unwrap().first().cloned();
        if let Some(what) = first {
            panic!("violated: {what}");
        }
    }

    fn mark(&self, what: &'static str) {
        self.push(Ev::Mark(what));
    }

    /// A handler starts: never while another of its key is in flight.
    fn start(&self, id: &Id, attempt: u32) {
        if id.keyed() {
            let before = {
                let mut f = self.in_flight.lock().unwrap();
                let n = f.entry(id.key.clone()).or_default();
                *n += 1;
                *n - 1
            };
            if before != 0 {
                self.violated(format!(
                    "two messages of key {} in flight at once (starting {id:?})",
                    id.key
                ));
            }
        }
        self.push(Ev::Start(id.clone(), attempt));
        self.check_bounds();
    }

    /// The job's run is over (settled, or failed retryably).
    fn end(&self, id: &Id) {
        if id.keyed() {
            *self.in_flight.lock().unwrap().get_mut(&id.key).unwrap() -= 1;
        }
    }

    /// Held messages never exceed the budget, nor a key's its depth.
    fn check_bounds(&self) {
        let Some(d) = self.dispatcher.lock().unwrap().clone() else {
            return;
        };
        let held = d.held();
        if held > self.budget {
            self.violated(format!("{held} held, over the budget {}", self.budget));
        }
        if let Some(hot) = d.hot_keys(1).first() {
            if hot.backlog as usize > self.depth {
                self.violated(format!("a key holds {}, over its depth {}", hot.backlog, self.depth));
            }
        }
    }

    fn starts(&self) -> Vec<(Id, u32)> {
        self.log()
            .into_iter()
            .filter_map(|e| match e {
                Ev::Start(id, a) => Some((id, a)),
                _ => None,
            })
            .collect()
    }

    fn settled(&self, what: &str) -> Vec<Id> {
        self.log()
            .into_iter()
            .filter_map(|e| match e {
                Ev::Settled(id, w) if w == what => Some(id),
                _ => None,
            })
            .collect()
    }

    fn index(&self, ev: &Ev) -> Option<usize> {
        self.log().iter().position(|e| e == ev)
    }

    /// Detaches the dispatcher (it holds the handler, which holds the world).
    fn finish(&self) {
        self.dispatcher.lock().unwrap().take();
        self.check();
    }
}

/// A broker settlement fenced by the job's own lease.
#[derive(Debug)]
struct FakeSettle {
    id: Id,
    lease: Arc<ScopeLease>,
    world: Arc<World>,
}

impl std::fmt::Debug for World {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("World")
    }
}

impl FakeSettle {
    fn fenced(&self) -> Error {
        Error::Fenced {
            scope: self.lease.scope().to_string(),
            generation: self.lease.generation(),
        }
    }

    fn settle(&self, what: &'static str) -> keyorder_core::Result<()> {
        let lost = self.lease.is_lost();
        self.world.end(&self.id);
        if lost {
            self.world.push(Ev::Settled(self.id.clone(), "fenced"));
            return Err(self.fenced());
        }
        self.world.push(Ev::Settled(self.id.clone(), what));
        Ok(())
    }
}

#[async_trait]
impl Settle for FakeSettle {
    async fn begin_attempt(&self) -> keyorder_core::Result<u32> {
        if self.lease.is_lost() {
            return Err(self.fenced());
        }
        let n = {
            let mut a = self.world.attempts.lock().unwrap();
            let n = a.entry(self.id.clone()).or_default();
            *n += 1;
            *n
        };
        self.world.push(Ev::Attempt(self.id.clone(), n));
        Ok(n)
    }
    async fn ack(&self) -> keyorder_core::Result<()> {
        self.settle("ack")
    }
    async fn park(&self, _: &str) -> keyorder_core::Result<()> {
        self.settle("park")
    }
    async fn halt(&self, _: &str) -> keyorder_core::Result<()> {
        self.settle("halt")
    }
}

/// The handler: records its start, yields a random number of times (so
/// handlers of different keys overlap in every way), checks the bounds, and
/// fails where the test said.
fn handler(world: Arc<World>) -> impl keyorder_core::Handler {
    move |d: Delivery| {
        let world = world.clone();
        async move {
            let id = Id::parse(d.id());
            assert!(d.attempt() >= 1);
            world.start(&id, d.attempt());
            let yields = shuttle::rand::thread_rng().gen_range(0..3);
            for _ in 0..yields {
                yield_now().await;
            }
            world.check_bounds();
            let fail = world.fail.lock().unwrap().get(&id).copied();
            match fail {
                Some(Fail::Retry(n)) if d.attempt() <= n => {
                    world.end(&id);
                    Err(HandlerError::retry("dependency down"))
                }
                Some(Fail::Poison(n)) if d.attempt() <= n => Err(HandlerError::poison("bad message")),
                _ => HandlerResult::Ok(()),
            }
        }
    }
}

fn lease(scope: &str, gen: u64) -> Arc<ScopeLease> {
    ScopeLease::new(scope, gen, &LeaseConfig::default(), Instant::now())
}

fn job(world: &Arc<World>, lease: &Arc<ScopeLease>, id: &Id) -> Job {
    let key = id.keyed().then(|| OrderingKey::new(id.key.as_str()).unwrap());
    let mut message = Message::new(id.text()).with_id(id.text());
    if let Some(k) = &key {
        message = message.with_ordering_key(k.clone());
    }
    Job::new(
        Inbound {
            message,
            lease: lease.clone(),
            settle: Box::new(FakeSettle {
                id: id.clone(),
                lease: lease.clone(),
                world: world.clone(),
            }),
        },
        key,
    )
}

fn cfg(concurrency: usize, per_key_depth: usize, budget: usize, poison: PoisonPolicy) -> DispatchConfig {
    DispatchConfig {
        concurrency,
        per_key_depth,
        budget,
        retry: RetryPolicy {
            max_attempts: 3,
            initial_backoff: Duration::ZERO,
            max_backoff: Duration::ZERO,
        },
        poison,
        global_backoff: GlobalBackoff {
            distinct_keys: 0,
            ..GlobalBackoff::default()
        },
    }
}

fn dispatcher(world: &Arc<World>, cfg: DispatchConfig) -> Dispatcher {
    let d = Dispatcher::new(cfg, Arc::new(handler(world.clone())), Arc::new(Stats::default()));
    *world.dispatcher.lock().unwrap() = Some(d.clone());
    d
}

/// One submitter (a source reading one stream): submits its jobs in order;
/// a job handed back is offered again once room appeared, as a source does
/// after pausing its scope. Returns the ids taken, in order; stops at
/// shutdown.
fn lane(
    d: &Dispatcher,
    world: &Arc<World>,
    lease: &Arc<ScopeLease>,
    ids: Vec<Id>,
) -> shuttle::future::JoinHandle<Vec<Id>> {
    let (d, world, lease) = (d.clone(), world.clone(), lease.clone());
    spawn(async move {
        let mut taken = Vec::new();
        'jobs: for id in ids {
            let mut next = job(&world, &lease, &id);
            loop {
                let epoch = d.room_epoch();
                match d.submit(next) {
                    Submit::Accepted => {
                        world.check_bounds();
                        taken.push(id);
                        break;
                    }
                    Submit::Full(_, Widening::Stopping) => break 'jobs,
                    Submit::Full(back, _) => {
                        world.check();
                        next = back;
                        d.wait_room_since(epoch, Duration::from_millis(10)).await;
                    }
                }
            }
        }
        taken
    })
}

/// Waits (yielding to the others) until `cond`; shuttle's step bound turns a
/// livelock into a failure.
async fn until(world: &World, cond: impl Fn() -> bool) {
    while !cond() {
        world.check();
        yield_now().await;
    }
    world.check();
}

fn ids(key: &str, lane: u32, seqs: std::ops::Range<u32>, gen: u64) -> Vec<Id> {
    seqs.map(|s| Id::new(key, lane, s, gen)).collect()
}

/// Per-key FIFO: each lane's jobs of a key started in the order it
/// submitted them (a re-run repeats the job right after itself), and
/// exactly the `taken` ones started when `complete`.
fn assert_fifo(world: &World, taken: &[Id], complete: bool) {
    let starts = world.starts();
    let mut by_lane_key: HashMap<(u32, String), Vec<Id>> = HashMap::new();
    for (id, _) in &starts {
        let runs = by_lane_key.entry((id.lane, id.key.clone())).or_default();
        if runs.last() != Some(id) {
            runs.push(id.clone());
        }
    }
    let mut expected: HashMap<(u32, String), Vec<Id>> = HashMap::new();
    for id in taken {
        expected.entry((id.lane, id.key.clone())).or_default().push(id.clone());
    }
    for (lk, runs) in &by_lane_key {
        let want = expected.get(lk).cloned().unwrap_or_default();
        if lk.1 == "-" {
            continue;
        }
        if complete {
            assert_eq!(
                runs, &want,
                "violated: lane {} key {}: starts out of order or missing",
                lk.0, lk.1
            );
        } else {
            assert!(
                want.starts_with(runs),
                "violated: lane {} key {}: starts {runs:?} not a prefix of the submission order {want:?}",
                lk.0,
                lk.1
            );
        }
    }
    // Every start was preceded by its own durable attempt.
    let log = world.log();
    for (i, e) in log.iter().enumerate() {
        if let Ev::Start(id, a) = e {
            assert!(
                log[..i].contains(&Ev::Attempt(id.clone(), *a)),
                "violated: {id:?} started attempt {a} without counting it at the broker"
            );
        }
    }
}

// ---------------------------------------------------------------------------

/// Three submitters, two of them on the same key at once, two keys and a
/// keyless message, concurrency 2, depth 2, budget 3, one retried failure:
/// per-key FIFO, one message per key in flight, bounds held, everything
/// applied exactly once, nothing left behind.
async fn fifo_body() {
    let c = cfg(2, 2, 3, PoisonPolicy::Halt);
    let world = World::new(&c);
    let d = dispatcher(&world, c);
    let l = lease("s0", 1);
    world.fail.lock().unwrap().insert(Id::new("a", 1, 0, 1), Fail::Retry(1));
    let lanes = vec![
        lane(
            &d,
            &world,
            &l,
            vec![Id::new("a", 0, 0, 1), Id::new("b", 0, 1, 1), Id::new("a", 0, 2, 1)],
        ),
        lane(
            &d,
            &world,
            &l,
            vec![Id::new("a", 1, 0, 1), Id::new("a", 1, 1, 1), Id::new("b", 1, 2, 1)],
        ),
        lane(
            &d,
            &world,
            &l,
            vec![Id::new("b", 2, 0, 1), Id::new("-", 2, 1, 1), Id::new("b", 2, 2, 1)],
        ),
    ];
    let mut taken = Vec::new();
    for h in lanes {
        taken.extend(h.await.unwrap());
    }
    assert_eq!(taken.len(), 9, "violated: a submitter gave up although room came back");
    until(&world, || world.settled("ack").len() == taken.len() && d.held() == 0).await;
    assert_fifo(&world, &taken, true);
    let mut acked = world.settled("ack");
    acked.sort();
    let mut want = taken.clone();
    want.sort();
    assert_eq!(acked, want, "violated: each message applied exactly once");
    assert!(d.hot_keys(10).is_empty(), "violated: key state outlived its messages");
    world.finish();
}

#[test]
fn per_key_fifo_one_in_flight_and_bounded_buffers() {
    explore(fifo_body);
}

/// Resets the planted bug when a test ends, panicking or not.
struct Planted;

impl Planted {
    fn on() -> Self {
        keyorder_core::plant_bug(true);
        Planted
    }
}

impl Drop for Planted {
    fn drop(&mut self) {
        keyorder_core::plant_bug(false);
    }
}

/// The planted bug (`Dispatcher::submit` deciding to schedule a key in one
/// critical section and queueing it in another) is caught by the FIFO test.
#[test]
#[should_panic(expected = "violated:")]
fn the_planted_check_then_act_bug_is_caught() {
    let _planted = Planted::on();
    explore(fifo_body);
}

/// Halt: the poison head stays, the key stops (its later messages wait),
/// other keys flow; the operator's release either runs the head again
/// (`resume`) or drops it (`skip`), and the key continues in order.
async fn halt_body(skip: bool) {
    let c = cfg(2, 3, 6, PoisonPolicy::Halt);
    let world = World::new(&c);
    let d = dispatcher(&world, c);
    let l = lease("s0", 1);
    let head = Id::new("a", 0, 1, 1);
    world.fail.lock().unwrap().insert(head.clone(), Fail::Poison(1));
    let a = lane(&d, &world, &l, ids("a", 0, 0..4, 1));
    let b = lane(&d, &world, &l, ids("b", 1, 0..3, 1));
    let operator = {
        let (d, world, head) = (d.clone(), world.clone(), head.clone());
        spawn(async move {
            until(&world, || d.stats().snapshot().halted_now == 1).await;
            // A halted key holds only itself: the other key finishes.
            until(&world, || {
                world.settled("ack").iter().filter(|i| i.key == "b").count() == 3
            })
            .await;
            assert!(world.index(&Ev::Settled(head.clone(), "halt")).is_some());
            let later = world
                .starts()
                .into_iter()
                .filter(|(i, _)| i.key == "a" && i.seq > 1)
                .count();
            assert_eq!(later, 0, "violated: a message behind the halted head started");
            world.mark("release");
            assert!(
                d.release("a", skip),
                "violated: the release of a key whose halt was recorded was lost"
            );
        })
    };
    let mut taken = a.await.unwrap();
    taken.extend(b.await.unwrap());
    operator.await.unwrap();
    let done = if skip { taken.len() - 1 } else { taken.len() };
    until(&world, || world.settled("ack").len() == done && d.held() == 0).await;
    let a_starts: Vec<(u32, u32)> = world
        .starts()
        .into_iter()
        .filter(|(i, _)| i.key == "a")
        .map(|(i, n)| (i.seq, n))
        .collect();
    if skip {
        assert_eq!(a_starts, vec![(0, 1), (1, 1), (2, 1), (3, 1)]);
    } else {
        assert_eq!(a_starts, vec![(0, 1), (1, 1), (1, 2), (2, 1), (3, 1)]);
    }
    let release = world.index(&Ev::Mark("release")).unwrap();
    let next = world.index(&Ev::Start(Id::new("a", 0, 2, 1), 1)).unwrap();
    assert!(
        release < next,
        "violated: the key moved on before the operator released it"
    );
    assert_eq!(d.stats().snapshot().halted_now, 0);
    assert!(d.hot_keys(10).is_empty());
    world.finish();
}

#[test]
fn halt_holds_only_its_key_and_resume_runs_the_head_again() {
    explore(|| halt_body(false));
}

#[test]
fn halt_holds_only_its_key_and_skip_drops_the_head() {
    explore(|| halt_body(true));
}

/// Park: the poison head is dead-lettered and only then is the key
/// released; two submitters of the key keep their own order.
async fn park_body() {
    let c = cfg(2, 2, 4, PoisonPolicy::Park { max_attempts: 1 });
    let world = World::new(&c);
    let d = dispatcher(&world, c);
    let l = lease("s0", 1);
    let head = Id::new("a", 0, 1, 1);
    world.fail.lock().unwrap().insert(head.clone(), Fail::Poison(u32::MAX));
    let x = lane(&d, &world, &l, ids("a", 0, 0..3, 1));
    let y = lane(&d, &world, &l, ids("a", 1, 0..2, 1));
    let mut taken = x.await.unwrap();
    taken.extend(y.await.unwrap());
    until(&world, || {
        world.settled("ack").len() + world.settled("park").len() == taken.len() && d.held() == 0
    })
    .await;
    assert_fifo(&world, &taken, true);
    assert_eq!(world.settled("park"), vec![head.clone()]);
    let parked = world.index(&Ev::Settled(head, "park")).unwrap();
    let next = world.index(&Ev::Start(Id::new("a", 0, 2, 1), 1)).unwrap();
    assert!(
        parked < next,
        "violated: the key was released before the park was confirmed"
    );
    assert_eq!(d.stats().snapshot().parked, 1);
    world.finish();
}

#[test]
fn park_releases_the_key_only_after_the_dead_letter() {
    explore(park_body);
}

/// Shutdown at a random point: nothing starts after `drain` returned, every
/// handler that started finished and was acknowledged, waiting messages are
/// dropped for redelivery, and nothing is held afterwards.
async fn drain_body() {
    let c = cfg(2, 2, 4, PoisonPolicy::Halt);
    let world = World::new(&c);
    let d = dispatcher(&world, c);
    let l = lease("s0", 1);
    let lanes = vec![
        lane(&d, &world, &l, ids("a", 0, 0..3, 1)),
        lane(&d, &world, &l, ids("b", 1, 0..3, 1)),
        lane(&d, &world, &l, ids("a", 2, 0..2, 1)),
    ];
    let drainer = {
        let (d, world) = (d.clone(), world.clone());
        spawn(async move {
            let wait = shuttle::rand::thread_rng().gen_range(0..12);
            for _ in 0..wait {
                yield_now().await;
            }
            world.mark("drain");
            let dropped = d.drain().await;
            world.mark("drained");
            dropped
        })
    };
    let mut taken = Vec::new();
    for h in lanes {
        taken.extend(h.await.unwrap());
    }
    let dropped = drainer.await.unwrap();
    let drained = world.index(&Ev::Mark("drained")).unwrap();
    let log = world.log();
    for (i, e) in log.iter().enumerate() {
        if let Ev::Start(id, _) = e {
            assert!(i < drained, "violated: {id:?} started after the drain returned");
            let acked = log[..drained].contains(&Ev::Settled(id.clone(), "ack"));
            assert!(acked, "violated: {id:?} was running at shutdown and not acknowledged");
        }
    }
    let acked = world.settled("ack").len();
    assert!(
        acked + dropped <= taken.len(),
        "violated: {acked} acked + {dropped} dropped of {}",
        taken.len()
    );
    assert_eq!(d.held(), 0, "violated: messages held after the drain");
    assert!(d.is_draining());
    let late = job(&world, &l, &Id::new("c", 9, 0, 1));
    assert!(matches!(d.submit(late), Submit::Full(_, Widening::Stopping)));
    assert_fifo(&world, &taken, false);
    world.finish();
}

#[test]
fn drain_finishes_and_acks_running_handlers_and_starts_nothing_new() {
    explore(drain_body);
}

/// A lost scope: the old generation's buffered messages are discarded and
/// never started, the new generation of the same scope (queued behind them
/// on the same key) and another scope run in order, and every message of
/// the lost generation is accounted for: applied before the loss, fenced,
/// or discarded.
async fn lost_body() {
    let c = cfg(2, 4, 8, PoisonPolicy::Halt);
    let world = World::new(&c);
    let d = dispatcher(&world, c);
    let old = lease("s0", 1);
    let other = lease("s1", 1);
    let new = lease("s0", 2);
    let a_old = lane(&d, &world, &old, ids("a", 0, 0..3, 1));
    let c_other = lane(&d, &world, &other, ids("c", 1, 0..3, 1));
    let failover = {
        let (d, world, old, new) = (d.clone(), world.clone(), old.clone(), new.clone());
        spawn(async move {
            let wait = shuttle::rand::thread_rng().gen_range(0..8);
            for _ in 0..wait {
                yield_now().await;
            }
            old.lose();
            world.mark("lost");
            d.discard_lost();
            // The scope was re-acquired: the new owner's reads follow.
            let taken = lane(&d, &world, &new, ids("a", 2, 0..2, 2)).await.unwrap();
            assert_eq!(taken.len(), 2);
            taken
        })
    };
    let taken_old = a_old.await.unwrap();
    let mut taken = c_other.await.unwrap();
    taken.extend(failover.await.unwrap());
    until(&world, || {
        world
            .settled("ack")
            .iter()
            .filter(|i| i.gen == 2 || i.key == "c")
            .count()
            == taken.len()
    })
    .await;
    until(&world, || d.held() == 0).await;
    let log = world.log();
    let lost = world.index(&Ev::Mark("lost")).unwrap();
    for (i, e) in log.iter().enumerate() {
        if let Ev::Attempt(id, _) = e {
            if id.key == "a" && id.gen == 1 {
                assert!(i < lost, "violated: {id:?} was attempted after its scope was lost");
            }
        }
    }
    // The new generation and the other scope: all applied, in order.
    assert_fifo(
        &world,
        &taken.iter().chain(&taken_old).cloned().collect::<Vec<_>>(),
        false,
    );
    let mut applied: Vec<Id> = world
        .settled("ack")
        .into_iter()
        .filter(|i| i.gen == 2 || i.key == "c")
        .collect();
    applied.sort();
    taken.sort();
    assert_eq!(applied, taken, "violated: work of a scope still owned was lost");
    // The lost generation: every message accounted for exactly once.
    let s = d.stats().snapshot();
    let old_acked = world
        .settled("ack")
        .iter()
        .filter(|i| i.key == "a" && i.gen == 1)
        .count();
    assert_eq!(
        old_acked as u64 + s.fence_rejections + s.self_fence_discards,
        taken_old.len() as u64,
        "violated: lost-generation messages: {old_acked} applied, {} fenced, {} discarded, of {}",
        s.fence_rejections,
        s.self_fence_discards,
        taken_old.len()
    );
    assert_eq!(d.held_in_scope("s0"), 0);
    world.finish();
}

#[test]
fn a_lost_scope_discards_its_buffered_work_and_spares_the_next_generation() {
    explore(lost_body);
}

/// A scope whose ownership was not confirmed recently starts nothing until
/// a fenced round trip succeeds again.
async fn stale_body() {
    let c = cfg(2, 2, 4, PoisonPolicy::Halt);
    let world = World::new(&c);
    let d = dispatcher(&world, c);
    let lc = LeaseConfig {
        ttl: Duration::from_secs(4),
        heartbeat: Duration::from_secs(1),
        margin: Duration::from_secs(1),
    };
    let stale = ScopeLease::new("s0", 3, &lc, Instant::now() - Duration::from_secs(5));
    let a = lane(&d, &world, &stale, ids("a", 0, 0..2, 3));
    let b = lane(&d, &world, &stale, ids("b", 1, 0..2, 3));
    let confirmer = {
        let (world, stale) = (world.clone(), stale.clone());
        spawn(async move {
            let wait = shuttle::rand::thread_rng().gen_range(0..8);
            for _ in 0..wait {
                yield_now().await;
            }
            world.mark("confirming");
            stale.confirm(Instant::now());
        })
    };
    let mut taken = a.await.unwrap();
    taken.extend(b.await.unwrap());
    confirmer.await.unwrap();
    until(&world, || world.settled("ack").len() == taken.len() && d.held() == 0).await;
    let confirming = world.index(&Ev::Mark("confirming")).unwrap();
    let first = world.log().iter().position(|e| matches!(e, Ev::Start(..)));
    assert!(
        first > Some(confirming),
        "violated: a handler started on an unconfirmed scope"
    );
    assert_fifo(&world, &taken, true);
    world.finish();
}

#[test]
fn a_stale_scope_starts_nothing_until_confirmed() {
    explore(stale_body);
}
