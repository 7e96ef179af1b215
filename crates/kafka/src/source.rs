//! The source: a consumer-group member polled on a thread of its own, the
//! partitions it owns, the commits, and the self-fence.
//!
//! - **Poll thread.** librdkafka serves rebalances inside `poll`, so a
//!   dedicated thread polls and forwards messages and rebalance events, in
//!   order, to the async side. The member and its thread start at the
//!   subscription's first call, not when it is built.
//! - **Assign.** The thread reads the committed offsets and their metadata
//!   first, forwards them, then assigns from exactly those offsets. The read
//!   holds the poll, so it is bounded well under `max.poll.interval.ms`;
//!   partitions it could not read in time do not start, and the member
//!   rejoins. Their leases count as confirmed when the callback began.
//! - **Revoke.** The thread forwards the revoke and waits: the subscription
//!   takes no new work from those partitions, lets their in-flight handlers
//!   return, the final commit is made, and only then does the thread let the
//!   partitions go. A partition the broker already gave away (assignment
//!   lost) is dropped at once, uncommitted.
//! - **Commits** are made by one committer task, so they never go backwards:
//!   each `ack`, attempt and halt waits for the commit that carries it.
//! - **Self-fence.** A heartbeat task confirms every owned partition with a
//!   round trip to the group coordinator. If no confirmation succeeded for
//!   longer than the session timeout less a heartbeat (a `SIGSTOP`, a
//!   network cut), the broker may have given the partitions away: they are
//!   all marked lost and the member is replaced by a new one. A round trip
//!   confirms only while librdkafka does not hold the assignment lost: the
//!   coordinator answers an expelled member's offset fetch too. A poll
//!   held past `max.poll.interval.ms` (librdkafka leaves the group) loses
//!   every partition at once.

use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc as std_mpsc, Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use keyorder_core::{Inbound, OrderingKey, Result, ScopeLease, SourceEvent, SourceSpec, TransportSource};
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext};
use rdkafka::message::OwnedMessage;
use rdkafka::types::{RDKafkaErrorCode, RDKafkaRespErr};
use rdkafka::{ClientContext, Message as _, Offset, TopicPartitionList};
use tokio::sync::{mpsc, watch, Notify};
use tokio::time::Instant;

use crate::broker::KafkaTransport;
use crate::config::{base_config, Assignor, StartAt};
use crate::error::{create_err, fenced, kafka_err, layout_changed};
use crate::names::Names;
use crate::settle::KafkaSettle;
use crate::state;
use crate::track::{decode, Admit, Track};
use crate::wire::{message_of, partition_for};

/// What the poll thread tells the async side, in order.
pub(crate) enum Ev {
    /// Partitions assigned: (partition, committed offset, saved generation,
    /// commit metadata, older generations' records found), and when the assignment was known valid (the
    /// rebalance callback's entry): the leases are confirmed as of then,
    /// not as of when the event is applied, however long the read took.
    Assigned {
        parts: Vec<(i32, i64, u64, String, Vec<u64>, String)>,
        at: Instant,
    },
    /// Partitions revoked; `reply` is dropped or sent once they may go.
    Revoke {
        parts: Vec<i32>,
        lost: bool,
        reply: std_mpsc::SyncSender<()>,
    },
    Msg(OwnedMessage),
    Error(String),
}

pub(crate) struct Ctx {
    tx: mpsc::UnboundedSender<Ev>,
    stopping: Arc<AtomicBool>,
    topic: String,
    names: Names,
    group_id: String,
    /// Reads state records (outside the group).
    reader: state::Reader,
    producer: rdkafka::producer::FutureProducer,
    instance: String,
    /// The longest a revoke may wait for its partitions to drain: less
    /// than `max.poll.interval.ms`, past which the broker expels a member
    /// whose poll is held.
    revoke_wait: Duration,
    /// The longest an assignment may wait for its saved progress: well
    /// under `revoke_wait` (see `start_member`).
    load_wait: Duration,
    shared: std::sync::Weak<Shared>,
    /// The assignor is `cooperative-sticky` (incremental assign and revoke).
    cooperative: bool,
}

impl ClientContext for Ctx {}

fn parts_of(tpl: &TopicPartitionList, topic: &str) -> Vec<i32> {
    tpl.elements()
        .iter()
        .filter(|e| e.topic() == topic)
        .map(|e| e.partition())
        .collect()
}

impl Ctx {
    /// Where each of `fresh` (partitions without saved progress) starts,
    /// as the `start` option says; absent: at the beginning.
    fn first_offsets(
        &self,
        c: &BaseConsumer<Self>,
        fresh: &[i32],
        deadline: std::time::Instant,
    ) -> std::result::Result<HashMap<i32, i64>, String> {
        let mut out = HashMap::new();
        let Some(shared) = self.shared.upgrade() else {
            return Ok(out);
        };
        // A partition's (low, high) watermarks, within the callback's wait.
        let watermarks = |p: i32| {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Err("the assignment's wait ran out".to_owned());
            }
            c.fetch_watermarks(&self.topic, p, left.min(Duration::from_secs(10)))
                .map_err(|e| e.to_string())
        };
        match &shared.t.cfg.start {
            StartAt::Earliest => {}
            StartAt::Group(_) => {
                for p in fresh {
                    if let Some(o) = shared.start_offsets.get(p) {
                        // Within what the partition holds: an offset past
                        // its end (another topic's of the same name) would
                        // skip what comes next.
                        let (low, high) = watermarks(*p)?;
                        if *o > high {
                            tracing::warn!(partition = p, "kafka: start=group: the group's committed offset lies past the partition's end; starting at the end");
                        }
                        out.insert(*p, (*o).min(high).max(low));
                    }
                }
            }
            StartAt::Latest => {
                for p in fresh {
                    out.insert(*p, watermarks(*p)?.1);
                }
            }
        }
        Ok(out)
    }
}

impl ConsumerContext for Ctx {
    fn rebalance(&self, c: &BaseConsumer<Self>, err: RDKafkaRespErr, tpl: &mut TopicPartitionList) {
        // From the configuration, not `c.rebalance_protocol()`: that asks
        // librdkafka's main thread, which never answers while the consumer
        // is being destroyed (a last reference dropped off the poll thread
        // serves a final revoke from inside the drop: seen hanging a
        // process at exit).
        let cooperative = self.cooperative;
        match err {
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS => {
                // The group gave these partitions now; the read below may
                // take long, and the assignment is only known valid as of
                // here.
                let at = Instant::now();
                let deadline = std::time::Instant::now() + self.load_wait;
                // Read the saved progress first: the assignment starts
                // exactly where the state it comes with was written.
                // A partition beyond the layout (added to the topic while
                // in use) has no state partition and is never started: the
                // subscription stops at its next `maintain` (C23).
                let layout = self.shared.upgrade().map_or(i32::MAX, |s| s.partitions);
                let (parts, outside): (Vec<i32>, Vec<i32>) =
                    parts_of(tpl, &self.topic).into_iter().partition(|p| *p < layout);
                if let (Some(p), Some(shared)) = (outside.iter().max(), self.shared.upgrade()) {
                    shared.outside_layout.fetch_max(p + 1, Ordering::SeqCst);
                }
                tracing::debug!(instance = %self.instance, ?parts, "kafka: the group assigns; reading saved progress");
                // Never start without it: a partition taken from its committed
                // offset alone would run finished messages again. Retried up
                // to `load_wait` only: the poll is held meanwhile, and a
                // rebalance the group starts now waits for this member's
                // rejoin at most `max.poll.interval.ms` before expelling it.
                let limit = state::Limit {
                    until: Some(deadline),
                    stop: &self.stopping,
                };
                let mut saved = None;
                // A static member that found a gap, or failed for good,
                // starts nothing until it has checked for a newer
                // incarnation (see `Shared::newer_incarnation`): librdkafka
                // may rejoin on its own meanwhile.
                let held = self.shared.upgrade().is_some_and(|s| {
                    s.static_member
                        && (s.replace.load(Ordering::SeqCst)
                            || s.fatal.lock().unwrap_or_else(|e| e.into_inner()).is_some())
                });
                // And every assignment of a static member checks first: a
                // stalled incarnation's librdkafka may rejoin by itself.
                let mut held = held;
                let current = |s: &Shared| s.member().is_some_and(|m| std::ptr::eq(Arc::as_ptr(&m), c));
                if let Some(shared) = self
                    .shared
                    .upgrade()
                    .filter(|s| s.static_member && !held && !self.stopping.load(Ordering::SeqCst) && current(s))
                {
                    loop {
                        match shared.newer_incarnation_with(&self.reader, Duration::from_secs(5), Some(deadline)) {
                            Ok(false) => break,
                            Ok(true) => {
                                held = true;
                                break;
                            }
                            Err(e)
                                if self.stopping.load(Ordering::SeqCst)
                                    || std::time::Instant::now() + Duration::from_secs(1) >= deadline =>
                            {
                                tracing::warn!(instance = %self.instance, error = %e, "kafka: static member could not check for a newer incarnation; not starting the assigned partitions");
                                if current(&shared) {
                                    shared.replace.store(true, Ordering::SeqCst);
                                }
                                held = true;
                                break;
                            }
                            Err(_) => {
                                // The poll thread, not a runtime worker.
                                #[allow(clippy::disallowed_methods)]
                                std::thread::sleep(Duration::from_millis(200));
                            }
                        }
                    }
                }
                if held {
                    tracing::debug!(instance = %self.instance, ?parts, "kafka: static member not checked; not starting the assigned partitions");
                }
                while !held
                    && saved.is_none()
                    && !self.stopping.load(Ordering::SeqCst)
                    && std::time::Instant::now() < deadline
                {
                    match state::load(
                        c,
                        &self.reader,
                        &self.producer,
                        &self.names,
                        &self.group_id,
                        &parts,
                        Duration::from_secs(10),
                        limit,
                    ) {
                        Ok(list) => saved = Some(list),
                        Err(e) => {
                            let _ = self
                                .tx
                                .send(Ev::Error(format!("reading saved progress: {e}; retrying")));
                            // A broker refusing at once is not asked in a spin.
                            // This is the poll thread, not a runtime worker.
                            #[allow(clippy::disallowed_methods)]
                            std::thread::sleep(Duration::from_millis(200));
                        }
                    }
                }
                if !held && saved.is_none() && !self.stopping.load(Ordering::SeqCst) {
                    // Not loadable in time: none of these start here. The
                    // member leaves and rejoins, so that the group hands
                    // them out again (to this member or another) rather
                    // than leaving them with a member that runs none.
                    tracing::warn!(
                        instance = %self.instance,
                        ?parts,
                        wait_ms = self.load_wait.as_millis() as u64,
                        "kafka: saved progress not read in time; not starting the assigned partitions, rejoining"
                    );
                    if let Some(shared) = self.shared.upgrade() {
                        shared.replace.store(true, Ordering::SeqCst);
                    }
                } else if saved.is_some() && c.assignment_lost() {
                    // The group expelled this member while it read (and the
                    // assign call below would clear the flag): nothing starts,
                    // what it owned from before is lost too, and the member
                    // rejoins (as after a gap) so that no partition stays
                    // with it unread.
                    tracing::warn!(instance = %self.instance, ?parts, "kafka: assignment lost while reading saved progress; rejoining");
                    saved = None;
                    if let Some(shared) = self.shared.upgrade() {
                        shared.lose_all("the assignment was lost while reading saved progress");
                        shared.replace.store(true, Ordering::SeqCst);
                    }
                }
                // Where partitions this group never consumed start (the
                // `start` option); not readable in time: none start, the
                // member rejoins (as for saved progress).
                let mut firsts = HashMap::new();
                if let Some(list) = &saved {
                    let fresh: Vec<i32> = list.iter().filter(|s| !s.known).map(|s| s.partition).collect();
                    match self.first_offsets(c, &fresh, deadline) {
                        Ok(f) => firsts = f,
                        Err(e) => {
                            tracing::warn!(instance = %self.instance, error = %e, "kafka: start offsets not read in time; not starting the assigned partitions, rejoining");
                            saved = None;
                            if let Some(shared) = self.shared.upgrade() {
                                shared.replace.store(true, Ordering::SeqCst);
                            }
                        }
                    }
                }
                let mut assign = TopicPartitionList::new();
                if let Some(saved) = saved {
                    let mut info = Vec::new();
                    for mut s in saved {
                        let from = if s.known {
                            Offset::Offset(s.committed)
                        } else if let Some(first) = firsts.get(&s.partition) {
                            // The track starts there too, so that its first
                            // commit does not point back to the beginning.
                            s.committed = *first;
                            Offset::Offset(*first)
                        } else {
                            Offset::Beginning
                        };
                        let _ = assign.add_partition_offset(&self.topic, s.partition, from);
                        info.push((s.partition, s.committed, s.generation, s.meta, s.older, s.claim));
                    }
                    tracing::debug!(instance = %self.instance, ?parts, "kafka: saved progress read");
                    let _ = self.tx.send(Ev::Assigned { parts: info, at });
                }
                let r = if cooperative {
                    c.incremental_assign(&assign)
                } else {
                    c.assign(&assign)
                };
                if let Err(e) = r {
                    let _ = self.tx.send(Ev::Error(format!("assign: {e}")));
                }
            }
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__REVOKE_PARTITIONS => {
                let parts = parts_of(tpl, &self.topic);
                tracing::debug!(instance = %self.instance, ?parts, "kafka: the group revokes");
                if !parts.is_empty() && !self.stopping.load(Ordering::SeqCst) {
                    let (reply, wait) = std_mpsc::sync_channel(1);
                    let lost = c.assignment_lost();
                    let asked = parts.clone();
                    if self.tx.send(Ev::Revoke { parts, lost, reply }).is_ok() {
                        // Until the partitions drained and committed, or the
                        // source went away (the sender is dropped), at most
                        // `revoke_wait`: past it they are lost here first
                        // (their handlers' settlements are refused), so that
                        // the poll returns before the broker expels the member.
                        if let Err(std_mpsc::RecvTimeoutError::Timeout) = wait.recv_timeout(self.revoke_wait) {
                            tracing::warn!(
                                instance = %self.instance,
                                partitions = asked.len(),
                                wait_ms = self.revoke_wait.as_millis() as u64,
                                "kafka: revoked partitions did not drain in time (max.poll.interval.ms less the session timeout); handing them over as lost"
                            );
                            if let Some(shared) = self.shared.upgrade() {
                                shared.lose_parts(&asked, false);
                            }
                        }
                    }
                }
                let r = if cooperative {
                    c.incremental_unassign(tpl)
                } else {
                    c.unassign()
                };
                if let Err(e) = r {
                    let _ = self.tx.send(Ev::Error(format!("unassign: {e}")));
                }
            }
            other => {
                let _ = self.tx.send(Ev::Error(format!("rebalance error: {other:?}")));
            }
        }
    }
}

pub(crate) type Member = BaseConsumer<Ctx>;

/// One owned partition, shared with its deliveries' settles.
pub(crate) struct Part {
    pub(crate) partition: i32,
    pub(crate) lease: Arc<ScopeLease>,
    pub(crate) track: Mutex<Track>,
    /// The track version the newest state write carried (sent, durable).
    sent_version: AtomicU64,
    saved_version: AtomicU64,
    /// Being handed over: the committer still commits it.
    releasing: AtomicBool,
    /// Halted heads held here, by offset (for the operator's actions).
    heads: Mutex<HashMap<i64, HeldHead>>,
    /// Generations of earlier owners' records the claim found, whose keys
    /// are deleted after this owner's first checked pointer move.
    superseded: Mutex<Vec<u64>>,
    /// The marker this owner's claim appended (see [`state::newer_claims`]).
    claim: String,
}

/// How long a static member may fail to check for a newer incarnation
/// before it fails for good (see [`Shared::newer_incarnation_with`]).
const UNCHECKED_LIMIT: Duration = Duration::from_secs(300);

/// A static member's incarnation: its record's token, the state partition
/// that holds it, and where the next check reads from.
#[derive(Clone, Debug)]
struct Incarnation {
    token: String,
    partition: i32,
    from: i64,
    first: bool,
}

/// A halted head as the owner keeps it.
#[derive(Clone)]
pub(crate) struct HeldHead {
    pub(crate) offset: i64,
    pub(crate) key: String,
    pub(crate) payload: keyorder_core::Bytes,
    pub(crate) headers: Option<rdkafka::message::OwnedHeaders>,
}

impl Part {
    pub(crate) fn hold_head(&self, head: HeldHead) {
        self.heads
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(head.offset, head);
    }

    pub(crate) fn held_head(&self, key_label: &str) -> Option<HeldHead> {
        self.heads
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .find(|h| keyorder_core::key::label(&h.key) == key_label)
            .cloned()
    }

    pub(crate) fn forget_head(&self, offset: i64) {
        self.heads.lock().unwrap_or_else(|e| e.into_inner()).remove(&offset);
    }

    pub(crate) fn track(&self) -> std::sync::MutexGuard<'_, Track> {
        self.track.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// State rounds in flight at once (each waits for its records' delivery
/// reports; acknowledgements wait for the round that carries them). Fewer,
/// larger rounds cost the broker less: measured on tansu at 100 keys and a
/// 1 ms handler, 8 in flight ran 6,500-7,000 msg/s, 4 about 7,800, 2 about
/// 9,000 (before the pointer commits were spaced out).
const MAX_ROUNDS: usize = 2;

/// The topic partitions' committed offsets (for lag and other tools) go
/// out at most this often, without waiting. One commit per round cost the
/// broker a group-coordinator request per round.
const POINTER_EVERY: Duration = Duration::from_millis(250);

/// The state partitions' pointers are moved, with a check (see [`state`]),
/// at most this often and at every hand-over. A new owner reads the state
/// partition from the pointer to its end, so a late pointer only lengthens
/// that read; an acknowledgement waits for its state record, never for a
/// pointer.
pub(crate) const CHECKPOINT_EVERY: Duration = Duration::from_secs(2);

/// Commits not yet sent.
struct Pointers {
    last: Instant,
    /// partition -> committed offset of the topic partition.
    pending: HashMap<i32, i64>,
    /// partition -> (the writer's generation, offset of its newest state
    /// record).
    state: HashMap<i32, (u64, i64)>,
}

/// What the source shares with its settles, committer and heartbeat.
pub(crate) struct Shared {
    pub(crate) t: KafkaTransport,
    pub(crate) names: Names,
    pub(crate) group: String,
    pub(crate) ordered: bool,
    pub(crate) partitions: i32,
    member: Mutex<Option<Arc<Member>>>,
    pub(crate) parts: Mutex<HashMap<i32, Arc<Part>>>,
    /// Commit requests and completions (sequence numbers).
    wanted: AtomicU64,
    completed: watch::Sender<u64>,
    wake: Notify,
    /// The last broker-confirmed ownership (sent time).
    last_confirm: Mutex<Instant>,
    /// The self-fence found a gap: replace the member.
    pub(crate) replace: AtomicBool,
    /// Session timeout less one heartbeat: past it, ownership is presumed lost.
    gap: Duration,
    /// Operator actions for the owner (in-process admin).
    pub(crate) events: Mutex<Vec<SourceEvent>>,
    closed: AtomicBool,
    pointers: Mutex<Pointers>,
    /// Reads the state partitions for the pointer checks (outside the group).
    checker: Mutex<Option<state::Reader>>,
    /// The heartbeat's round trip to the group coordinator, on its own
    /// connection (see [`membership_confirmed`]); created at first use.
    prober: Mutex<Option<Arc<BaseConsumer>>>,
    /// One pointer check at a time.
    checking: tokio::sync::Mutex<()>,
    /// The highest partition beyond the layout the group assigned, plus
    /// one (0: none); never loaded or started (C23).
    outside_layout: std::sync::atomic::AtomicI32,
    /// The subscription's instance id (`group.instance.id` of a static member).
    pub(crate) instance: String,
    /// Joined as a static member.
    pub(crate) static_member: bool,
    /// A static member's incarnation record (see [`Shared::newer_incarnation`]).
    incarnation: Mutex<Option<Incarnation>>,
    /// Whether a record with an unusable (empty) key was reported.
    pub(crate) unusable_key_reported: AtomicBool,
    /// Whether a record on another partition than its key's was reported.
    pub(crate) misplaced_key_reported: AtomicBool,
    /// Whether a failure to create the prober was reported.
    prober_reported: AtomicBool,
    /// Since when the incarnation check has failed (`None`: it last passed).
    unchecked_since: Mutex<Option<Instant>>,
    /// `start=group:<id>`: that group's committed offsets, read at open.
    start_offsets: HashMap<i32, i64>,
    /// Why librdkafka gave this member up for good (a fatal error, such as
    /// another consumer joining with its `group.instance.id`).
    fatal: Mutex<Option<String>>,
}

impl fmt::Debug for Shared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KafkaShared")
            .field("topic", &self.names.topic())
            .finish()
    }
}

impl Shared {
    fn member(&self) -> Option<Arc<Member>> {
        self.member.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The partitions owned now.
    fn owned(&self) -> Vec<Arc<Part>> {
        self.parts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .cloned()
            .collect()
    }

    pub(crate) fn part(&self, partition: i32) -> Option<Arc<Part>> {
        self.parts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&partition)
            .cloned()
    }

    /// Marks every owned partition lost when ownership was not confirmed
    /// for longer than the broker keeps a silent member. Returns whether it did.
    pub(crate) fn check_gap(&self) -> bool {
        let mut guard = self.last_confirm.lock().unwrap_or_else(|e| e.into_inner());
        let last = *guard;
        if last.elapsed() <= self.gap {
            return false;
        }
        if self.parts.lock().unwrap_or_else(|e| e.into_inner()).is_empty() {
            // Nothing owned, nothing to lose: the next assignment confirms.
            *guard = Instant::now();
            return false;
        }
        drop(guard);
        let lost: Vec<Arc<Part>> = self
            .parts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain()
            .map(|(_, p)| p)
            .collect();
        if !lost.is_empty() {
            metrics::counter!("keyorder_kafka_partitions_lost_total").increment(lost.len() as u64);
            tracing::warn!(
                partitions = lost.len(),
                silent_ms = last.elapsed().as_millis() as u64,
                "kafka: ownership unconfirmed past the session timeout; partitions lost, rejoining"
            );
        }
        for p in lost {
            p.lease.lose();
        }
        self.replace.store(true, Ordering::SeqCst);
        self.completed.send_modify(|_| {});
        true
    }

    /// Asks for a commit carrying everything recorded so far and waits for
    /// it; fails with `Fenced` once `part` was lost.
    pub(crate) async fn commit_through(&self, part: &Part) -> Result<()> {
        let seq = self.wanted.fetch_add(1, Ordering::SeqCst) + 1;
        self.wake.notify_one();
        let mut rx = self.completed.subscribe();
        let lease = &part.lease;
        let r = rx.wait_for(|done| *done >= seq || lease.is_lost()).await;
        if r.is_err() || lease.is_lost() {
            return Err(fenced(lease));
        }
        Ok(())
    }

    /// The committer: writes the state of every changed partition in
    /// rounds, up to [`MAX_ROUNDS`] in flight. Rounds complete in order (records of
    /// one partition are appended in order by the idempotent producer), so
    /// a completed request number means everything recorded before it is
    /// durable. A failed round is covered by the next: a partition stays
    /// changed until a round carrying it succeeded.
    async fn committer(self: Arc<Self>) {
        use futures::stream::{FuturesOrdered, StreamExt};
        let mut tick = tokio::time::interval(Duration::from_millis(500));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut rounds = FuturesOrdered::new();
        let mut started = 0u64;
        loop {
            if self.closed.load(Ordering::SeqCst) {
                return;
            }
            let wanted = self.wanted.load(Ordering::SeqCst);
            let mut ticked = false;
            if wanted <= started || rounds.len() >= MAX_ROUNDS {
                tokio::select! {
                    () = self.wake.notified() => {}
                    _ = tick.tick() => ticked = true,
                    Some(done) = rounds.next(), if !rounds.is_empty() => {
                        self.finish(done);
                        continue;
                    }
                }
                if rounds.len() >= MAX_ROUNDS {
                    continue;
                }
            }
            let target = self.wanted.load(Ordering::SeqCst);
            if target <= started && !ticked {
                continue;
            }
            if self.check_gap() {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
            let Some(member) = self.member() else {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            };
            if ticked {
                self.commit_pointers(&member, false);
            }
            let parts = self.owned();
            let mut dirty = Vec::new();
            for p in &parts {
                if p.lease.is_lost() {
                    continue;
                }
                let (version, committed, hw, meta) = {
                    let t = p.track();
                    let (committed, hw, meta) = t.commit(self.partitions);
                    (t.version, committed, hw, meta)
                };
                if version > p.sent_version.load(Ordering::SeqCst) {
                    p.sent_version.fetch_max(version, Ordering::SeqCst);
                    dirty.push(Write {
                        part: p.clone(),
                        version,
                        committed,
                        hw,
                        meta,
                    });
                }
            }
            started = started.max(target);
            tracing::trace!(
                target,
                partitions = dirty.len(),
                in_flight = rounds.len(),
                "kafka: state round"
            );
            let me = self.clone();
            rounds.push_back(async move {
                let ok = me.write(&member, &dirty).await;
                (target, ok, dirty)
            });
        }
    }

    /// Writes one round's state records, then sends the pointer commit.
    async fn write(&self, member: &Member, dirty: &[Write]) -> bool {
        if dirty.is_empty() {
            return true;
        }
        // Behind the self-fence: nothing is written for a partition that may
        // have been given away.
        if self.check_gap() || dirty.iter().any(|w| w.part.lease.is_lost()) {
            return false;
        }
        let state_topic = self.names.state();
        let group_id = self.names.group_id(&self.group);
        let writes = dirty.iter().map(|w| {
            let generation = w.part.lease.generation();
            let value = state::encode(generation, w.committed, &w.meta);
            let key = state::record_key(&group_id, generation);
            let (t, topic) = (&self.t, &state_topic);
            async move {
                t.produce_state(topic, w.part.partition, key.as_bytes(), value.as_bytes())
                    .await
            }
        });
        let written = futures::future::join_all(writes).await;
        let mut ok = true;
        {
            let mut pointers = self.pointers.lock().unwrap_or_else(|e| e.into_inner());
            for (w, r) in dirty.iter().zip(written) {
                match r {
                    Ok((_, at)) => {
                        let generation = w.part.lease.generation();
                        let e = pointers.state.entry(w.part.partition).or_insert((generation, at));
                        if at >= e.1 {
                            *e = (generation, at);
                            pointers.pending.insert(w.part.partition, w.committed);
                        }
                    }
                    Err(e) => {
                        ok = false;
                        metrics::counter!("keyorder_kafka_state_write_errors_total").increment(1);
                        tracing::warn!(error = %e, "kafka: writing partition state failed; retrying");
                    }
                }
            }
        }
        self.commit_pointers(member, false);
        ok
    }

    /// Sends the pending commits of the topic partitions' committed offsets
    /// (for lag and other tools), without waiting, if [`POINTER_EVERY`]
    /// passed since the last (or `now`). Only partitions still owned, and
    /// only behind the self-fence, are committed.
    fn commit_pointers(&self, member: &Member, now: bool) {
        if self.check_gap() {
            return;
        }
        let pending = {
            let mut pointers = self.pointers.lock().unwrap_or_else(|e| e.into_inner());
            if pointers.pending.is_empty() || (!now && pointers.last.elapsed() < POINTER_EVERY) {
                return;
            }
            pointers.last = Instant::now();
            std::mem::take(&mut pointers.pending)
        };
        let mut tpl = TopicPartitionList::new();
        for (partition, committed) in pending {
            if self.part(partition).is_none_or(|p| p.lease.is_lost()) {
                continue;
            }
            let _ = tpl.add_partition_offset(self.names.topic(), partition, Offset::Offset(committed));
        }
        if tpl.count() > 0 {
            if let Err(e) = member.commit(&tpl, CommitMode::Async) {
                tracing::debug!(error = %e, "kafka: offset commit not sent");
            }
        }
    }

    /// Moves the state partitions' pointers to the newest records written
    /// (see [`state::advance`]), checking first that no newer owner wrote:
    /// a partition that one did is lost, and the member is replaced. Waits
    /// for the check; the commit itself is sent without waiting.
    pub(crate) async fn checkpoint(self: &Arc<Self>) {
        let _one = self.checking.lock().await;
        let Some(member) = self.member() else { return };
        if self.check_gap() {
            return;
        }
        let list: Vec<(i32, u64, i64)> = {
            let mut pointers = self.pointers.lock().unwrap_or_else(|e| e.into_inner());
            std::mem::take(&mut pointers.state)
                .into_iter()
                .filter(|(p, (g, _))| {
                    self.part(*p)
                        .is_some_and(|part| !part.lease.is_lost() && part.lease.generation() == *g)
                })
                .map(|(p, (g, at))| (p, g, at))
                .collect()
        };
        if list.is_empty() {
            return;
        }
        let me = self.clone();
        let (group_id, names) = (self.names.group_id(&self.group), self.names.clone());
        let asked = list.clone();
        let claims: HashMap<i32, String> = list
            .iter()
            .filter_map(|(p, _, _)| self.part(*p).map(|part| (*p, part.claim.clone())))
            .collect();
        let checked_claims = claims.clone();
        let checked = tokio::task::spawn_blocking(move || {
            let prober = me.prober()?;
            me.with_checker(|reader| {
                state::advance(
                    &*member,
                    &prober,
                    reader,
                    &me.t.state_producer,
                    &names,
                    &group_id,
                    &asked,
                    &claims,
                    Duration::from_secs(10),
                    CommitMode::Async,
                    // A close does not wait out the check's read.
                    state::Limit {
                        until: None,
                        stop: &me.closed,
                    },
                )
            })
        })
        .await;
        match checked {
            Ok(Ok(stale)) => {
                if !stale.is_empty() {
                    // A static member does not rejoin: under its instance
                    // id it would take them back from a newer incarnation.
                    self.lose_claims(&stale, Some(&checked_claims), !self.static_member);
                }
                self.tombstone_superseded(&list, &stale).await;
            }
            other => {
                let error = match other {
                    Ok(Err(e)) => e.to_string(),
                    Err(e) => e.to_string(),
                    Ok(Ok(_)) => String::new(),
                };
                tracing::debug!(error = %error, "kafka: state pointer check failed; retrying at the next");
                // Try again with these, unless newer records came meanwhile.
                let mut pointers = self.pointers.lock().unwrap_or_else(|e| e.into_inner());
                for (p, g, at) in list {
                    pointers.state.entry(p).or_insert((g, at));
                }
            }
        }
    }

    /// Deletes the keys of the earlier owners' records each claim found
    /// (see [`state::tombstone`]) for the partitions whose pointer check
    /// just passed with a durable record of this owner's generation: the
    /// state topic would otherwise keep a key per generation for good.
    async fn tombstone_superseded(&self, checked: &[(i32, u64, i64)], stale: &[i32]) {
        let group_id = self.names.group_id(&self.group);
        for (partition, generation, _) in checked {
            if stale.contains(partition) {
                continue;
            }
            let Some(part) = self.part(*partition) else { continue };
            if part.lease.is_lost() || part.lease.generation() != *generation {
                continue;
            }
            let older: Vec<u64> = std::mem::take(&mut *part.superseded.lock().unwrap_or_else(|e| e.into_inner()))
                .into_iter()
                .filter(|g| g < generation)
                .collect();
            if older.is_empty() {
                continue;
            }
            match state::tombstone(&self.t.state_producer, &self.names, &group_id, *partition, &older).await {
                Ok(()) => {
                    tracing::debug!(partition, generations = ?older, "kafka: earlier owners' state records deleted");
                }
                Err(e) => {
                    tracing::debug!(error = %e, partition, "kafka: deleting earlier owners' state records failed; retrying at the next check");
                    part.superseded.lock().unwrap_or_else(|e| e.into_inner()).extend(older);
                }
            }
        }
    }

    /// Drops partitions this member can no longer hold: a newer owner wrote
    /// state for them (a stall, a cut from the coordinator), or their revoke
    /// did not drain in time. Their leases are lost before they go.
    pub(crate) fn lose_parts(&self, stale: &[i32], rejoin: bool) {
        self.lose_claims(stale, None, rejoin);
    }

    /// As [`Shared::lose_parts`], for what a claim check found stale: only
    /// the claims it checked (`claims`) are lost. A partition claimed here
    /// again since (the group handed it back during the check) holds a
    /// newer claim, which the check read as another owner's: it stays.
    fn lose_claims(&self, stale: &[i32], claims: Option<&HashMap<i32, String>>, rejoin: bool) {
        let lost: Vec<Arc<Part>> = {
            let mut parts = self.parts.lock().unwrap_or_else(|e| e.into_inner());
            let checked: Vec<i32> = stale
                .iter()
                .copied()
                .filter(|p| match (claims.map(|c| c.get(p)), parts.get(p)) {
                    (None, _) => true,
                    (Some(c), Some(part)) => c == Some(&part.claim),
                    (Some(_), None) => false,
                })
                .collect();
            checked.iter().filter_map(|p| parts.remove(p)).collect()
        };
        if lost.is_empty() {
            return;
        }
        metrics::counter!("keyorder_kafka_partitions_lost_total").increment(lost.len() as u64);
        tracing::warn!(
            partitions = lost.len(),
            rejoin,
            "kafka: partitions lost (a newer owner wrote their state, or their revoke did not drain in time)"
        );
        for p in lost {
            p.lease.lose();
        }
        if rejoin {
            self.replace.store(true, Ordering::SeqCst);
        }
        self.completed.send_modify(|_| {});
    }

    /// Drops every owned partition: the member's assignment was lost (the
    /// group expelled it: `max.poll.interval.ms` exceeded, or expelled
    /// while an assignment read its state), a gap in membership as the
    /// self-fence's. librdkafka rejoins by itself, and the lost revoke
    /// that follows finds nothing left to wait for.
    pub(crate) fn lose_all(&self, why: &str) {
        let lost: Vec<Arc<Part>> = self
            .parts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain()
            .map(|(_, p)| p)
            .collect();
        if lost.is_empty() {
            return;
        }
        metrics::counter!("keyorder_kafka_partitions_lost_total").increment(lost.len() as u64);
        tracing::warn!(
            partitions = lost.len(),
            why,
            "kafka: assignment lost; every partition lost"
        );
        for p in lost {
            p.lease.lose();
        }
        self.completed.send_modify(|_| {});
    }

    /// Moves the state pointers every [`CHECKPOINT_EVERY`].
    async fn checkpointer(self: Arc<Self>) {
        let mut tick = tokio::time::interval(CHECKPOINT_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            if self.closed.load(Ordering::SeqCst) {
                return;
            }
            self.checkpoint().await;
        }
    }

    /// A round completed (in order).
    fn finish(&self, (target, ok, dirty): (u64, bool, Vec<Write>)) {
        if ok {
            for w in &dirty {
                w.part.saved_version.fetch_max(w.version, Ordering::SeqCst);
                w.part.track().saved(w.hw);
            }
            metrics::counter!("keyorder_kafka_state_writes_total").increment(1);
            self.completed.send_modify(|d| *d = (*d).max(target));
        } else {
            // Write these again in the next round.
            for w in &dirty {
                w.part
                    .sent_version
                    .store(w.part.saved_version.load(Ordering::SeqCst), Ordering::SeqCst);
            }
            self.wanted.fetch_add(1, Ordering::SeqCst);
            self.wake.notify_one();
        }
    }

    /// Runs `f` with the state reader the checks share (created at first
    /// use), one check at a time. Blocking.
    fn with_checker<T>(
        &self,
        f: impl FnOnce(&state::Reader) -> rdkafka::error::KafkaResult<T>,
    ) -> rdkafka::error::KafkaResult<T> {
        let mut checker = self.checker.lock().unwrap_or_else(|e| e.into_inner());
        let reader = match checker.take() {
            Some(reader) => reader,
            None => state::reader(&self.t.cfg)?,
        };
        let out = f(&reader);
        *checker = Some(reader);
        out
    }

    /// The consumer the heartbeat's coordinator round trip goes through:
    /// of this member's group id, never subscribed (so never a member), on
    /// its own connection. Created at first use.
    fn prober(&self) -> rdkafka::error::KafkaResult<Arc<BaseConsumer>> {
        let mut prober = self.prober.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = prober.as_ref() {
            return Ok(p.clone());
        }
        let mut c = base_config(&self.t.cfg);
        c.set("group.id", self.names.group_id(&self.group))
            .set("client.id", format!("keyorder-{}-probe", self.instance))
            .set("enable.auto.commit", "false");
        let p: Arc<BaseConsumer> = match c.create() {
            Ok(p) => Arc::new(p),
            Err(e) => {
                // Nothing is confirmed without it: said once, not silently
                // self-fenced and replaced over and over.
                if !self.prober_reported.swap(true, Ordering::SeqCst) {
                    tracing::warn!(topic = %self.names.topic(), error = %e, "kafka: the heartbeat's prober consumer could not be created; no lease is confirmed until it can (check the client settings)");
                }
                return Err(e);
            }
        };
        *prober = Some(p.clone());
        Ok(p)
    }

    /// librdkafka gave the member up for good: every partition is lost at
    /// once, and the subscription fails at its next `maintain`.
    pub(crate) fn fail(&self, why: String) {
        let mut fatal = self.fatal.lock().unwrap_or_else(|e| e.into_inner());
        if fatal.is_none() {
            tracing::error!(topic = %self.names.topic(), error = %why, "kafka: the group member failed for good; its partitions are lost");
            *fatal = Some(why);
            drop(fatal);
            self.lose_all("the group member failed");
        }
    }

    /// A static member's confirmation: the broker hands a restarted
    /// member's partitions to its new incarnation without asking the old
    /// one, which may be stalled rather than dead, and not every broker
    /// fences the old one (tansu 0.6 does not), so the state topic decides:
    /// no newer claim of any owned partition may precede this check's
    /// markers. A partition with one is lost here, and the member does not
    /// rejoin for it: a newer incarnation with this instance id took over,
    /// and a rejoin under the same id would take it back (the two would
    /// take turns). On Apache Kafka the broker also fences the old
    /// incarnation (`FENCED_INSTANCE_ID`), which fails its subscription.
    async fn no_newer_claims(self: &Arc<Self>, parts: &[Arc<Part>]) -> bool {
        // The group's pointers are read through the prober, not the
        // member: on the member's connection the read would wait behind
        // its pending join (see `membership_confirmed`).
        let (member, me) = match self.prober() {
            Ok(prober) => (prober, self.clone()),
            Err(e) => {
                tracing::debug!(error = %e, "kafka: static member's claim check: no prober; not confirmed");
                return false;
            }
        };
        let own: Vec<(i32, u64)> = parts.iter().map(|p| (p.partition, p.lease.generation())).collect();
        let claims: HashMap<i32, String> = parts.iter().map(|p| (p.partition, p.claim.clone())).collect();
        let checked_claims = claims.clone();
        let group_id = self.names.group_id(&self.group);
        let checked = tokio::task::spawn_blocking(move || {
            me.with_checker(|reader| {
                state::newer_claims(
                    &*member,
                    reader,
                    &me.t.state_producer,
                    &me.names,
                    &group_id,
                    &own,
                    &claims,
                    Duration::from_secs(5),
                    state::Limit {
                        until: None,
                        stop: &me.closed,
                    },
                )
            })
        })
        .await;
        match checked {
            Ok(Ok(stale)) if stale.is_empty() => true,
            Ok(Ok(stale)) => {
                // Not rejoining (see `checkpoint`); the others are confirmed
                // at the next heartbeat.
                self.lose_claims(&stale, Some(&checked_claims), false);
                false
            }
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "kafka: static member's claim check failed; not confirmed");
                false
            }
            Err(_) => false,
        }
    }

    /// Registers this static member's incarnation under its instance id,
    /// once, before it first joins (see [`Shared::newer_incarnation`]).
    async fn register_incarnation(self: &Arc<Self>) -> Result<()> {
        if !self.static_member || self.incarnation.lock().unwrap_or_else(|e| e.into_inner()).is_some() {
            return Ok(());
        }
        let me = self.clone();
        let token = uuid::Uuid::new_v4().simple().to_string();
        let partition = state::incarnation_partition(&self.instance, self.partitions);
        let t = token.clone();
        let from = tokio::task::spawn_blocking(move || {
            state::register_incarnation(
                &me.t.state_producer,
                &me.names,
                &me.names.group_id(&me.group),
                &me.instance,
                partition,
                &t,
                Duration::from_secs(10),
            )
        })
        .await
        .map_err(kafka_err)?
        .map_err(|e| {
            keyorder_core::Error::Broker(format!("kafka: registering the static member's incarnation: {e}"))
        })?;
        *self.incarnation.lock().unwrap_or_else(|e| e.into_inner()) = Some(Incarnation {
            token,
            partition,
            from,
            first: true,
        });
        Ok(())
    }

    /// Whether a newer incarnation of this static member (another process
    /// with its instance id) registered since this one did. The broker
    /// hands a static member's partitions to its newer incarnation without
    /// asking the older one, which may be stalled rather than dead, and not
    /// every broker fences it (tansu 0.6 does not): an older incarnation
    /// that rejoined under the same id would take the partitions back, and
    /// the two would take turns. So an incarnation that finds a newer one
    /// fails for good, naming the fix, at its next heartbeat and before it
    /// rejoins after a gap; it cannot tell a newer incarnation from a slow
    /// rejoin of its own by the group alone. Each check reads only what
    /// was written since the last one. `Err`: not read.
    async fn newer_incarnation(self: &Arc<Self>) -> std::result::Result<bool, String> {
        let me = self.clone();
        tokio::task::spawn_blocking(move || {
            me.with_checker(|reader| Ok(me.newer_incarnation_with(reader, Duration::from_secs(5), None)))
                .map_err(|e| e.to_string())?
        })
        .await
        .map_err(|e| e.to_string())?
    }

    /// [`Shared::newer_incarnation`], blocking, with `reader` (the
    /// rebalance callback checks with its own before it loads anything).
    pub(crate) fn newer_incarnation_with(
        &self,
        reader: &state::Reader,
        timeout: Duration,
        until: Option<std::time::Instant>,
    ) -> std::result::Result<bool, String> {
        let Some(inc) = self.incarnation.lock().unwrap_or_else(|e| e.into_inner()).clone() else {
            return Ok(false);
        };
        let checked = state::newer_incarnation(
            reader,
            &self.t.state_producer,
            &self.names,
            &self.names.group_id(&self.group),
            &self.instance,
            inc.partition,
            &inc.token,
            inc.from,
            inc.first,
            timeout,
            state::Limit {
                until,
                stop: &self.closed,
            },
        );
        match checked {
            Ok((false, end)) => {
                if let Some(i) = self.incarnation.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
                    if i.token == inc.token {
                        i.from = i.from.max(end);
                        i.first = false;
                    }
                }
                *self.unchecked_since.lock().unwrap_or_else(|e| e.into_inner()) = None;
                Ok(false)
            }
            Ok((true, _)) => {
                self.fail(
                    "a newer incarnation of this static member (another process with its instance id) \
                     registered and took its partitions over"
                        .into(),
                );
                Ok(true)
            }
            Err(e) => {
                // Never stuck: a member that cannot check for long fails
                // for good rather than hold its assignment unread.
                let mut since = self.unchecked_since.lock().unwrap_or_else(|e| e.into_inner());
                let first = *since.get_or_insert_with(Instant::now);
                drop(since);
                if first.elapsed() > UNCHECKED_LIMIT {
                    self.fail(format!(
                        "could not read the state topic for a newer incarnation for {} s ({e}); open the \
                         subscription again once the state topic `{}` is readable",
                        UNCHECKED_LIMIT.as_secs(),
                        self.names.state()
                    ));
                }
                Err(e.to_string())
            }
        }
    }

    /// How long a static member's assigned partition waits, after its
    /// claim, before its work starts: the broker may have taken it from a
    /// stalled incarnation with the same instance id, whose leases were last
    /// confirmed by a claim check that began before this claim (see
    /// [`Shared::no_newer_claims`]), so they end within `ttl - margin` of it;
    /// one heartbeat more for slack.
    pub(crate) fn static_start_wait(spec: &SourceSpec) -> Duration {
        spec.lease.ttl.saturating_sub(spec.lease.margin) + spec.lease.heartbeat
    }

    /// The heartbeat: confirms owned partitions with a round trip to the
    /// group coordinator, or marks them lost after a gap.
    async fn heartbeat(self: Arc<Self>, every: Duration) {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            if self.closed.load(Ordering::SeqCst) {
                return;
            }
            if self.check_gap() {
                continue;
            }
            let Some(member) = self.member() else { continue };
            // Also with nothing owned: membership is confirmed while an
            // assignment reads its saved progress (librdkafka heartbeats
            // meanwhile), so a long read does not end in a gap.
            let parts = self.owned();
            let sent = Instant::now();
            let (topic, first) = (self.names.topic().to_owned(), parts.first().map_or(0, |p| p.partition));
            let prober = self.prober();
            let mut ok = match prober {
                Ok(prober) => {
                    tokio::task::spawn_blocking(move || membership_confirmed(&*member, &prober, &topic, first))
                        .await
                        .unwrap_or(false)
                }
                Err(e) => {
                    tracing::debug!(topic = %self.names.topic(), error = %e, "kafka: the heartbeat's prober could not be created");
                    false
                }
            };
            let mut step = "coordinator round trip";
            if ok && self.static_member && !parts.is_empty() {
                ok = self.no_newer_claims(&parts).await;
                step = "claim check";
            }
            if ok && self.static_member {
                // A newer incarnation fails this one; an unreadable check
                // does not stop the leases' confirmation (the coordinator
                // round trip confirms membership), it is retried.
                ok = !matches!(self.newer_incarnation().await, Ok(true));
                step = "incarnation check";
            }
            if !ok {
                tracing::debug!(topic = %self.names.topic(), instance = %self.instance, step, took_ms = sent.elapsed().as_millis() as u64, "kafka: heartbeat round trip failed");
                if let Some(member) = self.member() {
                    if let Some((code, why)) = member.client().fatal_error() {
                        self.fail(format!("{code:?}: {why}"));
                    }
                }
            }
            if ok && !self.check_gap() {
                {
                    let mut last = self.last_confirm.lock().unwrap_or_else(|e| e.into_inner());
                    *last = (*last).max(sent);
                }
                for p in parts {
                    p.lease.confirm(sent);
                }
            }
        }
    }
}

/// The heartbeat's round trip: whether `member` still holds its
/// assignment. An offset fetch from the group's coordinator, not only a
/// partition leader: a member cut off from its coordinator cannot heartbeat
/// either, and the broker hands its partitions on after the session
/// timeout. The fetch alone does not show membership: the coordinator
/// answers it for a member it expelled too (past `max.poll.interval.ms`,
/// or its session timed out), so the assignment must also not be lost
/// (librdkafka marks it lost then; the lost revoke comes only at a later
/// poll). The pointer check finds a newer owner's state (see `checkpoint`).
///
/// The fetch goes through `prober`, a consumer of the same group id that
/// never joins, on its own connection: a broker serves one request of a
/// connection at a time, so on the member's own connection it waited
/// behind the member's pending join for as long as a rebalance took (a
/// static member's restart waits out the old incarnation's session), and
/// a member that kept its partitions through the rebalance took that for
/// a lost membership, was replaced, and its replacement's join started
/// the wait over for the others.
///
/// What this gives up: the fetch no longer shows that the member's own
/// connection to the coordinator lives. A member whose coordinator
/// connection alone dies silently (no reset) while its join is pending is
/// confirmed by the prober until librdkafka's join request times out
/// (`max.poll.interval.ms` plus 3 s), and a dynamic member's partitions may
/// meanwhile be handed on when the coordinator expires it; outside a
/// rebalance librdkafka marks the assignment lost at the session timeout.
/// A fault that takes the process's connections down together (C19) stops
/// the prober too. Static members also check claims at every heartbeat.
pub(crate) fn membership_confirmed<C: ConsumerContext>(
    member: &BaseConsumer<C>,
    prober: &BaseConsumer,
    topic: &str,
    partition: i32,
) -> bool {
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition(topic, partition);
    // Checked after the round trip: a loss while it ran is seen.
    prober.committed_offsets(tpl, Duration::from_secs(5)).is_ok()
        && !member.assignment_lost()
        && member.client().fatal_error().is_none()
}

/// Refuses a static member whose instance id cannot be a
/// `group.instance.id`, or is already a member of the same group in this
/// transport (the two would fence each other).
fn check_static_member(t: &KafkaTransport, shared: &Arc<Shared>) -> Result<()> {
    let id = &shared.instance;
    let legal = !id.is_empty()
        && id.len() <= 200
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if !legal {
        return Err(keyorder_core::Error::Config(
            "kafka: static_membership=true needs an instance id of 1 to 200 ASCII letters, digits, `.`, `_` or `-` \
             (set one that survives a restart, such as the pod's name, with .instance_id(...))"
                .into(),
        ));
    }
    let uuid_like = id.len() == 36 && id.bytes().filter(|b| *b == b'-').count() == 4;
    if uuid_like {
        tracing::warn!(
            topic = %shared.names.topic(),
            "kafka: static membership with a generated instance id: a restart joins as a new member and the old one \
             keeps its partitions until its session times out; set .instance_id(...) to a name that survives a restart"
        );
    }
    let group_id = shared.names.group_id(&shared.group);
    let taken = t.registry.live::<Shared>().iter().any(|o| {
        !Arc::ptr_eq(o, shared)
            && o.static_member
            && !o.closed.load(Ordering::SeqCst)
            && o.instance == *id
            && o.names.group_id(&o.group) == group_id
    });
    if taken {
        return Err(keyorder_core::Error::Config(format!(
            "kafka: group `{group_id}` already has a static member with this instance id in this process: \
             give each subscription of a category and group its own .instance_id(...)"
        )));
    }
    Ok(())
}

/// One partition's state in a write round.
struct Write {
    part: Arc<Part>,
    version: u64,
    committed: i64,
    hw: i64,
    meta: String,
}

/// A revoke the poll thread waits on.
struct Pending {
    left: HashSet<i32>,
    reply: std_mpsc::SyncSender<()>,
}

struct Local {
    held: VecDeque<Inbound>,
    paused: bool,
    /// A static member's partition starts no work before this (see
    /// [`Shared::static_start_wait`]).
    start_at: Option<Instant>,
}

pub(crate) struct Source {
    shared: Arc<Shared>,
    spec: SourceSpec,
    rx: mpsc::UnboundedReceiver<Ev>,
    stop: Arc<AtomicBool>,
    /// Resolves when the poll thread has left the group and closed.
    thread: Option<tokio::sync::oneshot::Receiver<()>>,
    local: HashMap<i32, Local>,
    scopes: HashMap<Arc<str>, i32>,
    pending: Vec<Pending>,
    events: Vec<SourceEvent>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    last_report: Option<Instant>,
    /// Where the next `take` starts its turn over the partitions.
    turn: usize,
    /// Whether the group member was started (at the first `fetch` or
    /// `maintain`, not at `open`).
    joined: bool,
    /// A partition beyond the layout's count was assigned (C23): never
    /// started; the subscription stops at its next `maintain`.
    outside_layout: Option<i32>,
    /// When a static member last warned it could not check for a newer
    /// incarnation (once per 30 s).
    last_unchecked: Option<Instant>,
}

impl fmt::Debug for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KafkaSource")
            .field("topic", &self.shared.names.topic())
            .field("owned", &self.local.len())
            .finish()
    }
}

impl Drop for Source {
    fn drop(&mut self) {
        self.shared.closed.store(true, Ordering::SeqCst);
        self.stop.store(true, Ordering::SeqCst);
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl Source {
    pub(crate) async fn open(t: KafkaTransport, spec: SourceSpec, names: Names, partitions: i32) -> Result<Self> {
        let ttl = spec.lease.ttl;
        // Partitions this group never consumed start where `start` says;
        // another group's offsets are read only while some partition needs
        // them (that group's offsets may expire once it is gone).
        let fresh = check_partition_count(&t, &names, &spec.group, partitions).await?;
        let start_offsets = match &t.cfg.start {
            StartAt::Group(g) if !fresh.is_empty() => group_offsets(&t, &names, g, partitions).await?,
            _ => HashMap::new(),
        };
        let (completed, _) = watch::channel(0);
        let shared = Arc::new(Shared {
            t: t.clone(),
            names,
            group: spec.group.clone(),
            ordered: spec.ordered,
            partitions,
            member: Mutex::new(None),
            parts: Mutex::default(),
            wanted: AtomicU64::new(0),
            completed,
            wake: Notify::new(),
            last_confirm: Mutex::new(Instant::now()),
            replace: AtomicBool::new(false),
            gap: ttl.saturating_sub(spec.lease.heartbeat),
            events: Mutex::default(),
            closed: AtomicBool::new(false),
            pointers: Mutex::new(Pointers {
                last: Instant::now(),
                pending: HashMap::new(),
                state: HashMap::new(),
            }),
            checker: Mutex::new(None),
            prober: Mutex::new(None),
            checking: tokio::sync::Mutex::new(()),
            outside_layout: std::sync::atomic::AtomicI32::new(0),
            instance: spec.instance.clone(),
            static_member: t.cfg.static_membership,
            incarnation: Mutex::new(None),
            unusable_key_reported: AtomicBool::new(false),
            misplaced_key_reported: AtomicBool::new(false),
            prober_reported: AtomicBool::new(false),
            unchecked_since: Mutex::new(None),
            start_offsets,
            fatal: Mutex::new(None),
        });
        if shared.static_member {
            check_static_member(&t, &shared)?;
        }
        let (_, rx) = mpsc::unbounded_channel();
        let mut source = Source {
            shared: shared.clone(),
            spec,
            rx,
            stop: Arc::new(AtomicBool::new(false)),
            thread: None,
            local: HashMap::new(),
            scopes: HashMap::new(),
            pending: Vec::new(),
            events: Vec::new(),
            tasks: Vec::new(),
            last_report: None,
            turn: 0,
            joined: false,
            outside_layout: None,
            last_unchecked: None,
        };
        source.tasks.push(tokio::spawn(shared.clone().committer()));
        source.tasks.push(tokio::spawn(shared.clone().checkpointer()));
        source
            .tasks
            .push(tokio::spawn(shared.clone().heartbeat(source.spec.lease.heartbeat)));
        t.registry.add(&shared);
        Ok(source)
    }

    /// Joins the group on the subscription's first call (as a Kafka
    /// consumer joins on its first poll), not when it is built: a
    /// subscription built and not yet run takes no partitions away from the
    /// members that run.
    async fn join(&mut self) -> Result<()> {
        if !self.joined {
            self.shared.register_incarnation().await?;
            self.start_member()?;
            self.joined = true;
        }
        Ok(())
    }

    /// Creates a group member and its poll thread.
    fn start_member(&mut self) -> Result<()> {
        let cfg = &self.shared.t.cfg;
        let mut c = base_config(cfg);
        let session_ms = self.spec.lease.ttl.as_millis().max(1000);
        let heartbeat_ms = self.spec.lease.heartbeat.as_millis().max(100);
        // A revoke holds the poll while its partitions drain; the broker
        // expels a member that does not poll within `max.poll.interval.ms`.
        // So a revoke waits at most that less the session timeout.
        let max_poll_ms: u128 = cfg
            .extra
            .get("max.poll.interval.ms")
            .and_then(|v| v.parse().ok())
            .unwrap_or(300_000)
            .max(session_ms + 1000);
        let revoke_wait = Duration::from_millis((max_poll_ms - session_ms) as u64);
        // An assignment's read of its saved progress holds the poll as a
        // revoke does, so it is bounded by the same reasoning, with room
        // to spare: half of it (145 s by default).
        let load_wait = revoke_wait / 2;
        c.set("group.id", self.shared.names.group_id(&self.spec.group))
            .set("client.id", format!("keyorder-{}", self.spec.instance))
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("auto.offset.reset", "earliest")
            .set("session.timeout.ms", session_ms.to_string())
            .set("heartbeat.interval.ms", heartbeat_ms.to_string())
            .set("fetch.wait.max.ms", cfg.fetch_wait_ms.to_string());
        for (k, v) in &cfg.extra {
            c.set(k, v);
        }
        // After the pass-through settings: the rebalance callback relies
        // on the `assignor` option's protocol.
        c.set("partition.assignment.strategy", cfg.assignor.name());
        if self.shared.static_member {
            c.set("group.instance.id", &self.shared.instance);
        }
        c.set("max.poll.interval.ms", max_poll_ms.to_string());
        let (tx, rx) = mpsc::unbounded_channel();
        let stop = Arc::new(AtomicBool::new(false));
        let mut rc = base_config(cfg);
        rc.set("group.id", "keyorder-state-reader")
            .set("enable.auto.commit", "false")
            .set("fetch.wait.max.ms", cfg.fetch_wait_ms.to_string());
        let ctx = Ctx {
            tx: tx.clone(),
            stopping: stop.clone(),
            topic: self.shared.names.topic().to_owned(),
            names: self.shared.names.clone(),
            group_id: self.shared.names.group_id(&self.spec.group),
            reader: rc.create().map_err(create_err)?,
            producer: self.shared.t.state_producer.clone(),
            instance: self.spec.instance.to_string(),
            revoke_wait,
            load_wait,
            shared: Arc::downgrade(&self.shared),
            cooperative: cfg.assignor == Assignor::CooperativeSticky,
        };
        let member: Member = c.create_with_context(ctx).map_err(create_err)?;
        member.subscribe(&[self.shared.names.topic()]).map_err(kafka_err)?;
        let member = Arc::new(member);
        *self.shared.member.lock().unwrap_or_else(|e| e.into_inner()) = Some(member.clone());
        *self.shared.last_confirm.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
        let thread_stop = stop.clone();
        let (left_tx, left) = tokio::sync::oneshot::channel();
        std::thread::Builder::new()
            .name("keyorder-kafka-poll".into())
            .spawn(move || {
                poll_loop(member, tx, thread_stop);
                let _ = left_tx.send(());
            })
            .map_err(|e| keyorder_core::Error::Broker(format!("kafka: cannot start the poll thread: {e}")))?;
        self.stop = stop;
        self.thread = Some(left);
        self.rx = rx;
        Ok(())
    }

    /// Drops every partition here and replaces the member (after a gap).
    ///
    /// The old member leaves the group before the new one joins: a group
    /// that still counts the old member (its own rejoin after the gap, not
    /// yet left) waits for it in the next rebalance for as long as the
    /// rebalance timeout (`max.poll.interval.ms`, 5 minutes by default), and
    /// nobody in the group gets partitions meanwhile (C21 on tansu).
    async fn replace_member(&mut self) -> Result<()> {
        self.stop.store(true, Ordering::SeqCst);
        *self.shared.member.lock().unwrap_or_else(|e| e.into_inner()) = None;
        let parts: Vec<i32> = self.local.keys().copied().collect();
        for p in parts {
            self.forget(p);
        }
        self.pending.clear();
        self.drain_events();
        if let Some(thread) = self.thread.take() {
            if tokio::time::timeout(self.spec.lease.ttl, thread).await.is_err() {
                tracing::warn!(topic = %self.shared.names.topic(), "kafka: the old member did not leave the group in time; joining anyway");
            }
        }
        self.shared.replace.store(false, Ordering::SeqCst);
        tracing::info!(topic = %self.shared.names.topic(), "kafka: rejoining the group with a new member");
        self.start_member()
    }

    /// Closes the old poll thread's channel and drops what it sent unread.
    /// An unread revoke holds the sender its callback waits on: the thread
    /// would wait up to `revoke_wait` for an answer while the caller waits
    /// for the thread. Dropping the sender answers it (the source went
    /// away), and once closed the callback sends nothing to wait on.
    fn drain_events(&mut self) {
        self.rx.close();
        while let Ok(ev) = self.rx.try_recv() {
            drop(ev);
        }
    }

    /// Forgets a partition locally: its lease is lost, held work dropped.
    fn forget(&mut self, partition: i32) {
        if let Some(p) = self
            .shared
            .parts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&partition)
        {
            p.lease.lose();
            self.scopes.remove(p.lease.scope());
        }
        self.local.remove(&partition);
        self.scopes.retain(|_, v| *v != partition);
        // A pointer of a partition gone is not sent (it would be the next
        // owner's to move).
        self.shared
            .pointers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pending
            .remove(&partition);
        self.settle_pending(partition);
    }

    fn settle_pending(&mut self, partition: i32) {
        for p in &mut self.pending {
            p.left.remove(&partition);
        }
        self.pending.retain(|p| {
            if p.left.is_empty() {
                let _ = p.reply.try_send(());
                false
            } else {
                true
            }
        });
    }

    fn scope_of(&self, partition: i32) -> Arc<str> {
        Arc::from(self.shared.names.scope(partition))
    }

    /// Applies what the poll thread sent, up to `limit` messages.
    fn pump(&mut self, limit: usize) {
        let mut n = 0;
        while n < limit {
            let Ok(ev) = self.rx.try_recv() else { break };
            n += 1;
            self.apply(ev);
        }
        self.pace();
    }

    fn apply(&mut self, ev: Ev) {
        match ev {
            Ev::Assigned { parts: list, at } => {
                // The broker gave these to this member at `at` (the
                // callback's entry): that confirms it as of then, not now;
                // a lease older than the self-fence allows waits for the
                // next heartbeat. Never moves the confirmation backwards.
                let sent = at;
                {
                    let mut last = self.shared.last_confirm.lock().unwrap_or_else(|e| e.into_inner());
                    *last = (*last).max(sent);
                }
                for (partition, committed, saved_generation, meta, older, claim) in list {
                    if partition >= self.shared.partitions {
                        // Added to the topic while in use: keys moved into
                        // it. Never started (C23).
                        self.outside_layout = Some(partition);
                        continue;
                    }
                    // Never saved (the group's first owner of it): its
                    // start is saved at once, so that an owner after a quiet
                    // hand-over starts where this one did, not where
                    // `start=latest` finds the end then.
                    let first_owner = meta.is_empty();
                    let restored = decode(committed, &meta);
                    // One more than the generation of the newest saved state:
                    // the fencing token, per partition.
                    let generation = saved_generation + 1;
                    let scope = self.scope_of(partition);
                    let lease = ScopeLease::new(scope.clone(), generation, &self.spec.lease, sent);
                    let part = Arc::new(Part {
                        partition,
                        lease,
                        track: Mutex::new({
                            let mut t = Track::new(committed, restored);
                            if first_owner {
                                t.version += 1;
                            }
                            t
                        }),
                        sent_version: AtomicU64::new(0),
                        saved_version: AtomicU64::new(0),
                        releasing: AtomicBool::new(false),
                        heads: Mutex::default(),
                        superseded: Mutex::new(older),
                        claim,
                    });
                    tracing::debug!(instance = %self.spec.instance, scope = %scope, generation, from = committed, "kafka: assigned");
                    metrics::counter!("keyorder_kafka_partitions_assigned_total").increment(1);
                    if let Some(old) = self
                        .shared
                        .parts
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert(partition, part)
                    {
                        old.lease.lose();
                    }
                    self.scopes.insert(scope, partition);
                    self.local.insert(
                        partition,
                        Local {
                            held: VecDeque::new(),
                            paused: false,
                            start_at: self
                                .shared
                                .static_member
                                .then(|| Instant::now() + Shared::static_start_wait(&self.spec)),
                        },
                    );
                }
            }
            Ev::Revoke { parts, lost, reply } => {
                tracing::debug!(instance = %self.spec.instance, ?parts, lost, "kafka: revoke");
                let mut left = HashSet::new();
                for partition in parts {
                    if lost {
                        self.forget(partition);
                        continue;
                    }
                    let Some(p) = self.shared.part(partition) else { continue };
                    if !p.releasing.swap(true, Ordering::SeqCst) {
                        self.events.push(SourceEvent::Revoke(p.lease.scope().clone()));
                    }
                    // Held, undelivered messages stay unfinished: the next owner gets them.
                    if let Some(l) = self.local.get_mut(&partition) {
                        l.held.clear();
                    }
                    left.insert(partition);
                }
                if lost {
                    metrics::counter!("keyorder_kafka_assignments_lost_total").increment(1);
                    tracing::warn!(topic = %self.shared.names.topic(), "kafka: assignment lost (session timed out)");
                }
                if left.is_empty() {
                    let _ = reply.try_send(());
                } else {
                    self.pending.push(Pending { left, reply });
                }
            }
            Ev::Msg(m) => self.admit(m),
            Ev::Error(e) => {
                metrics::counter!("keyorder_kafka_client_errors_total").increment(1);
                tracing::warn!(error = %e, topic = %self.shared.names.topic(), "kafka: client error");
            }
        }
    }

    fn admit(&mut self, m: OwnedMessage) {
        let partition = m.partition();
        let Some(part) = self.shared.part(partition) else {
            return;
        };
        if part.releasing.load(Ordering::SeqCst) || part.lease.is_lost() {
            return;
        }
        let Some(local) = self.local.get_mut(&partition) else {
            return;
        };
        let offset = m.offset();
        let (attempts, halted) = match part.track().admit(offset) {
            Admit::Skip => return,
            Admit::Deliver { attempts, halted } => (attempts, halted),
        };
        let payload = keyorder_core::Bytes::copy_from_slice(m.payload().unwrap_or_default());
        let mut msg = message_of(
            payload.clone(),
            m.headers(),
            self.shared.names.topic(),
            partition,
            offset,
        );
        let key_bytes = m.key().map(<[u8]>::to_vec);
        // A key on another partition than Java's default partitioner gives
        // it (a producer on librdkafka's `consistent_random`, say): its
        // records and keyorder's, or another producer's, of one key land
        // on different partitions, which order nothing between them.
        // Counted, and said once with the fix.
        if let Some(raw) = key_bytes.as_deref().filter(|k| !k.is_empty()) {
            if partition_for(raw, self.shared.partitions) != partition {
                metrics::counter!("keyorder_kafka_misplaced_keys_total").increment(1);
                if !self.shared.misplaced_key_reported.swap(true, Ordering::SeqCst) {
                    tracing::warn!(
                        topic = %self.shared.names.topic(),
                        partition,
                        offset,
                        "kafka: a record's key is on another partition than Java's default partitioner (murmur2) \
                         puts it, where keyorder publishes it: a key's records from such a producer and from others \
                         land on different partitions and are not ordered with each other. Set the producer's \
                         partitioner to murmur2 (librdkafka clients: partitioner=murmur2_random) (reported once; \
                         counted in keyorder_kafka_misplaced_keys_total)"
                    );
                }
            }
        }
        // The record key is the routing key; it reaches key selection as
        // the routing-key header.
        // Any key bytes order their messages (the partitioner placed them
        // by those bytes): bytes that are no key as they are (not UTF-8,
        // over 255 bytes) get their stable text form. Only an empty key is
        // none: the keyless policy handles it, counted and reported once.
        match key_bytes.as_deref().map(OrderingKey::from_bytes) {
            Some(Ok(k)) => {
                msg = msg.with_header(keyorder_core::KEY_HEADER, k.as_str());
                msg = msg.with_ordering_key(k);
            }
            Some(Err(e)) => {
                metrics::counter!("keyorder_kafka_unusable_keys_total").increment(1);
                if !self.shared.unusable_key_reported.swap(true, Ordering::SeqCst) {
                    tracing::warn!(
                        topic = %self.shared.names.topic(),
                        partition,
                        offset,
                        error = %e,
                        "kafka: a record's key is no ordering key ({}); it runs under the keyless policy. \
                         Give its producer a non-empty key (reported once; counted in keyorder_kafka_unusable_keys_total)",
                        e.rule().name()
                    );
                }
            }
            None => {}
        }
        if halted.is_some() {
            tracing::info!(scope = %part.lease.scope(), offset, "kafka: a key halted here under an earlier owner");
        }
        let settle = KafkaSettle {
            shared: self.shared.clone(),
            part: part.clone(),
            offset,
            key: key_bytes,
            payload,
            headers: m.headers().cloned(),
            message_id: msg.id().to_owned(),
            earlier: attempts,
        };
        local.held.push_back(Inbound {
            message: msg,
            lease: part.lease.clone(),
            settle: Box::new(settle),
        });
    }

    /// Pauses a partition whose unfinished messages reached the limit and
    /// resumes it (with a seek to where it stopped) once half drained.
    fn pace(&mut self) {
        let Some(member) = self.shared.member() else { return };
        let max = self.shared.t.cfg.max_unfinished;
        for (partition, local) in &mut self.local {
            let Some(part) = self.shared.part(*partition) else {
                continue;
            };
            let (unfinished, position) = {
                let t = part.track();
                (t.unfinished(), t.position())
            };
            let mut tpl = TopicPartitionList::new();
            tpl.add_partition(self.shared.names.topic(), *partition);
            if !local.paused && unfinished >= max {
                if member.pause(&tpl).is_ok() {
                    local.paused = true;
                    metrics::counter!("keyorder_kafka_partition_pauses_total").increment(1);
                    tracing::debug!(scope = %part.lease.scope(), unfinished, "kafka: partition paused (full)");
                }
            } else if local.paused && unfinished <= max / 2 && member.resume(&tpl).is_ok() {
                local.paused = false;
                // Without the seek the first message comes 0.5-0.9 s later.
                let _ = member.seek(
                    self.shared.names.topic(),
                    *partition,
                    Offset::Offset(position),
                    Duration::ZERO,
                );
            }
        }
    }

    /// Hands out up to `max` held messages. The room goes first to the
    /// partitions whose messages the dispatcher holds fewest of
    /// (water-filling with a floor for every partition, `share_room`, so
    /// one holding a halted key's messages still gets some): a partition of many keys consumes
    /// fastest and gets the most, so its keys do not run dry while one of
    /// few keys fills the room. What a partition cannot use goes round the
    /// others one message at a time. Ties start one partition further each
    /// call. Draining partitions in map order gave the dispatcher's whole
    /// room to the first ones: their few keys ran while the keys of the
    /// others waited for them to finish (one partition of eight started
    /// 2.6 s into a 3.5 s run).
    fn take(&mut self, max: usize, paused: &HashSet<Arc<str>>, out: &mut Vec<Inbound>) {
        let mut order: Vec<i32> = self
            .local
            .iter()
            .filter(|(_, l)| {
                l.held.front().is_some_and(|f| !paused.contains(f.lease.scope()))
                    && l.start_at.is_none_or(|t| t <= Instant::now())
            })
            .map(|(p, _)| *p)
            .collect();
        if order.is_empty() || out.len() >= max {
            return;
        }
        order.sort_unstable();
        self.turn = self.turn.wrapping_add(1);
        let start = self.turn % order.len();
        order.rotate_left(start);
        // Delivered to the dispatcher and unfinished: admitted, less what
        // is still held here.
        let in_dispatcher: Vec<usize> = order
            .iter()
            .map(|p| {
                let admitted = self.shared.part(*p).map_or(0, |part| part.track().unfinished());
                admitted.saturating_sub(self.local.get(p).map_or(0, |l| l.held.len()))
            })
            .collect();
        let levels = keyorder_core::transport::share_room(&in_dispatcher, max - out.len(), 0);
        for (p, level) in order.iter().zip(levels) {
            let Some(l) = self.local.get_mut(p) else { continue };
            for _ in 0..level {
                match l.held.pop_front() {
                    Some(i) => out.push(i),
                    None => break,
                }
            }
        }
        while out.len() < max {
            let mut took = false;
            for p in &order {
                if out.len() >= max {
                    break;
                }
                if let Some(i) = self.local.get_mut(p).and_then(|l| l.held.pop_front()) {
                    out.push(i);
                    took = true;
                }
            }
            if !took {
                break;
            }
        }
    }
}

fn poll_loop(member: Arc<Member>, tx: mpsc::UnboundedSender<Ev>, stop: Arc<AtomicBool>) {
    while !stop.load(Ordering::SeqCst) {
        match member.poll(Duration::from_millis(100)) {
            Some(Ok(m)) if tx.send(Ev::Msg(m.detach())).is_err() => break,
            Some(Ok(_)) => {}
            Some(Err(e)) => {
                // The poll was held past `max.poll.interval.ms`: librdkafka
                // left the group (and rejoins), so every partition may be
                // another member's already. A gap in membership, as the
                // self-fence's: nothing owned here may run on.
                if e.rdkafka_error_code() == Some(RDKafkaErrorCode::PollExceeded) {
                    if let Some(shared) = member.context().shared.upgrade() {
                        shared.lose_all("max.poll.interval.ms exceeded");
                    }
                }
                // Given up for good (another consumer joined with this
                // static member's instance id): nothing may run on.
                // (An old member being replaced is not this source's any more.)
                if let Some((code, why)) = member.client().fatal_error() {
                    if let Some(shared) = member.context().shared.upgrade() {
                        if shared.member().is_some_and(|m| Arc::ptr_eq(&m, &member)) {
                            shared.fail(format!("{code:?}: {why}"));
                        }
                    }
                }
                let _ = tx.send(Ev::Error(e.to_string()));
            }
            None => {}
        }
    }
    // Leaving: the rebalance callback sees `stop` and does not wait.
    stop.store(true, Ordering::SeqCst);
    member.unsubscribe();
    // Serve the revoke the unsubscribe triggers.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while std::time::Instant::now() < deadline {
        if member.assignment().map(|a| a.count() == 0).unwrap_or(true) {
            break;
        }
        let _ = member.poll(Duration::from_millis(50));
    }
    // Close here, on the poll thread, bounded: wherever the last reference
    // goes later (a settle handle, an aborted task's closure), the
    // consumer's drop finds it closed and serves nothing (served off the
    // poll thread, a final revoke waited for librdkafka's main thread
    // forever: seen hanging a process at exit).
    if member.close_queue().is_ok() {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !member.closed() && std::time::Instant::now() < deadline {
            let _ = member.poll(Duration::from_millis(50));
        }
    }
}

/// Refuses a topic whose partition count differs from the one the group's
/// commits were made under: keys would have moved between partitions.
/// The offsets `group` (a consumer group that consumed the topic before
/// keyorder, `start=group:<id>`) committed on `names`' topic, by partition.
/// Refused when it committed none there: a misspelt name would otherwise
/// replay the whole topic.
async fn group_offsets(t: &KafkaTransport, names: &Names, group: &str, partitions: i32) -> Result<HashMap<i32, i64>> {
    let mut c = base_config(&t.cfg);
    c.set("group.id", group).set("enable.auto.commit", "false");
    let probe: BaseConsumer = c.create().map_err(create_err)?;
    let topic = names.topic().to_owned();
    let committed = tokio::task::spawn_blocking(move || {
        let mut tpl = TopicPartitionList::new();
        for p in 0..partitions {
            tpl.add_partition(&topic, p);
        }
        probe.committed_offsets(tpl, Duration::from_secs(10))
    })
    .await
    .map_err(kafka_err)?
    .map_err(|e| {
        keyorder_core::Error::Broker(format!(
            "kafka: reading the committed offsets of group `{group}` (start=group:{group}): {e}"
        ))
    })?;
    let out: HashMap<i32, i64> = committed
        .elements()
        .iter()
        .filter_map(|e| match e.offset() {
            Offset::Offset(o) if o >= 0 => Some((e.partition(), o)),
            _ => None,
        })
        .collect();
    if out.is_empty() {
        return Err(keyorder_core::Error::Config(format!(
            "kafka: start=group:{group}: that group has no committed offsets on topic `{}`; check the group's \
             name (`kafka-consumer-groups.sh --list`), or use start=earliest or start=latest",
            names.topic()
        )));
    }
    tracing::info!(topic = %names.topic(), partitions = out.len(), "kafka: partitions without saved progress start at another group's committed offsets");
    Ok(out)
}

/// Returns the partitions without saved progress (never consumed by the
/// group).
async fn check_partition_count(t: &KafkaTransport, names: &Names, group: &str, partitions: i32) -> Result<Vec<i32>> {
    let mut c = base_config(&t.cfg);
    c.set("group.id", names.group_id(group))
        .set("enable.auto.commit", "false");
    let probe: BaseConsumer = c.create().map_err(create_err)?;
    let reader = state::reader(&t.cfg).map_err(kafka_err)?;
    let producer = t.state_producer.clone();
    let (n2, g2) = (names.clone(), names.group_id(group));
    let saved = tokio::task::spawn_blocking(move || {
        let parts: Vec<i32> = (0..partitions).collect();
        state::read_saved(
            &probe,
            &reader,
            &producer,
            &n2,
            &g2,
            &parts,
            Duration::from_secs(10),
            state::Limit::none(),
        )
    })
    .await
    .map_err(kafka_err)?
    .map_err(kafka_err)?;
    let fresh = saved.iter().filter(|s| !s.known).map(|s| s.partition).collect();
    for s in saved {
        if let Some(n) = decode(s.committed, &s.meta).partitions {
            if n != partitions {
                return Err(keyorder_core::Error::Config(format!(
                    "kafka: topic `{}` has {partitions} partitions but group `{group}` committed under {n}: keys \
                     moved between partitions, so their order cannot be kept. Restore {n} partitions, or drain \
                     the group and consume with a new one",
                    names.topic()
                )));
            }
        }
    }
    Ok(fresh)
}

#[async_trait]
impl TransportSource for Source {
    async fn fetch(&mut self, max: usize, paused: &HashSet<Arc<str>>, wait: Duration) -> Result<Vec<Inbound>> {
        self.join().await?;
        let mut out = Vec::new();
        self.pump(4 * max.max(64));
        self.take(max, paused, &mut out);
        if out.is_empty() {
            if let Ok(Some(ev)) = tokio::time::timeout(wait, self.rx.recv()).await {
                self.apply(ev);
                self.pump(4 * max.max(64));
                self.take(max, paused, &mut out);
            }
        }
        Ok(out)
    }

    async fn maintain(&mut self) -> Result<Vec<SourceEvent>> {
        self.join().await?;
        // The topic still has its layout's count (C23): at most every
        // `LAYOUT_CHECK`, and at once when a partition beyond it came.
        let outside = self.shared.outside_layout.load(Ordering::SeqCst);
        if let Some(p) = self.outside_layout {
            return Err(layout_changed(&self.shared.names, self.shared.partitions, p + 1));
        }
        if outside > 0 {
            return Err(layout_changed(&self.shared.names, self.shared.partitions, outside));
        }
        self.shared.t.check_layout(&self.shared.names).await?;
        if self.shared.replace.load(Ordering::SeqCst)
            && self.shared.static_member
            && self.shared.fatal.lock().unwrap_or_else(|e| e.into_inner()).is_none()
        {
            // Before rejoining under the instance id: a newer incarnation
            // may have taken it over while this one was silent.
            if let Err(e) = self.shared.newer_incarnation().await {
                // Not rejoining unchecked: retried at the next call.
                if self
                    .last_unchecked
                    .is_none_or(|t| t.elapsed() > Duration::from_secs(30))
                {
                    self.last_unchecked = Some(Instant::now());
                    tracing::warn!(topic = %self.shared.names.topic(), error = %e, "kafka: static member: could not read the state topic for a newer incarnation; not rejoining yet");
                }
                return Ok(std::mem::take(&mut self.events));
            }
        }
        if let Some(why) = self.shared.fatal.lock().unwrap_or_else(|e| e.into_inner()).clone() {
            let fix = if why.starts_with("could not read the state topic") {
                "the state topic stayed unreadable, so this static member could not tell whether a newer \
                 incarnation took its instance id over; open the subscription again once the broker serves it"
            } else if self.shared.static_member {
                "another consumer joined the group with this instance id (static membership): a newer incarnation \
                 of this instance took over, or two processes share an instance id; give each its own .instance_id(...)"
            } else {
                "see the error; the subscription must be opened again"
            };
            // Not retried (a `Broker` error would be): rejoining would
            // take the partitions back from the newer incarnation.
            return Err(keyorder_core::Error::Config(format!(
                "kafka: the group member of `{}` failed for good ({why}): {fix}",
                self.shared.names.topic()
            )));
        }
        if tracing::enabled!(tracing::Level::TRACE)
            && self.last_report.is_none_or(|t| t.elapsed() > Duration::from_secs(5))
        {
            self.last_report = Some(Instant::now());
            for (p, l) in &self.local {
                if let Some(part) = self.shared.part(*p) {
                    let t = part.track();
                    tracing::trace!(instance = %self.spec.instance, partition = p, held = l.held.len(), paused = l.paused, unfinished = t.unfinished(), position = t.position(), state = ?part.lease.state(), "kafka: partition");
                }
            }
        }
        if self.shared.replace.load(Ordering::SeqCst) {
            self.replace_member().await?;
        }
        // Partitions lost to the self-fence are gone from the shared map.
        let gone: Vec<i32> = self
            .local
            .keys()
            .copied()
            .filter(|p| self.shared.part(*p).is_none())
            .collect();
        for p in gone {
            self.forget(p);
        }
        let mut events = std::mem::take(&mut self.events);
        events.extend(std::mem::take(
            &mut *self.shared.events.lock().unwrap_or_else(|e| e.into_inner()),
        ));
        Ok(events)
    }

    async fn release(&mut self, scope: &str) -> Result<()> {
        let Some(partition) = self.scopes.get(scope).copied() else {
            return Ok(());
        };
        if let Some(part) = self.shared.part(partition) {
            // The final commit, then let the partition go.
            let deadline = Instant::now() + self.spec.lease.ttl;
            if tokio::time::timeout_at(deadline, self.shared.commit_through(&part))
                .await
                .is_err()
            {
                tracing::warn!(scope = %scope, "kafka: final state write before hand-over timed out");
            }
            if let Some(member) = self.shared.member() {
                self.shared.commit_pointers(&member, true);
            }
            // The next owner reads from the pointer: move it now, bounded.
            let _ = tokio::time::timeout(Duration::from_secs(5), self.shared.checkpoint()).await;
            metrics::counter!("keyorder_kafka_partitions_released_total").increment(1);
            tracing::debug!(instance = %self.spec.instance, scope = %scope, "kafka: released");
        }
        self.forget(partition);
        Ok(())
    }

    async fn close(&mut self) -> Result<()> {
        let scopes: Vec<Arc<str>> = self.scopes.keys().cloned().collect();
        for s in scopes {
            self.release(&s).await?;
        }
        self.shared.closed.store(true, Ordering::SeqCst);
        self.stop.store(true, Ordering::SeqCst);
        *self.shared.member.lock().unwrap_or_else(|e| e.into_inner()) = None;
        self.pending.clear();
        self.drain_events();
        if let Some(thread) = self.thread.take() {
            // Leaving the group normally takes well under a second; a broker
            // that does not answer must not hold the shutdown (the session
            // timeout removes the member then).
            if tokio::time::timeout(self.spec.lease.ttl, thread).await.is_err() {
                tracing::warn!(topic = %self.shared.names.topic(), "kafka: leaving the group timed out; the session timeout will end the membership");
            }
        }
        for t in &self.tasks {
            t.abort();
        }
        Ok(())
    }
}

/// The heartbeat's confirmation on the test broker (`KAFKA_BROKERS`).
#[cfg(test)]
mod broker_tests {
    use super::*;
    use crate::config::KafkaConfig;

    /// A member the group expelled (its poll held past
    /// `max.poll.interval.ms`) still gets its offset fetch answered: that
    /// round trip alone kept confirming its leases, and its self-fence let
    /// work start on partitions another member may own.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_expelled_member_is_not_confirmed() {
        let brokers = std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into());
        let cfg = KafkaConfig {
            brokers,
            partitions: 1,
            ..KafkaConfig::default()
        };
        let t = KafkaTransport::connect(cfg).await.expect("the test broker answers");
        let nonce = uuid::Uuid::new_v4().simple().to_string();
        let names = Names::new(&format!("ko-expel-{}", &nonce[..12])).unwrap();
        t.ensure(&names).await.unwrap();
        let mut c = base_config(&t.cfg);
        c.set("group.id", names.group_id("g"))
            .set("enable.auto.commit", "false")
            .set("session.timeout.ms", "6000")
            .set("heartbeat.interval.ms", "500")
            .set("max.poll.interval.ms", "6000");
        let member: Arc<BaseConsumer> = Arc::new(c.create().unwrap());
        member.subscribe(&[names.topic()]).unwrap();
        let mut p = base_config(&t.cfg);
        p.set("group.id", names.group_id("g"))
            .set("enable.auto.commit", "false");
        let prober: Arc<BaseConsumer> = Arc::new(p.create().unwrap());
        let topic = names.topic().to_owned();
        let confirmed = |member: &Arc<BaseConsumer>| {
            let (member, prober, topic) = (member.clone(), prober.clone(), topic.clone());
            tokio::task::spawn_blocking(move || membership_confirmed(&*member, &prober, &topic, 0))
        };
        let m = member.clone();
        tokio::task::spawn_blocking(move || {
            let deadline = std::time::Instant::now() + Duration::from_secs(60);
            while m.assignment().map(|a| a.count()).unwrap_or(0) == 0 {
                assert!(std::time::Instant::now() < deadline, "the member gets its partition");
                let _ = m.poll(Duration::from_millis(100));
            }
        })
        .await
        .unwrap();
        assert!(confirmed(&member).await.unwrap(), "a member in the group is confirmed");
        // Not polled for longer than `max.poll.interval.ms`: librdkafka
        // leaves the group and marks the assignment lost.
        let deadline = Instant::now() + Duration::from_secs(30);
        while !member.assignment_lost() {
            assert!(Instant::now() < deadline, "librdkafka marks the assignment lost");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let (m, t2) = (member.clone(), topic.clone());
        let fetched = tokio::task::spawn_blocking(move || {
            let mut tpl = TopicPartitionList::new();
            tpl.add_partition(&t2, 0);
            m.committed_offsets(tpl, Duration::from_secs(5)).is_ok()
        })
        .await
        .unwrap();
        assert!(
            fetched,
            "the coordinator still answers the expelled member's offset fetch"
        );
        assert!(
            !confirmed(&member).await.unwrap(),
            "an expelled member's round trip confirms nothing"
        );
        drop(member);
    }
}
