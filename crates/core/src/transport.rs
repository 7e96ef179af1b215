//! The traits a transport implements: publisher, ordered source, per-delivery
//! settlement, and the operator's admin view.
//!
//! Users do not call these directly: they use [`crate::Client`],
//! [`crate::Publisher`] and [`crate::SubscriptionBuilder`], which add key
//! validation, registration checks, strategy resolution and keyed dispatch on
//! top. An adapter crate implements them over its broker.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use crate::capability::Capabilities;
use crate::error::Result;
use crate::key::KeyRules;
use crate::lease::{LeaseConfig, ScopeLease};
use crate::message::Message;

/// A transport: one broker connection configuration.
#[async_trait]
pub trait Transport: Send + Sync + fmt::Debug + 'static {
    /// The adapter's name (`memory`, `redis`, ...), used in trial names and errors.
    fn name(&self) -> &str;

    /// The capabilities this transport has with its declared configuration,
    /// decided without a broker round trip.
    fn capabilities(&self) -> Capabilities;

    /// How a user gets cross-instance affinity on this transport, for the
    /// error `Strategy::Auto` gives when it is missing.
    fn affinity_fix(&self) -> String;

    /// A publisher for one category.
    ///
    /// # Behavior
    /// - The returned publisher appends in call order: a `publish` awaited
    ///   before the next keeps the key's publish order.
    async fn publisher(&self, category: &str) -> Result<Arc<dyn TransportPublisher>>;

    /// Opens a source for one (category, group) on behalf of one instance.
    ///
    /// Ordered sources require [`Capabilities::cross_instance_affinity`]
    /// (checked by the subscription builder, never here).
    ///
    /// # Behavior
    /// - With `spec.ordered`, every delivery carries the [`ScopeLease`] of the
    ///   scope it came from, and the scope is owned by this instance alone.
    /// - Without it, the source is the transport's plain competing-consumer
    ///   path (the benchmark baseline).
    async fn open(&self, spec: &SourceSpec) -> Result<Box<dyn TransportSource>>;

    /// The operator's view of this transport.
    fn admin(&self) -> Arc<dyn Admin>;

    /// The lease a subscription uses when its builder sets none: the one
    /// the transport's URL states (`lease_ttl_ms`, `lease_heartbeat_ms`,
    /// `lease_margin_ms`, parsed by [`crate::lease::LeaseOptions`]), or
    /// `None` for [`LeaseConfig::default`]. A transport that wraps another
    /// forwards it.
    fn default_lease(&self) -> Option<LeaseConfig> {
        None
    }
}

/// What a source is opened for.
#[derive(Debug, Clone)]
pub struct SourceSpec {
    /// The category (stream, topic, queue family).
    pub category: String,
    /// Further categories read by the same subscription and partitioned by
    /// the same correlation value (C11): one owner per value across all of
    /// them. Empty for a single-category subscription.
    ///
    /// Requires [`Capabilities::correlated_ownership`] (checked by the
    /// subscription builder).
    pub correlated: Vec<String>,
    /// The consumer group.
    pub group: String,
    /// The instance's unique id (owner id in leases).
    pub instance: String,
    /// Ordered by key (scopes owned exclusively) or the plain baseline.
    pub ordered: bool,
    /// Lease timing.
    pub lease: LeaseConfig,
    /// The key rules of the deployment.
    pub key_rules: KeyRules,
}

/// A publisher's claim for a fenced publish: the scope it publishes for (a
/// relay's slot, say) and the generation it holds that scope at.
///
/// A broker that fences publishes keeps, per category and scope, the highest
/// token it has seen: a publish with a lower token is refused
/// ([`crate::Error::Fenced`]) and stores nothing, so once a new owner (a
/// higher generation) has published for a scope, the old owner's late
/// publishes cannot reach consumers.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PublishFence {
    /// The scope: 1 to 200 bytes of ASCII letters, digits and `-_./`.
    pub scope: String,
    /// The publisher's generation for the scope.
    pub token: u64,
}

impl PublishFence {
    /// Checks the scope's spelling (the transports use it in names).
    pub fn check(&self) -> Result<()> {
        let ok = !self.scope.is_empty()
            && self.scope.len() <= 200
            && self
                .scope
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'));
        if ok {
            Ok(())
        } else {
            Err(crate::Error::Config(format!(
                "publish fence scope {:?}: use 1 to 200 ASCII letters, digits and -_./",
                self.scope.chars().take(40).collect::<String>()
            )))
        }
    }
}

/// A transport's publisher for one category.
#[async_trait]
pub trait TransportPublisher: Send + Sync + fmt::Debug {
    /// Appends one message; returns once the broker acknowledged it.
    async fn publish(&self, message: Message) -> Result<()>;

    /// Appends one message unless the broker has seen a higher token for
    /// `fence.scope` in this category, recording `fence.token` as the
    /// highest seen, in one atomic step on the broker.
    ///
    /// Called only on a transport that declares
    /// [`Capabilities::publish_fencing`]; elsewhere [`crate::Publisher`]
    /// publishes unfenced, as its documentation says.
    ///
    /// # Errors
    /// [`crate::Error::Fenced`] when refused (nothing stored).
    /// [`crate::Error::Unsupported`] (the default): the transport declared
    /// the capability without implementing it.
    async fn publish_fenced(&self, message: Message, fence: &PublishFence) -> Result<()> {
        let _ = (message, fence);
        Err(crate::Error::Unsupported {
            transport: format!("{self:?}"),
            capability: "publish_fencing",
            fix: "this adapter declares publish fencing but does not implement publish_fenced; \
                  declare `publish_fencing: false` in its capabilities"
                .into(),
        })
    }
}

/// One delivery as a transport hands it over.
#[derive(Debug)]
pub struct Inbound {
    /// The message (its key is the routing key the producer routed by).
    pub message: Message,
    /// The scope's lease in this instance.
    pub lease: Arc<ScopeLease>,
    /// Settles this delivery on the broker.
    pub settle: Box<dyn Settle>,
}

/// Settles one delivery on the broker. Every call is fenced: it fails with
/// [`crate::Error::Fenced`] once the owner lost the scope.
#[async_trait]
pub trait Settle: Send + Sync + fmt::Debug {
    /// Durably increments and returns the attempt count (1 on the first
    /// attempt), before the handler starts.
    ///
    /// # Behavior
    /// - The count survives a restart and an owner change: a new owner sees
    ///   the attempts its predecessors made.
    /// - Fails with [`crate::Error::Fenced`] when this owner lost the scope.
    async fn begin_attempt(&self) -> Result<u32>;
    /// Acknowledges the delivery.
    ///
    /// # Behavior
    /// - Requires [`Capabilities::fencing`] for the fence: a stale owner's
    ///   acknowledgement fails with [`crate::Error::Fenced`] and changes nothing.
    /// - Once it returned `Ok`, no later owner delivers this message again.
    async fn ack(&self) -> Result<()>;
    /// Moves the delivery to the dead-letter destination with `reason`,
    /// durably confirmed, then acknowledges it.
    ///
    /// Requires [`Capabilities::park_and_release`].
    ///
    /// # Behavior
    /// - Returns `Ok` only after the dead letter is durable; the key is
    ///   released only then.
    async fn park(&self, reason: &str) -> Result<()>;
    /// Records durably that the key halted at this delivery (it stays pending).
    ///
    /// Requires [`Capabilities::halt_on_poison`].
    ///
    /// # Behavior
    /// - The halted head shows in [`Admin::halted`] until an operator
    ///   resolves it ([`Admin::resolve`]).
    async fn halt(&self, reason: &str) -> Result<()>;
    /// Hands a delivery that never started back to the transport, because
    /// its key is halted; returns `false` when the transport cannot take it
    /// (the default), and the dispatcher keeps it.
    ///
    /// # Behavior
    /// - A transport that returns `true` delivers the message again, in its
    ///   key's order, once the key's halt is resolved; until then it holds
    ///   it (not delivered, not counted as an attempt), so a halted key
    ///   takes no memory or per-key depth in the consumer.
    /// - Called only after [`Settle::halt`] of the key's head returned `Ok`:
    ///   while the key is halted, or when the subscription takes the
    ///   halt's resolution ([`SourceEvent::Resolved`], before its next
    ///   fetch) for a message that waited in a paused scope. Such a message
    ///   too is delivered again, after the key's earlier messages, by the
    ///   read that follows the resolution.
    fn unread(&self) -> bool {
        false
    }
    /// Whether this message was delivered before (to this owner or an
    /// earlier one) and not settled: an earlier attempt may have killed its
    /// process. The dispatcher runs such a message alone, so that a crash
    /// is charged to the message that caused it and not to every message
    /// that ran beside it. `false` (the default) where the transport cannot
    /// tell.
    fn delivered_before(&self) -> bool {
        false
    }
}

/// Something the transport tells the subscription loop.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SourceEvent {
    /// The scope must be handed over: take no new work from it, let its
    /// in-flight work finish, then call [`TransportSource::release`].
    Revoke(Arc<str>),
    /// An operator resolved a halted key's head at the broker: release the
    /// key in the dispatcher, dropping its held head (`drop_head`) or running
    /// it again.
    Resolved {
        /// The key's value.
        key: String,
        /// Whether the head was settled at the broker (skip, dead letter).
        drop_head: bool,
    },
}

/// A transport's source of deliveries for one instance.
#[async_trait]
pub trait TransportSource: Send + Sync + fmt::Debug {
    /// Returns up to [`Room::max`] deliveries from scopes the room does not
    /// pause, waiting up to `wait` when none is ready. Renews leases as
    /// needed.
    ///
    /// # Behavior
    /// - A source that reads several scopes at once splits the room over
    ///   them with [`Room::split`], the one policy (what the dispatcher
    ///   holds of each scope decides its share); it decides only which
    ///   scopes are readable.
    async fn fetch(&mut self, room: &Room, wait: Duration) -> Result<Vec<Inbound>>;
    /// Housekeeping (heartbeat, rebalance, operator actions); returns events.
    async fn maintain(&mut self) -> Result<Vec<SourceEvent>>;
    /// Hands a revoked scope over once its in-flight work returned.
    async fn release(&mut self, scope: &str) -> Result<()>;
    /// Releases every scope of `scopes` (each drained, as for
    /// [`TransportSource::release`]); a source whose broker lets many go in
    /// one round trip overrides it (Redis). On an error the subscription
    /// calls it again with the same scopes: releasing a scope no longer
    /// held here does nothing.
    async fn release_all(&mut self, scopes: &[Arc<str>]) -> Result<()> {
        for scope in scopes {
            self.release(scope).await?;
        }
        Ok(())
    }
    /// Leaves: releases every owned scope (called after draining).
    async fn close(&mut self) -> Result<()>;
}

/// One scope as the operator sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScopeInfo {
    /// The scope's name.
    pub scope: String,
    /// The owning instance, if any.
    pub owner: Option<String>,
    /// The owner's generation.
    pub generation: u64,
    /// Messages not yet acknowledged.
    pub lag: u64,
    /// Halted keys in the scope.
    pub halted: usize,
}

/// A halted key and its head.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HaltedKey {
    /// A log-safe label of the key (`k#` + stable hash).
    pub label: String,
    /// The key, redacted.
    pub preview: String,
    /// The scope it halted in.
    pub scope: String,
    /// The head's message id.
    pub head_id: String,
    /// Attempts made on the head.
    pub attempts: u32,
    /// Why it halted.
    pub reason: String,
    /// Messages of the key held behind the head, where the transport counts
    /// them (`None`: held in the consumer's memory, not counted here).
    pub held: Option<u64>,
}

/// A key holding a large share of the backlog.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HotKey {
    /// A log-safe label of the key.
    pub label: String,
    /// Messages of the key not yet acknowledged.
    pub backlog: u64,
}

impl HotKey {
    /// The `limit` largest of `(label, backlog)` counts, largest first
    /// (ties by label).
    pub fn top(counts: impl IntoIterator<Item = (String, u64)>, limit: usize) -> Vec<HotKey> {
        let mut hot: Vec<HotKey> = counts
            .into_iter()
            .map(|(label, backlog)| HotKey { label, backlog })
            .collect();
        hot.sort_by(|a, b| b.backlog.cmp(&a.backlog).then_with(|| a.label.cmp(&b.label)));
        hot.truncate(limit);
        hot
    }
}

/// A dead-lettered message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetter {
    /// The message id.
    pub id: String,
    /// The key's label.
    pub label: String,
    /// Why it was parked.
    pub reason: String,
}

/// A consumer group of a category, as the broker records it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupInfo {
    /// The group's name.
    pub name: String,
    /// Members (instances) the broker sees as live in it now.
    pub live_members: usize,
}

/// What an operator does with a halted head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeadAction {
    /// Acknowledge it without processing (logged), release the key.
    Skip,
    /// Move it to the dead-letter destination, release the key.
    DeadLetter,
    /// Reset its attempts and run it again.
    Resume,
}

impl HeadAction {
    /// Its name on the wire and in the `keyorder head` command: `skip`,
    /// `dlq` or `resume`.
    pub fn name(self) -> &'static str {
        match self {
            HeadAction::Skip => "skip",
            HeadAction::DeadLetter => "dlq",
            HeadAction::Resume => "resume",
        }
    }

    /// The action [`HeadAction::name`] gives `name`, if any.
    pub fn from_name(name: &str) -> Option<Self> {
        [HeadAction::Skip, HeadAction::DeadLetter, HeadAction::Resume]
            .into_iter()
            .find(|a| a.name() == name)
    }
}

/// The operator's view of a transport.
#[async_trait]
pub trait Admin: Send + Sync + fmt::Debug {
    /// Live scopes of (category, group) with owner, generation and lag.
    async fn scopes(&self, category: &str, group: &str) -> Result<Vec<ScopeInfo>>;
    /// Halted keys and their heads (the operator's "inspect head").
    ///
    /// Requires [`Capabilities::halt_on_poison`].
    async fn halted(&self, category: &str, group: &str) -> Result<Vec<HaltedKey>>;
    /// Keys holding the largest share of the backlog, largest first.
    async fn hot_keys(&self, category: &str, group: &str, limit: usize) -> Result<Vec<HotKey>>;
    /// Dead-lettered messages of (category, group).
    async fn dead_letters(&self, category: &str, group: &str) -> Result<Vec<DeadLetter>>;
    /// Resolves a halted head. `key` is the key's value or its label.
    ///
    /// Requires [`Capabilities::halt_on_poison`].
    ///
    /// # Behavior
    /// - The action is carried out at the broker first (skip: acknowledged;
    ///   dead letter: parked and acknowledged; resume: attempts reset), then
    ///   the owner is told to release the key ([`SourceEvent::Resolved`]), so
    ///   it works from another process and with no owner at all.
    /// - An unknown or not-halted key is [`crate::Error::NotFound`].
    async fn resolve(&self, category: &str, group: &str, key: &str, action: HeadAction) -> Result<()>;
    /// The consumer groups the broker records for `category`: every group
    /// that has subscribed and was not removed, live or stopped. Retention
    /// and trimming keep what any of them still needs.
    async fn groups(&self, category: &str) -> Result<Vec<GroupInfo>> {
        let _ = category;
        Err(crate::Error::Config(format!(
            "{self:?}: listing consumer groups is not implemented by this adapter"
        )))
    }
    /// Removes a stopped group of `category`: what the broker keeps for it
    /// (positions, pending entries, queues) goes, and retention no longer
    /// waits for it.
    ///
    /// # Behavior
    /// - Refused with [`crate::Error::Config`] while the group has live
    ///   members (stop them first).
    /// - An unknown group is [`crate::Error::NotFound`].
    async fn remove_group(&self, category: &str, group: &str) -> Result<()> {
        let _ = (category, group);
        Err(crate::Error::Config(format!(
            "{self:?}: removing consumer groups is not implemented by this adapter"
        )))
    }
    /// Deletes `category` and everything the broker keeps for it, for every
    /// consumer group (messages, positions, halted keys, dead letters), and
    /// says what went, in words (`"12 rows"`, `"7 queues"`): `keyorder
    /// delete-queue` is this verb on every transport.
    ///
    /// # Behavior
    /// - Refused with [`crate::Error::Config`] while a group of the category
    ///   has live members (stop their subscriptions first).
    /// - [`crate::Error::Unsupported`] where the broker keeps the category in
    ///   a form keyorder does not own; the error names the broker's own way.
    async fn delete_category(&self, category: &str) -> Result<String> {
        let _ = category;
        Err(crate::Error::Unsupported {
            transport: "this transport".into(),
            capability: "delete_category",
            fix: "it keeps no category that keyorder can delete; nothing was deleted".into(),
        })
    }
    /// Reclaims the room that consumed messages left behind and refreshes
    /// the statistics the broker plans its reads with, where keyorder's
    /// tables need it (PostgreSQL: `VACUUM (ANALYZE)` of keyorder's tables,
    /// what autovacuum does on a server where it is on). Nothing on a
    /// transport whose broker keeps its own house.
    async fn vacuum(&self) -> Result<()> {
        Ok(())
    }
    /// What a durable acknowledgement waits for on the broker, as one line
    /// for a report (PostgreSQL: `synchronous_commit=on fsync=on`), with a
    /// warning when it is relaxed below what the ordering guarantee
    /// assumes; `None` where the adapter has nothing to report.
    async fn durability(&self) -> Result<Option<String>> {
        Ok(None)
    }
}

/// The room a fetch may fill, as the subscription hands it to
/// [`TransportSource::fetch`]: how many deliveries in all, which scopes take
/// none now (their back-pressure or hand-over), and what the dispatcher
/// holds of each scope (delivered, not yet finished), from which
/// [`Room::split`] shares the room over the scopes a source can read.
///
/// The policy lives here, once, so every transport shares the dispatcher's
/// room the same way; a transport decides only which of its scopes are
/// readable.
///
/// ```
/// use keyorder_core::transport::Room;
/// let room = Room::up_to(16).holding([("a".into(), 64)]);
/// // A scope that holds much still gets a floor; the rest lifts the others.
/// assert_eq!(room.split(&["a", "b", "c", "d"], 16, 0), vec![1, 5, 5, 5]);
/// ```
#[derive(Debug, Clone, Default)]
pub struct Room {
    max: usize,
    paused: HashSet<Arc<str>>,
    held: HashMap<Arc<str>, usize>,
}

impl Room {
    /// Room for up to `max` deliveries, no scope paused, nothing held.
    pub fn up_to(max: usize) -> Room {
        Room { max, ..Room::default() }
    }

    /// The same room with `scopes` paused: a fetch takes nothing of them.
    #[must_use]
    pub fn pausing(mut self, scopes: impl IntoIterator<Item = Arc<str>>) -> Room {
        self.paused.extend(scopes);
        self
    }

    /// The same room, knowing what the dispatcher holds of each scope.
    #[must_use]
    pub fn holding(mut self, held: impl IntoIterator<Item = (Arc<str>, usize)>) -> Room {
        self.held.extend(held);
        self
    }

    /// The most deliveries the fetch may return.
    pub fn max(&self) -> usize {
        self.max
    }

    /// Whether the fetch must take nothing of `scope`.
    pub fn is_paused(&self, scope: &str) -> bool {
        self.paused.contains(scope)
    }

    /// What the dispatcher holds of `scope`: delivered, not yet finished.
    pub fn held(&self, scope: &str) -> usize {
        self.held.get(scope).copied().unwrap_or(0)
    }

    /// Shares `room` (at most [`Room::max`] less what the fetch already
    /// took) over `scopes`, one share each in their order: every scope first
    /// gets a floor (a quarter of an even share, at least one each when the
    /// room allows), and the rest goes to the scopes the dispatcher holds
    /// least of (water-filling), so what every scope holds evens out; ties go
    /// first to the scopes from `start` on. A scope that holds much because
    /// one of its keys is halted or slow still gets its floor, so its other
    /// keys never wait for every other scope's backlog; and a scope of many
    /// keys (which consumes fastest) is not starved by a scope of few keys
    /// filling the budget.
    pub fn split<S: AsRef<str>>(&self, scopes: &[S], room: usize, start: usize) -> Vec<usize> {
        let held: Vec<usize> = scopes.iter().map(|s| self.held(s.as_ref())).collect();
        share_room(&held, room, start)
    }
}

/// Splits a fetch's `room` over scopes that already hold `held` delivered,
/// unsettled messages each, lifting the lowest first (water-filling), so
/// what every scope holds evens out; ties go first to the scopes from
/// `start` on. A source that reads many scopes at once uses it to share the
/// dispatcher's room: even shares let a scope of few keys (which consumes
/// slowly) fill the budget while the keys of a crowded scope ran dry, and
/// those keys then finished their backlog last.
///
/// For example `fill_levels(&[0, 10, 3], 5, 0)` gives `[4, 0, 1]`.
pub(crate) fn fill_levels(held: &[usize], room: usize, start: usize) -> Vec<usize> {
    let n = held.len();
    if n == 0 {
        return Vec::new();
    }
    let cost = |level: usize| held.iter().map(|&h| level.saturating_sub(h)).sum::<usize>();
    // The highest level every scope can be lifted to within `room`.
    let (mut lo, mut hi) = (0, held.iter().max().copied().unwrap_or(0) + room);
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if cost(mid) <= room {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    let mut give: Vec<usize> = held.iter().map(|&h| lo.saturating_sub(h)).collect();
    // What is left (less than one each at the level) goes one each to
    // scopes at the level, from `start` on.
    let mut left = room - cost(lo);
    for i in (0..n).map(|i| (start + i) % n) {
        if left == 0 {
            break;
        }
        if held[i] + give[i] == lo {
            give[i] += 1;
            left -= 1;
        }
    }
    give
}

/// `fill_levels` with a floor: every scope first gets a quarter of an
/// even share (at least one each when the room allows), and the rest is
/// water-filled. A scope that holds many because one of its keys is halted
/// or slow (its messages stay with the dispatcher) still gets some room, so
/// its other keys never wait for every other scope's backlog.
///
/// For example `share_room(&[64, 0, 0, 0], 16, 0)` gives `[1, 5, 5, 5]`:
/// a floor of one each, and the rest lifts the lowest.
pub(crate) fn share_room(held: &[usize], room: usize, start: usize) -> Vec<usize> {
    let n = held.len();
    if n == 0 {
        return Vec::new();
    }
    let floor = (room / (4 * n)).max(usize::from(room >= n));
    let mut give = fill_levels(held, room - floor * n, start);
    give.iter_mut().for_each(|g| *g += floor);
    give
}

#[cfg(test)]
mod fill_tests {
    use std::sync::Arc;

    use super::{fill_levels, share_room, Room};

    #[test]
    fn the_room_splits_by_what_the_dispatcher_holds() {
        let a: Arc<str> = "a".into();
        let room = Room::up_to(10).holding([(a.clone(), 6)]).pausing(["p".into()]);
        assert_eq!(room.max(), 10);
        assert!(room.is_paused("p") && !room.is_paused("a"));
        assert_eq!((room.held("a"), room.held("b")), (6, 0));
        // Floor 1 each (10 / 8), then 8 lift b to 6 and both on by 1.
        assert_eq!(room.split(&["a", "b"], 10, 0), vec![2, 8]);
        assert_eq!(room.split(&["b", "c"], 7, 1), vec![3, 4], "ties from `start` on");
        assert_eq!(room.split::<&str>(&[], 7, 0), Vec::<usize>::new());
    }

    #[test]
    fn a_full_scope_still_gets_a_floor() {
        assert_eq!(share_room(&[64, 0, 0, 0], 16, 0), vec![1, 5, 5, 5]);
        assert_eq!(share_room(&[64, 0, 0, 0], 3, 0), vec![0, 1, 1, 1]);
        assert_eq!(share_room(&[0, 0], 0, 0), vec![0, 0]);
        assert_eq!(share_room(&[], 9, 0), Vec::<usize>::new());
        for (held, room) in [
            (vec![1usize, 7, 2, 9], 13usize),
            (vec![300, 0], 256),
            (vec![64; 16], 256),
        ] {
            let give = share_room(&held, room, 1);
            assert_eq!(give.iter().sum::<usize>(), room, "all the room is used");
            if room >= held.len() {
                assert!(give.iter().all(|g| *g >= 1), "every scope gets some: {give:?}");
            }
        }
    }

    #[test]
    fn the_room_lifts_the_lowest_slots_first() {
        assert_eq!(fill_levels(&[0, 10, 3], 5, 0), vec![4, 0, 1]);
        assert_eq!(fill_levels(&[5, 5, 5], 2, 1), vec![0, 1, 1]);
        assert_eq!(fill_levels(&[5, 5, 5], 2, 2), vec![1, 0, 1]);
        assert_eq!(fill_levels(&[0, 0], 0, 0), vec![0, 0]);
        assert_eq!(fill_levels(&[], 7, 3), Vec::<usize>::new());
        for (held, room) in [
            (vec![1usize, 7, 2, 9], 13usize),
            (vec![0; 64], 256),
            (vec![300, 0], 256),
        ] {
            let give = fill_levels(&held, room, 5);
            assert_eq!(give.iter().sum::<usize>(), room, "all the room is used");
            let after: Vec<usize> = held.iter().zip(&give).map(|(h, g)| h + g).collect();
            let lifted_max = after.iter().zip(&give).filter(|(_, g)| **g > 0).map(|(a, _)| *a).max();
            let unlifted_min = after.iter().zip(&give).filter(|(_, g)| **g == 0).map(|(a, _)| *a).min();
            if let (Some(l), Some(u)) = (lifted_max, unlifted_min) {
                assert!(
                    l <= u + 1,
                    "no scope is lifted above one left behind: {held:?} {give:?}"
                );
            }
        }
    }
}
