//! What a source holds: its link (the connection of its own and what runs
//! on it), the queues it owns with their consumers and leases, and the
//! lookups the other rooms of the source share.

use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::FutureExt;
use keyorder_core::{Inbound, ScopeLease, SourceEvent, SourceSpec};
use lapin::message::Delivery;
use lapin::{Channel, Connection};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::attempts::Attempts;
use crate::claims::Claims;
use crate::config::Topology;
use crate::conn::Conn;
use crate::held::AckBarrier;
use crate::names::GroupNames;
use crate::plan::Plan;
use crate::presence::SharedBoard;

/// Why a queue whose lease a fenced settlement lost is handed back.
pub(super) const SETTLE_FENCED: &str = "a settlement was fenced";

/// How long a shutdown or hand-over waits for the broker's close-ok.
pub(super) const CLOSE_WAIT: Duration = Duration::from_secs(5);

/// A delivery with its queue, the local id of the consumer that received
/// it, and that consumer's lease (its token known).
pub(super) type Arrival = (String, u64, Arc<ScopeLease>, Delivery);

/// The lease of a consumer, once the broker activated it and its claim was
/// read back; shared with its consumer task (which loses it the moment the
/// consumer's stream ends).
pub(super) type Slot = Arc<Mutex<Option<Arc<ScopeLease>>>>;

pub(super) struct Owned {
    pub(super) channel: Channel,
    /// Confirms the acknowledgements written on `channel`.
    pub(super) barrier: Arc<AckBarrier>,
    /// This source's id for the consumer (a local sequence).
    pub(super) consumer: u64,
    pub(super) scope: Arc<str>,
    pub(super) lease: Slot,
    /// Set by the consumer task when it ended (channel or connection
    /// closed, consumer cancelled, claim not read back).
    pub(super) ended: Arc<AtomicBool>,
    pub(super) revoking: bool,
    /// When a fenced settlement's lost lease was first seen (the queue is
    /// then handed back, within the TTL).
    pub(super) fenced_since: Option<Instant>,
    pub(super) task: JoinHandle<()>,
}

impl Owned {
    pub(super) fn lease(&self) -> Option<Arc<ScopeLease>> {
        self.lease.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

pub(super) struct Link {
    pub(super) conn: Arc<Connection>,
    pub(super) dlq_channel: Channel,
    pub(super) claims: Arc<Claims>,
    /// Attempts counted per started attempt (the `attempts` module).
    pub(super) attempts: Arc<Attempts>,
    /// This source's consumer of the group's members queue (never given a
    /// message): the queue's consumer count is the group's live members.
    pub(super) _member: lapin::Consumer,
    pub(super) presence: Option<(Channel, JoinHandle<()>)>,
}

pub(crate) struct Source {
    /// `x-consumer-timeout` for each consumer, where the broker takes it.
    pub(super) timeout_arg: Option<i64>,
    /// Queues already warned about a routing key that is no valid key.
    pub(super) warned_invalid: std::sync::Mutex<HashSet<String>>,
    /// Whether a delivery the AMQP client could not read was reported
    /// (see `watch_unreadable`).
    pub(super) unreadable_reported: Arc<AtomicBool>,
    pub(super) t: Conn,
    pub(super) spec: SourceSpec,
    pub(super) names: GroupNames,
    pub(super) queues: Vec<String>,
    pub(super) link: Option<Link>,
    /// What the presence listener heard (announcements and their plans).
    pub(super) board: SharedBoard,
    /// This connection's nonce: in its announcements and its live queue's
    /// name (a new one per connection, so a reconnect never waits for the
    /// old connection's queue to go).
    pub(super) nonce: String,
    /// The offset of this source's first join claim on the virtual host's claims
    /// stream: its place in the plan's member order (oldest first).
    pub(super) joined_at: Option<u64>,
    /// Set by the presence listener when an instance appears or a leader
    /// announces another plan: rebalance now.
    pub(super) joined: Arc<AtomicBool>,
    /// This instance's own plan, while it is the oldest live one.
    pub(super) plan: Option<Plan>,
    /// Ids already reported as unconfirmed (bounded).
    pub(super) unconfirmed_reported: HashSet<String>,
    /// Confirmations asked in the current heartbeat interval: since, count.
    pub(super) confirm_window: (Instant, usize),
    /// Whether a refused declaration of this source's live queue was
    /// reported (once until it succeeds).
    pub(super) live_warned: bool,
    /// When this connection's live queue was last declared (`None`: not
    /// held; no announcement goes out then).
    pub(super) live_at: Option<Instant>,
    pub(super) owned: HashMap<String, Owned>,
    pub(super) scopes: HashMap<Arc<str>, String>,
    pub(super) tx: mpsc::UnboundedSender<Arrival>,
    pub(super) rx: mpsc::UnboundedReceiver<Arrival>,
    pub(super) held: HashMap<String, VecDeque<Inbound>>,
    pub(super) events: Vec<SourceEvent>,
    pub(super) last_maintain: Option<Instant>,
    /// The last consumer id given out.
    pub(super) consumers: u64,
    pub(super) soon: bool,
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

/// The AMQP heartbeat for `lease` (see `Source::heartbeat_secs`).
pub(crate) fn heartbeat_secs(lease: &keyorder_core::LeaseConfig) -> u64 {
    let fresh_ms = lease.fresh_for().as_millis() as u64;
    fresh_ms.div_ceil(2000).max(1)
}

impl Source {
    /// How long one presence round trip (declaring the live queue,
    /// confirming an announcement) may take: a slow broker must not hold
    /// up the lease confirmations of the next maintenance.
    pub(super) fn presence_wait(&self) -> Duration {
        (self.spec.lease.heartbeat / 2).clamp(Duration::from_millis(200), Duration::from_secs(1))
    }

    /// Whether queues are spread over the instances (ordered `hash`): with
    /// `sac` every instance consumes the one queue and the broker keeps the
    /// first consumer active until it goes away (the next takes over at
    /// once); unordered sources consume every queue.
    pub(super) fn spreads(&self) -> bool {
        self.spec.ordered && matches!(self.t.cfg.topology, Topology::ConsistentHash { .. })
    }

    /// The AMQP heartbeat: half the self-fence's freshness (`ttl -
    /// margin`), rounded up to whole seconds, at least 1. RabbitMQ closes a
    /// connection silent for 2 to 3 heartbeats, so never before the
    /// self-fence paused (2 heartbeats ≥ `ttl - margin`), and soon after.
    pub(super) fn heartbeat_secs(&self) -> u64 {
        heartbeat_secs(&self.spec.lease)
    }

    /// Stops consuming `queue` here: its consumer task ends, its lease is
    /// lost (buffered work is discarded), held deliveries are dropped (they
    /// are unacknowledged: the broker returns them).
    pub(super) fn drop_owned(&mut self, queue: &str) -> Option<Owned> {
        let o = self.owned.remove(queue)?;
        o.task.abort();
        if let Some(l) = o.lease() {
            l.lose();
        }
        self.scopes.remove(&o.scope);
        self.held.remove(queue);
        Some(o)
    }

    pub(super) fn lose_all(&mut self, why: &str) {
        let queues: Vec<String> = self.owned.keys().cloned().collect();
        for q in queues {
            if let Some(l) = self.owned.get(&q).and_then(Owned::lease) {
                l.lose_to_broker();
            }
            if let Some(o) = self.drop_owned(&q) {
                tracing::warn!(scope = %o.scope, why, "rabbitmq: queue lost");
            }
        }
    }
}
