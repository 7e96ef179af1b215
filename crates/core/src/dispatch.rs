//! The keyed dispatcher: the local layer inside one process.
//!
//! One room on purpose (over 700 lines): the per-key queues, the budget,
//! the isolation gate and the settlement tasks are one state behind one
//! lock with one set of invariants, which the shuttle schedule tests and
//! their planted bug exercise as a unit.
//!
//! * The same key runs one message at a time, FIFO by arrival; different keys
//!   run concurrently up to `concurrency`.
//! * Memory is bounded by a global in-flight `budget` (buffered + running)
//!   and a `per_key_depth`, never by key cardinality: a key's state exists
//!   only while it holds messages.
//! * A slow or halted key does not delay other keys while its held messages
//!   fit its depth; beyond that [`Dispatcher::submit`] hands the message back
//!   ([`Submit::Full`]) and the caller pauses the smallest scope it can (the
//!   widening, counted in [`Stats::widened`]).
//! * Before a handler starts: the self-fence ([`ScopeLease::usable`]), then a
//!   durable attempt increment ([`Settle::begin_attempt`]). Retries back off;
//!   failures spanning many keys back the whole dispatcher off instead of
//!   halting or parking healthy keys; exhausted keys follow the
//!   [`PoisonPolicy`].

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use tokio::time::Instant;

use crate::error::Error;
use crate::handler::{Handler, HandlerError, Settled, Settlement};
use crate::key::OrderingKey;
use crate::lease::LeaseState;
use crate::lease::ScopeLease;
use crate::message::{Delivery, Message};
use crate::rt::{self, AtomicU64, AtomicUsize, Either, Mutex, MutexGuard, Notify, Stop};
use crate::stats::{bump, Stats};
use crate::strategy::{GlobalBackoff, PoisonPolicy, RetryPolicy};
use crate::transport::{HotKey, Inbound, Settle};

/// Limits and policies of the dispatcher.
#[derive(Debug, Clone, Copy)]
pub struct DispatchConfig {
    /// Handlers running at once (keys in flight).
    pub concurrency: usize,
    /// Messages one key may hold (running + waiting) before back-pressure
    /// widens. Keep `budget` at least `per_key_depth` times the number of
    /// keys that may be deep at once (slow or halted), so they cannot take
    /// the whole budget from the others.
    pub per_key_depth: usize,
    /// Messages the whole dispatcher may hold (running + waiting).
    pub budget: usize,
    /// Retry with back-off.
    pub retry: RetryPolicy,
    /// What happens when retries are exhausted.
    pub poison: PoisonPolicy,
    /// Whole-subscription back-off when failures span many keys.
    pub global_backoff: GlobalBackoff,
}

impl Default for DispatchConfig {
    fn default() -> Self {
        DispatchConfig {
            concurrency: 64,
            per_key_depth: 64,
            budget: 4096,
            retry: RetryPolicy::default(),
            poison: PoisonPolicy::default(),
            global_backoff: GlobalBackoff::default(),
        }
    }
}

impl DispatchConfig {
    fn max_attempts(&self) -> u32 {
        match self.poison {
            PoisonPolicy::Park { max_attempts } => max_attempts.max(1),
            PoisonPolicy::Halt => self.retry.max_attempts.max(1),
        }
    }
}

/// One message waiting in or running through the dispatcher.
#[derive(Debug)]
pub struct Job {
    pub(crate) message: Arc<Message>,
    pub(crate) lease: Arc<ScopeLease>,
    pub(crate) settle: Box<dyn Settle>,
    pub(crate) key: Option<OrderingKey>,
}

impl Job {
    /// A job for `inbound`, ordered by `key` (`None`: unordered).
    pub fn new(inbound: Inbound, key: Option<OrderingKey>) -> Self {
        Job {
            message: Arc::new(inbound.message),
            lease: inbound.lease,
            settle: inbound.settle,
            key,
        }
    }
    /// The scope the job came from.
    pub fn scope(&self) -> &Arc<str> {
        self.lease.scope()
    }
    /// Whether the job's scope was lost.
    pub fn is_lost(&self) -> bool {
        self.lease.is_lost()
    }
}

/// Why [`Dispatcher::submit`] handed a job back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Widening {
    /// The key already holds `per_key_depth` messages.
    KeyDepth,
    /// The dispatcher holds `budget` messages.
    Budget,
    /// The dispatcher is shutting down.
    Stopping,
}

/// The result of [`Dispatcher::submit`].
#[derive(Debug)]
pub enum Submit {
    /// The dispatcher took the job.
    Accepted,
    /// The job was handed back: pause its scope and submit it again later.
    Full(Job, Widening),
}

#[derive(Default)]
struct KeyQueue {
    /// Waiting jobs; a halted key's head is the first.
    queue: VecDeque<Job>,
    /// In the ready queue or being processed by a worker (never both, and
    /// at most once in the ready queue: one message of a key at a time).
    scheduled: bool,
    /// A job was taken from the queue and is being processed.
    busy: bool,
    halted: bool,
    /// An operator resolved the key (`Some(drop_head)`) while its job was
    /// still coming back from recording the halt at the broker: applied as
    /// soon as it is back, so the release is not lost.
    release: Option<bool>,
}

/// Work a worker can pick up: a key with waiting jobs, or a keyless job.
enum Ready {
    Key(OrderingKey),
    Keyless(Job),
}

impl KeyQueue {
    fn held(&self) -> usize {
        self.queue.len() + usize::from(self.busy)
    }
}

#[derive(Default)]
struct State {
    keys: HashMap<OrderingKey, KeyQueue>,
    /// Round-robin over ready keys: a key with more waiting jobs goes to the back.
    ready: VecDeque<Ready>,
    /// Worker tasks alive (at most `concurrency`).
    workers: usize,
    total: usize,
    running: usize,
    scopes: HashMap<Arc<str>, usize>,
}

/// Runs a message that was delivered before without being settled alone:
/// nothing else runs while it does. A message that kills its process (a
/// crash counts as an attempt for every message in flight) is then the only
/// one charged for the crash, and messages of other keys that happened to
/// run beside it do not use up their attempts and halt or park (C22).
///
/// A suspect waits at most [`ISOLATION_WAIT`] for the handlers running
/// when it came (and new ones wait behind it meanwhile): a slow or hung
/// handler must not stop every key. Past it, the suspect runs beside them
/// (a crash then charges them too, once). Each subscription has a gate of
/// its own; dispatchers made with [`Dispatcher::new_in_process`] share one
/// (a crash ends every subscription of the process, but a shared gate lets
/// one subscription's hung handler delay another's redelivered messages).
#[derive(Default)]
struct Gate {
    state: Mutex<GateState>,
    changed: Notify,
}

#[derive(Default)]
struct GateState {
    /// Handlers running beside each other.
    shared: usize,
    /// Acknowledgements of applied messages still to land: a crash before
    /// one lands charges its message an attempt, so a suspect waits for
    /// them as for running handlers.
    acking: usize,
    /// A suspect runs.
    exclusive: bool,
    /// Suspects waiting for their turn (new shared runs wait behind them).
    queued: usize,
}

/// Held while a handler runs; lets the next one in when dropped.
struct GatePass<'a> {
    gate: &'a Gate,
    exclusive: bool,
}

impl Gate {
    fn lock(&self) -> MutexGuard<'_, GateState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    async fn shared(&self) -> GatePass<'_> {
        loop {
            let notified = self.changed.notified();
            {
                let mut st = self.lock();
                if !st.exclusive && st.queued == 0 {
                    st.shared += 1;
                    return GatePass {
                        gate: self,
                        exclusive: false,
                    };
                }
            }
            notified.await;
        }
    }

    async fn exclusive(&self, wait: Duration) -> GatePass<'_> {
        // Counted as queued at once: shared runs that come later wait.
        let queued = Queued(self);
        self.lock().queued += 1;
        let mut waited = std::pin::pin!(rt::sleep(wait));
        loop {
            let notified = self.changed.notified();
            {
                let mut st = self.lock();
                if !st.exclusive && st.shared == 0 && st.acking == 0 {
                    st.exclusive = true;
                    st.queued -= 1;
                    std::mem::forget(queued);
                    return GatePass {
                        gate: self,
                        exclusive: true,
                    };
                }
            }
            if let Either::Right(()) = rt::race(notified, waited.as_mut()).await {
                break;
            }
        }
        // Waited long enough: no longer queued (the shared runs behind it
        // go on), and runs beside whatever runs, once no suspect does.
        drop(queued);
        tracing::warn!(
            wait_s = wait.as_secs(),
            "a redelivered message waited its turn to run alone too long; it runs beside the others"
        );
        loop {
            let notified = self.changed.notified();
            {
                let mut st = self.lock();
                if !st.exclusive {
                    st.shared += 1;
                    return GatePass {
                        gate: self,
                        exclusive: false,
                    };
                }
            }
            notified.await;
        }
    }
}

/// The longest a redelivered message (one delivered before and not
/// settled) waits to run alone, nothing else running beside it; then it
/// runs beside the others.
pub const ISOLATION_WAIT: Duration = Duration::from_secs(5);

/// The gate the subscriptions of this process share.
#[cfg(not(keyorder_shuttle))]
fn process_gate() -> Arc<Gate> {
    static GATE: std::sync::OnceLock<Arc<Gate>> = std::sync::OnceLock::new();
    GATE.get_or_init(|| Arc::new(Gate::default())).clone()
}

impl Gate {
    fn ack_started(&self) {
        self.lock().acking += 1;
    }
}

/// One acknowledgement counted by [`Gate::ack_started`]; done when dropped
/// (also when its task is dropped with the runtime).
struct Acking(Arc<Inner>);

impl Drop for Acking {
    fn drop(&mut self) {
        self.0.gate.lock().acking -= 1;
        self.0.gate.changed.notify_waiters();
    }
}

/// Un-queues a suspect whose wait was abandoned (shutdown).
struct Queued<'a>(&'a Gate);

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        self.0.lock().queued -= 1;
        self.0.changed.notify_waiters();
    }
}

impl Drop for GatePass<'_> {
    fn drop(&mut self) {
        {
            let mut st = self.gate.lock();
            if self.exclusive {
                st.exclusive = false;
            } else {
                st.shared -= 1;
            }
        }
        self.gate.changed.notify_waiters();
    }
}

#[derive(Default)]
struct Health {
    failures: VecDeque<(Instant, u64)>,
    paused_until: Option<Instant>,
}

struct Inner {
    cfg: DispatchConfig,
    handler: Arc<dyn Handler>,
    state: Mutex<State>,
    health: Mutex<Health>,
    changed: Notify,
    /// Notified when the held count falls to `budget - low_water`, or a
    /// full key's to three quarters of its depth.
    room: Notify,
    room_epoch: AtomicU64,
    /// The [`crate::lease::lost_epoch`] last swept by `discard_lost`.
    lost_seen: AtomicU64,
    epoch: AtomicU64,
    waiters: AtomicUsize,
    stopping: Stop,
    /// Redelivered messages run alone ([`Gate`]).
    gate: Arc<Gate>,
    stats: Arc<Stats>,
    /// Told of every delivery's settlement, when the application asked.
    observer: std::sync::OnceLock<crate::handler::SettledHook>,
    /// The latency histograms, once labelled ([`Dispatcher::metered`]).
    meters: std::sync::OnceLock<Meters>,
}

/// Handles of the latency histograms of one subscription.
struct Meters {
    handler: metrics::Histogram,
    settle: metrics::Histogram,
}

/// The keyed dispatcher. Cheap to clone; clones share one state.
#[derive(Clone)]
pub struct Dispatcher {
    inner: Arc<Inner>,
}

impl fmt::Debug for Dispatcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let st = self.inner.lock();
        f.debug_struct("Dispatcher")
            .field("keys", &st.keys.len())
            .field("held", &st.total)
            .field("running", &st.running)
            .finish()
    }
}

enum Outcome {
    /// Applied, parked, or dropped by an operator: the job is finished.
    Done,
    /// The key halted at this job: it stays as the key's head.
    Halted,
    /// The scope was lost: the job and the key's queued jobs of that scope go.
    Lost,
    /// Shutting down before the job was settled: left for redelivery.
    Stopped,
    /// The handler succeeded; the acknowledgement is still to be made. The
    /// worker hands it to a task of its own and takes other work meanwhile
    /// (the key stays busy until the acknowledgement is durable).
    Applied,
}

impl Dispatcher {
    /// A dispatcher running `handler` under `cfg`, counting into `stats`.
    /// Its redelivered messages run alone among its own handlers; see
    /// [`Dispatcher::new_in_process`].
    pub fn new(cfg: DispatchConfig, handler: Arc<dyn Handler>, stats: Arc<Stats>) -> Self {
        Self::with_gate(cfg, handler, stats, Arc::default())
    }

    /// Like [`Dispatcher::new`], but a redelivered message runs alone among
    /// the handlers of every dispatcher of the process made this way (what a
    /// subscription runs): a message that crashes the process is then
    /// charged alone, whichever subscription it came from.
    pub fn new_in_process(cfg: DispatchConfig, handler: Arc<dyn Handler>, stats: Arc<Stats>) -> Self {
        #[cfg(not(keyorder_shuttle))]
        let gate = process_gate();
        #[cfg(keyorder_shuttle)]
        let gate = Arc::default();
        Self::with_gate(cfg, handler, stats, gate)
    }

    fn with_gate(cfg: DispatchConfig, handler: Arc<dyn Handler>, stats: Arc<Stats>, gate: Arc<Gate>) -> Self {
        let cfg = DispatchConfig {
            concurrency: cfg.concurrency.max(1),
            per_key_depth: cfg.per_key_depth.max(1),
            budget: cfg.budget.max(1),
            ..cfg
        };
        Dispatcher {
            inner: Arc::new(Inner {
                cfg,
                handler,
                state: Mutex::new(State::default()),
                health: Mutex::new(Health::default()),
                changed: Notify::new(),
                room: Notify::new(),
                room_epoch: AtomicU64::new(0),
                lost_seen: AtomicU64::new(0),
                epoch: AtomicU64::new(0),
                waiters: AtomicUsize::new(0),
                stopping: Stop::new(),
                gate,
                stats,
                observer: std::sync::OnceLock::new(),
                meters: std::sync::OnceLock::new(),
            }),
        }
    }

    /// Tells `hook` of every delivery's settlement from now on (once; a
    /// second call is ignored).
    pub fn on_settled(&self, hook: crate::handler::SettledHook) {
        let _ = self.inner.observer.set(hook);
    }

    /// The counters.
    pub fn stats(&self) -> &Arc<Stats> {
        &self.inner.stats
    }

    /// Takes a job, or hands it back when the key's depth or the budget is full.
    pub fn submit(&self, job: Job) -> Submit {
        #[cfg(keyorder_shuttle)]
        if job.key.is_some() && rt::planted_bug() {
            return self.submit_split(job);
        }
        let inner = &self.inner;
        let mut st = inner.lock();
        // Under the lock: `drain` sets the flag before it sweeps the waiting
        // jobs under the lock, so a job is either swept or refused, never
        // taken after the sweep and held forever.
        if inner.stopping.is_set() {
            return Submit::Full(job, Widening::Stopping);
        }
        if st.total >= inner.cfg.budget {
            return Submit::Full(job, Widening::Budget);
        }
        st.total += 1;
        *st.scopes.entry(job.scope().clone()).or_default() += 1;
        let ready = match job.key.clone() {
            None => Some(Ready::Keyless(job)),
            Some(key) => {
                let depth = inner.cfg.per_key_depth;
                let q = st.keys.entry(key.clone()).or_default();
                // A halted key's later message goes back to a transport that
                // holds it (read again once the halt is resolved): it takes
                // no room here, so the halt never widens.
                if q.halted && job.settle.unread() {
                    st.total -= 1;
                    st.forget_scope(job.scope());
                    drop(st);
                    bump(&inner.stats.handed_back, "keyorder_handed_back_total");
                    return Submit::Accepted;
                }
                if q.held() >= depth {
                    st.total -= 1;
                    st.forget_scope(job.scope());
                    return Submit::Full(job, Widening::KeyDepth);
                }
                q.queue.push_back(job);
                if q.scheduled || q.halted {
                    None
                } else {
                    q.scheduled = true;
                    Some(Ready::Key(key))
                }
            }
        };
        let spawn = ready.map(|r| st.make_ready(r, inner.cfg.concurrency)).unwrap_or(false);
        drop(st);
        bump(&inner.stats.received, "keyorder_received_total");
        if spawn {
            let inner = self.inner.clone();
            rt::spawn(inner.worker());
        }
        Submit::Accepted
    }

    /// The planted bug of the schedule tests (`crates/core/tests/SHUTTLE.md`):
    /// [`submit`](Self::submit) with its check-then-act split over two
    /// critical sections, as if the scheduling were moved out of the lock.
    /// Two submits of one idle key can both see it unscheduled and both
    /// queue it, so two workers run the key at once. Compiled only into
    /// `--cfg keyorder_shuttle` builds, and used only while
    /// [`crate::plant_bug`] is on.
    #[cfg(keyorder_shuttle)]
    fn submit_split(&self, job: Job) -> Submit {
        let inner = &self.inner;
        let mut st = inner.lock();
        // Under the lock: `drain` sets the flag before it sweeps the waiting
        // jobs under the lock, so a job is either swept or refused, never
        // taken after the sweep and held forever.
        if inner.stopping.is_set() {
            return Submit::Full(job, Widening::Stopping);
        }
        if st.total >= inner.cfg.budget {
            return Submit::Full(job, Widening::Budget);
        }
        let key = job.key.clone().expect("only keyed jobs come here");
        let depth = inner.cfg.per_key_depth;
        let q = st.keys.entry(key.clone()).or_default();
        if q.held() >= depth {
            return Submit::Full(job, Widening::KeyDepth);
        }
        let scope = job.scope().clone();
        q.queue.push_back(job);
        let schedule = !q.scheduled && !q.halted;
        st.total += 1;
        *st.scopes.entry(scope).or_default() += 1;
        drop(st);
        bump(&inner.stats.received, "keyorder_received_total");
        if schedule {
            let mut st = inner.lock();
            if let Some(q) = st.keys.get_mut(&key) {
                q.scheduled = true;
            }
            if st.make_ready(Ready::Key(key), inner.cfg.concurrency) {
                drop(st);
                rt::spawn(inner.clone().worker());
            }
        }
        Submit::Accepted
    }

    /// Room left in the budget.
    pub fn room(&self) -> usize {
        self.inner.cfg.budget.saturating_sub(self.inner.lock().total)
    }

    /// The room [`wait_room`](Self::wait_room) waits for: a quarter of the
    /// budget, so a full dispatcher refills in batches, not one by one.
    pub fn low_water(&self) -> usize {
        self.inner.low_water()
    }

    /// A counter that grows when room appears in batches: the budget fell
    /// to [`low_water`](Self::low_water) free, or a key that was full has a
    /// quarter of its depth free.
    pub fn room_epoch(&self) -> u64 {
        self.inner.room_epoch.load(Ordering::SeqCst)
    }

    /// Waits until [`room_epoch`](Self::room_epoch) moved past `epoch` (read
    /// it before the [`submit`](Self::submit) that was handed back), or
    /// `timeout` passed: a refill in batches, not one message per completion.
    pub async fn wait_room_since(&self, epoch: u64, timeout: Duration) {
        let notified = self.inner.room.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if self.room_epoch() == epoch {
            let _ = rt::timeout(timeout, notified).await;
        }
    }

    /// Waits until the budget has [`low_water`](Self::low_water) room, or
    /// `timeout` passed.
    pub async fn wait_room(&self, timeout: Duration) {
        let notified = self.inner.room.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if self.room() < self.low_water() {
            let _ = rt::timeout(timeout, notified).await;
        }
    }

    /// Messages held (waiting or running).
    pub fn held(&self) -> usize {
        self.inner.lock().total
    }

    /// Messages held (waiting or running) of every scope that holds any:
    /// what [`crate::transport::Room::split`] shares a fetch's room by.
    pub fn holdings(&self) -> Vec<(Arc<str>, usize)> {
        let st = self.inner.lock();
        st.scopes
            .iter()
            .filter(|(_, n)| **n > 0)
            .map(|(s, n)| (s.clone(), *n))
            .collect()
    }

    /// Records handler run time (`keyorder_handler_seconds`) and the wait
    /// from a handler's return to its acknowledgement reported durable
    /// (`keyorder_settle_seconds`) as histograms labelled by `category` and
    /// `group`, through the `metrics` recorder installed now (install it
    /// first). Only the first call counts.
    pub fn metered(&self, category: &str, group: &str) {
        let labels = [("category", category.to_owned()), ("group", group.to_owned())];
        let _ = self.inner.meters.set(Meters {
            handler: metrics::histogram!("keyorder_handler_seconds", &labels),
            settle: metrics::histogram!("keyorder_settle_seconds", &labels),
        });
    }

    /// Whether the whole dispatcher is backing off right now because
    /// failures spanned many keys ([`GlobalBackoff`]).
    pub fn backing_off(&self) -> bool {
        let h = self.inner.health.lock().unwrap_or_else(|e| e.into_inner());
        h.paused_until.is_some_and(|t| t > Instant::now())
    }

    /// Messages of `scope` held (waiting or running).
    pub fn held_in_scope(&self, scope: &str) -> usize {
        self.inner.lock().scopes.get(scope).copied().unwrap_or(0)
    }

    /// Drops every waiting job of `scope` (its lease was lost or revoked);
    /// running handlers finish. Returns how many were dropped.
    pub fn discard_scope(&self, scope: &str) -> usize {
        self.discard(|j| &**j.scope() == scope, false)
    }

    /// Drops every waiting job whose lease was lost, halted heads included
    /// (a halted key never reaches the self-fence on its own). Cheap when no
    /// lease was lost since the last call.
    pub fn discard_lost(&self) -> usize {
        let epoch = crate::lease::lost_epoch();
        if self.inner.lost_seen.swap(epoch, Ordering::SeqCst) == epoch {
            return 0;
        }
        self.discard(Job::is_lost, true)
    }

    /// Drops the waiting jobs (keyed, halted heads, keyless) that `gone`
    /// selects, releases keys whose halted head went, and reschedules keys
    /// left with work. `fenced` counts the drops as self-fence discards.
    fn discard(&self, gone: impl Fn(&Job) -> bool, fenced: bool) -> usize {
        let mut st = self.inner.lock();
        let mut dropped = Vec::new();
        let mut halted_cleared = 0;
        st.keys.retain(|_, q| {
            let head_gone = q.halted && q.queue.front().is_some_and(&gone);
            let (out, kept): (VecDeque<Job>, VecDeque<Job>) = q.queue.drain(..).partition(&gone);
            q.queue = kept;
            dropped.extend(out);
            if head_gone {
                // The held head went with its scope: the next owner re-reads
                // it with its durable attempt count.
                q.halted = false;
                halted_cleared += 1;
            }
            q.scheduled || q.busy || !q.queue.is_empty()
        });
        let (out, kept): (VecDeque<Ready>, VecDeque<Ready>) = std::mem::take(&mut st.ready)
            .into_iter()
            .partition(|r| matches!(r, Ready::Keyless(j) if gone(j)));
        st.ready = kept;
        dropped.extend(out.into_iter().filter_map(|r| match r {
            Ready::Keyless(job) => Some(job),
            Ready::Key(_) => None,
        }));
        for job in &dropped {
            st.forget(job);
        }
        // A key released from a dropped head may still hold other work.
        let orphans: Vec<OrderingKey> = st
            .keys
            .iter()
            .filter(|(_, q)| !q.scheduled && !q.halted && !q.busy && !q.queue.is_empty())
            .map(|(k, _)| k.clone())
            .collect();
        let mut spawn = 0;
        for key in orphans {
            if let Some(q) = st.keys.get_mut(&key) {
                q.scheduled = true;
            }
            spawn += usize::from(st.make_ready(Ready::Key(key), self.inner.cfg.concurrency));
        }
        drop(st);
        for _ in 0..halted_cleared {
            self.inner.stats.halted_now.fetch_sub(1, Ordering::Relaxed);
            metrics::gauge!("keyorder_halted_keys").decrement(1.0);
        }
        if fenced {
            for _ in 0..dropped.len() {
                bump(
                    &self.inner.stats.self_fence_discards,
                    "keyorder_self_fence_discards_total",
                );
            }
        }
        self.inner.signal();
        self.inner.refilled();
        for _ in 0..spawn {
            rt::spawn(self.inner.clone().worker());
        }
        dropped.len()
    }

    /// Releases a halted key after an operator resolved its head at the
    /// broker: drops the head (`drop_head`, after skip or dead letter) or runs
    /// it again (resume). `key` is the key's value or its label (a key
    /// whose value it is comes first). Returns
    /// whether a halted key was found here (or a key whose job is in flight,
    /// maybe coming back from recording its halt: the release then applies
    /// when it is back, if it halted).
    pub fn release(&self, key: &str, drop_head: bool) -> bool {
        let mut st = self.inner.lock();
        // By value first: a key's value may read like another key's label
        // (`k#<hash>`, keys are user data), and that other key, halted too,
        // was released in its place now and then (map order).
        let by_value = |k: &OrderingKey| k.as_str() == key;
        let by_label = |k: &OrderingKey| k.label() == key;
        let halted = |named: &dyn Fn(&OrderingKey) -> bool| {
            st.keys
                .iter()
                .find(|(k, q)| q.halted && named(k))
                .map(|(k, _)| k.clone())
        };
        let Some(found) = halted(&by_value).or_else(|| halted(&by_label)) else {
            // The halt is recorded at the broker before its job comes back
            // here: an operator may resolve it in between. The release then
            // waits for the job (and lapses if it did not halt).
            let busy = st
                .keys
                .iter()
                .find(|(k, q)| q.busy && by_value(k))
                .or_else(|| st.keys.iter().find(|(k, q)| q.busy && by_label(k)))
                .map(|(k, _)| k.clone());
            if let Some(q) = busy.and_then(|k| st.keys.get_mut(&k)) {
                q.release = Some(drop_head);
                return true;
            }
            return false;
        };
        let q = st.keys.get_mut(&found).expect("found above");
        q.halted = false;
        let head = if drop_head { q.queue.pop_front() } else { None };
        let mut spawn = false;
        if !q.queue.is_empty() && !q.scheduled {
            q.scheduled = true;
            spawn = st.make_ready(Ready::Key(found.clone()), self.inner.cfg.concurrency);
        } else if q.queue.is_empty() && !q.scheduled && !q.busy {
            st.keys.remove(&found);
        }
        if let Some(job) = &head {
            st.forget(job);
        }
        drop(st);
        self.inner.stats.halted_now.fetch_sub(1, Ordering::Relaxed);
        metrics::gauge!("keyorder_halted_keys").decrement(1.0);
        self.inner.signal();
        if spawn {
            let inner = self.inner.clone();
            rt::spawn(inner.worker());
        }
        true
    }

    /// Keys holding the most messages, largest first (labels, never values).
    pub fn hot_keys(&self, limit: usize) -> Vec<HotKey> {
        let st = self.inner.lock();
        let mut keys: Vec<(usize, &OrderingKey)> = st.keys.iter().map(|(k, q)| (q.held(), k)).collect();
        keys.sort_by_key(|k| std::cmp::Reverse(k.0));
        keys.into_iter()
            .take(limit)
            .map(|(n, k)| HotKey {
                label: k.label(),
                backlog: n as u64,
            })
            .collect()
    }

    /// Whether [`drain`](Self::drain) has started.
    pub fn is_draining(&self) -> bool {
        self.inner.is_stopping()
    }

    /// A counter that grows whenever a job finishes or a key is released:
    /// read it before [`submit`](Self::submit) and pass it to
    /// [`changed_since`](Self::changed_since) so no change is missed.
    pub fn epoch(&self) -> u64 {
        self.inner.epoch.load(Ordering::SeqCst)
    }

    /// Waits until something changed since `epoch` (a job finished, a key
    /// was released), or `timeout` passed.
    pub async fn changed_since(&self, epoch: u64, timeout: Duration) {
        use Ordering::SeqCst;
        // Announce the waiter before checking the epoch; `signal` bumps the
        // epoch before checking for waiters: one of the two sees the other.
        self.inner.waiters.fetch_add(1, SeqCst);
        let notified = self.inner.changed.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if self.epoch() == epoch {
            let _ = rt::timeout(timeout, notified).await;
        }
        self.inner.waiters.fetch_sub(1, SeqCst);
    }

    /// Graceful shutdown: starts nothing new, waits until every running
    /// handler returned and was settled, then drops the waiting jobs (they
    /// are unacknowledged, so the broker delivers them again). Returns how
    /// many waiting jobs were dropped.
    pub async fn drain(&self) -> usize {
        self.inner.stopping.set();
        loop {
            let epoch = self.epoch();
            if self.inner.lock().running == 0 {
                break;
            }
            self.changed_since(epoch, Duration::from_millis(50)).await;
        }
        let mut st = self.inner.lock();
        let mut jobs: Vec<Job> = st.keys.drain().flat_map(|(_, q)| q.queue).collect();
        jobs.extend(st.ready.drain(..).filter_map(|r| match r {
            Ready::Keyless(job) => Some(job),
            Ready::Key(_) => None,
        }));
        for job in &jobs {
            st.forget(job);
        }
        jobs.len()
    }
}

impl State {
    fn forget(&mut self, job: &Job) {
        self.total -= 1;
        self.forget_scope(job.scope());
    }

    fn forget_scope(&mut self, scope: &Arc<str>) {
        if let Some(n) = self.scopes.get_mut(&**scope) {
            *n -= 1;
            if *n == 0 {
                self.scopes.remove(&**scope);
            }
        }
    }

    /// Queues ready work; returns whether a new worker must be spawned.
    fn make_ready(&mut self, ready: Ready, concurrency: usize) -> bool {
        self.ready.push_back(ready);
        if self.workers < concurrency {
            self.workers += 1;
            true
        } else {
            false
        }
    }

    /// Settles the bookkeeping of a processed job and reschedules its key.
    /// Returns whether the key's held count fell to its low water
    /// (`key_low`), so a caller waiting for room may retry.
    fn finish(&mut self, key: Option<OrderingKey>, job: Job, outcome: Outcome, stats: &Stats, key_low: usize) -> bool {
        self.running -= 1;
        let Some(key) = key else {
            self.forget(&job);
            return false;
        };
        match outcome {
            // `Applied` never comes here: its acknowledgement settles it first.
            Outcome::Done | Outcome::Stopped | Outcome::Applied => self.forget(&job),
            Outcome::Halted if !job.is_lost() => {
                let q = self.keys.entry(key.clone()).or_default();
                let Some(drop_head) = q.release.take() else {
                    // What waits behind the head goes back to a transport
                    // that holds a halted key's messages (see `submit`).
                    let waiting = std::mem::take(&mut q.queue);
                    let (back, kept): (VecDeque<Job>, VecDeque<Job>) =
                        waiting.into_iter().partition(|j| j.settle.unread());
                    q.queue = kept;
                    q.queue.push_front(job);
                    q.halted = true;
                    q.busy = false;
                    q.scheduled = false;
                    for j in &back {
                        self.forget(j);
                        bump(&stats.handed_back, "keyorder_handed_back_total");
                    }
                    return false;
                };
                // Resolved while the halt was being recorded: released at
                // once, as `Dispatcher::release` would have.
                stats.halted_now.fetch_sub(1, Ordering::Relaxed);
                metrics::gauge!("keyorder_halted_keys").decrement(1.0);
                if drop_head {
                    self.forget(&job);
                } else {
                    q.queue.push_front(job);
                }
            }
            Outcome::Halted | Outcome::Lost => {
                if matches!(outcome, Outcome::Halted) {
                    // Halted on a lease lost meanwhile: the next owner re-reads it.
                    stats.halted_now.fetch_sub(1, Ordering::Relaxed);
                    metrics::gauge!("keyorder_halted_keys").decrement(1.0);
                }
                self.forget(&job);
                let mut dropped = VecDeque::new();
                if let Some(q) = self.keys.get_mut(&key) {
                    // Only this lease's jobs: a re-acquired scope's new
                    // generation may already be queued behind them.
                    let (gone, kept): (VecDeque<Job>, VecDeque<Job>) =
                        q.queue.drain(..).partition(|j| Arc::ptr_eq(&j.lease, &job.lease));
                    q.queue = kept;
                    dropped = gone;
                }
                for j in &dropped {
                    self.forget(j);
                    bump(&stats.self_fence_discards, "keyorder_self_fence_discards_total");
                }
            }
        }
        let Some(q) = self.keys.get_mut(&key) else { return false };
        q.busy = false;
        q.release = None;
        let low = q.held() == key_low;
        if q.halted {
            q.scheduled = false;
        } else if q.queue.is_empty() {
            self.keys.remove(&key);
        } else {
            // Round-robin: the key goes to the back of the ready queue.
            self.ready.push_back(Ready::Key(key));
        }
        low
    }
}

impl Inner {
    fn refilled(&self) {
        self.room_epoch.fetch_add(1, Ordering::SeqCst);
        self.room.notify_waiters();
    }

    fn low_water(&self) -> usize {
        (self.cfg.budget / 4).max(1)
    }

    fn signal(&self) {
        use Ordering::SeqCst;
        self.epoch.fetch_add(1, SeqCst);
        if self.waiters.load(SeqCst) > 0 {
            self.changed.notify_waiters();
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn is_stopping(&self) -> bool {
        self.stopping.is_set()
    }

    /// A worker: takes ready work until there is none (or shutdown), one
    /// message at a time. At most `concurrency` workers run.
    async fn worker(self: Arc<Self>) {
        let mut last: Option<(Option<OrderingKey>, Job, Outcome)> = None;
        loop {
            let finished = last.is_some();
            let mut refilled = false;
            let next = {
                let mut st = self.lock();
                if let Some((key, job, outcome)) = last.take() {
                    refilled = self.finish_job(&mut st, key, job, outcome);
                }
                let stopping = self.is_stopping();
                loop {
                    let item = if stopping { None } else { st.ready.pop_front() };
                    match item {
                        None => {
                            st.workers -= 1;
                            break None;
                        }
                        Some(Ready::Keyless(job)) => {
                            st.running += 1;
                            break Some((None, job));
                        }
                        Some(Ready::Key(key)) => {
                            let Some(q) = st.keys.get_mut(&key) else { continue };
                            if q.halted {
                                q.scheduled = false;
                                continue;
                            }
                            match q.queue.pop_front() {
                                Some(job) => {
                                    q.busy = true;
                                    st.running += 1;
                                    break Some((Some(key), job));
                                }
                                None => {
                                    st.keys.remove(&key);
                                }
                            }
                        }
                    }
                }
            };
            if finished {
                self.signal();
            }
            if refilled {
                self.refilled();
            }
            let Some((key, job)) = next else { return };
            let outcome = if self.is_stopping() {
                Outcome::Stopped
            } else {
                self.process(&job).await
            };
            if matches!(outcome, Outcome::Applied) {
                // The acknowledgement is a broker round trip: make it on a
                // task of its own so this worker runs another key meanwhile.
                // The key stays busy (one message of a key at a time, the
                // next only once this one is durably settled), and the job
                // stays counted in the budget and as running, so `drain`
                // waits for it.
                let inner = self.clone();
                let acking = Acking(self.clone());
                rt::spawn(async move {
                    let started = std::time::Instant::now();
                    let outcome = inner.ack(&job).await;
                    if let Some(m) = inner.meters.get() {
                        m.settle.record(started.elapsed().as_secs_f64());
                    }
                    drop(acking);
                    if inner.settled(key, job, outcome) {
                        // Ready work and a free worker place: this task
                        // becomes the worker, a task wake-up sooner than
                        // spawning one (the key's next message starts
                        // here).
                        inner.boxed_worker().await;
                    }
                });
                continue;
            }
            last = Some((key, job, outcome));
        }
    }

    /// `worker` behind a box: a worker's future holds the acknowledgement
    /// task that may become a worker, so that task names this type.
    fn boxed_worker(self: Arc<Self>) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> {
        Box::pin(self.worker())
    }

    /// A processed job's bookkeeping (`State::finish`); returns
    /// whether room came back: its key fell to its low water, or the held
    /// count crossed below the budget's refill mark.
    fn finish_job(&self, st: &mut State, key: Option<OrderingKey>, job: Job, outcome: Outcome) -> bool {
        let mark = self.cfg.budget - self.low_water();
        let before = st.total;
        let key_low = self.cfg.per_key_depth - self.cfg.per_key_depth / 4;
        let key_refilled = st.finish(key, job, outcome, &self.stats, key_low);
        key_refilled || (before > mark && st.total <= mark)
    }

    /// Settles a job whose acknowledgement ran on its own task (see
    /// `worker`): the bookkeeping a worker does for its last job. Returns
    /// whether ready work has no worker and a worker place is free; the
    /// place is then taken (counted) and the caller runs the worker.
    fn settled(self: &Arc<Self>, key: Option<OrderingKey>, job: Job, outcome: Outcome) -> bool {
        let (refilled, spawn) = {
            let mut st = self.lock();
            let refilled = self.finish_job(&mut st, key, job, outcome);
            let spawn = !st.ready.is_empty() && st.workers < self.cfg.concurrency && !self.is_stopping();
            if spawn {
                st.workers += 1;
            }
            (refilled, spawn)
        };
        self.signal();
        if refilled {
            self.refilled();
        }
        spawn
    }

    /// Sleeps `d` unless shutdown starts first; returns `false` on shutdown.
    async fn nap(&self, d: Duration) -> bool {
        let stopped = self.stopping.stopped();
        if self.stopping.is_set() {
            return false;
        }
        matches!(rt::race(rt::sleep(d), stopped).await, Either::Left(()))
    }

    fn note_failure(&self, key: Option<&OrderingKey>) -> bool {
        let gb = self.cfg.global_backoff;
        if gb.distinct_keys == 0 {
            return false;
        }
        let now = Instant::now();
        let mut h = self.health.lock().unwrap_or_else(|e| e.into_inner());
        h.failures.push_back((now, key.map_or(0, OrderingKey::stable_hash)));
        while h
            .failures
            .front()
            .is_some_and(|(t, _)| now.duration_since(*t) > gb.window)
        {
            h.failures.pop_front();
        }
        if h.failures.len() > 4 * gb.distinct_keys.max(64) {
            h.failures.pop_front();
        }
        let mut distinct: Vec<u64> = h.failures.iter().map(|(_, k)| *k).collect();
        distinct.sort_unstable();
        distinct.dedup();
        let degraded = distinct.len() >= gb.distinct_keys;
        if degraded && h.paused_until.is_none_or(|t| t <= now) {
            h.paused_until = Some(now + gb.pause);
            bump(&self.stats.global_backoffs, "keyorder_global_backoffs_total");
            tracing::warn!(
                failing_keys = distinct.len(),
                pause_ms = gb.pause.as_millis() as u64,
                "failures span many keys: the subscription backs off as a whole"
            );
        }
        degraded
    }

    /// Whether failures currently span enough keys to count as an outage.
    fn is_degraded(&self) -> bool {
        let gb = self.cfg.global_backoff;
        if gb.distinct_keys == 0 {
            return false;
        }
        let now = Instant::now();
        let h = self.health.lock().unwrap_or_else(|e| e.into_inner());
        let mut distinct: Vec<u64> = h
            .failures
            .iter()
            .filter(|(t, _)| now.duration_since(*t) <= gb.window)
            .map(|(_, k)| *k)
            .collect();
        distinct.sort_unstable();
        distinct.dedup();
        distinct.len() >= gb.distinct_keys
    }

    async fn global_pause(&self) -> bool {
        let until = self.health.lock().unwrap_or_else(|e| e.into_inner()).paused_until;
        match until {
            Some(t) if t > Instant::now() => self.nap(t - Instant::now()).await,
            _ => !self.is_stopping(),
        }
    }

    /// The self-fence, abandoned on shutdown: `Some(fresh)`, or `None` when
    /// shutdown started while the scope was unconfirmed.
    async fn usable(&self, job: &Job) -> Option<bool> {
        let stopped = self.stopping.stopped();
        if self.stopping.is_set() && job.lease.state() != LeaseState::Fresh {
            return None;
        }
        let usable = job
            .lease
            .usable(|| bump(&self.stats.self_fence_pauses, "keyorder_self_fence_pauses_total"));
        match rt::race(usable, stopped).await {
            Either::Left(fresh) => Some(fresh),
            Either::Right(()) => match job.lease.state() {
                LeaseState::Fresh => Some(true),
                LeaseState::Lost => Some(false),
                LeaseState::Stale => None,
            },
        }
    }

    async fn process(&self, job: &Job) -> Outcome {
        let lease = &job.lease;
        let settle = &job.settle;
        let max = self.cfg.max_attempts();
        match self.usable(job).await {
            Some(true) => {}
            Some(false) => return self.discarded(job),
            None => return Outcome::Stopped,
        }
        let mut fenced_attempt: Option<u32> = None;
        let mut fenced_runs = 0u32;
        // The first run here of a message delivered before without being
        // settled (it may have crashed a process) runs alone; later local
        // retries did not crash and run beside others. A pass is held only
        // while an attempt is counted and its handler runs, never across a
        // back-off, a pause or a lease check: a suspect that waits must not
        // keep every other key waiting with it.
        let mut alone = settle.delivered_before();
        if alone {
            bump(&self.stats.isolated, "keyorder_isolated_runs_total");
        }
        loop {
            if !self.global_pause().await {
                return Outcome::Stopped;
            }
            match lease.state() {
                LeaseState::Fresh => {}
                LeaseState::Lost => return self.discarded(job),
                LeaseState::Stale => match self.usable(job).await {
                    Some(true) => {}
                    Some(false) => return self.discarded(job),
                    None => return Outcome::Stopped,
                },
            }
            let pass = if alone {
                rt::race(self.gate.exclusive(ISOLATION_WAIT), self.stopping.stopped()).await
            } else {
                rt::race(self.gate.shared(), self.stopping.stopped()).await
            };
            let pass = match pass {
                Either::Left(pass) => pass,
                Either::Right(()) => return Outcome::Stopped,
            };
            if lease.is_lost() {
                return self.discarded(job);
            }
            // After the handler's store refused the token, the same attempt
            // runs again: it was no failure of the message.
            let attempt = match fenced_attempt.take() {
                Some(n) => n,
                None => match settle.begin_attempt().await {
                    Ok(n) => n,
                    Err(Error::Fenced { .. }) => return self.fenced(job),
                    Err(err) => {
                        drop(pass);
                        tracing::warn!(error = %err, "attempt count not recorded; retrying");
                        if !self.nap(self.cfg.retry.initial_backoff).await {
                            return Outcome::Stopped;
                        }
                        continue;
                    }
                },
            };
            // Attempts already spent (by an earlier owner, or during an
            // outage): apply the policy without running, unless failures span
            // many keys, when the run doubles as a probe of the dependency.
            let (reason, poison) = if attempt > max && !self.is_degraded() {
                (format!("{} attempts already made (limit {max})", attempt - 1), true)
            } else {
                let delivery = Delivery {
                    message: job.message.clone(),
                    key: job.key.clone(),
                    attempt,
                    fencing_token: lease.generation(),
                    scope: lease.scope().clone(),
                };
                let span = tracing::info_span!(
                    "keyorder.delivery",
                    key = %job.key.as_ref().map_or_else(|| "keyless".to_owned(), OrderingKey::label),
                    attempt,
                    token = lease.generation(),
                );
                // Feature `otel`: the producer's span (the message's
                // `traceparent`) is this span's parent.
                crate::trace::continue_from(&span, job.message.headers());
                let run = AssertUnwindSafe(self.handler.handle(delivery)).catch_unwind();
                let started = std::time::Instant::now();
                let ran = tracing::Instrument::instrument(run, span).await;
                if let Some(m) = self.meters.get() {
                    m.handler.record(started.elapsed().as_secs_f64());
                }
                match ran {
                    Ok(Ok(())) => {
                        // Its acknowledgement is still to be made: counted
                        // before the pass goes, so a suspect waits for it
                        // too (a crash before it lands makes this message
                        // an attempt more); the worker's `Acking` ends it.
                        self.gate.ack_started();
                        return Outcome::Applied;
                    }
                    Ok(Err(HandlerError::Fenced(e))) => {
                        // Not acknowledged, and no failure of the message:
                        // the broker decides who owns the scope. A stale
                        // owner loses it at its next heartbeat (the job is
                        // then discarded above); until then the same
                        // attempt runs again after a back-off.
                        bump(&self.stats.handler_fenced, "keyorder_handler_fenced_total");
                        tracing::warn!(
                            scope = %lease.scope(),
                            token = lease.generation(),
                            error = %e,
                            "the handler's store refused the fencing token; not acknowledged, running it again \
                             while this instance still owns the scope"
                        );
                        self.report(job, Settlement::Fenced);
                        drop(pass);
                        fenced_runs += 1;
                        if !self.nap(self.cfg.retry.backoff(fenced_runs)).await {
                            return Outcome::Stopped;
                        }
                        fenced_attempt = Some(attempt);
                        continue;
                    }
                    Ok(Err(HandlerError::Retryable(e))) => (e.to_string(), false),
                    Ok(Err(HandlerError::Poison(e))) => (e.to_string(), true),
                    Err(_) => {
                        bump(&self.stats.panics, "keyorder_handler_panics_total");
                        ("handler panicked".to_owned(), true)
                    }
                }
            };
            drop(pass);
            alone = false;
            let degraded = self.note_failure(job.key.as_ref());
            if !poison && attempt < max {
                bump(&self.stats.retries, "keyorder_retries_total");
                if !self.nap(self.cfg.retry.backoff(attempt)).await {
                    return Outcome::Stopped;
                }
                continue;
            }
            if degraded && !poison {
                // A broken dependency, not a bad message: wait for the whole
                // subscription's back-off instead of halting a healthy key.
                continue;
            }
            return self.exhausted(job, &reason).await;
        }
    }

    fn fenced(&self, job: &Job) -> Outcome {
        bump(&self.stats.fence_rejections, "keyorder_fence_rejections_total");
        // The broker refused this owner: a loss, even when the heartbeat
        // finds it later (only the first marking counts).
        job.lease.lose_to_broker();
        self.report(job, Settlement::Fenced);
        Outcome::Lost
    }

    /// The self-fence discards a job whose scope was lost, before it ran.
    fn discarded(&self, job: &Job) -> Outcome {
        bump(&self.stats.self_fence_discards, "keyorder_self_fence_discards_total");
        self.report(job, Settlement::Discarded);
        Outcome::Lost
    }

    /// Tells the application's observer, if any, how `job` ended.
    fn report(&self, job: &Job, settlement: Settlement) {
        if let Some(hook) = self.observer.get() {
            let settled = Settled {
                id: job.message.id().to_owned(),
                key_label: job.key.as_ref().map(OrderingKey::label),
                fencing_token: job.lease.generation(),
                settlement,
            };
            // A panicking observer must not take the settlement's
            // bookkeeping with it (the key would stay busy for good).
            if std::panic::catch_unwind(AssertUnwindSafe(|| hook.call(&settled))).is_err() {
                bump(&self.stats.panics, "keyorder_handler_panics_total");
                tracing::error!("the on_settled observer panicked; the settlement itself stands");
            }
        }
    }

    /// Runs a broker settlement until it succeeds, is fenced, or shutdown.
    async fn settle_until<'a, F, Fut>(&self, job: &'a Job, what: &str, op: F) -> Result<(), Outcome>
    where
        F: Fn(&'a Job) -> Fut,
        Fut: std::future::Future<Output = crate::Result<()>> + 'a,
    {
        let mut attempt = 1;
        loop {
            match op(job).await {
                Ok(()) => return Ok(()),
                Err(Error::Fenced { .. }) => return Err(self.fenced(job)),
                Err(err) => {
                    tracing::warn!(error = %err, op = what, "broker settlement failed; retrying (the key waits)");
                    if job.lease.is_lost() {
                        return Err(Outcome::Lost);
                    }
                    if !self.nap(self.cfg.retry.backoff(attempt)).await {
                        return Err(Outcome::Stopped);
                    }
                    attempt += 1;
                }
            }
        }
    }

    async fn ack(&self, job: &Job) -> Outcome {
        match self.settle_until(job, "ack", |j| j.settle.ack()).await {
            Ok(()) => {
                bump(&self.stats.applied, "keyorder_applied_total");
                self.report(job, Settlement::Acknowledged);
                Outcome::Done
            }
            Err(outcome) => outcome,
        }
    }

    async fn exhausted(&self, job: &Job, reason: &str) -> Outcome {
        let label = job
            .key
            .as_ref()
            .map_or_else(|| "keyless".to_owned(), OrderingKey::label);
        // A keyless message holds no key to halt: it is parked.
        let policy = if job.key.is_none() {
            PoisonPolicy::Park { max_attempts: 1 }
        } else {
            self.cfg.poison
        };
        match policy {
            PoisonPolicy::Park { .. } => match self.settle_until(job, "park", |j| j.settle.park(reason)).await {
                Ok(()) => {
                    bump(&self.stats.parked, "keyorder_parked_total");
                    self.report(job, Settlement::Parked);
                    tracing::warn!(key = %label, id = job.message.id(), reason, "head parked; key released (gap)");
                    Outcome::Done
                }
                Err(outcome) => outcome,
            },
            PoisonPolicy::Halt => match self.settle_until(job, "halt", |j| j.settle.halt(reason)).await {
                Ok(()) => {
                    bump(&self.stats.halts, "keyorder_halts_total");
                    self.report(job, Settlement::Halted);
                    self.stats.halted_now.fetch_add(1, Ordering::Relaxed);
                    metrics::gauge!("keyorder_halted_keys").increment(1.0);
                    tracing::error!(key = %label, id = job.message.id(), reason, "key halted at a poison head");
                    Outcome::Halted
                }
                Err(outcome) => outcome,
            },
        }
    }
}
