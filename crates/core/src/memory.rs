//! The in-memory transport: one process, submission order.
//!
//! A category is split into partitions (`stable_hash(key) % partitions`;
//! keyless messages round-robin). Each consumer group owns every partition
//! through one member at a time, with a generation that grows on every
//! acquire; settlements are fenced on (member, generation) exactly as a
//! broker adapter fences them, so the conformance suite exercises the same
//! paths. Members that stop polling for longer than their lease TTL lose
//! their partitions, and the next owner re-reads every unacknowledged entry.
//!
//! Use it for the demo, quick starts, docs and tests: it keeps nothing on
//! disk and lives inside one process (`connect("memory://")`).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::capability::Capabilities;
use crate::error::{Error, Result};
use crate::key::OrderingKey;
use crate::lease::{LeaseConfig, ScopeLease};
use crate::message::Message;
use crate::transport::{
    Admin, DeadLetter, HaltedKey, HeadAction, HotKey, Inbound, PublishFence, ScopeInfo, Settle, SourceEvent,
    SourceSpec, Transport, TransportPublisher, TransportSource,
};

/// Default partition count of a memory category.
pub const DEFAULT_PARTITIONS: u32 = 16;

/// The in-memory transport. Clones share one broker.
#[derive(Clone)]
pub struct MemoryTransport {
    broker: Arc<Broker>,
}

impl fmt::Debug for MemoryTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryTransport")
            .field("partitions", &self.broker.partitions)
            .finish()
    }
}

impl Default for MemoryTransport {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryTransport {
    /// A fresh broker with [`DEFAULT_PARTITIONS`] partitions per category.
    pub fn new() -> Self {
        Self::with_partitions(DEFAULT_PARTITIONS)
    }

    /// A fresh broker with `partitions` partitions per category (at least 1).
    pub fn with_partitions(partitions: u32) -> Self {
        MemoryTransport {
            broker: Arc::new(Broker {
                partitions: partitions.max(1),
                state: Mutex::new(BrokerState::default()),
                notify: Notify::new(),
            }),
        }
    }

    /// Parses `memory://[?partitions=N]`.
    pub fn from_url(url: &url::Url) -> Result<Self> {
        let mut partitions = DEFAULT_PARTITIONS;
        for (k, v) in url.query_pairs() {
            match &*k {
                "partitions" => {
                    partitions = v
                        .parse()
                        .ok()
                        .filter(|n| (1..=4096).contains(n))
                        .ok_or_else(|| Error::Url(format!("memory://?partitions={v}: expected 1..=4096")))?;
                }
                other => {
                    return Err(Error::Url(format!(
                        "memory:// has no option `{other}` (known: partitions)"
                    )))
                }
            }
        }
        Ok(Self::with_partitions(partitions))
    }
}

struct Broker {
    partitions: u32,
    state: Mutex<BrokerState>,
    notify: Notify,
}

impl fmt::Debug for Broker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Broker").field("partitions", &self.partitions).finish()
    }
}

#[derive(Default)]
struct BrokerState {
    categories: HashMap<String, Category>,
}

struct Stored {
    message: Message,
}

#[derive(Default)]
struct PartLog {
    base: u64,
    entries: VecDeque<Stored>,
}

impl PartLog {
    fn end(&self) -> u64 {
        self.base + self.entries.len() as u64
    }
    fn get(&self, offset: u64) -> Option<&Stored> {
        offset.checked_sub(self.base).and_then(|i| self.entries.get(i as usize))
    }
}

struct Category {
    logs: Vec<PartLog>,
    next_keyless: u32,
    groups: HashMap<String, Group>,
    /// Publish fences: the highest token seen per scope.
    fences: HashMap<String, u64>,
}

#[derive(Default, Clone)]
struct GroupPart {
    owner: Option<(String, u64)>,
    generation: u64,
    acked_upto: u64,
    acked: BTreeSet<u64>,
    next: u64,
    revoking: bool,
}

impl GroupPart {
    fn ack(&mut self, offset: u64) {
        if offset < self.acked_upto {
            return;
        }
        self.acked.insert(offset);
        while self.acked.remove(&self.acked_upto) {
            self.acked_upto += 1;
        }
    }
    fn is_acked(&self, offset: u64) -> bool {
        offset < self.acked_upto || self.acked.contains(&offset)
    }
    /// Delivered to the owner and not settled yet.
    fn unsettled(&self) -> usize {
        // Acknowledgements at or past `next` (a new owner reads again from
        // `acked_upto`) are not among the delivered ones.
        (self.next.saturating_sub(self.acked_upto) as usize).saturating_sub(self.acked.range(..self.next).count())
    }
    fn hand_back(&mut self) {
        self.owner = None;
        self.revoking = false;
        self.next = self.acked_upto;
    }
}

struct Member {
    last_seen: Instant,
    ttl: Duration,
    events: Vec<SourceEvent>,
}

struct Halt {
    part: u32,
    offset: u64,
    key: String,
    id: String,
    reason: String,
}

struct Group {
    ordered: bool,
    members: BTreeMap<String, Member>,
    parts: Vec<GroupPart>,
    attempts: HashMap<(u32, u64), u32>,
    halted: Vec<Halt>,
    dead: Vec<DeadLetter>,
    /// Unordered mode: entries handed to a member and not yet settled.
    inflight: HashMap<(u32, u64), String>,
    redeliver: BTreeSet<(u32, u64)>,
}

impl Broker {
    fn lock(&self) -> MutexGuard<'_, BrokerState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn category<'a>(&self, st: &'a mut BrokerState, name: &str) -> &'a mut Category {
        let partitions = self.partitions as usize;
        st.categories.entry(name.to_owned()).or_insert_with(|| Category {
            logs: (0..partitions).map(|_| PartLog::default()).collect(),
            next_keyless: 0,
            groups: HashMap::new(),
            fences: HashMap::new(),
        })
    }
}

fn scope_name(category: &str, part: u32) -> Arc<str> {
    Arc::from(format!("{category}/p{part}"))
}

fn parse_scope(scope: &str) -> Option<u32> {
    scope.rsplit_once("/p").and_then(|(_, n)| n.parse().ok())
}

impl Category {
    fn group_mut(&mut self, group: &str) -> Result<&mut Group> {
        self.groups
            .get_mut(group)
            .ok_or_else(|| Error::NotFound(format!("consumer group `{group}`")))
    }

    /// Drops entries every group has acknowledged (bounded memory).
    fn trim(&mut self) {
        if self.groups.is_empty() {
            return;
        }
        for (p, log) in self.logs.iter_mut().enumerate() {
            let floor = self
                .groups
                .values()
                .map(|g| g.parts[p].acked_upto)
                .min()
                .unwrap_or(log.base);
            while log.base < floor && !log.entries.is_empty() {
                log.entries.pop_front();
                log.base += 1;
            }
        }
    }
}

impl Group {
    /// Expires silent members and spreads partitions fairly over live ones.
    fn rebalance(&mut self, now: Instant, partitions: u32, category: &str) {
        let expired: Vec<String> = self
            .members
            .iter()
            .filter(|(_, m)| now.duration_since(m.last_seen) > m.ttl)
            .map(|(id, _)| id.clone())
            .collect();
        for id in expired {
            self.leave(&id);
        }
        if !self.ordered || self.members.is_empty() {
            return;
        }
        let members: Vec<String> = self.members.keys().cloned().collect();
        for p in 0..partitions {
            let want = &members[p as usize % members.len()];
            let part = &mut self.parts[p as usize];
            if let Some((owner, _)) = &part.owner {
                if owner != want && !part.revoking {
                    part.revoking = true;
                    let owner = owner.clone();
                    if let Some(m) = self.members.get_mut(&owner) {
                        m.events.push(SourceEvent::Revoke(scope_name(category, p)));
                    }
                }
            }
        }
    }

    fn leave(&mut self, member: &str) {
        self.members.remove(member);
        for part in &mut self.parts {
            if part.owner.as_ref().is_some_and(|(o, _)| o == member) {
                part.hand_back();
            }
        }
        let mine: Vec<(u32, u64)> = self
            .inflight
            .iter()
            .filter(|(_, m)| m.as_str() == member)
            .map(|(k, _)| *k)
            .collect();
        for k in mine {
            self.inflight.remove(&k);
            self.redeliver.insert(k);
        }
    }

    fn fence(&self, part: u32, member: &str, generation: u64, scope: &str) -> Result<()> {
        let ok = if self.ordered {
            self.parts[part as usize]
                .owner
                .as_ref()
                .is_some_and(|(o, g)| o == member && *g == generation)
        } else {
            self.members.contains_key(member)
        };
        if ok {
            Ok(())
        } else {
            Err(Error::Fenced {
                scope: scope.to_owned(),
                generation,
            })
        }
    }

    fn settle(&mut self, part: u32, offset: u64) {
        self.parts[part as usize].ack(offset);
        self.attempts.remove(&(part, offset));
        self.inflight.remove(&(part, offset));
        self.redeliver.remove(&(part, offset));
        self.halted.retain(|h| !(h.part == part && h.offset == offset));
    }
}

#[async_trait]
impl Transport for MemoryTransport {
    fn name(&self) -> &str {
        "memory"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            cross_instance_affinity: true,
            fencing: true,
            self_fencing: true,
            crash_reclaim: true,
            halt_on_poison: true,
            park_and_release: true,
            ..Capabilities::default()
        }
    }

    fn affinity_fix(&self) -> String {
        "the in-memory transport always has it".into()
    }

    async fn publisher(&self, category: &str) -> Result<Arc<dyn TransportPublisher>> {
        Ok(Arc::new(MemoryPublisher {
            broker: self.broker.clone(),
            category: category.to_owned(),
        }))
    }

    async fn open(&self, spec: &SourceSpec) -> Result<Box<dyn TransportSource>> {
        let mut st = self.broker.lock();
        let partitions = self.broker.partitions;
        let cat = self.broker.category(&mut st, &spec.category);
        let logs: Vec<u64> = cat.logs.iter().map(|l| l.base).collect();
        let group = cat.groups.entry(spec.group.clone()).or_insert_with(|| Group {
            ordered: spec.ordered,
            members: BTreeMap::new(),
            // A new group starts at the oldest retained entry: nothing
            // published before it existed is skipped.
            parts: logs
                .iter()
                .map(|&base| GroupPart {
                    acked_upto: base,
                    next: base,
                    ..GroupPart::default()
                })
                .collect(),
            attempts: HashMap::new(),
            halted: Vec::new(),
            dead: Vec::new(),
            inflight: HashMap::new(),
            redeliver: BTreeSet::new(),
        });
        if group.ordered != spec.ordered {
            return Err(Error::Config(format!(
                "group `{}` of `{}` is {} here; an ordered and an unordered subscription cannot share a group",
                spec.group,
                spec.category,
                if group.ordered { "ordered" } else { "unordered" }
            )));
        }
        if group.members.contains_key(&spec.instance) {
            return Err(Error::Config(format!(
                "instance id `{}` is already a member of the group",
                spec.instance
            )));
        }
        group.members.insert(
            spec.instance.clone(),
            Member {
                last_seen: Instant::now(),
                ttl: spec.lease.ttl,
                events: Vec::new(),
            },
        );
        group.rebalance(Instant::now(), partitions, &spec.category);
        drop(st);
        self.broker.notify.notify_waiters();
        let lease_cfg = if spec.ordered {
            spec.lease
        } else {
            LeaseConfig {
                ttl: Duration::from_secs(365 * 24 * 3600),
                heartbeat: spec.lease.heartbeat,
                margin: Duration::ZERO,
            }
        };
        Ok(Box::new(MemorySource {
            broker: self.broker.clone(),
            category: spec.category.clone(),
            group: spec.group.clone(),
            member: spec.instance.clone(),
            ordered: spec.ordered,
            lease_cfg,
            leases: HashMap::new(),
            events: Vec::new(),
            cursor: 0,
            closed: false,
        }))
    }

    fn admin(&self) -> Arc<dyn Admin> {
        Arc::new(MemoryAdmin {
            broker: self.broker.clone(),
        })
    }
}

struct MemoryPublisher {
    broker: Arc<Broker>,
    category: String,
}

impl fmt::Debug for MemoryPublisher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryPublisher")
            .field("category", &self.category)
            .finish()
    }
}

#[async_trait]
impl TransportPublisher for MemoryPublisher {
    async fn publish(&self, message: Message) -> Result<()> {
        self.append(message, None)
    }

    fn fences_publishes(&self) -> bool {
        true
    }

    async fn publish_fenced(&self, message: Message, fence: &PublishFence) -> Result<()> {
        self.append(message, Some(fence))
    }
}

impl MemoryPublisher {
    fn append(&self, message: Message, fence: Option<&PublishFence>) -> Result<()> {
        let partitions = self.broker.partitions;
        {
            let mut st = self.broker.lock();
            let cat = self.broker.category(&mut st, &self.category);
            if let Some(f) = fence {
                let seen = cat.fences.entry(f.scope.clone()).or_insert(0);
                if *seen > f.token {
                    return Err(Error::Fenced {
                        scope: f.scope.clone(),
                        generation: f.token,
                    });
                }
                *seen = f.token;
            }
            let part = match message.key() {
                Some(key) => (key.stable_hash() % u64::from(partitions)) as u32,
                None => {
                    cat.next_keyless = (cat.next_keyless + 1) % partitions;
                    cat.next_keyless
                }
            };
            cat.logs[part as usize].entries.push_back(Stored { message });
        }
        self.broker.notify.notify_waiters();
        Ok(())
    }
}

struct MemorySource {
    broker: Arc<Broker>,
    category: String,
    group: String,
    member: String,
    ordered: bool,
    lease_cfg: LeaseConfig,
    leases: HashMap<u32, Arc<ScopeLease>>,
    events: Vec<SourceEvent>,
    cursor: u32,
    closed: bool,
}

impl fmt::Debug for MemorySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemorySource")
            .field("category", &self.category)
            .field("group", &self.group)
            .field("owned", &self.leases.len())
            .finish()
    }
}

impl MemorySource {
    /// Heartbeat, rebalance, lease bookkeeping: one fenced round trip.
    /// Collects the member's events for the next `maintain`, or fails with
    /// `Fenced` if the member was expired.
    fn round_trip(&mut self, st: &mut BrokerState) -> Result<()> {
        let sent = Instant::now();
        let partitions = self.broker.partitions;
        let cat = self.broker.category(st, &self.category);
        let group = cat.group_mut(&self.group)?;
        group.rebalance(sent, partitions, &self.category);
        let Some(me) = group.members.get_mut(&self.member) else {
            for lease in self.leases.values() {
                lease.lose();
            }
            self.leases.clear();
            return Err(Error::Fenced {
                scope: format!("{}/*", self.category),
                generation: 0,
            });
        };
        me.last_seen = sent;
        let events = std::mem::take(&mut me.events);
        for p in 0..partitions {
            let part = &mut group.parts[p as usize];
            if self.ordered && part.owner.is_none() {
                let want = group.members.keys().nth(p as usize % group.members.len());
                if want == Some(&self.member) {
                    part.generation += 1;
                    part.owner = Some((self.member.clone(), part.generation));
                    part.next = part.acked_upto;
                }
            }
            let held = if self.ordered {
                part.owner.as_ref().filter(|(o, _)| *o == self.member).map(|(_, g)| *g)
            } else {
                Some(0)
            };
            match (held, self.leases.get(&p)) {
                (Some(gen), Some(lease)) if lease.generation() == gen => lease.confirm(sent),
                (Some(gen), old) => {
                    if let Some(old) = old {
                        old.lose();
                    }
                    let lease = ScopeLease::new(scope_name(&self.category, p), gen, &self.lease_cfg, sent);
                    self.leases.insert(p, lease);
                }
                (None, Some(lease)) => {
                    lease.lose();
                    self.leases.remove(&p);
                }
                (None, None) => {}
            }
        }
        self.events.extend(events);
        Ok(())
    }

    fn try_fetch(&mut self, max: usize, paused: &HashSet<Arc<str>>) -> Result<Vec<Inbound>> {
        let broker = self.broker.clone();
        let mut st = broker.lock();
        self.round_trip(&mut st)?;
        let partitions = self.broker.partitions;
        let cat = self.broker.category(&mut st, &self.category);
        let Category { logs, groups, .. } = cat;
        let group = groups
            .get_mut(&self.group)
            .ok_or_else(|| Error::NotFound(format!("consumer group `{}`", self.group)))?;
        let mut out = Vec::new();
        if !self.ordered {
            while out.len() < max {
                let Some((p, off)) = group.redeliver.pop_first() else {
                    break;
                };
                if let Some(s) = logs[p as usize].get(off) {
                    group.inflight.insert((p, off), self.member.clone());
                    out.push(self.inbound(p, off, s.message.clone()));
                }
            }
        }
        if self.ordered {
            // The readable partitions, starting one further each fetch.
            let readable: Vec<u32> = (0..partitions)
                .map(|i| (self.cursor + i) % partitions)
                .filter(|p| {
                    self.leases.get(p).is_some_and(|l| !paused.contains(l.scope()))
                        && !group.parts[*p as usize].revoking
                        && group.parts[*p as usize].next < logs[*p as usize].end()
                })
                .collect();
            // The room goes to the partitions holding the fewest unsettled
            // deliveries (`share_room`): a partition of many keys consumes
            // fastest and gets the most, so its keys do not run dry while a
            // partition of few keys fills the budget. What a partition
            // cannot use goes round the others one at a time.
            let held: Vec<usize> = readable.iter().map(|p| group.parts[*p as usize].unsettled()).collect();
            let levels = crate::transport::share_room(&held, max - out.len(), 0);
            for (p, level) in readable.iter().zip(levels) {
                self.take_from(group, logs, *p, level, max, &mut out);
            }
            while out.len() < max {
                let before = out.len();
                for p in &readable {
                    self.take_from(group, logs, *p, 1, max, &mut out);
                }
                if out.len() == before {
                    break;
                }
            }
        } else {
            // Round-robin over partitions so one busy partition does not starve the rest.
            for i in 0..partitions {
                if out.len() >= max {
                    break;
                }
                let p = (self.cursor + i) % partitions;
                let Some(lease) = self.leases.get(&p) else { continue };
                if paused.contains(lease.scope()) || group.parts[p as usize].revoking {
                    continue;
                }
                let share = (max - out.len()).div_ceil((partitions - i) as usize).max(1);
                self.take_from(group, logs, p, share, max, &mut out);
            }
        }
        self.cursor = (self.cursor + 1) % partitions;
        Ok(out)
    }

    /// Delivers up to `limit` unacknowledged entries of partition `p` from
    /// its read position, without `out` passing `max`.
    fn take_from(&self, group: &mut Group, logs: &[PartLog], p: u32, limit: usize, max: usize, out: &mut Vec<Inbound>) {
        let part = &mut group.parts[p as usize];
        let log = &logs[p as usize];
        let mut taken = 0;
        while taken < limit && out.len() < max && part.next < log.end() {
            let off = part.next;
            part.next += 1;
            if part.is_acked(off) {
                continue;
            }
            let message = log.get(off).expect("offset within log").message.clone();
            if !self.ordered {
                group.inflight.insert((p, off), self.member.clone());
            }
            taken += 1;
            out.push(self.inbound(p, off, message));
        }
    }

    fn inbound(&self, part: u32, offset: u64, message: Message) -> Inbound {
        let lease = self.leases[&part].clone();
        Inbound {
            settle: Box::new(MemorySettle {
                broker: self.broker.clone(),
                category: self.category.clone(),
                group: self.group.clone(),
                member: self.member.clone(),
                scope: lease.scope().clone(),
                generation: lease.generation(),
                part,
                offset,
                key: message.key().cloned(),
                id: message.id().to_owned(),
            }),
            lease,
            message,
        }
    }
}

#[async_trait]
impl TransportSource for MemorySource {
    async fn fetch(&mut self, max: usize, paused: &HashSet<Arc<str>>, wait: Duration) -> Result<Vec<Inbound>> {
        let broker = self.broker.clone();
        let notified = broker.notify.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let batch = self.try_fetch(max, paused)?;
        if !batch.is_empty() {
            return Ok(batch);
        }
        let _ = tokio::time::timeout(wait, notified).await;
        self.try_fetch(max, paused)
    }

    async fn maintain(&mut self) -> Result<Vec<SourceEvent>> {
        let broker = self.broker.clone();
        let mut st = broker.lock();
        self.round_trip(&mut st)?;
        Ok(std::mem::take(&mut self.events))
    }

    async fn release(&mut self, scope: &str) -> Result<()> {
        let Some(p) = parse_scope(scope) else {
            return Err(Error::NotFound(format!("scope `{scope}`")));
        };
        {
            let mut st = self.broker.lock();
            let cat = self.broker.category(&mut st, &self.category);
            let group = cat.group_mut(&self.group)?;
            let part = &mut group.parts[p as usize];
            if part.owner.as_ref().is_some_and(|(o, _)| *o == self.member) {
                part.hand_back();
            }
        }
        if let Some(lease) = self.leases.remove(&p) {
            lease.lose();
        }
        self.broker.notify.notify_waiters();
        Ok(())
    }

    async fn close(&mut self) -> Result<()> {
        if self.closed {
            return Ok(());
        }
        self.closed = true;
        {
            let mut st = self.broker.lock();
            let cat = self.broker.category(&mut st, &self.category);
            if let Ok(group) = cat.group_mut(&self.group) {
                group.leave(&self.member);
            }
        }
        for lease in self.leases.values() {
            lease.lose();
        }
        self.leases.clear();
        self.broker.notify.notify_waiters();
        Ok(())
    }
}

impl Drop for MemorySource {
    fn drop(&mut self) {
        if !self.closed {
            // Dropped without close (for example a task aborted): the member
            // is left to expire after its lease TTL, like a crashed process.
        }
    }
}

#[derive(Debug)]
struct MemorySettle {
    broker: Arc<Broker>,
    category: String,
    group: String,
    member: String,
    scope: Arc<str>,
    generation: u64,
    part: u32,
    offset: u64,
    key: Option<OrderingKey>,
    id: String,
}

impl MemorySettle {
    fn with_group<T>(&self, f: impl FnOnce(&mut Group) -> T) -> Result<T> {
        let mut st = self.broker.lock();
        let cat = self.broker.category(&mut st, &self.category);
        let group = cat.group_mut(&self.group)?;
        group.fence(self.part, &self.member, self.generation, &self.scope)?;
        let out = f(group);
        cat.trim();
        Ok(out)
    }
}

#[async_trait]
impl Settle for MemorySettle {
    async fn begin_attempt(&self) -> Result<u32> {
        self.with_group(|g| {
            let n = g.attempts.entry((self.part, self.offset)).or_insert(0);
            *n += 1;
            *n
        })
    }

    async fn ack(&self) -> Result<()> {
        self.with_group(|g| g.settle(self.part, self.offset))?;
        self.broker.notify.notify_waiters();
        Ok(())
    }

    async fn park(&self, reason: &str) -> Result<()> {
        self.with_group(|g| {
            g.dead.push(DeadLetter {
                id: self.id.clone(),
                label: self.key.as_ref().map_or_else(|| "keyless".into(), OrderingKey::label),
                reason: reason.to_owned(),
            });
            g.settle(self.part, self.offset);
        })?;
        self.broker.notify.notify_waiters();
        Ok(())
    }

    async fn halt(&self, reason: &str) -> Result<()> {
        self.with_group(|g| {
            g.halted.retain(|h| !(h.part == self.part && h.offset == self.offset));
            g.halted.push(Halt {
                part: self.part,
                offset: self.offset,
                key: self.key.as_ref().map_or_else(String::new, |k| k.as_str().to_owned()),
                id: self.id.clone(),
                reason: reason.to_owned(),
            });
        })
    }
}

struct MemoryAdmin {
    broker: Arc<Broker>,
}

impl fmt::Debug for MemoryAdmin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryAdmin").finish()
    }
}

impl MemoryAdmin {
    fn with_group<T>(
        &self,
        category: &str,
        group: &str,
        f: impl FnOnce(&mut Category, &str) -> Result<T>,
    ) -> Result<T> {
        let mut st = self.broker.lock();
        let Some(cat) = st.categories.get_mut(category) else {
            return Err(Error::NotFound(format!("category `{category}`")));
        };
        cat.group_mut(group)?;
        f(cat, group)
    }
}

#[async_trait]
impl Admin for MemoryAdmin {
    async fn scopes(&self, category: &str, group: &str) -> Result<Vec<ScopeInfo>> {
        self.with_group(category, group, |cat, group| {
            let g = &cat.groups[group];
            Ok(cat
                .logs
                .iter()
                .zip(&g.parts)
                .enumerate()
                .map(|(p, (log, part))| ScopeInfo {
                    scope: scope_name(category, p as u32).to_string(),
                    owner: part.owner.as_ref().map(|(o, _)| o.clone()),
                    generation: part.generation,
                    lag: log.end().saturating_sub(part.acked_upto) - part.acked.len() as u64,
                    halted: g.halted.iter().filter(|h| h.part == p as u32).count(),
                })
                .collect())
        })
    }

    async fn halted(&self, category: &str, group: &str) -> Result<Vec<HaltedKey>> {
        self.with_group(category, group, |cat, group| {
            let g = &cat.groups[group];
            Ok(g.halted
                .iter()
                .map(|h| HaltedKey {
                    label: crate::key::label(&h.key),
                    preview: crate::key::redact(&h.key),
                    scope: scope_name(category, h.part).to_string(),
                    head_id: h.id.clone(),
                    attempts: g.attempts.get(&(h.part, h.offset)).copied().unwrap_or(0),
                    reason: h.reason.clone(),
                    held: None,
                })
                .collect())
        })
    }

    async fn hot_keys(&self, category: &str, group: &str, limit: usize) -> Result<Vec<HotKey>> {
        self.with_group(category, group, |cat, group| {
            let g = &cat.groups[group];
            let mut counts: HashMap<String, u64> = HashMap::new();
            for (log, part) in cat.logs.iter().zip(&g.parts) {
                for off in part.acked_upto..log.end() {
                    if part.is_acked(off) {
                        continue;
                    }
                    if let Some(key) = log.get(off).and_then(|s| s.message.key()) {
                        *counts.entry(key.label()).or_default() += 1;
                    }
                }
            }
            Ok(HotKey::top(counts, limit))
        })
    }

    async fn dead_letters(&self, category: &str, group: &str) -> Result<Vec<DeadLetter>> {
        self.with_group(category, group, |cat, group| Ok(cat.groups[group].dead.clone()))
    }

    async fn resolve(&self, category: &str, group: &str, key: &str, action: HeadAction) -> Result<()> {
        self.with_group(category, group, |cat, group| {
            let g = cat.groups.get_mut(group).expect("checked");
            let label_of = crate::key::label;
            let Some(i) = g.halted.iter().position(|h| h.key == key || label_of(&h.key) == key) else {
                return Err(Error::NotFound(format!("no halted key {}", crate::key::redact(key))));
            };
            let h = g.halted.remove(i);
            let drop_head = match action {
                HeadAction::Skip => {
                    tracing::warn!(key = %label_of(&h.key), id = &*h.id, "operator skipped a halted head");
                    g.settle(h.part, h.offset);
                    true
                }
                HeadAction::DeadLetter => {
                    g.dead.push(DeadLetter {
                        id: h.id.clone(),
                        label: label_of(&h.key),
                        reason: format!("operator: {}", h.reason),
                    });
                    g.settle(h.part, h.offset);
                    true
                }
                HeadAction::Resume => {
                    g.attempts.remove(&(h.part, h.offset));
                    false
                }
            };
            if let Some((owner, _)) = &g.parts[h.part as usize].owner {
                if let Some(m) = g.members.get_mut(owner) {
                    m.events.push(SourceEvent::Resolved {
                        key: h.key.clone(),
                        drop_head,
                    });
                }
            }
            cat.trim();
            Ok(())
        })?;
        self.broker.notify.notify_waiters();
        Ok(())
    }

    async fn groups(&self, category: &str) -> Result<Vec<crate::GroupInfo>> {
        let st = self.broker.lock();
        let now = Instant::now();
        let mut out: Vec<crate::GroupInfo> = st
            .categories
            .get(category)
            .map(|cat| {
                cat.groups
                    .iter()
                    .map(|(name, g)| crate::GroupInfo {
                        name: name.clone(),
                        live_members: g
                            .members
                            .values()
                            .filter(|m| now.duration_since(m.last_seen) <= m.ttl)
                            .count(),
                    })
                    .collect()
            })
            .unwrap_or_default();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    async fn remove_group(&self, category: &str, group: &str) -> Result<()> {
        self.with_group(category, group, |cat, group| {
            let now = Instant::now();
            let live = cat.groups[group]
                .members
                .values()
                .filter(|m| now.duration_since(m.last_seen) <= m.ttl)
                .count();
            if live > 0 {
                return Err(Error::Config(format!(
                    "memory: consumer group `{group}` has {live} live member(s); stop them first, then remove it"
                )));
            }
            cat.groups.remove(group);
            cat.trim();
            Ok(())
        })
    }
}

#[cfg(test)]
mod room_tests {
    use std::collections::HashSet;
    use std::time::Duration;

    use super::MemoryTransport;
    use crate::key::{KeyRules, OrderingKey};
    use crate::lease::LeaseConfig;
    use crate::message::Message;
    use crate::transport::{Inbound, SourceSpec, Transport, TransportSource};

    /// The partition a delivery came from (`category/pN`).
    fn part(i: &Inbound) -> u32 {
        super::parse_scope(i.lease.scope()).expect("a partition scope")
    }

    /// A key of partition `p` of 2.
    fn key_in(p: u64) -> String {
        (0..)
            .map(|i| format!("k{i}"))
            .find(|k| OrderingKey::new(k.as_str()).unwrap().stable_hash() % 2 == p)
            .unwrap()
    }

    /// The only (ordered) member of group `g` of `category`: it owns every partition.
    async fn open(t: &MemoryTransport, category: &str) -> Box<dyn TransportSource> {
        let spec = SourceSpec {
            category: category.into(),
            correlated: Vec::new(),
            group: "g".into(),
            instance: "a".into(),
            ordered: true,
            lease: LeaseConfig::default(),
            key_rules: KeyRules::default(),
        };
        t.open(&spec).await.unwrap()
    }

    async fn fetch(src: &mut Box<dyn TransportSource>, max: usize) -> Vec<Inbound> {
        src.fetch(max, &HashSet::new(), Duration::ZERO).await.expect("fetch")
    }

    /// A fetch lifts the partitions holding the fewest unsettled deliveries
    /// first, instead of splitting its room evenly: the partition whose keys
    /// consumed what they had gets the most.
    #[tokio::test]
    async fn the_room_goes_to_the_partitions_holding_least() {
        let t = MemoryTransport::with_partitions(2);
        let (k0, k1) = (key_in(0), key_in(1));
        let publisher = t.publisher("room").await.unwrap();
        for i in 0..20 {
            for k in [&k0, &k1] {
                publisher
                    .publish(Message::new(format!("{i}")).with_key(k).unwrap())
                    .await
                    .unwrap();
            }
        }
        let mut src = open(&t, "room").await;
        let first = fetch(&mut src, 8).await;
        let count = |batch: &[Inbound], p: u32| batch.iter().filter(|i| part(i) == p).count();
        assert_eq!(
            (count(&first, 0), count(&first, 1)),
            (4, 4),
            "both hold nothing: even shares"
        );
        // Partition 1's deliveries are settled; partition 0 still holds 4.
        for i in first.iter().filter(|i| part(i) == 1) {
            i.settle.ack().await.unwrap();
        }
        let second = fetch(&mut src, 8).await;
        assert_eq!(
            (count(&second, 0), count(&second, 1)),
            (2, 6),
            "partition 1 (holding 0) is lifted to partition 0's 4 first, then both by 2"
        );
    }

    /// Room a partition cannot use (it has fewer entries left than its
    /// share) goes to the others in the same fetch.
    #[tokio::test]
    async fn room_a_partition_cannot_use_goes_to_the_others() {
        let t = MemoryTransport::with_partitions(2);
        let publisher = t.publisher("left").await.unwrap();
        publisher
            .publish(Message::new("only").with_key(key_in(0)).unwrap())
            .await
            .unwrap();
        for i in 0..20 {
            publisher
                .publish(Message::new(format!("{i}")).with_key(key_in(1)).unwrap())
                .await
                .unwrap();
        }
        let mut src = open(&t, "left").await;
        let got = fetch(&mut src, 8).await;
        let count = |p: u32| got.iter().filter(|i| part(i) == p).count();
        assert_eq!((count(0), count(1)), (1, 7), "the fetch is filled from partition 1");
    }
}
