//! `Shared`: what a source shares with its settles, its committer, its
//! checks and its heartbeat, and the losing of partitions. The group
//! member's context (`Ctx`, with the events it sends, `Ev`) is defined here
//! too, since the two hold each other (the member is `Shared`'s, and its
//! callbacks reach `Shared`); `member.rs` holds the callbacks themselves.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc as std_mpsc, Arc, Mutex};
use std::time::Duration;

use keyorder_core::{SourceEvent, SourceSpec};
use rdkafka::consumer::BaseConsumer;
use rdkafka::message::OwnedMessage;
use tokio::sync::{mpsc, watch, Notify};
use tokio::time::Instant;

use super::part::Part;
use crate::broker::KafkaTransport;
use crate::config::base_config;
use crate::names::Names;
use crate::state;

/// What the poll thread tells the async side, in order.
pub(crate) enum Ev {
    /// Partitions assigned: (partition, committed offset, saved generation,
    /// the state record's progress text, older generations' records found,
    /// the claim's marker), and when the assignment was known valid (the
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

/// The group member's context: what its rebalance callbacks (in
/// `member.rs`) read with, and where they send.
pub(crate) struct Ctx {
    pub(crate) tx: mpsc::UnboundedSender<Ev>,
    pub(crate) stopping: Arc<AtomicBool>,
    pub(crate) topic: String,
    pub(crate) names: Names,
    pub(crate) group_id: String,
    /// Reads state records (outside the group).
    pub(crate) reader: state::Reader,
    pub(crate) producer: rdkafka::producer::FutureProducer,
    pub(crate) instance: String,
    /// The longest a revoke may wait for its partitions to drain: less
    /// than `max.poll.interval.ms`, past which the broker expels a member
    /// whose poll is held.
    pub(crate) revoke_wait: Duration,
    /// The longest an assignment may wait for its saved progress: well
    /// under `revoke_wait` (see `member::start`).
    pub(crate) load_wait: Duration,
    pub(crate) shared: std::sync::Weak<Shared>,
    /// The assignor is `cooperative-sticky` (incremental assign and revoke).
    pub(crate) cooperative: bool,
}

/// The group member.
pub(crate) type Member = BaseConsumer<Ctx>;

/// A static member's incarnation: its record's token, the state partition
/// that holds it, and where the next check reads from.
#[derive(Clone, Debug)]
pub(crate) struct Incarnation {
    pub(crate) token: String,
    pub(crate) partition: i32,
    pub(crate) from: i64,
    pub(crate) first: bool,
}

/// Pointer commits not yet sent.
pub(crate) struct Pointers {
    pub(crate) last: Instant,
    /// partition -> committed offset of the topic partition.
    pub(crate) pending: HashMap<i32, i64>,
    /// partition -> (the writer's generation, offset of its newest state
    /// record).
    pub(crate) state: HashMap<i32, (u64, i64)>,
}

/// What the source shares with its settles, committer and heartbeat.
pub(crate) struct Shared {
    pub(crate) t: KafkaTransport,
    pub(crate) names: Names,
    pub(crate) group: String,
    pub(crate) ordered: bool,
    pub(crate) partitions: i32,
    pub(crate) member: Mutex<Option<Arc<Member>>>,
    pub(crate) parts: Mutex<HashMap<i32, Arc<Part>>>,
    /// State-round requests and completions (sequence numbers).
    pub(super) wanted: AtomicU64,
    pub(super) completed: watch::Sender<u64>,
    pub(super) wake: Notify,
    /// The last broker-confirmed ownership (sent time).
    pub(crate) last_confirm: Mutex<Instant>,
    /// The self-fence found a gap: replace the member.
    pub(crate) replace: AtomicBool,
    /// Session timeout less one heartbeat: past it, ownership is presumed lost.
    pub(super) gap: Duration,
    /// Operator actions for the owner (in-process admin).
    pub(crate) events: Mutex<Vec<SourceEvent>>,
    pub(crate) closed: AtomicBool,
    pub(crate) pointers: Mutex<Pointers>,
    /// Reads the state partitions for the pointer checks (outside the group).
    pub(super) checker: Mutex<Option<state::Reader>>,
    /// The heartbeat's round trip to the group coordinator, on its own
    /// connection (see `membership_confirmed` in `heartbeat`); created at
    /// first use.
    pub(super) prober: Mutex<Option<Arc<BaseConsumer>>>,
    /// One pointer check at a time.
    pub(super) checking: tokio::sync::Mutex<()>,
    /// The highest partition beyond the layout the group assigned, plus
    /// one (0: none); never loaded or started (C23).
    pub(crate) outside_layout: std::sync::atomic::AtomicI32,
    /// The subscription's instance id (`group.instance.id` of a static member).
    pub(crate) instance: String,
    /// Joined as a static member.
    pub(crate) static_member: bool,
    /// A static member's incarnation record (see [`Shared::newer_incarnation`]).
    pub(super) incarnation: Mutex<Option<Incarnation>>,
    /// Whether a record with an unusable (empty) key was reported.
    pub(crate) unusable_key_reported: AtomicBool,
    /// Whether a record on another partition than its key's was reported.
    pub(crate) misplaced_key_reported: AtomicBool,
    /// Whether a failure to create the prober was reported.
    pub(super) prober_reported: AtomicBool,
    /// Since when the incarnation check has failed (`None`: it last passed).
    pub(super) unchecked_since: Mutex<Option<Instant>>,
    /// `start=group:<id>`: that group's committed offsets, read at open.
    pub(crate) start_offsets: HashMap<i32, i64>,
    /// Why librdkafka gave this member up for good (a fatal error, such as
    /// another consumer joining with its `group.instance.id`).
    pub(crate) fatal: Mutex<Option<String>>,
}

impl fmt::Debug for Shared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KafkaShared")
            .field("topic", &self.names.topic())
            .finish()
    }
}

impl Shared {
    /// The shared state of a source of `spec` on `names`' topic (of
    /// `partitions` in its layout), owning nothing yet.
    pub(crate) fn new(
        t: &KafkaTransport,
        names: Names,
        spec: &SourceSpec,
        partitions: i32,
        start_offsets: HashMap<i32, i64>,
    ) -> Self {
        let (completed, _) = watch::channel(0);
        Shared {
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
            gap: spec.lease.ttl.saturating_sub(spec.lease.heartbeat),
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
        }
    }

    pub(crate) fn member(&self) -> Option<Arc<Member>> {
        self.member.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The partitions owned now.
    pub(crate) fn owned(&self) -> Vec<Arc<Part>> {
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
            p.lease.lose_to_broker();
        }
        self.replace.store(true, Ordering::SeqCst);
        self.completed.send_modify(|_| {});
        true
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
    pub(crate) fn lose_claims(&self, stale: &[i32], claims: Option<&HashMap<i32, String>>, rejoin: bool) {
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
            p.lease.lose_to_broker();
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
            p.lease.lose_to_broker();
        }
        self.completed.send_modify(|_| {});
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

    /// Runs `f` with the state reader the checks share (created at first
    /// use), one check at a time. Blocking.
    pub(crate) fn with_checker<T>(
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
    pub(crate) fn prober(&self) -> rdkafka::error::KafkaResult<Arc<BaseConsumer>> {
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
}
