//! The source: a connection of its own (its AMQP heartbeat is the stall
//! fence), a consumer per queue this instance owns, and presence.
//!
//! Ordered `sac`: every instance consumes the one queue; the broker keeps the
//! first consumer active until it goes away, then activates the next.
//!
//! Ordered `hash`: instances announce themselves on the category's
//! presence exchange every heartbeat; every instance computes the same fair
//! share of the queues over the live ones and consumes only its share. The
//! queues' single active consumer keeps a queue from being consumed twice
//! while instances disagree during a change. A queue is handed over by
//! finishing and acknowledging its in-flight work and then closing its
//! channel, so the broker activates the next consumer with nothing of the old
//! one outstanding.
//!
//! Fencing token: taken when the broker activates a consumer (its first
//! delivery), from the virtual host's claims stream: see the `claims` module.
//! Deliveries wait until it is known.
//!
//! Self-fence: a scope's lease is confirmed by a round trip on its channel
//! (a passive queue declaration; all of them concurrently) every heartbeat.
//! A consumer whose channel or connection the broker closed (or whose
//! stream of deliveries ended) loses its lease at once, from its consumer
//! task, so nothing it buffered starts after the broker requeued it.
//! Stalls: RabbitMQ closes a connection it received nothing on for between
//! 2 and 3 heartbeat intervals (it checks every interval and gives up after
//! two checks without data). The heartbeat asked for is half the self-fence's
//! freshness (`ttl - margin`, rounded up to whole seconds), so the broker
//! hands a stalled consumer's queues over no earlier than the self-fence
//! paused them (a lease is fresh for `ttl - margin` after the confirming
//! round trip was sent, and that round trip reached the broker after it was
//! sent), and at most about 1.5 × (`ttl - margin`) + 1 s after the stall.

use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU32};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use futures::{FutureExt, StreamExt};
use keyorder_core::{
    Inbound, Message, OrderingKey, Result, ScopeLease, SourceEvent, SourceSpec, TransportSource, KEY_HEADER,
};
use lapin::message::Delivery;
use lapin::options::{BasicConsumeOptions, BasicPublishOptions, BasicQosOptions, ExchangeDeclareOptions};
use lapin::options::{QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ExchangeKind};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::attempts::Attempts;
use crate::claims::Claims;
use crate::config::Topology;
use crate::plan::{Plan, PLAN_HEADER};
use crate::presence::{Announcer, SharedBoard, CONFIRMS_PER_HEARTBEAT, NONCE_HEADER};
use crate::settle::{AckBarrier, Held, RabbitSettle};
use crate::topology::{amqp, private_queue, GroupNames};
use crate::{confirm_channel, connect_uri, short, RabbitTransport, EPOCH_HEADER};

/// Why a queue whose lease a fenced settlement lost is handed back.
const SETTLE_FENCED: &str = "a settlement was fenced";

/// How long a shutdown or hand-over waits for the broker's close-ok.
const CLOSE_WAIT: Duration = Duration::from_secs(5);

/// A delivery with its queue, the local id of the consumer that received
/// it, and that consumer's lease (its token known).
type Arrival = (String, u64, Arc<ScopeLease>, Delivery);

/// The lease of a consumer, once the broker activated it and its claim was
/// read back; shared with its consumer task (which loses it the moment the
/// consumer's stream ends).
type Slot = Arc<Mutex<Option<Arc<ScopeLease>>>>;

struct Owned {
    channel: Channel,
    /// Confirms the acknowledgements written on `channel`.
    barrier: Arc<AckBarrier>,
    /// This source's id for the consumer (a local sequence).
    consumer: u64,
    scope: Arc<str>,
    lease: Slot,
    /// Set by the consumer task when it ended (channel or connection
    /// closed, consumer cancelled, claim not read back).
    ended: Arc<AtomicBool>,
    revoking: bool,
    /// When a fenced settlement's lost lease was first seen (the queue is
    /// then handed back, within the TTL).
    fenced_since: Option<Instant>,
    task: JoinHandle<()>,
}

impl Owned {
    fn lease(&self) -> Option<Arc<ScopeLease>> {
        self.lease.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

struct Link {
    conn: Arc<Connection>,
    dlq_channel: Channel,
    claims: Arc<Claims>,
    /// Attempts counted per started attempt (the `attempts` module).
    attempts: Arc<Attempts>,
    /// This source's consumer of the group's members queue (never given a
    /// message): the queue's consumer count is the group's live members.
    _member: lapin::Consumer,
    presence: Option<(Channel, JoinHandle<()>)>,
}

/// Whether the queue `name` is an exclusive queue of another connection
/// (`Some(true)`), absent or not exclusive (`Some(false)`), or unknown (no
/// answer, `None`).
async fn live_elsewhere(conn: &Connection, name: &str) -> Option<bool> {
    let ch = conn.create_channel().await.ok()?;
    let passive = ch
        .queue_declare(
            name.into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await;
    match passive {
        Ok(_) => {
            let _ = ch.close(200, "checked".into()).await;
            Some(false)
        }
        Err(e) if e.to_string().contains("RESOURCE_LOCKED") => Some(true),
        Err(e) if crate::topology::not_found(&e) => Some(false),
        Err(_) => None,
    }
}

pub(crate) struct Source {
    /// `x-consumer-timeout` for each consumer, where the broker takes it.
    timeout_arg: Option<i64>,
    /// Queues already warned about a routing key that is no valid key.
    warned_invalid: std::sync::Mutex<HashSet<String>>,
    /// Whether a delivery the AMQP client could not read was reported
    /// (see `watch_unreadable`).
    unreadable_reported: Arc<AtomicBool>,
    t: RabbitTransport,
    spec: SourceSpec,
    names: GroupNames,
    queues: Vec<String>,
    link: Option<Link>,
    /// What the presence listener heard (announcements and their plans).
    board: SharedBoard,
    /// This connection's nonce: in its announcements and its live queue's
    /// name (a new one per connection, so a reconnect never waits for the
    /// old connection's queue to go).
    nonce: String,
    /// The offset of this source's first join claim on the virtual host's claims
    /// stream: its place in the plan's member order (oldest first).
    joined_at: Option<u64>,
    /// Set by the presence listener when an instance appears or a leader
    /// announces another plan: rebalance now.
    joined: Arc<AtomicBool>,
    /// This instance's own plan, while it is the oldest live one.
    plan: Option<Plan>,
    /// Ids already reported as unconfirmed (bounded).
    unconfirmed_reported: HashSet<String>,
    /// Confirmations asked in the current heartbeat interval: since, count.
    confirm_window: (Instant, usize),
    /// Whether a refused declaration of this source's live queue was
    /// reported (once until it succeeds).
    live_warned: bool,
    /// When this connection's live queue was last declared (`None`: not
    /// held; no announcement goes out then).
    live_at: Option<Instant>,
    owned: HashMap<String, Owned>,
    scopes: HashMap<Arc<str>, String>,
    tx: mpsc::UnboundedSender<Arrival>,
    rx: mpsc::UnboundedReceiver<Arrival>,
    held: HashMap<String, VecDeque<Inbound>>,
    events: Vec<SourceEvent>,
    last_maintain: Option<Instant>,
    /// The last consumer id given out.
    consumers: u64,
    soon: bool,
}

impl fmt::Debug for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitSource")
            .field("category", &self.names.category())
            .field("owned", &self.owned.len())
            .finish()
    }
}

impl Drop for Source {
    fn drop(&mut self) {
        if let Some(Link {
            presence: Some((_, h)), ..
        }) = &self.link
        {
            h.abort();
        }
        // Nothing buffered starts from here on. Each channel is closed
        // before its consumer goes (dropping a consumer sends
        // `basic.cancel`, which would let the next single active consumer
        // start while the channel still held unacknowledged deliveries).
        let owned: Vec<Owned> = self.owned.drain().map(|(_, o)| o).collect();
        for o in &owned {
            if let Some(l) = o.lease() {
                l.lose();
            }
        }
        // The first poll of a close marks the channel closing and queues
        // its frame (lapin then sends no cancel for the channel's
        // consumers): no runtime is needed for that, and none may be left.
        // The close-ok is not waited for.
        for o in &owned {
            if o.channel.status().connected() {
                let _ = o.channel.close(200, "subscription dropped".into()).now_or_never();
            }
        }
        for o in owned {
            o.task.abort();
        }
    }
}

pub(crate) fn header_text(props: &BasicProperties, name: &str) -> Option<String> {
    let h = props.headers().as_ref()?;
    match h.inner().get(name)? {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
        _ => None,
    }
}

/// Whether `name` is a header the broker (dead-lettering, delivery counts,
/// shovels, stream offsets) or keyorder's dead-lettering set on a delivery,
/// not the producer.
fn is_delivery_header(name: &str) -> bool {
    const EXACT: [&str; 3] = ["x-death", "x-delivery-count", "x-received-from"];
    const PREFIXES: [&str; 6] = [
        "x-first-death-",
        "x-last-death-",
        "x-shovelled",
        "x-keyorder-",
        "x-opt-",
        "x-stream-",
    ];
    EXACT.contains(&name) || PREFIXES.iter().any(|p| name.starts_with(p))
}

fn header_int(props: &BasicProperties, name: &str) -> Option<i64> {
    let h = props.headers().as_ref()?;
    match h.inner().get(name)? {
        AMQPValue::LongLongInt(n) => Some(*n),
        AMQPValue::LongInt(n) => Some(i64::from(*n)),
        AMQPValue::LongUInt(n) => Some(i64::from(*n)),
        AMQPValue::ShortInt(n) => Some(i64::from(*n)),
        AMQPValue::ShortUInt(n) => Some(i64::from(*n)),
        _ => None,
    }
}

/// The AMQP heartbeat for `lease` (see `Source::heartbeat_secs`).
pub(crate) fn heartbeat_secs(lease: &keyorder_core::LeaseConfig) -> u64 {
    let fresh_ms = lease.fresh_for().as_millis() as u64;
    fresh_ms.div_ceil(2000).max(1)
}

/// One consumer's task: its token at its activation, then its deliveries.
struct Activation {
    consumer_id: u64,
    queue: String,
    scope: Arc<str>,
    lease_cfg: keyorder_core::LeaseConfig,
    claims: Arc<Claims>,
    channel: Channel,
    slot: Slot,
    ended: Arc<AtomicBool>,
    tx: mpsc::UnboundedSender<Arrival>,
    consumer: lapin::Consumer,
}

/// Forwards a consumer's deliveries, each with the consumer's lease. The
/// first delivery is the broker's activation of this consumer: the claim
/// is published on the consumer's channel and read back first (later
/// deliveries wait in the consumer meanwhile). When the consumer's stream
/// ends or fails (its channel or connection closed, the consumer was
/// cancelled) the lease is lost at once: the self-fence discards whatever
/// of it is buffered before any of it starts.
async fn activation(mut a: Activation) {
    let mut lease: Option<Arc<ScopeLease>> = None;
    while let Some(Ok(d)) = a.consumer.next().await {
        let l = match &lease {
            Some(l) => l.clone(),
            None => {
                let sent = Instant::now();
                let Some(offset) = a.claims.claim(Some(&a.channel), a.lease_cfg.ttl).await else {
                    tracing::warn!(scope = %a.scope, ttl_s = a.lease_cfg.ttl.as_secs(), "rabbitmq: activation claim not read back in time; giving the queue back");
                    let _ = tokio::time::timeout(CLOSE_WAIT, a.channel.close(200, "no claim".into())).await;
                    break;
                };
                // Offsets start at 0; a token is at least 1.
                let l = ScopeLease::new(a.scope.clone(), offset + 1, &a.lease_cfg, sent);
                *a.slot.lock().unwrap_or_else(|e| e.into_inner()) = Some(l.clone());
                tracing::debug!(scope = %a.scope, generation = offset + 1, "rabbitmq: activated");
                lease = Some(l.clone());
                l
            }
        };
        if a.tx.send((a.queue.clone(), a.consumer_id, l, d)).is_err() {
            // The source is gone: the channel is closed before this task
            // drops its consumer (a `basic.cancel` first would let the next
            // single active consumer start while the channel still held
            // unacknowledged deliveries).
            if let Some(l) = a.slot.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
                l.lose();
            }
            let _ = tokio::time::timeout(CLOSE_WAIT, a.channel.close(200, "subscription dropped".into())).await;
            break;
        }
    }
    a.ended.store(true, std::sync::atomic::Ordering::SeqCst);
    if let Some(l) = a.slot.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
        l.lose();
    }
}

impl Source {
    pub(crate) async fn open(
        timeout_arg: Option<i64>,
        t: RabbitTransport,
        spec: SourceSpec,
        names: GroupNames,
    ) -> Result<Self> {
        let (tx, rx) = mpsc::unbounded_channel();
        let board = Arc::new(Mutex::new(crate::presence::Board::new(&spec.instance)));
        let mut source = Source {
            timeout_arg,
            warned_invalid: std::sync::Mutex::default(),
            unreadable_reported: Arc::default(),
            queues: names.queues(t.cfg.topology),
            t,
            spec,
            names,
            link: None,
            board,
            nonce: crate::presence::nonce(),
            joined_at: None,
            joined: Arc::default(),
            plan: None,
            unconfirmed_reported: HashSet::new(),
            confirm_window: (Instant::now(), 0),
            live_warned: false,
            live_at: None,
            owned: HashMap::new(),
            scopes: HashMap::new(),
            tx,
            rx,
            held: HashMap::new(),
            events: Vec::new(),
            last_maintain: None,
            consumers: 0,
            soon: false,
        };
        source.maintain_now().await?;
        Ok(source)
    }

    /// How long one presence round trip (declaring the live queue,
    /// confirming an announcement) may take: a slow broker must not hold
    /// up the lease confirmations of the next maintenance.
    fn presence_wait(&self) -> Duration {
        (self.spec.lease.heartbeat / 2).clamp(Duration::from_millis(200), Duration::from_secs(1))
    }

    /// Declares this source's live queue on `conn` (exclusive: the broker
    /// deletes it with the connection), so that the others believe its
    /// announcements. Refused while an earlier connection of this source
    /// still holds it (the broker has not yet noticed that one died): tried
    /// again at the next maintenance; until then the others leave this
    /// source out of their plans, and single active consumers keep every
    /// queue consumed once.
    async fn hold_live(&mut self, conn: &Connection) {
        let Some(started) = self.joined_at else {
            return;
        };
        let name = self.names.live(started, &self.spec.instance, &self.nonce);
        let declare = async {
            let ch = conn.create_channel().await?;
            ch.queue_declare(
                name.as_str().into(),
                QueueDeclareOptions {
                    exclusive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await?;
            let _ = ch.close(200, "declared".into()).await;
            Ok::<_, lapin::Error>(())
        };
        match tokio::time::timeout(self.presence_wait(), declare).await {
            Ok(Ok(())) => {
                self.live_warned = false;
                self.live_at = Some(Instant::now());
            }
            Ok(Err(e)) if !self.live_warned => {
                self.live_at = None;
                self.live_warned = true;
                tracing::warn!(
                    error = %e,
                    "rabbitmq: cannot declare this instance's live queue yet (an earlier connection may still \
                     hold it); the other instances leave it out of their plans until it is declared"
                );
            }
            Ok(Err(_)) => self.live_at = None,
            // No answer: the last state stands.
            Err(_) => {}
        }
    }

    /// The announcements (this source's excluded) that the broker
    /// confirms: each one's live queue exists and is locked to another
    /// connection (the `presence` module). One not confirmed is ignored for
    /// a lease TTL and its id reported once; one not yet checked (over the
    /// budget, or no answer) waits. A confirmation lasts one lease TTL;
    /// confirmed members are checked again before new ones.
    async fn confirm(&mut self, fresh: Vec<Announcer>) -> Vec<Announcer> {
        let ttl = self.spec.lease.ttl;
        let current: HashSet<&Announcer> = fresh.iter().collect();
        let confirmed: HashMap<Announcer, Instant> = {
            let mut board = self.board.lock().unwrap_or_else(|e| e.into_inner());
            let c = board.confirmed();
            c.retain(|a, at| at.elapsed() < ttl * 4 && current.contains(a));
            c.clone()
        };
        let Some(conn) = self.link.as_ref().map(|l| l.conn.clone()) else {
            return Vec::new();
        };
        if self.confirm_window.0.elapsed() >= self.spec.lease.heartbeat {
            self.confirm_window = (Instant::now(), 0);
        }
        // Enough for every confirmed member's re-check and some news, so a
        // large group is never starved by its own size.
        let budget = (CONFIRMS_PER_HEARTBEAT + 2 * confirmed.len()).saturating_sub(self.confirm_window.1);
        let mut due: Vec<Announcer> = fresh
            .iter()
            .filter(|a| confirmed.get(*a).is_some_and(|at| at.elapsed() >= ttl))
            .cloned()
            .collect();
        due.extend(fresh.iter().filter(|a| !confirmed.contains_key(*a)).cloned());
        due.truncate(budget);
        self.confirm_window.1 += due.len();
        let wait = self.presence_wait();
        let checks = due.into_iter().map(|a| {
            let name = self.names.live(a.started, &a.who, &a.nonce);
            let conn = conn.clone();
            async move {
                let verdict = tokio::time::timeout(wait, live_elsewhere(&conn, &name))
                    .await
                    .ok()
                    .flatten();
                (a, verdict)
            }
        });
        let verdicts = futures::future::join_all(checks).await;
        let mut board = self.board.lock().unwrap_or_else(|e| e.into_inner());
        for (a, verdict) in verdicts {
            match verdict {
                Some(true) => {
                    board.confirmed().insert(a, Instant::now());
                }
                // Confirmed before: checked again next round before it is
                // given up (a member between two connections).
                Some(false) if confirmed.contains_key(&a) => {
                    board.confirmed().remove(&a);
                }
                Some(false) => {
                    board.reject(&a);
                    metrics::counter!("keyorder_rabbitmq_presence_unconfirmed_total").increment(1);
                    if self.unconfirmed_reported.len() < 1000 && self.unconfirmed_reported.insert(a.who.clone()) {
                        tracing::warn!(
                            member = a.who.as_str(),
                            "rabbitmq: an announcement on the presence exchange is not confirmed by the broker (no \
                             live queue held for it): ignored. A forged or replayed announcement, or one of an \
                             older keyorder; see SECURITY.md for the permissions that keep publishers off the \
                             presence exchange"
                        );
                    }
                }
                // No answer: the last verdict stands.
                None => {}
            }
        }
        let confirmed = board.confirmed();
        fresh.into_iter().filter(|a| confirmed.contains_key(a)).collect()
    }

    /// Whether queues are spread over the instances (ordered `hash`): with
    /// `sac` every instance consumes the one queue and the broker keeps the
    /// first consumer active until it goes away (the next takes over at
    /// once); unordered sources consume every queue.
    fn spreads(&self) -> bool {
        self.spec.ordered && matches!(self.t.cfg.topology, Topology::ConsistentHash { .. })
    }

    /// The AMQP heartbeat: half the self-fence's freshness (`ttl -
    /// margin`), rounded up to whole seconds, at least 1. RabbitMQ closes a
    /// connection silent for 2 to 3 heartbeats, so never before the
    /// self-fence paused (2 heartbeats ≥ `ttl - margin`), and soon after.
    fn heartbeat_secs(&self) -> u64 {
        heartbeat_secs(&self.spec.lease)
    }

    /// Stops consuming `queue` here: its consumer task ends, its lease is
    /// lost (buffered work is discarded), held deliveries are dropped (they
    /// are unacknowledged: the broker returns them).
    fn drop_owned(&mut self, queue: &str) -> Option<Owned> {
        let o = self.owned.remove(queue)?;
        o.task.abort();
        if let Some(l) = o.lease() {
            l.lose();
        }
        self.scopes.remove(&o.scope);
        self.held.remove(queue);
        Some(o)
    }

    fn lose_all(&mut self, why: &str) {
        let queues: Vec<String> = self.owned.keys().cloned().collect();
        for q in queues {
            if let Some(o) = self.drop_owned(&q) {
                tracing::warn!(scope = %o.scope, why, "rabbitmq: queue lost");
            }
        }
    }

    /// Connects and sets up the link, within a deadline (the lease TTL, at
    /// least 10 s): a broker that just restarted can take a while to start a
    /// stream, and a consume it never answers must not hold the source up.
    /// A connection whose set-up failed is closed in the background.
    async fn connect(&mut self) -> Result<()> {
        let uri = self.t.cfg.uri_with_heartbeat(self.heartbeat_secs());
        let conn = Arc::new(connect_uri(&uri, &self.t.cfg).await?);
        watch_unreadable(&conn, &self.unreadable_reported, self.names.base());
        let wait = self.spec.lease.ttl.max(Duration::from_secs(10));
        let failed = match tokio::time::timeout(wait, self.set_up(conn.clone())).await {
            Ok(Ok(())) => return Ok(()),
            Ok(Err(e)) => e,
            Err(_) => keyorder_core::Error::Broker(format!(
                "rabbitmq: setting up the consumer's connection took longer than {} s (the claims stream \
                 not ready yet?); retrying",
                wait.as_secs()
            )),
        };
        tokio::spawn(async move {
            let _ = tokio::time::timeout(CLOSE_WAIT, conn.close(200, "set-up failed".into())).await;
        });
        Err(failed)
    }

    async fn set_up(&mut self, conn: Arc<Connection>) -> Result<()> {
        let dlq_channel = confirm_channel(&conn).await?;
        let stream = crate::claims::STREAM;
        let tag = short("instance id", &format!("{}-claims", self.spec.instance))?;
        let claims = Arc::new(Claims::open(&conn, stream, tag).await.map_err(|e| match e {
            // "NOT_FOUND - home node ... of durable queue ... is down or
            // inaccessible" right after a restart is transient (retried);
            // only "no queue" means it is gone.
            keyorder_core::Error::Broker(text) if text.contains("no queue") => {
                // Declared with every group (`ensure_group`): this process
                // declares it again when the subscription is built again.
                self.t.forget(self.names.base());
                self.t.forget(self.names.category());
                keyorder_core::Error::NotFound(format!(
                    "rabbitmq: the claims stream `{stream}` (fencing tokens) does not exist: it was deleted, or the \
                     group `{}` of category `{}` was declared by an earlier version (or with `declare=false`) \
                     without it. Build the subscription again (with `declare=true`) to declare it",
                    self.names.group(),
                    self.names.category()
                ))
            }
            e => e,
        })?);
        let ledger = crate::attempts::STREAM;
        let tag = short("instance id", &format!("{}-attempts", self.spec.instance))?;
        let attempts = Arc::new(Attempts::open(&conn, ledger, tag).await.map_err(|e| match e {
            keyorder_core::Error::Broker(text) if text.contains("no queue") => {
                self.t.forget(self.names.base());
                self.t.forget(self.names.category());
                keyorder_core::Error::NotFound(format!(
                    "rabbitmq: the attempts stream `{ledger}` (attempts counted per started attempt) does not \
                     exist: it was deleted, or the group `{}` of category `{}` was declared by an earlier version \
                     (or with `declare=false`) without it. Build the subscription again (with `declare=true`) to \
                     declare it",
                    self.names.group(),
                    self.names.category()
                ))
            }
            e => e,
        })?);
        if self.joined_at.is_none() {
            let wait = self.spec.lease.ttl.max(Duration::from_secs(5));
            let Some(offset) = claims.claim(None, wait).await else {
                return Err(keyorder_core::Error::Broker(format!(
                    "rabbitmq: the join claim on `{stream}` was not read back within {} s",
                    wait.as_secs()
                )));
            };
            self.joined_at = Some(offset);
        }
        // Declared with the group (`ensure_group`), never here: a group
        // removed meanwhile is not half re-created by its members queue.
        let member_channel = conn.create_channel().await.map_err(amqp)?;
        let member = member_channel
            .basic_consume(
                self.names.members().as_str().into(),
                short("instance id", &format!("{}-member", self.spec.instance))?,
                BasicConsumeOptions {
                    no_ack: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(|e| self.gone(&self.names.members(), e))?;
        let presence = if self.spreads() {
            let ch = conn.create_channel().await.map_err(amqp)?;
            ch.exchange_declare(
                self.names.presence().as_str().into(),
                ExchangeKind::Fanout,
                ExchangeDeclareOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(amqp)?;
            let (queue, mut consumer) = private_queue(&ch).await?;
            ch.queue_bind(
                queue.as_str().into(),
                self.names.presence().as_str().into(),
                "".into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(amqp)?;
            let board = self.board.clone();
            let joined = self.joined.clone();
            let queues = self.queues.len();
            let task = tokio::spawn(async move {
                while let Some(Ok(d)) = consumer.next().await {
                    // `started:who`: a u64, a colon and an AMQP name at most.
                    if d.data.len() > 300 {
                        continue;
                    }
                    let text = String::from_utf8_lossy(&d.data).into_owned();
                    let Some((started, who)) = text.split_once(':') else {
                        continue;
                    };
                    let Ok(started) = started.parse() else {
                        continue;
                    };
                    let announcer = Announcer {
                        started,
                        who: who.to_owned(),
                        nonce: header_text(&d.properties, NONCE_HEADER).unwrap_or_default(),
                    };
                    // No plan header: an instance that does not follow
                    // plans (an older version); empty: one that follows but
                    // makes none.
                    if !board.lock().unwrap_or_else(|e| e.into_inner()).admits(&announcer) {
                        continue;
                    }
                    let plan = header_text(&d.properties, PLAN_HEADER)
                        .filter(|text| text.len() <= 64 * 1024)
                        .map(|text| Plan::parse(&text, queues));
                    if board.lock().unwrap_or_else(|e| e.into_inner()).hear(announcer, plan) {
                        joined.store(true, std::sync::atomic::Ordering::SeqCst);
                    }
                }
            });
            Some((ch, task))
        } else {
            None
        };
        if self.spreads() {
            self.nonce = crate::presence::nonce();
            self.live_at = None;
            self.hold_live(&conn).await;
        }
        self.link = Some(Link {
            conn,
            dlq_channel,
            claims,
            attempts,
            _member: member,
            presence,
        });
        Ok(())
    }

    /// A consume refused: a queue that no longer exists means the group
    /// was removed (or its category deleted) by another process; this
    /// transport forgets that it declared the group, so building the
    /// subscription again declares it anew.
    fn gone(&self, queue: &str, e: lapin::Error) -> keyorder_core::Error {
        let text = e.to_string();
        if !(text.contains("NOT_FOUND") || text.contains("404")) {
            return amqp(e);
        }
        self.t.forget(self.names.base());
        self.t.forget(self.names.category());
        keyorder_core::Error::NotFound(format!(
            "rabbitmq: queue `{queue}` of group `{}` of category `{}` no longer exists: the group was removed \
             (`Admin::remove_group`, `keyorder groups remove`) or its category deleted (`keyorder delete-queue`) \
             by another process. Build the subscription again to declare the group anew (it then receives what is \
             published from then on)",
            self.names.group(),
            self.names.category()
        ))
    }

    async fn consume(&mut self, queue: &str) -> Result<()> {
        let Some(link) = &self.link else { return Ok(()) };
        let ch = link.conn.create_channel().await.map_err(amqp)?;
        ch.basic_qos(self.t.cfg.prefetch, BasicQosOptions::default())
            .await
            .map_err(amqp)?;
        // The fencing token is not known yet: it is taken when the broker
        // activates this consumer (the `claims` module).
        self.consumers += 1;
        let id = self.consumers;
        let tag = short(
            "instance id",
            &format!("{}-{}-{id}", self.spec.instance, uuid::Uuid::new_v4().simple()),
        )?;
        let mut args = FieldTable::default();
        if let Some(ms) = self.timeout_arg {
            // A halted head stays unacknowledged: no redelivery while halted.
            args.insert("x-consumer-timeout".into(), AMQPValue::LongLongInt(ms));
        }
        let consumer = ch
            .basic_consume(queue.into(), tag, BasicConsumeOptions::default(), args)
            .await
            .map_err(|e| self.gone(queue, e))?;
        let scope: Arc<str> = Arc::from(format!("{}/{queue}", self.names.category()));
        let slot: Slot = Arc::default();
        let ended = Arc::new(AtomicBool::new(false));
        let task = tokio::spawn(activation(Activation {
            consumer_id: id,
            queue: queue.to_owned(),
            scope: scope.clone(),
            lease_cfg: self.spec.lease,
            claims: link.claims.clone(),
            channel: ch.clone(),
            slot: slot.clone(),
            ended: ended.clone(),
            tx: self.tx.clone(),
            consumer,
        }));
        tracing::debug!(scope = %scope, "rabbitmq: consuming");
        self.scopes.insert(scope.clone(), queue.to_owned());
        self.owned.insert(
            queue.to_owned(),
            Owned {
                barrier: AckBarrier::new(ch.clone()),
                channel: ch,
                consumer: id,
                scope,
                lease: slot,
                ended,
                revoking: false,
                fenced_since: None,
                task,
            },
        );
        Ok(())
    }

    async fn maintain_now(&mut self) -> Result<()> {
        let sent = Instant::now();
        let healthy = self.link.as_ref().is_some_and(|l| l.conn.status().connected());
        if !healthy {
            self.lose_all("connection closed");
            self.link = None;
            self.connect().await?;
        }
        if self
            .link
            .as_ref()
            .is_some_and(|l| !l.claims.alive() || !l.attempts.alive())
        {
            // No activation could get its token: start over. The connection
            // is closed before the consumers go: dropping a consumer sends
            // `basic.cancel`, and a cancel that reached the broker first
            // would let the next single active consumer start while this
            // channel still held unacknowledged deliveries (the model's
            // CANCEL_BEFORE_CLOSE, verification/rabbitmq.pml).
            for o in self.owned.values() {
                if let Some(l) = o.lease() {
                    l.lose();
                }
            }
            if let Some(link) = self.link.take() {
                let _ = tokio::time::timeout(CLOSE_WAIT, link.conn.close(200, "claims reader stopped".into())).await;
            }
            self.lose_all("claims reader stopped");
            self.connect().await?;
        }
        // Confirm what we hold: a round trip on each queue's channel, all
        // at once (one after another, latency alone could outlast the
        // lease). One not answered within the TTL confirms nothing; the
        // broker's heartbeat decides whether the channel is gone.
        let ttl = self.spec.lease.ttl;
        let checks = self.owned.iter().map(|(q, o)| async move {
            // A lease lost here (its settlement fenced: lapin refused an
            // acknowledgement) leaves every later delivery discarded and
            // unacknowledged: the queue is handed back (below) and consumed
            // anew.
            if o.ended.load(std::sync::atomic::Ordering::SeqCst) || !o.channel.status().connected() {
                return (q.clone(), Err("channel closed"));
            }
            if o.barrier.broken() {
                return (q.clone(), Err("acknowledgements no longer confirmed"));
            }
            if o.lease().is_some_and(|l| l.is_lost()) {
                return (q.clone(), Err(SETTLE_FENCED));
            }
            let passive = QueueDeclareOptions {
                passive: true,
                ..Default::default()
            };
            let answer = tokio::time::timeout(
                ttl,
                o.channel
                    .queue_declare(q.as_str().into(), passive, FieldTable::default()),
            )
            .await;
            match answer {
                Ok(Ok(_)) => (q.clone(), Ok(true)),
                Ok(Err(_)) => (q.clone(), Err("channel closed")),
                Err(_) => (q.clone(), Ok(false)),
            }
        });
        let mut lost = Vec::new();
        let mut whys = HashMap::new();
        for (q, alive) in futures::future::join_all(checks).await {
            match alive {
                Ok(true) => {
                    if let Some(l) = self.owned.get(&q).and_then(Owned::lease) {
                        l.confirm(sent);
                    }
                }
                Ok(false) => tracing::debug!(queue = %q, "rabbitmq: lease round trip unanswered within the TTL"),
                Err(SETTLE_FENCED) => {
                    // The channel is sound: the queue is revoked, so its
                    // in-flight handlers return before the close hands their
                    // messages on (a close now would let the next owner run
                    // them alongside).
                    // Bounded: a handler that does not return within the
                    // TTL no longer holds the queue, which is then given up
                    // at once as a closed channel is (the handler's own
                    // store fences it by the token).
                    if let Some(o) = self.owned.get_mut(&q) {
                        let since = *o.fenced_since.get_or_insert(sent);
                        if since.elapsed() >= ttl {
                            whys.insert(q.clone(), "a settlement was fenced; the hand-back outlasted the TTL");
                            lost.push(q);
                        } else if !o.revoking {
                            o.revoking = true;
                            tracing::warn!(scope = %o.scope, "rabbitmq: a settlement was fenced; handing the queue back");
                            self.events.push(SourceEvent::Revoke(o.scope.clone()));
                        }
                    }
                }
                Err(why) => {
                    whys.insert(q.clone(), why);
                    lost.push(q);
                }
            }
        }
        // First the leases (nothing buffered starts once the broker may
        // hand a queue on), then every lost channel closed at once, then
        // the consumers: dropping one sends `basic.cancel`, and a cancel
        // before the close would let the next single active consumer start
        // while the channel still held unacknowledged deliveries. A close
        // that is not answered was still sent first.
        for q in &lost {
            if let Some(l) = self.owned.get(q).and_then(Owned::lease) {
                l.lose();
            }
        }
        let closes = lost
            .iter()
            .filter_map(|q| self.owned.get(q))
            .filter(|o| o.channel.status().connected())
            .map(|o| tokio::time::timeout(CLOSE_WAIT, o.channel.close(200, "queue lost".into())));
        futures::future::join_all(closes).await;
        for q in lost {
            if let Some(o) = self.drop_owned(&q) {
                metrics::counter!("keyorder_rabbitmq_queues_lost_total").increment(1);
                let why = whys.get(&q).copied().unwrap_or("channel closed");
                tracing::warn!(scope = %o.scope, why, "rabbitmq: queue lost");
            }
        }
        let me = self.spec.instance.clone();
        let mine: HashSet<String> = if self.spreads() {
            let ttl = self.spec.lease.ttl;
            let fresh = self.board.lock().unwrap_or_else(|e| e.into_inner()).fresh(&me, ttl);
            // Declared again once a TTL (idempotent on this connection), so a
            // queue deleted by someone else comes back.
            if self.live_at.is_none_or(|at| at.elapsed() >= ttl) {
                if let Some(conn) = self.link.as_ref().map(|l| l.conn.clone()) {
                    self.hold_live(&conn).await;
                }
            }
            // One announcement per member: a restarted one's newest (the
            // larger join claim), a reconnected one's newest (heard first
            // later: `fresh` is in that order).
            let mut by_who: HashMap<String, Announcer> = HashMap::new();
            for a in self.confirm(fresh).await {
                if by_who.get(&a.who).is_none_or(|b| b.started <= a.started) {
                    by_who.insert(a.who.clone(), a);
                }
            }
            let mut live: Vec<(u64, String)> = by_who.values().map(|a| (a.started, a.who.clone())).collect();
            live.push((self.joined_at.unwrap_or(u64::MAX), me.clone()));
            live.sort();
            let members: Vec<String> = live.into_iter().map(|(_, m)| m).collect();
            let plan = if members.first() == Some(&me) {
                match &self.plan {
                    Some(p) if p.members == members => p.clone(),
                    _ => {
                        // Alone, every queue is this instance's: no depths
                        // needed. With an instance that does not follow
                        // plans, the count share, which it computes too.
                        let follow = {
                            let board = self.board.lock().unwrap_or_else(|e| e.into_inner());
                            members
                                .iter()
                                .all(|m| *m == me || by_who.get(m).is_some_and(|a| board.follows(a)))
                        };
                        let depths = if members.len() > 1 && follow {
                            self.depths().await
                        } else {
                            Vec::new()
                        };
                        let floor = u64::from(self.t.cfg.prefetch) * self.queues.len() as u64;
                        let plan = Plan::make(&members, &self.queues, &depths, floor);
                        tracing::debug!(members = members.len(), owners = ?plan.owners, ?depths, "rabbitmq: queue plan");
                        self.plan = Some(plan.clone());
                        plan
                    }
                }
            } else {
                self.plan = None;
                // The leader's plan for this member list, else the count share.
                let board = self.board.lock().unwrap_or_else(|e| e.into_inner());
                by_who
                    .get(&members[0])
                    .and_then(|a| board.plan(a))
                    .filter(|p| p.members == members)
                    .unwrap_or_else(|| Plan::make(&members, &self.queues, &[], 0))
            };
            if let Some((ch, _)) = self
                .link
                .as_ref()
                .and_then(|l| l.presence.as_ref())
                .filter(|_| self.live_at.is_some())
            {
                let mut headers = Plan::header(self.plan.as_ref());
                headers.insert(NONCE_HEADER.into(), AMQPValue::LongString(self.nonce.as_str().into()));
                let props = BasicProperties::default().with_headers(headers);
                ch.basic_publish(
                    self.names.presence().as_str().into(),
                    "".into(),
                    BasicPublishOptions::default(),
                    format!("{}:{me}", self.joined_at.unwrap_or(u64::MAX)).as_bytes(),
                    props,
                )
                .await
                .map_err(amqp)?;
            }
            plan.mine(&me, &self.queues).into_iter().cloned().collect()
        } else {
            self.queues.iter().cloned().collect()
        };
        for (q, o) in &mut self.owned {
            if !mine.contains(q) && !o.revoking {
                o.revoking = true;
                self.events.push(SourceEvent::Revoke(o.scope.clone()));
            }
        }
        self.soon = false;
        for q in self.queues.clone() {
            if mine.contains(&q) && !self.owned.contains_key(&q) {
                self.consume(&q).await?;
            }
        }
        let resolved = self
            .t
            .shared
            .resolved
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(self.names.base());
        self.events.extend(resolved.unwrap_or_default());
        self.last_maintain = Some(sent);
        Ok(())
    }

    /// Every queue's ready messages, read on a channel of its own (a
    /// failed passive declaration closes its channel); empty when any read
    /// fails (the plan then falls back to the count share).
    async fn depths(&self) -> Vec<u64> {
        let Some(link) = &self.link else { return Vec::new() };
        let Ok(ch) = link.conn.create_channel().await else {
            return Vec::new();
        };
        let passive = QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        let mut depths = Vec::with_capacity(self.queues.len());
        for q in &self.queues {
            match ch
                .queue_declare(q.as_str().into(), passive, FieldTable::default())
                .await
            {
                Ok(d) => depths.push(u64::from(d.message_count())),
                Err(_) => return Vec::new(),
            }
        }
        let _ = ch.close(200, "depths read".into()).await;
        depths
    }

    fn inbound(&self, queue: &str, consumer: u64, lease: Arc<ScopeLease>, d: Delivery) -> Option<Inbound> {
        let o = self.owned.get(queue).filter(|o| o.consumer == consumer)?;
        let link = self.link.as_ref()?;
        let generation = lease.generation();
        let mut props = d.properties.clone();
        // One buffer for the message and the copy kept for a dead letter.
        let payload = keyorder_core::Bytes::from(d.data);
        let mut msg = Message::new(payload.clone());
        if let Some(id) = props.message_id() {
            msg = msg.with_id(id.as_str());
        }
        if let Some(c) = props.correlation_id() {
            msg = msg.with_correlation_id(c.as_str());
        }
        if let Some(h) = props.headers() {
            for k in h.inner().keys() {
                // `x-` headers too (a key source may name one), but not
                // what the broker or keyorder itself set on a delivery or
                // a dead letter: re-published with the message, they would
                // tell a false history.
                if k.as_str() == EPOCH_HEADER || is_delivery_header(k.as_str()) {
                    continue;
                }
                if let Some(v) = header_text(&props, k.as_str()) {
                    msg = msg.with_header(k.as_str(), v);
                }
            }
        }
        // The key is what the message was placed by: its routing key (what
        // the ring hashed) unless that is keyorder's routing of a keyless
        // message (a hash of its id, or, before, the id itself) or empty;
        // else keyorder's `keyorder-key` header. A header that differs from
        // the routing key is kept as it came: the key source selects it and
        // the subscription parks the message as routed by another key.
        // A routing key that is the delivering queue's own name was a
        // publish straight to the queue (the default exchange: an
        // operator's move, a shovel), not a placement by the ring.
        let rk = d.routing_key.as_str();
        let id = props.message_id().as_ref().map(|s| s.as_str().to_owned());
        let not_routed = rk.is_empty()
            || rk == queue
            || id
                .as_deref()
                .is_some_and(|id| rk == id || rk == crate::keyless_routing_key(id));
        let header_key = header_text(&props, KEY_HEADER);
        let routed_by = (!not_routed).then(|| rk.to_owned());
        let stamp = header_key.is_none() && routed_by.is_some();
        let key_text = routed_by.clone().or(header_key);
        let key = match key_text
            .as_deref()
            .map(|k| OrderingKey::with_rules(k, &self.spec.key_rules))
        {
            Some(Ok(k)) => Some(k),
            Some(Err(e)) => {
                // Not a key keyorder can carry: run under the keyless
                // policy, counted, and said once per queue.
                metrics::counter!("keyorder_rabbitmq_invalid_routing_keys_total").increment(1);
                let first = self
                    .warned_invalid
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(queue.to_owned());
                if first {
                    tracing::warn!(queue, error = %e, "rabbitmq: a message's routing key is not a valid ordering key; such messages run under the keyless policy (unordered) and are counted in keyorder_rabbitmq_invalid_routing_keys_total: route by keys that meet the key rules (see Keys in the README)");
                }
                None
            }
            None => None,
        };
        if let Some(k) = &key {
            msg = msg.with_ordering_key(k.clone());
            if stamp {
                // Routed by the routing key alone: what
                // `KeySource::routing_key()` selects, and what a dead
                // letter of it keeps.
                msg = msg.with_header(KEY_HEADER, k.as_str());
                let mut h = props.headers().clone().unwrap_or_default();
                h.insert(
                    KEY_HEADER.into(),
                    AMQPValue::LongString(k.as_str().as_bytes().to_vec().into()),
                );
                props = props.with_headers(h);
            }
        }
        // Attempts are counted on the attempts stream, not from the
        // delivery: a quorum queue's `x-delivery-count` also counts
        // prefetched messages a dead consumer never started, a classic
        // queue only flags a redelivery (the `attempts` module).
        // `x-delivery-count` only from a quorum queue, which sets it: on a
        // classic queue the header can only be the publisher's (issue 37).
        let quorum = self.t.cfg.queue_type == crate::QueueType::Quorum;
        let redelivered = d.redelivered || (quorum && header_int(&props, "x-delivery-count").is_some_and(|n| n > 0));
        let subject = crate::attempts::subject(
            self.names.base(),
            props.message_id().as_ref().map(|s| s.as_str()),
            key_text.as_deref(),
            &payload,
        );
        let message_id = msg.id().to_owned();
        let key = key.map(|k| k.as_str().to_owned());
        if let Some(k) = &key {
            // Counted until the settle handle goes (`RabbitSettle::drop`).
            self.t.shared.hold(self.names.base(), k);
        }
        Some(Inbound {
            message: msg,
            lease: lease.clone(),
            settle: Box::new(RabbitSettle {
                t: self.t.clone(),
                dlq_channel: link.dlq_channel.clone(),
                group: self.names.base().to_owned(),
                dlq: self.names.dlq(),
                key,
                scope: o.scope.clone(),
                generation,
                message_id,
                redelivered,
                attempts: AtomicU32::new(0),
                pending: std::sync::Mutex::new(None),
                counted: AtomicU32::new(0),
                held: Arc::new(Held {
                    acker: d.acker.clone(),
                    payload,
                    properties: props,
                    reset: AtomicBool::new(false),
                    ledger: link.attempts.clone(),
                    subject,
                    ledger_wait: self.spec.lease.ttl.max(Duration::from_secs(5)),
                    barrier: o.barrier.clone(),
                }),
            }),
        })
    }

    fn take(&mut self, max: usize, paused: &HashSet<Arc<str>>, out: &mut Vec<Inbound>) {
        // Held deliveries of scopes no longer paused go first, in order.
        for (q, buf) in &mut self.held {
            let Some(o) = self.owned.get(q) else { continue };
            if paused.contains(&o.scope) {
                continue;
            }
            while out.len() < max {
                match buf.pop_front() {
                    Some(i) => out.push(i),
                    None => break,
                }
            }
        }
        self.held.retain(|_, b| !b.is_empty());
        while out.len() < max {
            let Ok((q, consumer, lease, d)) = self.rx.try_recv() else {
                break;
            };
            let Some(i) = self.inbound(&q, consumer, lease, d) else {
                continue;
            };
            let paused_now = self.held.contains_key(&q) || paused.contains(i.lease.scope());
            if paused_now {
                // Bounded by the queue's prefetch.
                self.held.entry(q).or_default().push_back(i);
            } else {
                out.push(i);
            }
        }
    }
}

#[async_trait]
impl TransportSource for Source {
    async fn fetch(&mut self, max: usize, paused: &HashSet<Arc<str>>, wait: Duration) -> Result<Vec<Inbound>> {
        let mut out = Vec::new();
        self.take(max, paused, &mut out);
        if out.is_empty() {
            if let Ok(Some((q, consumer, lease, d))) = tokio::time::timeout(wait, self.rx.recv()).await {
                if let Some(i) = self.inbound(&q, consumer, lease, d) {
                    if paused.contains(i.lease.scope()) || self.held.contains_key(&q) {
                        self.held.entry(q).or_default().push_back(i);
                    } else {
                        out.push(i);
                    }
                }
                self.take(max, paused, &mut out);
            }
        }
        Ok(out)
    }

    async fn maintain(&mut self) -> Result<Vec<SourceEvent>> {
        let every = if self.soon {
            Duration::from_millis(100).min(self.spec.lease.heartbeat)
        } else {
            self.spec.lease.heartbeat
        };
        // An announcement looks again at once, but not more often than every
        // 100 ms: a flood of them must not turn maintenance into a loop.
        let early = self
            .last_maintain
            .is_none_or(|t| t.elapsed() >= Duration::from_millis(100).min(self.spec.lease.heartbeat));
        let joined = early && self.joined.swap(false, std::sync::atomic::Ordering::SeqCst);
        if joined || self.last_maintain.is_none_or(|t| t.elapsed() >= every) {
            self.maintain_now().await?;
        }
        Ok(std::mem::take(&mut self.events))
    }

    async fn release(&mut self, scope: &str) -> Result<()> {
        let Some(q) = self.scopes.get(scope).cloned() else {
            return Ok(());
        };
        // Close the channel while its consumer is still registered, and only
        // then end the consumer task: lapin cancels a consumer whose stream
        // is dropped (`basic.cancel`), and a cancel before the close lets
        // RabbitMQ activate the next single active consumer at once, while
        // this one still holds its prefetched, unacknowledged deliveries;
        // those come back only at the close, after the next consumer was
        // given later messages of their keys. A close alone returns them
        // first, in order, and then activates the next consumer (nothing is
        // in flight: the subscription drained the scope).
        if let Some(o) = self.owned.get(&q) {
            if let Some(l) = o.lease() {
                l.lose();
            }
            // The close frame is sent before the wait: a broker that does not
            // answer (a connection it already dropped) cannot hold this up.
            if tokio::time::timeout(CLOSE_WAIT, o.channel.close(200, "handed over".into()))
                .await
                .is_err()
            {
                tracing::warn!(scope = %scope, wait_s = CLOSE_WAIT.as_secs(), "rabbitmq: no close-ok for a released queue's channel in time");
            }
        }
        if self.drop_owned(&q).is_some() {
            metrics::counter!("keyorder_rabbitmq_queues_released_total").increment(1);
            // Consumed anew at once where it is still this instance's.
            self.soon = true;
        }
        Ok(())
    }

    async fn close(&mut self) -> Result<()> {
        let scopes: Vec<Arc<str>> = self.scopes.keys().cloned().collect();
        // On a connection that is gone there is no channel to close (the
        // broker already returned the deliveries): only forget them.
        let connected = self.link.as_ref().is_some_and(|l| l.conn.status().connected());
        for s in scopes {
            if connected {
                self.release(&s).await?;
            } else if let Some(q) = self.scopes.get(&s).cloned() {
                self.drop_owned(&q);
            }
        }
        if let Some(link) = self.link.take() {
            if let Some((_, h)) = &link.presence {
                h.abort();
            }
            if tokio::time::timeout(CLOSE_WAIT, link.conn.close(200, "closing".into()))
                .await
                .is_err()
            {
                tracing::warn!(
                    wait_s = CLOSE_WAIT.as_secs(),
                    "rabbitmq: no close-ok for the connection in time"
                );
            }
        }
        Ok(())
    }
}

/// Reports, once per subscription, a delivery the AMQP client cannot read
/// and counts each (`keyorder_rabbitmq_unreadable_deliveries_total`): a
/// routing key (an AMQP short string) that is no UTF-8. AMQP forbids it,
/// RabbitMQ routes it anyway, and the client closes the connection on it,
/// so the message returns to its queue and stops it, every reconnect, until
/// it is removed. Nothing here can settle it (its delivery tag is in the
/// frame that could not be read), so the report names the fix.
fn watch_unreadable(conn: &Connection, reported: &Arc<AtomicBool>, category: &str) {
    let mut events = conn.events_listener();
    let (reported, category) = (reported.clone(), category.to_owned());
    tokio::spawn(async move {
        while let Some(event) = events.next().await {
            let lapin::Event::Error(e) = event else { continue };
            if !matches!(e.kind(), lapin::ErrorKind::ParsingError(_)) {
                continue;
            }
            metrics::counter!("keyorder_rabbitmq_unreadable_deliveries_total").increment(1);
            if !reported.swap(true, std::sync::atomic::Ordering::SeqCst) {
                tracing::error!(
                    category = %category,
                    error = %e,
                    "rabbitmq: a delivery could not be read (a routing key that is no UTF-8, which AMQP forbids but \
                     RabbitMQ routes); the connection closed and the message went back to its queue, which it stops \
                     until it is removed. Remove it with a client that reads raw bytes (the management UI's Get \
                     messages with Ack mode \"Reject requeue false\", or pika's basic_get and basic_ack), and make its \
                     producer send UTF-8 routing keys (reported once; counted in \
                     keyorder_rabbitmq_unreadable_deliveries_total)"
                );
            }
        }
    });
}
