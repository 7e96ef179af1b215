#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]

mod admin;
mod config;
mod control;
mod settle;
mod source;
mod state;
mod track;

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use async_trait::async_trait;
use keyorder_core::{
    Admin, Capabilities, Error, Message, Result, SourceSpec, Transport, TransportPublisher, TransportSource,
};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::error::RDKafkaErrorCode;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};

pub use crate::config::{Assignor, KafkaConfig, StartAt};
pub use rdkafka;

/// The header carrying a message's id.
pub const ID_HEADER: &str = "keyorder-id";
/// The header carrying a message's correlation id.
pub const CORRELATION_HEADER: &str = "keyorder-correlation";
/// The header a dead letter carries its reason in.
pub const REASON_HEADER: &str = "keyorder-reason";
/// The header a dead letter carries its origin (`topic/partition@offset`) in.
pub const ORIGIN_HEADER: &str = "keyorder-origin";
/// The header a dead letter carries its consumer group in.
pub const GROUP_HEADER: &str = "keyorder-group";

/// What the Kafka transport can do.
pub const CAPABILITIES: Capabilities = Capabilities {
    cross_instance_affinity: true,
    fencing: true,
    self_fencing: true,
    crash_reclaim: true,
    halt_on_poison: true,
    park_and_release: true,
    correlated_ownership: false,
    dynamic_partitions: false,
    remap_window: false,
    multi_process: true,
    persistent: false,
};

/// `min.compaction.lag.ms` of the state topic (an hour): see the README's
/// Kafka section for an existing state topic.
pub const STATE_MIN_COMPACTION_LAG_MS: &str = "3600000";

/// Kafka's default partitioner for keyed records (Java client,
/// `Utils.murmur2`): the 32-bit murmur2 hash with seed `0x9747b28c`.
///
/// ```
/// // Vectors from Apache Kafka's own UtilsTest.
/// assert_eq!(keyorder_kafka::murmur2(b"21"), -973932308);
/// assert_eq!(keyorder_kafka::murmur2(b"foobar"), -790332482);
/// ```
pub fn murmur2(data: &[u8]) -> i32 {
    const SEED: u32 = 0x9747_b28c;
    const M: u32 = 0x5bd1_e995;
    const R: u32 = 24;
    let len = data.len() as u32;
    let mut h = SEED ^ len;
    let mut chunks = data.chunks_exact(4);
    for c in &mut chunks {
        let mut k = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        k = k.wrapping_mul(M);
        k ^= k >> R;
        k = k.wrapping_mul(M);
        h = h.wrapping_mul(M);
        h ^= k;
    }
    let rest = chunks.remainder();
    if rest.len() >= 3 {
        h ^= u32::from(rest[2]) << 16;
    }
    if rest.len() >= 2 {
        h ^= u32::from(rest[1]) << 8;
    }
    if !rest.is_empty() {
        h ^= u32::from(rest[0]);
        h = h.wrapping_mul(M);
    }
    h ^= h >> 13;
    h = h.wrapping_mul(M);
    h ^= h >> 15;
    h as i32
}

/// A record key's bytes as keyorder names the key (its text, or the text
/// form [`keyorder_core::OrderingKey::from_bytes`] gives bytes that are no
/// UTF-8 or over 255 bytes): what the dispatcher, operators' labels and a
/// resolve all use. Empty bytes give an empty text (no key).
pub(crate) fn key_text(raw: &[u8]) -> String {
    keyorder_core::OrderingKey::from_bytes(raw)
        .map(|k| k.as_str().to_owned())
        .unwrap_or_default()
}

/// The partition the Java client (and this transport) puts a keyed record
/// in: `toPositive(murmur2(key)) % partitions`.
///
/// ```
/// let p = keyorder_kafka::partition_for(b"order-42", 8);
/// assert!((0..8).contains(&p));
/// ```
pub fn partition_for(key: &[u8], partitions: i32) -> i32 {
    ((murmur2(key) & 0x7fff_ffff) as i64 % i64::from(partitions.max(1))) as i32
}

/// A category's topic names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Names {
    topic: String,
}

impl Names {
    /// Validates the category as a Kafka topic name.
    pub fn new(category: &str) -> Result<Self> {
        let ok = !category.is_empty()
            && category.len() <= 200
            && category != "."
            && category != ".."
            && category
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-');
        if !ok {
            return Err(Error::Config(format!(
                "category `{}` is not a Kafka topic name: use 1-200 of [A-Za-z0-9._-]",
                keyorder_core::key::redact(category)
            )));
        }
        Ok(Names {
            topic: category.to_owned(),
        })
    }
    /// The category's topic.
    pub fn topic(&self) -> &str {
        &self.topic
    }
    /// The Kafka consumer group of keyorder group `group` on this topic:
    /// `<group>.<topic>`, so subscriptions to different categories never
    /// rebalance each other.
    pub fn group_id(&self, group: &str) -> String {
        format!("{group}.{}", self.topic)
    }
    /// Its state topic: each partition's saved progress (see the README).
    pub fn state(&self) -> String {
        format!("{}.keyorder-state", self.topic)
    }
    /// Its dead-letter topic.
    pub fn dlq(&self) -> String {
        format!("{}.dlq", self.topic)
    }
}

pub(crate) fn kafka_err(e: impl fmt::Display) -> Error {
    Error::Broker(format!("kafka: {e}"))
}

/// A client's creation failed: librdkafka's configuration error names the
/// value it refused (a password, say), so only the setting is shown.
pub(crate) fn create_err(e: rdkafka::error::KafkaError) -> Error {
    match e {
        rdkafka::error::KafkaError::ClientConfig(_, _, key, _) => Error::Config(format!(
            "kafka: librdkafka refused the setting `{}` (the value is not shown)",
            keyorder_core::redact::text(&key)
        )),
        other => kafka_err(other),
    }
}

/// Sources of this transport, for the in-process admin actions.
#[derive(Default)]
pub(crate) struct Registry {
    pub(crate) sources: Mutex<Vec<Weak<source::Shared>>>,
}

impl Registry {
    pub(crate) fn live(&self) -> Vec<Arc<source::Shared>> {
        let mut all = self.sources.lock().unwrap_or_else(|e| e.into_inner());
        all.retain(|w| w.strong_count() > 0);
        all.iter().filter_map(Weak::upgrade).collect()
    }
}

/// The Kafka transport (`kafka://`).
#[derive(Clone)]
pub struct KafkaTransport {
    pub(crate) cfg: Arc<KafkaConfig>,
    pub(crate) producer: FutureProducer,
    /// The state records' producer: no linger, since every acknowledgement
    /// waits for its round (same idempotence and `acks=all`).
    pub(crate) state_producer: FutureProducer,
    pub(crate) registry: Arc<Registry>,
    pub(crate) listening: Arc<control::Listening>,
    ensured: Arc<Mutex<HashSet<String>>>,
    partitions: Arc<Mutex<HashMap<String, i32>>>,
    /// Per topic, the layout check's state ([`KafkaTransport::check_layout`]).
    layouts: Arc<Mutex<HashMap<String, Layout>>>,
}

/// How often a publisher (and, at each heartbeat, a consumer) checks that
/// its topic still has the partition count of keyorder's layout.
pub const LAYOUT_CHECK: Duration = Duration::from_secs(5);

/// A topic's layout as this process checks it.
#[derive(Debug, Clone)]
struct Layout {
    /// The partition count keyorder uses (the state topic's).
    count: i32,
    /// When the topic's count was last compared with it.
    checked: tokio::time::Instant,
    /// The count found instead, once the topic changed (then for good).
    changed: Option<i32>,
}

/// The error of a topic whose partition count is no longer its layout's.
pub(crate) fn layout_changed(names: &Names, layout: i32, now: i32) -> Error {
    Error::Config(format!(
        "kafka: topic `{}` has {now} partitions, but keyorder's layout for it has {layout} (the count it was \
         created with, kept by `{}`): partitions were added while it was in use, which moves keys between \
         partitions and breaks their order, so keyorder stops publishing to it and consuming it. Fix: Kafka \
         cannot remove partitions; stop the publishers, let every group drain the topic, then move to a new \
         category (or delete and recreate the topic and its `.keyorder-state` and `.dlq` topics with the new \
         count once drained)",
        names.topic(),
        names.state()
    ))
}

impl fmt::Debug for KafkaTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KafkaTransport")
            .field("brokers", &self.cfg.brokers)
            .finish_non_exhaustive()
    }
}

impl KafkaTransport {
    /// Connects with `cfg` (creates the producer; checks the brokers answer).
    pub async fn connect(cfg: KafkaConfig) -> Result<Self> {
        // A configuration built in code is checked as a URL's is: a bad
        // pass-through setting is named, its value never shown.
        config::check_extra(&cfg.extra)?;
        let mut pc = base_config(&cfg);
        pc.set("enable.idempotence", "true")
            .set("acks", "all")
            .set("partitioner", "murmur2_random")
            .set("linger.ms", "1")
            .set("message.timeout.ms", "30000");
        apply_extra(&mut pc, &cfg);
        let producer: FutureProducer = pc.create().map_err(crate::create_err)?;
        pc.set("linger.ms", "0");
        apply_extra(&mut pc, &cfg);
        let state_producer: FutureProducer = pc.create().map_err(crate::create_err)?;
        let probe = producer.clone();
        let brokers = cfg.brokers.clone();
        let tls = match cfg.extra.get("security.protocol").map(|v| v.to_ascii_lowercase()) {
            Some(p) if p.contains("ssl") => {
                "is it running, does that port serve TLS (a plaintext port fails the handshake), and did the CA of \
                 ssl.ca.location (or a system root) sign its certificate? librdkafka's log line says which"
            }
            _ => "is it running?",
        };
        tokio::task::spawn_blocking(move || probe.client().fetch_metadata(None, Duration::from_secs(10)))
            .await
            .map_err(kafka_err)?
            .map_err(|e| Error::Broker(format!("kafka: no answer from {brokers}: {e} ({tls})")))?;
        Ok(KafkaTransport {
            cfg: Arc::new(cfg),
            producer,
            state_producer,
            registry: Arc::default(),
            listening: Arc::default(),
            ensured: Arc::default(),
            partitions: Arc::default(),
            layouts: Arc::default(),
        })
    }

    /// Connects to the brokers a `kafka://` URL names (options in its query
    /// string; see [`KafkaConfig`]).
    pub async fn from_url(url: &url::Url) -> Result<Self> {
        Self::connect(KafkaConfig::from_url(url)?).await
    }

    /// The configuration in use.
    pub fn config(&self) -> &KafkaConfig {
        &self.cfg
    }

    /// The partition count of `topic`, creating it (and its dead-letter
    /// topic) when missing and allowed.
    pub(crate) async fn ensure(&self, names: &Names) -> Result<i32> {
        if let Some(n) = self
            .partitions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(names.topic())
        {
            return Ok(*n);
        }
        let fresh = !self
            .ensured
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(names.topic());
        if fresh && self.cfg.create {
            let (dlq, state) = (names.dlq(), names.state());
            let rf = || TopicReplication::Fixed(self.cfg.replication);
            self.create_topics(&[NewTopic::new(names.topic(), self.cfg.partitions, rf())])
                .await?;
            // The state and dead-letter topics take the topic's own count
            // (one created earlier, by hand or with another `partitions`,
            // keeps its own): the state topic's count is the layout.
            let count = self.partition_count(names.topic()).await?;
            self.create_topics(&[
                NewTopic::new(&dlq, count, rf()),
                // Compaction never touches the last hour of records: a
                // claim or a pointer check reads from the pointer up to a
                // marker of its own and must find every record written
                // meanwhile (verification/kafka.pml; a read gives up long
                // before an hour).
                NewTopic::new(&state, count, rf())
                    .set("cleanup.policy", "compact")
                    .set("min.compaction.lag.ms", STATE_MIN_COMPACTION_LAG_MS),
            ])
            .await?;
            self.ensured
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(names.topic().to_owned());
        }
        let n = self.partition_count(names.topic()).await?;
        // The layout: the state topic's count (created with the topic, and
        // nobody adds partitions to it). A topic without one (created
        // outside keyorder, the state topic still to come) is its own.
        let layout = self.topic_count(&names.state()).await?.unwrap_or(n);
        if layout != n {
            // An empty state topic was most likely left by an earlier
            // attempt (earlier versions created it with `partitions`, not
            // the topic's count): recreated when the URL allows it.
            if !self.topic_empty(&names.state()).await? {
                return Err(layout_changed(names, layout, n));
            }
            if !self.cfg.reset_layout {
                return Err(Error::Config(format!(
                    "kafka: topic `{}` has {n} partitions, but its state topic `{}` has {layout} and holds no \
                     records (left by an earlier attempt, or partitions were added before any subscription \
                     ran). Fix: add `reset_layout=true` to the kafka:// URL once; keyorder then recreates the \
                     empty state topic with {n} partitions. If partitions were added to `{0}` after messages \
                     were published, its older messages of a key may lie in another partition than its newer \
                     ones: drain the topic first",
                    names.topic(),
                    names.state()
                )));
            }
            if let Err(e) = self.recreate_state_topic(names, n).await {
                // Created again by the next attempt, never left missing.
                self.ensured
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .remove(names.topic());
                return Err(e);
            }
        }
        self.layouts.lock().unwrap_or_else(|e| e.into_inner()).insert(
            names.topic().to_owned(),
            Layout {
                count: n,
                checked: tokio::time::Instant::now(),
                changed: None,
            },
        );
        self.partitions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(names.topic().to_owned(), n);
        Ok(n)
    }

    /// Checks, at most every [`LAYOUT_CHECK`], that `names`' topic still has
    /// its layout's partition count; returns the count. Once it changed,
    /// fails for good ([`layout_changed`]) in this process.
    pub(crate) async fn check_layout(&self, names: &Names) -> Result<i32> {
        let due = {
            let mut layouts = self.layouts.lock().unwrap_or_else(|e| e.into_inner());
            match layouts.get_mut(names.topic()) {
                None => None,
                Some(l) => {
                    if let Some(now) = l.changed {
                        return Err(layout_changed(names, l.count, now));
                    }
                    if l.checked.elapsed() < LAYOUT_CHECK {
                        return Ok(l.count);
                    }
                    // This caller checks; the others go on meanwhile.
                    l.checked = tokio::time::Instant::now();
                    Some(l.count)
                }
            }
        };
        let Some(count) = due else {
            return self.ensure(names).await;
        };
        match self.topic_count(names.topic()).await {
            Ok(Some(now)) if now != count => {
                if let Some(l) = self
                    .layouts
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .get_mut(names.topic())
                {
                    l.changed = Some(now);
                }
                metrics::counter!("keyorder_kafka_layout_changes_total").increment(1);
                tracing::error!(
                    topic = names.topic(),
                    layout = count,
                    now,
                    "kafka: partitions added to a topic in use; publishing and consuming stopped"
                );
                Err(layout_changed(names, count, now))
            }
            Ok(Some(_)) => Ok(count),
            // Unreadable now: not a check; the next one comes in a second.
            _ => {
                if let Some(l) = self
                    .layouts
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .get_mut(names.topic())
                {
                    let retry = LAYOUT_CHECK.saturating_sub(Duration::from_secs(1));
                    l.checked = tokio::time::Instant::now().checked_sub(retry).unwrap_or(l.checked);
                }
                Ok(count)
            }
        }
    }

    /// The partition count of `topic`, `None` when it does not exist (one
    /// metadata round trip, no waiting).
    pub(crate) async fn topic_count(&self, topic: &str) -> Result<Option<i32>> {
        let producer = self.producer.clone();
        let t = topic.to_owned();
        let md = tokio::task::spawn_blocking(move || {
            producer
                .client()
                .fetch_metadata(Some(&t), Duration::from_secs(10))
                .map(|md| md.topics().first().map(|t| (t.partitions().len(), t.error())))
        })
        .await
        .map_err(kafka_err)?
        .map_err(kafka_err)?;
        Ok(match md {
            Some((n, None)) if n > 0 => Some(n as i32),
            _ => None,
        })
    }

    /// Whether every partition of `topic` is empty (its low and high
    /// watermarks are equal).
    pub(crate) async fn topic_empty(&self, topic: &str) -> Result<bool> {
        // Unreadable is not empty: a reset must never follow a transient
        // metadata error.
        let Some(n) = self.topic_count(topic).await? else {
            return Err(Error::Broker(format!(
                "kafka: topic `{topic}` has no readable partitions now; retrying"
            )));
        };
        let producer = self.producer.clone();
        let t = topic.to_owned();
        tokio::task::spawn_blocking(move || {
            for p in 0..n {
                let (low, high) = producer.client().fetch_watermarks(&t, p, Duration::from_secs(10))?;
                if high > low {
                    return Ok::<bool, rdkafka::error::KafkaError>(false);
                }
            }
            Ok(true)
        })
        .await
        .map_err(kafka_err)?
        .map_err(kafka_err)
    }

    /// Waits until the state producer's metadata shows `state` with
    /// `count` partitions: after a recreate its cache still has the old
    /// count, and a produce to a new partition fails as unknown.
    async fn await_state_count(&self, state: &str, count: i32) -> Result<()> {
        // The state producer's cached metadata still has the old count
        // (a produce to a new partition fails as unknown until it learns).
        let producer = self.state_producer.clone();
        let t = state.to_owned();
        let learned = tokio::task::spawn_blocking(move || {
            let until = std::time::Instant::now() + Duration::from_secs(30);
            while std::time::Instant::now() < until {
                let n = producer
                    .client()
                    .fetch_metadata(Some(&t), Duration::from_secs(5))
                    .ok()
                    .and_then(|md| md.topics().first().map(|t| t.partitions().len()));
                if n == Some(count as usize) {
                    return true;
                }
                // A blocking thread of its own, not a runtime worker.
                #[allow(clippy::disallowed_methods)]
                std::thread::sleep(Duration::from_millis(200));
            }
            false
        })
        .await
        .map_err(kafka_err)?;
        if !learned {
            return Err(Error::Broker(format!(
                "kafka: the state topic `{state}` was recreated with {count} partitions, but the producer did not see them in 30 s; retrying"
            )));
        }
        Ok(())
    }

    /// Deletes the (empty) state topic of `names` and creates it again
    /// with `count` partitions (`reset_layout=true`).
    async fn recreate_state_topic(&self, names: &Names, count: i32) -> Result<()> {
        let state = names.state();
        // Checked again right before: another process may have reset it
        // (it has the topic's count now: done) or started using it.
        if self.topic_count(&state).await? == Some(count) {
            return self.await_state_count(&state, count).await;
        }
        if !self.topic_empty(&state).await? {
            return Err(Error::Broker(format!(
                "kafka: the state topic `{state}` is in use now (another process reset it or wrote to it); retrying"
            )));
        }
        let admin: AdminClient<DefaultClientContext> = base_config(&self.cfg).create().map_err(crate::create_err)?;
        let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
        for r in admin.delete_topics(&[&state], &opts).await.map_err(kafka_err)? {
            if let Err((topic, code)) = r {
                if code != RDKafkaErrorCode::UnknownTopicOrPartition {
                    return Err(Error::Broker(format!(
                        "kafka: deleting the empty state topic `{topic}`: {code}"
                    )));
                }
            }
        }
        // The deletion may take a moment to show: create until the broker
        // has the new count.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            self.create_topics(&[
                NewTopic::new(&state, count, TopicReplication::Fixed(self.cfg.replication))
                    .set("cleanup.policy", "compact")
                    .set("min.compaction.lag.ms", STATE_MIN_COMPACTION_LAG_MS),
            ])
            .await?;
            if self.topic_count(&state).await? == Some(count) {
                break;
            }
            if tokio::time::Instant::now() > deadline {
                return Err(Error::Broker(format!(
                    "kafka: the state topic `{state}` was deleted but not recreated with {count} partitions in 30 s"
                )));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        self.await_state_count(&state, count).await?;
        tracing::warn!(topic = names.topic(), state = %state, count, "kafka: reset_layout: recreated the empty state topic with the topic's partition count");
        Ok(())
    }

    /// Creates `topics`; one that already exists is fine.
    pub(crate) async fn create_topics(&self, topics: &[NewTopic<'_>]) -> Result<()> {
        let admin: AdminClient<DefaultClientContext> = base_config(&self.cfg).create().map_err(crate::create_err)?;
        let results = admin
            .create_topics(
                topics,
                &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
            )
            .await
            .map_err(kafka_err)?;
        for r in results {
            if let Err((topic, code)) = r {
                if code != RDKafkaErrorCode::TopicAlreadyExists {
                    return Err(Error::Broker(format!("kafka: creating topic `{topic}`: {code}")));
                }
            }
        }
        Ok(())
    }

    /// The broker's partition count of `topic` (waits briefly for a topic
    /// that was just created to show up).
    pub(crate) async fn partition_count(&self, topic: &str) -> Result<i32> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
        loop {
            match self.topic_count(topic).await? {
                Some(n) => return Ok(n),
                _ if tokio::time::Instant::now() > deadline => {
                    return Err(Error::Config(format!(
                        "kafka: topic `{topic}` does not exist: create it (e.g. with 8 partitions) or let keyorder \
                         create it (`create=true`)"
                    )))
                }
                _ => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
    }

    /// Produces one record and waits for its delivery report (`acks=all`).
    pub(crate) async fn produce(
        &self,
        topic: &str,
        key: Option<&[u8]>,
        payload: &[u8],
        headers: OwnedHeaders,
    ) -> Result<(i32, i64)> {
        self.produce_to(topic, None, key, payload, Some(headers)).await
    }

    /// Produces a state record (the no-linger producer) to `partition`.
    pub(crate) async fn produce_state(
        &self,
        topic: &str,
        partition: i32,
        key: &[u8],
        payload: &[u8],
    ) -> Result<(i32, i64)> {
        let record: FutureRecord<'_, [u8], [u8]> =
            FutureRecord::to(topic).payload(payload).key(key).partition(partition);
        match self.state_producer.send(record, Duration::from_secs(30)).await {
            Ok(d) => Ok((d.partition, d.offset)),
            Err((e, _)) => Err(Error::Broker(format!("kafka: producing to `{topic}`: {e}"))),
        }
    }

    /// Produces to a given partition (or the partitioner's choice).
    pub(crate) async fn produce_to(
        &self,
        topic: &str,
        partition: Option<i32>,
        key: Option<&[u8]>,
        payload: &[u8],
        headers: Option<OwnedHeaders>,
    ) -> Result<(i32, i64)> {
        let mut record: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(topic).payload(payload);
        if let Some(h) = headers {
            record = record.headers(h);
        }
        if let Some(k) = key {
            record = record.key(k);
        }
        if let Some(p) = partition {
            record = record.partition(p);
        }
        match self.producer.send(record, Duration::from_secs(30)).await {
            Ok(d) => Ok((d.partition, d.offset)),
            Err((e, _)) => Err(Error::Broker(format!("kafka: producing to `{topic}`: {e}"))),
        }
    }
}

pub(crate) fn base_config(cfg: &KafkaConfig) -> ClientConfig {
    let mut c = ClientConfig::new();
    // Topics are created only where keyorder means to (`ensure`, with
    // `create=true`): a producer's metadata request for a named topic
    // would otherwise let the broker create it, so that an operator's
    // read-only command created a category's topics (issue 37).
    c.set("bootstrap.servers", &cfg.brokers)
        .set("log_level", "3")
        .set("allow.auto.create.topics", "false");
    apply_extra(&mut c, cfg);
    c
}

fn apply_extra(c: &mut ClientConfig, cfg: &KafkaConfig) {
    for (k, v) in &cfg.extra {
        c.set(k, v);
    }
}

/// The record headers of a message: id, correlation id, user headers.
pub(crate) fn headers_of(message: &Message) -> OwnedHeaders {
    let mut h = OwnedHeaders::new_with_capacity(message.headers().len() + 2).insert(Header {
        key: ID_HEADER,
        value: Some(message.id()),
    });
    if let Some(c) = message.correlation_id() {
        h = h.insert(Header {
            key: CORRELATION_HEADER,
            value: Some(c),
        });
    }
    for (k, v) in message.headers() {
        h = h.insert(Header {
            key: k.as_str(),
            value: Some(v.as_str()),
        });
    }
    h
}

#[async_trait]
impl Transport for KafkaTransport {
    fn name(&self) -> &str {
        "kafka"
    }

    fn capabilities(&self) -> Capabilities {
        CAPABILITIES
    }

    fn affinity_fix(&self) -> String {
        "Kafka pins every key to a partition and every partition to one group member; nothing to configure".into()
    }

    async fn publisher(&self, category: &str) -> Result<Arc<dyn TransportPublisher>> {
        let names = Names::new(category)?;
        self.ensure(&names).await?;
        self.check_layout(&names).await?;
        Ok(Arc::new(KafkaPublisher {
            t: self.clone(),
            names,
            next: std::sync::atomic::AtomicU64::new(0),
        }))
    }

    async fn open(&self, spec: &SourceSpec) -> Result<Box<dyn TransportSource>> {
        let names = Names::new(&spec.category)?;
        self.ensure(&names).await?;
        let partitions = self.check_layout(&names).await?;
        Ok(Box::new(
            source::Source::open(self.clone(), spec.clone(), names, partitions).await?,
        ))
    }

    fn admin(&self) -> Arc<dyn Admin> {
        Arc::new(admin::KafkaAdmin { t: self.clone() })
    }
}

struct KafkaPublisher {
    t: KafkaTransport,
    names: Names,
    /// The next keyless record's partition (round robin).
    next: std::sync::atomic::AtomicU64,
}

impl fmt::Debug for KafkaPublisher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KafkaPublisher")
            .field("topic", &self.names.topic())
            .finish()
    }
}

#[async_trait]
impl TransportPublisher for KafkaPublisher {
    async fn publish(&self, message: Message) -> Result<()> {
        // A keyed record goes to its key's partition under the layout's
        // count, not the partitioner's: librdkafka's follows the topic's
        // count from its next metadata refresh, and added partitions would
        // move keys before the check below notices.
        let count = self.t.check_layout(&self.names).await?;
        // A key read from non-UTF-8 key bytes goes out as those bytes.
        let key_bytes = message.key().map(|k| k.to_bytes());
        let key = key_bytes.as_deref();
        // Keyless records carry no key and spread, round robin, over the
        // layout's partitions (never an added one, which nobody consumes).
        let partition = match key {
            Some(k) => partition_for(k, count),
            None => (self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % count.max(1) as u64) as i32,
        };
        let partition = Some(partition);
        self.t
            .produce_to(
                self.names.topic(),
                partition,
                key,
                message.payload(),
                Some(headers_of(&message)),
            )
            .await
            .map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn murmur2_matches_the_java_client() {
        // Apache Kafka, clients/src/test/java/org/apache/kafka/common/utils/UtilsTest.java.
        let cases: [(&[u8], i32); 6] = [
            (b"21", -973_932_308),
            (b"foobar", -790_332_482),
            (b"a-little-bit-long-string", -985_981_536),
            (b"a-little-bit-longer-string", -1_486_304_829),
            (b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8", -58_897_971),
            (b"abc", 479_470_107),
        ];
        for (data, want) in cases {
            assert_eq!(murmur2(data), want, "{}", String::from_utf8_lossy(data));
        }
        // Partitions as Java's default partitioner (and kafka-python's)
        // gives them: `foobar` of 50 is 16; the empty key hashes too.
        assert_eq!(partition_for(b"foobar", 50), 16);
        assert_eq!(murmur2(b""), 275_646_681);
        assert_eq!(partition_for(b"", 8), 1);
    }

    #[test]
    fn category_names_must_be_topic_names() {
        assert!(Names::new("orders.v1_x-y").is_ok());
        for bad in ["", "a b", "a/b", "..", "ä"] {
            assert!(Names::new(bad).is_err(), "{bad}");
        }
    }
}
