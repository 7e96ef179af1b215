//! Names, declaration and verification of a category's topology: one entry
//! exchange per category that publishers publish to, and behind it one set
//! of queues per consumer group, so every group receives every message.
//!
//! Category `{c}` (what publishers use):
//!
//! | Name | Kind | What |
//! |---|---|---|
//! | `{c}:entry` | fanout exchange | publishers publish here, routing key = the key (a keyless message: a hash of its id); every group's topology is bound to it. A foreign producer's routing key is its message's key (a valid one; else the message runs under the keyless policy, counted); a `keyorder-key` header that differs from the routing key gets the message parked |
//! | `{c}:groups` | classic queue (whatever `queue_type`: not replicated), never `x-expires`, one persistent message per group (`{"group": g, "topology": "hash:8"}`) | the group registry: `Admin::groups`, the topology each group was declared with (a different one is refused), what `remove_group` and `keyorder delete-queue` delete; a message that is no valid record is skipped |
//! | `{c}:groups-lock` | classic queue, never `x-expires`, never holds a message | the registry's lock: whoever reads or changes the registry holds an exclusive consumer on it, for a few round trips (a group's queues are declared after it is released) |
//!
//! Group `{g}` of category `{c}` (its base name `{c}:{g}`): its queues are of the configured
//! `queue_type`; quorum ones carry `x-delivery-limit` = `i32::MAX`
//! ([`DELIVERY_LIMIT`]: never reached, where RabbitMQ 4.x's default of 20
//! would drop a halted head):
//!
//! | Name | Kind | What |
//! |---|---|---|
//! | `{c}:{g}.hash` | `x-consistent-hash` exchange, arguments `x-keyorder-queues: N`, `x-keyorder-weight: W`, bound to `{c}:entry` (an exchange-to-exchange binding keeps the routing key) | the group's ring (`hash` topology) |
//! | `{c}:{g}.hash.{i}` | queue, single active consumer, bound to `{c}:{g}.hash` with weight W (`RING_WEIGHT`) | one of the group's N queues |
//! | `{c}:{g}.sac` | queue, single active consumer, bound to `{c}:entry` | the `sac` topology |
//! | `{c}:{g}.plain` | queue, bound to `{c}:entry` | the `plain` topology |
//! | `{c}:{g}.dlq` | queue, never `x-expires` | the group's dead letters (published with a confirm, then the head is acknowledged) |
//! | `{c}:{g}.members` | classic queue, never holds a message | every running source of the group consumes it: its consumer count is the group's live members |
//! | `{c}:{g}.presence` | fanout exchange (transient) | the group's instances announce themselves every heartbeat (`hash`) |
//! | `keyorder.live.{hash}` | exclusive queue (gone with its connection), never holds a message | held by each running source of a `hash` group, named after its join claim and instance id; an announcement is believed only while its queue exists and is locked to another connection ([`GroupNames::live`]) |
//!
//! Virtual host (shared by every category and group):
//!
//! | Name | Kind | What |
//! |---|---|---|
//! | `keyorder.claims` | stream queue (`x-queue-type: stream`, durable, `x-max-length-bytes` 16 MB in 1 MB segments, `x-max-age` 1D, never `x-expires`, never deleted by keyorder) | fencing tokens: a consumer's claim at its activation, and each source's join claim; a claim's offset is the token (see the `claims` module). One per virtual host, not per group: a stream holds files open on the broker for as long as it exists, and a group's queues may expire, a stream cannot |
//! | `keyorder.attempts` | stream queue (durable, `x-max-length-bytes` 16 MB in 1 MB segments, `x-max-age` 7D, never deleted by keyorder) | attempts counted per started attempt: a record is written and read back before an attempt that is not a first delivery's first starts (see the `attempts` module) |
//!
//! **No two (category, group) pairs share a name.** Categories and groups
//! are 1 to 200 bytes of `[A-Za-z0-9._-]` (the names keyorder's client
//! accepts; anything else is refused naming this rule), so neither holds a
//! `:`: the first `:` of a name ends the category. A category-level name
//! has no `.` after it; a group's name always ends in `.{kind}` with a kind
//! from the fixed set above, none of which ends another at a `.` (`hash.N`
//! ends in digits), so the group and the kind are recovered from the rest.
//! Category and group together are at most 244 bytes, so the longest name
//! (`{c}:{g}.hash.1023`) fits AMQP's 255; a longer pair is refused naming
//! that rule. Names of the layout before consumer groups (`{c}.hash`,
//! `{c}.hash.N`, `{c}.sac`, `{c}.plain`, `{c}.dlq`) hold no `:` either: a
//! category that still has such queues is refused at subscribe and at
//! publish until they are drained and deleted ([`legacy_queues`]).
//!
//! The drift checks hold per group: a group is recorded in the registry with
//! its topology (and N), and declaring it with another one (another N, `sac`
//! for a `hash` group, ...) is refused with the fix, with `declare=false`
//! too; the group's existing queues are checked as well (a hash queue
//! beyond N or a queue of another kind is refused; without a record, so is
//! a ring of fewer queues), since RabbitMQ does not compare a custom
//! exchange's arguments (`x-keyorder-queues` enforces nothing by itself).
//! The queue type and the single-active-consumer argument are checked by
//! the broker on every declaration (406).

use std::collections::BTreeMap;
use std::time::Duration;

use keyorder_core::{Error, Result};
use lapin::options::{
    BasicConsumeOptions, BasicGetOptions, BasicNackOptions, BasicPublishOptions, ConfirmSelectOptions,
    ExchangeBindOptions, ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Channel, Connection, Consumer, ExchangeKind};
use serde_json::{json, Value};

use crate::config::{QueueType, RabbitConfig, Topology};

pub(crate) fn amqp(e: lapin::Error) -> Error {
    Error::Broker(format!("rabbitmq: {e}"))
}

/// The longest category and group together (bytes): `{c}:{g}.hash.1023`
/// then fits AMQP's 255-byte names.
pub const MAX_CATEGORY_AND_GROUP: usize = 255 - ":".len() - ".hash.1023".len();

fn check(what: &str, name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 200
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if ok {
        Ok(())
    } else {
        Err(Error::Config(format!(
            "rabbitmq: {what} `{}` is not usable: a {what} name is 1 to 200 characters of [A-Za-z0-9._-] (the \
             queue and exchange names of every (category, group) pair must differ, and `:` separates them)",
            name.chars().take(60).collect::<String>().escape_debug()
        )))
    }
}

/// The names of one category (see the module's table).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Names {
    c: String,
}

impl Names {
    /// The names of `category` (1 to 200 characters of `[A-Za-z0-9._-]`).
    pub fn new(category: &str) -> Result<Self> {
        check("category", category)?;
        Ok(Names { c: category.to_owned() })
    }
    /// The category.
    pub fn category(&self) -> &str {
        &self.c
    }
    /// The entry exchange publishers publish to.
    pub fn entry(&self) -> String {
        format!("{}:entry", self.c)
    }
    /// The group registry queue.
    pub fn registry(&self) -> String {
        format!("{}:groups", self.c)
    }
    /// The registry's lock queue.
    pub fn registry_lock(&self) -> String {
        format!("{}:groups-lock", self.c)
    }
    /// The names of `group` of this category.
    pub fn group(&self, group: &str) -> Result<GroupNames> {
        check("group", group)?;
        if self.c.len() + group.len() > MAX_CATEGORY_AND_GROUP {
            return Err(Error::Config(format!(
                "rabbitmq: category `{}` and group `{}` are {} bytes together: on RabbitMQ a category and a group \
                 name are at most {MAX_CATEGORY_AND_GROUP} bytes together (AMQP names are at most 255 bytes and the \
                 longest keyorder makes is `{{category}}:{{group}}.hash.1023`); shorten one of them",
                self.c,
                group,
                self.c.len() + group.len()
            )));
        }
        Ok(GroupNames {
            c: self.c.clone(),
            g: group.to_owned(),
            base: format!("{}:{group}", self.c),
        })
    }
    /// The queues of the layout before consumer groups (`{c}.sac`,
    /// `{c}.plain`, `{c}.dlq`, the first hash queue `{c}.hash.0`): a
    /// category that has any of them is refused until they are drained and
    /// deleted.
    pub fn legacy_queues(&self) -> Vec<String> {
        vec![
            format!("{}.sac", self.c),
            format!("{}.plain", self.c),
            format!("{}.dlq", self.c),
            format!("{}.hash.0", self.c),
        ]
    }
    /// The consistent-hash exchange of the layout before consumer groups.
    pub fn legacy_hash_exchange(&self) -> String {
        format!("{}.hash", self.c)
    }
    /// Hash queue `i` of the layout before consumer groups.
    pub fn legacy_hash_queue(&self, i: u16) -> String {
        format!("{}.hash.{i}", self.c)
    }
}

/// The names of one (category, group) pair (see the module's table).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupNames {
    c: String,
    g: String,
    base: String,
}

impl GroupNames {
    /// The category.
    pub fn category(&self) -> &str {
        &self.c
    }
    /// The group.
    pub fn group(&self) -> &str {
        &self.g
    }
    /// `{category}:{group}`, the prefix of every name of the group (unique
    /// per pair; also the key of the group's state in a process).
    pub fn base(&self) -> &str {
        &self.base
    }
    /// The group's consistent-hash exchange.
    pub fn hash_exchange(&self) -> String {
        format!("{}.hash", self.base)
    }
    /// Queue `i` of the group's hash topology.
    pub fn hash_queue(&self, i: u16) -> String {
        format!("{}.hash.{i}", self.base)
    }
    /// The group's single-active-consumer queue.
    pub fn sac_queue(&self) -> String {
        format!("{}.sac", self.base)
    }
    /// The group's plain queue.
    pub fn plain_queue(&self) -> String {
        format!("{}.plain", self.base)
    }
    /// The group's dead-letter queue.
    pub fn dlq(&self) -> String {
        format!("{}.dlq", self.base)
    }
    /// The queue every running source of the group consumes (its consumer
    /// count is the group's live members).
    pub fn members(&self) -> String {
        format!("{}.members", self.base)
    }
    /// The group's presence exchange.
    pub fn presence(&self) -> String {
        format!("{}.presence", self.base)
    }
    /// The exclusive queue a running source of the group holds for as long
    /// as its connection lives, named after its join claim's offset, its
    /// instance id and its nonce: the broker's proof that an announcement
    /// comes from a live member (the `presence` module). A fixed-length
    /// name (`keyorder.live.` and 32 hex digits of SHA-256), so a long
    /// category, group or instance id still fits.
    pub fn live(&self, started: u64, who: &str, nonce: &str) -> String {
        use sha2::Digest;
        let digest = sha2::Sha256::new()
            .chain_update(self.base.as_bytes())
            .chain_update([0])
            .chain_update(started.to_be_bytes())
            .chain_update(who.as_bytes())
            .chain_update([0])
            .chain_update(nonce.as_bytes())
            .finalize();
        let hex: String = digest[..16].iter().map(|b| format!("{b:02x}")).collect();
        format!("keyorder.live.{hex}")
    }

    /// The queues a topology consumes.
    pub fn queues(&self, t: Topology) -> Vec<String> {
        match t {
            Topology::Plain => vec![self.plain_queue()],
            Topology::SingleActiveConsumer => vec![self.sac_queue()],
            Topology::ConsistentHash { queues } => (0..queues).map(|i| self.hash_queue(i)).collect(),
        }
    }
}

/// A topology as the registry records it: `plain`, `sac` or `hash:N`.
pub(crate) fn describe(t: Topology) -> String {
    match t {
        Topology::Plain => "plain".into(),
        Topology::SingleActiveConsumer => "sac".into(),
        Topology::ConsistentHash { queues } => format!("hash:{queues}"),
    }
}

/// The topology a registry record names.
pub(crate) fn parse_topology(s: &str) -> Option<Topology> {
    match s {
        "plain" => Some(Topology::Plain),
        "sac" => Some(Topology::SingleActiveConsumer),
        _ => s
            .strip_prefix("hash:")
            .and_then(|n| n.parse().ok())
            .filter(|n| (1..=1024).contains(n))
            .map(|queues| Topology::ConsistentHash { queues }),
    }
}

/// The URL options that declare `t`.
fn url_options(t: Topology) -> String {
    match t {
        Topology::Plain => "topology=plain".into(),
        Topology::SingleActiveConsumer => "topology=sac".into(),
        Topology::ConsistentHash { queues } => format!("topology=hash&queues={queues}"),
    }
}

/// Points each queue takes on the consistent-hash ring. With one point per
/// queue the ring splits keys very unevenly over few queues; more points
/// even it out. It is part of the topology (recorded on the exchange): a
/// change moves keys.
pub(crate) const RING_WEIGHT: u32 = 64;

/// The delivery limit pinned on quorum queues: never reached. RabbitMQ
/// 4.x gives a quorum queue without one a limit of 20 deliveries, past
/// which it drops the message (or dead-letters it where a dead-letter
/// exchange is set): a halted head, kept unacknowledged and redelivered at
/// every hand-over, would be lost. keyorder applies its own poison policy.
/// (`-1` cannot be used: RabbitMQ 3.x reads it as a limit, and drops a
/// message at its first return.)
pub(crate) const DELIVERY_LIMIT: i32 = i32::MAX;

fn queue_args(qt: QueueType, sac: bool, expires: Option<u32>) -> FieldTable {
    queue_args_limited(qt, sac, expires, true)
}

/// `queue_args`, with or without [`DELIVERY_LIMIT`] on a quorum queue
/// (without: as an earlier version declared it).
fn queue_args_limited(qt: QueueType, sac: bool, expires: Option<u32>, limit: bool) -> FieldTable {
    let mut args = FieldTable::default();
    if limit && qt == QueueType::Quorum {
        args.insert("x-delivery-limit".into(), AMQPValue::LongInt(DELIVERY_LIMIT));
    }
    if let Some(ms) = expires {
        args.insert("x-expires".into(), AMQPValue::LongUInt(ms));
    }
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString(LongString::from(qt.name())),
    );
    if sac {
        args.insert("x-single-active-consumer".into(), AMQPValue::Boolean(true));
    }
    args
}

fn explain(e: lapin::Error, what: &str, fix: &str) -> Error {
    let text = e.to_string();
    if text.contains("PRECONDITION_FAILED") || text.contains("406") {
        Error::Config(format!("rabbitmq: {what} exists with other arguments ({text}); {fix}"))
    } else if text.contains("NOT_FOUND") || text.contains("404") {
        Error::Config(format!("rabbitmq: {what} is missing ({text}); {fix}"))
    } else {
        amqp(e)
    }
}

pub(crate) fn not_found(e: &lapin::Error) -> bool {
    let text = e.to_string();
    text.contains("NOT_FOUND") || text.contains("404")
}

/// A passive declaration of `queue` on a channel of its own (a refused one
/// closes its channel): `(messages ready, consumers)`, `None` when the queue
/// does not exist.
pub(crate) async fn queue_state(conn: &Connection, queue: &str) -> Result<Option<(u32, u32)>> {
    let ch = conn.create_channel().await.map_err(amqp)?;
    let passive = QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    match ch.queue_declare(queue.into(), passive, FieldTable::default()).await {
        Ok(q) => {
            let _ = ch.close(200, "checked".into()).await;
            Ok(Some((q.message_count(), q.consumer_count())))
        }
        Err(e) if not_found(&e) => Ok(None),
        Err(e) => Err(amqp(e)),
    }
}

pub(crate) async fn exchange_exists(conn: &Connection, exchange: &str, kind: ExchangeKind) -> Result<bool> {
    let ch = conn.create_channel().await.map_err(amqp)?;
    let passive = ExchangeDeclareOptions {
        passive: true,
        ..Default::default()
    };
    match ch
        .exchange_declare(exchange.into(), kind, passive, FieldTable::default())
        .await
    {
        Ok(()) => {
            let _ = ch.close(200, "checked".into()).await;
            Ok(true)
        }
        Err(e) if not_found(&e) => Ok(false),
        Err(e) => Err(amqp(e)),
    }
}

/// The queues of the layout before consumer groups that `names`' category
/// still has.
pub(crate) async fn legacy_queues(conn: &Connection, names: &Names) -> Result<Vec<String>> {
    let mut found = Vec::new();
    for q in names.legacy_queues() {
        if queue_state(conn, &q).await?.is_some() {
            found.push(q);
        }
    }
    Ok(found)
}

/// Refuses a category that still has queues of the layout before consumer
/// groups (their messages would never reach the groups' queues), then
/// declares (or with `declare=false` verifies) its entry exchange.
pub(crate) async fn ensure_category(conn: &Connection, cfg: &RabbitConfig, names: &Names) -> Result<()> {
    let old = legacy_queues(conn, names).await?;
    if !old.is_empty() {
        return Err(Error::Config(format!(
            "rabbitmq: category `{c}` has queues of the layout before consumer groups ({list}); this version \
             gives every consumer group queues of its own (`{c}:<group>.*`) behind the exchange `{c}:entry`, and \
             would leave those queues' messages behind. Drain them with the previous keyorder version (run its \
             subscriptions until the queues are empty), then delete them with `keyorder delete-queue --url <url> \
             --category {c} --yes`, and start this version",
            c = names.category(),
            list = old.iter().map(|q| format!("`{q}`")).collect::<Vec<_>>().join(", ")
        )));
    }
    let entry = names.entry();
    let ch = conn.create_channel().await.map_err(amqp)?;
    ch.exchange_declare(
        entry.as_str().into(),
        ExchangeKind::Fanout,
        ExchangeDeclareOptions {
            passive: !cfg.declare,
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .map_err(|e| {
        explain(
            e,
            &format!("exchange `{entry}`"),
            "keyorder needs it as a durable fanout exchange: set `declare=true` or create it",
        )
    })?;
    let _ = ch.close(200, "declared".into()).await;
    Ok(())
}

/// One registry record: a group and the topology it was declared with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Record {
    pub(crate) group: String,
    pub(crate) topology: String,
}

/// The registry of one category, locked: read, changed, then released.
pub(crate) struct Registry {
    ch: Channel,
    /// The exclusive consumer on the lock queue: dropping it would cancel
    /// it (and release the lock) early.
    _lock: Consumer,
    queue: String,
    /// Every record read, by delivery tag (unacknowledged until released).
    read: Vec<(u64, Record)>,
    /// Tags to acknowledge at release (removed groups, duplicates).
    drop: Vec<u64>,
    /// Tags of messages that are no valid record (returned at release).
    skipped: Vec<u64>,
}

/// How long a registry lock is waited for. The lock is held only to read,
/// compare and record a group (a few round trips, never while a group's
/// queues are declared), so a wait this long means a holder that stalled.
const LOCK_WAIT: Duration = Duration::from_secs(120);

impl Registry {
    /// Takes the lock of `names`' registry (an exclusive consumer on its
    /// lock queue, waited for up to [`LOCK_WAIT`]) and reads every record.
    /// With `declare`, the registry and lock queues are declared first
    /// (and again when another process deleted them meanwhile:
    /// `delete_category`); without, they must exist.
    pub(crate) async fn lock(conn: &Connection, names: &Names, declare: bool) -> Result<Registry> {
        let registry = names.registry();
        let lock = names.registry_lock();
        let deadline = tokio::time::Instant::now() + LOCK_WAIT;
        let mut pause = Duration::from_millis(10);
        let mut declared = false;
        let (ch, lock_consumer) = loop {
            if declare && !declared {
                // Never `x-expires`: nothing consumes them while the groups
                // run, and a registry that expired would let drift through.
                for q in [&registry, &lock] {
                    declare_aux(conn, q, None).await?;
                }
                declared = true;
            }
            let ch = conn.create_channel().await.map_err(amqp)?;
            ch.confirm_select(ConfirmSelectOptions::default()).await.map_err(amqp)?;
            match ch
                .basic_consume(
                    lock.as_str().into(),
                    "lock".into(),
                    BasicConsumeOptions {
                        exclusive: true,
                        no_ack: true,
                        ..Default::default()
                    },
                    FieldTable::default(),
                )
                .await
            {
                Ok(consumer) => break (ch, consumer),
                Err(e) if not_found(&e) && declare => {
                    // Deleted by `delete_category` while this waited.
                    declared = false;
                }
                Err(e) if not_found(&e) => {
                    return Err(Error::Config(format!(
                        "rabbitmq: queue `{lock}` (the lock of the group registry `{registry}`) is missing; set \
                         `declare=true` or create it (see the table in the crate's `topology` module)"
                    )))
                }
                Err(e) => {
                    let text = e.to_string();
                    if !(text.contains("ACCESS_REFUSED") || text.contains("403")) {
                        return Err(amqp(e));
                    }
                }
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(Error::Broker(format!(
                    "rabbitmq: the group registry of `{}` stayed locked for {} s (another process holds an \
                     exclusive consumer on `{lock}` and stalled: it is released when that process's connection \
                     closes)",
                    names.category(),
                    LOCK_WAIT.as_secs()
                )));
            }
            // Held by another process: it releases within a few round trips.
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(200));
        };
        let mut read = Vec::new();
        let mut drop = Vec::new();
        let mut skipped = Vec::new();
        while let Some(m) = ch
            .basic_get(registry.as_str().into(), BasicGetOptions::default())
            .await
            .map_err(amqp)?
        {
            let tag = m.delivery.delivery_tag;
            let v: Value = serde_json::from_slice(&m.delivery.data).unwrap_or(Value::Null);
            let field = |k: &str| v.get(k).and_then(Value::as_str).map(str::to_owned);
            let record = match (field("group"), field("topology")) {
                (Some(group), Some(topology)) if names.group(&group).is_ok() && parse_topology(&topology).is_some() => {
                    Some(Record { group, topology })
                }
                _ => None,
            };
            match record {
                Some(r) if read.iter().any(|(_, o): &(u64, Record)| o.group == r.group) => drop.push(tag),
                Some(r) => read.push((tag, r)),
                // Not a record keyorder wrote: left as it is, and skipped
                // (it names no group that could be used).
                None => skipped.push(tag),
            }
        }
        if !skipped.is_empty() {
            tracing::warn!(
                registry = %registry,
                skipped = skipped.len(),
                "rabbitmq: the group registry holds records that are not a valid group and topology; skipped"
            );
        }
        Ok(Registry {
            ch,
            _lock: lock_consumer,
            queue: registry,
            read,
            drop,
            skipped,
        })
    }

    /// The recorded groups, by name.
    pub(crate) fn records(&self) -> BTreeMap<String, String> {
        self.read
            .iter()
            .map(|(_, r)| (r.group.clone(), r.topology.clone()))
            .collect()
    }

    /// Records `group` with `topology` (a persistent message, confirmed).
    pub(crate) async fn add(&mut self, group: &str, topology: &str) -> Result<()> {
        let body = json!({"group": group, "topology": topology}).to_string();
        let confirm = self
            .ch
            .basic_publish(
                "".into(),
                self.queue.as_str().into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..Default::default()
                },
                body.as_bytes(),
                BasicProperties::default().with_delivery_mode(2),
            )
            .await
            .map_err(amqp)?
            .await
            .map_err(amqp)?;
        match confirm {
            lapin::Confirmation::Ack(None) => Ok(()),
            _ => Err(Error::Broker(format!(
                "rabbitmq: the registry `{}` did not take the record of group `{group}`",
                self.queue
            ))),
        }
    }

    /// Forgets `group` (its record goes at release).
    pub(crate) fn remove(&mut self, group: &str) {
        let tags: Vec<u64> = self
            .read
            .iter()
            .filter(|(_, r)| r.group == group)
            .map(|(t, _)| *t)
            .collect();
        self.read.retain(|(_, r)| r.group != group);
        self.drop.extend(tags);
    }

    /// Acknowledges the dropped records, returns the others to the
    /// registry and then releases the lock. The returns are sent before a
    /// synchronous round trip to the registry queue (a passive
    /// declaration), so the next holder of the lock reads them all.
    pub(crate) async fn release(self) -> Result<()> {
        for tag in &self.drop {
            self.ch
                .basic_ack(*tag, lapin::options::BasicAckOptions::default())
                .await
                .map_err(amqp)?;
        }
        for tag in self.read.iter().map(|(t, _)| t).chain(&self.skipped) {
            self.ch
                .basic_nack(
                    *tag,
                    BasicNackOptions {
                        multiple: false,
                        requeue: true,
                    },
                )
                .await
                .map_err(amqp)?;
        }
        self.ch
            .queue_declare(
                self.queue.as_str().into(),
                QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(amqp)?;
        let _ = self.ch.close(200, "registry released".into()).await;
        Ok(())
    }
}

impl Registry {
    /// Ends the lock of a registry that was deleted while it was held
    /// (`delete_category`): deletes the lock queue (which ends this
    /// consumer; a process waiting for the lock declares both anew).
    pub(crate) async fn delete(self, lock: &str) -> Result<()> {
        let res = self
            .ch
            .queue_delete(lock.into(), QueueDeleteOptions::default())
            .await
            .map(|_| ())
            .map_err(amqp);
        let _ = self.ch.close(200, "registry deleted".into()).await;
        res
    }
}

/// Declares a classic queue of keyorder's own (registry, lock, members)
/// with `expires`; one that exists with other arguments (another process's
/// `expires_ms`) is used as it is.
pub(crate) async fn declare_aux(conn: &Connection, queue: &str, expires: Option<u32>) -> Result<()> {
    declare_own(conn, queue, QueueType::Classic, expires, "a queue of keyorder's own").await
}

/// Declares `queue` (durable, of type `qt`, with `expires`) on a channel of
/// its own; one that exists with other arguments (an earlier version's
/// `x-expires`, another process's `expires_ms`) is used as it is.
async fn declare_own(conn: &Connection, queue: &str, qt: QueueType, expires: Option<u32>, what: &str) -> Result<()> {
    let ch = conn.create_channel().await.map_err(amqp)?;
    match ch
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            queue_args(qt, false, expires),
        )
        .await
    {
        Ok(_) => {
            let _ = ch.close(200, "declared".into()).await;
            Ok(())
        }
        Err(e) if e.to_string().contains("PRECONDITION_FAILED") => match queue_state(conn, queue).await? {
            Some(_) => {
                tracing::debug!(queue, what, "rabbitmq: exists with other arguments; used as it is");
                Ok(())
            }
            None => Err(amqp(e)),
        },
        Err(e) => Err(amqp(e)),
    }
}

/// Declares one of the virtual host's streams (claims, attempts); one that
/// exists with other retention arguments is used as it is.
async fn declare_stream(conn: &Connection, stream: &str, args: FieldTable) -> Result<()> {
    let ch = conn.create_channel().await.map_err(amqp)?;
    let declared = ch
        .queue_declare(
            stream.into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            args,
        )
        .await;
    match declared {
        Ok(_) => {
            let _ = ch.close(200, "declared".into()).await;
            Ok(())
        }
        Err(e) if e.to_string().contains("PRECONDITION_FAILED") && queue_state(conn, stream).await?.is_some() => {
            tracing::debug!(stream, "rabbitmq: stream exists with other arguments; used as it is");
            Ok(())
        }
        Err(e) => Err(amqp(e)),
    }
}

/// Passive checks of queues on one channel (a refused check closes its
/// channel: the next check opens another).
struct Probe<'a> {
    conn: &'a Connection,
    ch: Option<Channel>,
}

impl<'a> Probe<'a> {
    fn new(conn: &'a Connection) -> Self {
        Probe { conn, ch: None }
    }

    async fn queue(&mut self, queue: &str) -> Result<bool> {
        let ch = match &self.ch {
            Some(ch) if ch.status().connected() => ch.clone(),
            _ => {
                let ch = self.conn.create_channel().await.map_err(amqp)?;
                self.ch = Some(ch.clone());
                ch
            }
        };
        let passive = QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        match ch.queue_declare(queue.into(), passive, FieldTable::default()).await {
            Ok(_) => Ok(true),
            Err(e) if not_found(&e) => {
                self.ch = None;
                Ok(false)
            }
            Err(e) => Err(amqp(e)),
        }
    }

    /// How many hash queues `g` has, counted from `from` (which exists).
    async fn hash_count(&mut self, g: &GroupNames, from: u16) -> Result<u16> {
        let mut n = from;
        while n < 1024 && self.queue(&g.hash_queue(n)).await? {
            n += 1;
        }
        Ok(n)
    }

    async fn close(self) {
        if let Some(ch) = self.ch {
            let _ = ch.close(200, "checked".into()).await;
        }
    }
}

/// The refusal of `wanted` for group `g`, declared with `had`.
fn drift(g: &GroupNames, had: Topology, wanted: Topology, how: &str) -> Error {
    Error::Config(format!(
        "rabbitmq: group `{}` of category `{}` {how} {} and is now asked for {}: a group's topology and queue \
         count are fixed (keys would move, or queues would fill that no consumer reads). Keep `{}` in the URLs \
         of this group's subscriptions and of publishers that name it in `groups=`, or stop the group, drain it \
         and remove it (`Admin::remove_group`, `keyorder groups remove`) before declaring it anew",
        g.group(),
        g.category(),
        describe(had),
        describe(wanted),
        url_options(had)
    ))
}

/// Checks the queues group `g` already has against `wanted`: a hash queue
/// beyond its count, or a queue of another kind, is refused; without a
/// registry `record` (a registry lost or deleted, or that expired under an
/// earlier version), so is a ring with fewer queues. The record alone does
/// not suffice: RabbitMQ does not compare a custom exchange's arguments,
/// and a queue declared beside the record would take keys.
async fn check_queues(conn: &Connection, g: &GroupNames, wanted: Topology, recorded: bool) -> Result<()> {
    let mut p = Probe::new(conn);
    let res = async {
        let had = "has queues of topology";
        match wanted {
            Topology::ConsistentHash { queues } => {
                if queues < 1024 && p.queue(&g.hash_queue(queues)).await? {
                    let m = p.hash_count(g, queues + 1).await?;
                    return Err(drift(g, Topology::ConsistentHash { queues: m }, wanted, had));
                }
                if !recorded && p.queue(&g.hash_queue(0)).await? && !p.queue(&g.hash_queue(queues - 1)).await? {
                    let m = p.hash_count(g, 1).await?;
                    return Err(drift(g, Topology::ConsistentHash { queues: m }, wanted, had));
                }
            }
            Topology::SingleActiveConsumer | Topology::Plain => {
                if p.queue(&g.hash_queue(0)).await? {
                    let m = p.hash_count(g, 1).await?;
                    return Err(drift(g, Topology::ConsistentHash { queues: m }, wanted, had));
                }
            }
        }
        for other in [Topology::SingleActiveConsumer, Topology::Plain] {
            if other != wanted && p.queue(&g.queues(other)[0]).await? {
                return Err(drift(g, other, wanted, had));
            }
        }
        Ok(())
    }
    .await;
    p.close().await;
    res
}

/// Reads, compares and (when new) records group `g`'s topology under the
/// registry's lock, with the group's existing queues checked against it;
/// the lock is held for these few round trips only.
async fn reserve(conn: &Connection, cfg: &RabbitConfig, names: &Names, g: &GroupNames) -> Result<()> {
    let declare = cfg.declare;
    if !declare && queue_state(conn, &names.registry()).await?.is_none() {
        // A manually declared topology without a registry: its queues.
        return check_queues(conn, g, cfg.topology, false).await;
    }
    let mut registry = Registry::lock(conn, names, declare).await?;
    let res = async {
        let recorded = registry.records().get(g.group()).and_then(|t| parse_topology(t));
        if let Some(had) = recorded {
            if had != cfg.topology {
                return Err(drift(g, had, cfg.topology, "was declared with topology"));
            }
        }
        check_queues(conn, g, cfg.topology, recorded.is_some()).await?;
        if recorded.is_none() && declare {
            registry.add(g.group(), &describe(cfg.topology)).await?;
        }
        Ok(())
    }
    .await;
    let released = registry.release().await;
    res.and(released)
}

/// Declares (or, with `declare=false`, verifies) the topology of one
/// group behind its category's entry exchange, and records the group in
/// the registry. A group recorded with another topology, or whose queues
/// say it has another one, is refused. The registry's lock is held only
/// to read and record; the queues are declared after (declarations are
/// idempotent: two processes declaring one group declare the same).
pub(crate) async fn ensure_group(conn: &Connection, cfg: &RabbitConfig, names: &Names, g: &GroupNames) -> Result<()> {
    reserve(conn, cfg, names, g).await?;
    if cfg.declare {
        declare_group(conn, cfg, names, g).await
    } else {
        verify_group(conn, cfg, names, g).await
    }
}

async fn declare_group(conn: &Connection, cfg: &RabbitConfig, names: &Names, g: &GroupNames) -> Result<()> {
    let qt = cfg.queue_type;
    // Dead letters never expire (nothing consumes them while the group
    // runs). One declared by an earlier version with `x-expires` is used
    // as it is.
    declare_own(conn, &g.dlq(), qt, None, "the group's dead-letter queue").await?;
    declare_aux(conn, &g.members(), cfg.expires_ms).await?;
    declare_stream(conn, crate::claims::STREAM, crate::claims::stream_args()).await?;
    declare_stream(conn, crate::attempts::STREAM, crate::attempts::stream_args()).await?;
    for name in g.queues(cfg.topology) {
        declare_queue(conn, cfg, &name).await?;
    }
    let ch = conn.create_channel().await.map_err(amqp)?;
    let res = declare_on(&ch, cfg, names, g).await;
    let _ = ch.close(200, "declared".into()).await;
    res
}

/// Declares one of the group's queues. A quorum queue an earlier version
/// declared without [`DELIVERY_LIMIT`] (RabbitMQ refuses to redeclare it
/// with other arguments) is used as it is, with a warning naming the fix.
async fn declare_queue(conn: &Connection, cfg: &RabbitConfig, name: &str) -> Result<()> {
    let qt = cfg.queue_type;
    let sac = cfg.topology != Topology::Plain;
    let expected = if sac {
        format!("x-queue-type={}, x-single-active-consumer=true", qt.name())
    } else {
        format!("x-queue-type={}", qt.name())
    };
    let declare = |limit: bool| async move {
        let ch = conn.create_channel().await.map_err(amqp)?;
        let res = ch
            .queue_declare(
                name.into(),
                QueueDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                queue_args_limited(qt, sac, cfg.expires_ms, limit),
            )
            .await;
        if res.is_ok() {
            let _ = ch.close(200, "declared".into()).await;
        }
        Ok::<_, Error>(res)
    };
    let res = match declare(true).await? {
        Err(e) if qt == QueueType::Quorum && e.to_string().contains("'x-delivery-limit'") => {
            tracing::warn!(
                queue = name,
                "rabbitmq: this quorum queue was declared by an earlier keyorder without x-delivery-limit; used as \
                 it is. On RabbitMQ 4.x such a queue drops a message after 20 deliveries (a halted head handed \
                 over 20 times would be lost). Fix: drain the queue, delete it, and let keyorder declare it again \
                 (with x-delivery-limit={DELIVERY_LIMIT})"
            );
            declare(false).await?
        }
        other => other,
    };
    res.map(|_| ()).map_err(|e| {
        explain(
            e,
            &format!("queue `{name}`"),
            &format!("keyorder needs it with {expected}: delete it (after draining) or fix its arguments"),
        )
    })
}

/// The group's exchange and bindings, on one channel.
async fn declare_on(ch: &Channel, cfg: &RabbitConfig, names: &Names, g: &GroupNames) -> Result<()> {
    let entry = names.entry();
    // Again here: another process may have deleted the category since
    // this one declared it (`delete_category`).
    ch.exchange_declare(
        entry.as_str().into(),
        ExchangeKind::Fanout,
        ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .map_err(|e| {
        explain(
            e,
            &format!("exchange `{entry}`"),
            "keyorder needs it as a durable fanout exchange",
        )
    })?;
    // The queues were declared before (`declare_queue`), each on a channel
    // of its own.
    match cfg.topology {
        Topology::ConsistentHash { queues: count } => {
            let x = g.hash_exchange();
            let mut args = FieldTable::default();
            args.insert("x-keyorder-queues".into(), AMQPValue::LongUInt(u32::from(count)));
            args.insert("x-keyorder-weight".into(), AMQPValue::LongUInt(RING_WEIGHT));
            ch.exchange_declare(
                x.as_str().into(),
                ExchangeKind::Custom("x-consistent-hash".into()),
                ExchangeDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                args,
            )
            .await
            .map_err(|e| {
                explain(
                    e,
                    &format!("exchange `{x}`"),
                    "the plugin rabbitmq_consistent_hash_exchange must be enabled",
                )
            })?;
            // Every queue is on the ring before the ring gets messages.
            for i in 0..count {
                ch.queue_bind(
                    g.hash_queue(i).as_str().into(),
                    x.as_str().into(),
                    RING_WEIGHT.to_string().as_str().into(),
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await
                .map_err(amqp)?;
            }
            ch.exchange_bind(
                x.as_str().into(),
                entry.as_str().into(),
                "".into(),
                ExchangeBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(amqp)?;
        }
        Topology::SingleActiveConsumer | Topology::Plain => {
            let q = &g.queues(cfg.topology)[0];
            ch.queue_bind(
                q.as_str().into(),
                entry.as_str().into(),
                "".into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(amqp)?;
        }
    }
    Ok(())
}

/// `declare=false`: every name of the group must exist (passive checks);
/// the topology was compared with the registry's record and the group's
/// queues before ([`reserve`]).
async fn verify_group(conn: &Connection, cfg: &RabbitConfig, names: &Names, g: &GroupNames) -> Result<()> {
    let create = "set `declare=true` or create it (see the table in the crate's `topology` module)";
    if !exchange_exists(conn, &names.entry(), ExchangeKind::Fanout).await? {
        return Err(Error::Config(format!(
            "rabbitmq: exchange `{}` is missing; {create}",
            names.entry()
        )));
    }
    if let Topology::ConsistentHash { .. } = cfg.topology {
        let x = g.hash_exchange();
        if !exchange_exists(conn, &x, ExchangeKind::Custom("x-consistent-hash".into())).await? {
            return Err(Error::Config(format!("rabbitmq: exchange `{x}` is missing; {create}")));
        }
    }
    for q in g.queues(cfg.topology).into_iter().chain([
        g.dlq(),
        g.members(),
        crate::claims::STREAM.to_owned(),
        crate::attempts::STREAM.to_owned(),
    ]) {
        if queue_state(conn, &q).await?.is_none() {
            return Err(Error::Config(format!("rabbitmq: queue `{q}` is missing; {create}")));
        }
    }
    Ok(())
}

/// The queues that `topology` (a registry record) names for group `g`,
/// with its dead-letter and members queues.
pub(crate) fn group_queues(g: &GroupNames, topology: Option<Topology>) -> Vec<String> {
    let mut qs = match topology {
        Some(t) => g.queues(t),
        // Unknown: every kind but the hash queues (whose count is unknown).
        None => vec![g.sac_queue(), g.plain_queue()],
    };
    qs.push(g.dlq());
    qs.push(g.members());
    qs
}

/// Deletes group `g`'s queues and exchanges (what `topology` names; the
/// hash queues are also probed beyond a recorded count). Returns the names
/// deleted.
pub(crate) async fn delete_group(conn: &Connection, g: &GroupNames, topology: Option<Topology>) -> Result<Vec<String>> {
    let mut gone = Vec::new();
    let mut queues = group_queues(g, topology);
    // Hash queues beyond the recorded count, or all of them when unknown.
    let from = match topology {
        Some(Topology::ConsistentHash { queues }) => queues,
        _ => 0,
    };
    for i in from..1024 {
        if queue_state(conn, &g.hash_queue(i)).await?.is_none() {
            break;
        }
        queues.push(g.hash_queue(i));
    }
    let ch = conn.create_channel().await.map_err(amqp)?;
    for x in [g.hash_exchange(), g.presence()] {
        ch.exchange_delete(x.as_str().into(), ExchangeDeleteOptions::default())
            .await
            .map_err(amqp)?;
    }
    for q in queues {
        ch.queue_delete(q.as_str().into(), QueueDeleteOptions::default())
            .await
            .map_err(amqp)?;
        gone.push(q);
    }
    let _ = ch.close(200, "deleted".into()).await;
    Ok(gone)
}

/// A server-named, exclusive, auto-deleted queue on `ch` and a consumer of
/// it without acknowledgements (presence announcements, operator requests
/// and their answers); returns the queue's name and the consumer.
pub(crate) async fn private_queue(ch: &Channel) -> Result<(String, Consumer)> {
    let q = ch
        .queue_declare(
            "".into(),
            QueueDeclareOptions {
                exclusive: true,
                auto_delete: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .map_err(amqp)?;
    let consumer = ch
        .basic_consume(
            q.name().clone(),
            "".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .map_err(amqp)?;
    Ok((q.name().as_str().to_owned(), consumer))
}
