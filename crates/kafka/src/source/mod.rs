//! `Source`, the ordered source (`impl TransportSource`): the async side of
//! a consumer-group member polled on a thread of its own (`member`), the
//! partitions it owns (`owned`), their state records, and the self-fence.
//! Beside it: `admit` (a fetched record as an `Inbound`), `held` (the
//! messages held per partition for the dispatcher) and `open` (what is read
//! when the source opens).
//!
//! - **Poll thread.** librdkafka serves rebalances inside `poll`, so a
//!   dedicated thread polls and forwards messages and rebalance events, in
//!   order, to the async side. The member and its thread start at the
//!   subscription's first call, not when it is built.
//! - **Assign.** The thread reads each assigned partition's saved state (its
//!   state record: the committed offset and the progress above it) first,
//!   forwards it, then assigns from exactly the committed offsets read. The read
//!   holds the poll, so it is bounded well under `max.poll.interval.ms`;
//!   partitions it could not read in time do not start, and the member
//!   rejoins. Their leases count as confirmed when the callback began.
//! - **Revoke.** The thread forwards the revoke and waits: the subscription
//!   takes no new work from those partitions, lets their in-flight handlers
//!   return, their final state record is written, and only then does the
//!   thread let the partitions go. A partition the broker already gave away
//!   (assignment lost) is dropped at once, without a final state record.
//! - **State records** are written by one committer task, in rounds, so
//!   they never go backwards: each `ack`, attempt and halt waits for the
//!   round that carries it.
//! - **Self-fence.** A heartbeat task confirms every owned partition with a
//!   round trip to the group coordinator. If no confirmation succeeded for
//!   longer than the session timeout less a heartbeat (a `SIGSTOP`, a
//!   network cut), the broker may have given the partitions away: they are
//!   all marked lost and the member is replaced by a new one. A round trip
//!   confirms only while librdkafka does not hold the assignment lost: the
//!   coordinator answers an expelled member's offset fetch too. A poll
//!   held past `max.poll.interval.ms` (librdkafka leaves the group) loses
//!   every partition at once.

mod admit;
mod held;
mod open;

use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc as std_mpsc, Arc};
use std::time::Duration;

use async_trait::async_trait;
use keyorder_core::raw::Room;
use keyorder_core::{Inbound, Result, ScopeLease, SourceEvent, SourceSpec, TransportSource};
use rdkafka::message::OwnedMessage;
use rdkafka::Message as _;
use tokio::sync::mpsc;
use tokio::time::Instant;

use self::held::Local;
use crate::broker::KafkaTransport;
use crate::config::StartAt;
use crate::error::layout_changed;
use crate::member;
use crate::names::Names;
use crate::owned::{self, Ev, Part, Shared};
use crate::track::{decode, Track};

/// A revoke the poll thread waits on.
struct Pending {
    left: HashSet<i32>,
    reply: std_mpsc::SyncSender<()>,
}

/// The ordered source of one category and group.
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
        // Partitions this group never consumed start where `start` says;
        // another group's offsets are read only while some partition needs
        // them (that group's offsets may expire once it is gone).
        let fresh = open::check_partition_count(&t, &names, &spec.group, partitions).await?;
        let start_offsets = match &t.cfg.start {
            StartAt::Group(g) if !fresh.is_empty() => open::group_offsets(&t, &names, g, partitions).await?,
            _ => HashMap::new(),
        };
        let shared = Arc::new(Shared::new(&t, names, &spec, partitions, start_offsets));
        if shared.static_member {
            owned::check_static_member(&t, &shared)?;
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
        let started = member::start(&self.shared, &self.spec)?;
        self.stop = started.stop;
        self.thread = Some(started.left);
        self.rx = started.rx;
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
        held::pace(&self.shared, &mut self.local);
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
                    let mut track = Track::new(committed, restored);
                    if first_owner {
                        track.version += 1;
                    }
                    let part = Arc::new(Part::new(partition, lease, track, older, claim));
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
                        // librdkafka says the assignment was lost: a loss.
                        if let Some(p) = self.shared.part(partition) {
                            p.lease.lose_to_broker();
                        }
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
        if let Some(inbound) = admit::inbound(&self.shared, &part, m) {
            local.held.push_back(inbound);
        }
    }
}

#[async_trait]
impl TransportSource for Source {
    async fn fetch(&mut self, room: &Room, wait: Duration) -> Result<Vec<Inbound>> {
        self.join().await?;
        let max = room.max();
        let mut out = Vec::new();
        self.pump(4 * max.max(64));
        held::take(&mut self.local, &mut self.turn, room, &mut out);
        if out.is_empty() {
            if let Ok(Some(ev)) = tokio::time::timeout(wait, self.rx.recv()).await {
                self.apply(ev);
                self.pump(4 * max.max(64));
                held::take(&mut self.local, &mut self.turn, room, &mut out);
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
            // The final state record, then let the partition go.
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
