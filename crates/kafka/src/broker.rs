//! `KafkaTransport`, the handle every room holds: its clients and caches,
//! the topics it creates and counts, the layout check (C23), and producing
//! records. `transport.rs` connects it and implements `Transport` with it.

use std::any::Any;
use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use keyorder_core::{Error, Result};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::error::RDKafkaErrorCode;
use rdkafka::message::OwnedHeaders;
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};

use crate::config::{base_config, KafkaConfig};
use crate::error::{broker, create_err, layout_changed};
use crate::names::Names;

/// `min.compaction.lag.ms` of the state topic (an hour): see the README's
/// Kafka section for an existing state topic.
pub const STATE_MIN_COMPACTION_LAG_MS: &str = "3600000";

/// Sources of this transport, for the in-process admin actions.
///
/// Held as `Any`: a source's shared state holds a `KafkaTransport`, so
/// naming its type here would tie this room and the source's in a circle;
/// [`Registry::live`] gives them back as that type.
#[derive(Default)]
pub(crate) struct Registry {
    sources: Mutex<Vec<Weak<dyn Any + Send + Sync>>>,
}

impl Registry {
    /// Adds a source (held weakly: a source dropped leaves by itself).
    pub(crate) fn add<S: Any + Send + Sync>(&self, source: &Arc<S>) {
        let weak: Weak<S> = Arc::downgrade(source);
        let weak: Weak<dyn Any + Send + Sync> = weak;
        self.sources.lock().unwrap_or_else(|e| e.into_inner()).push(weak);
    }

    /// The sources still alive.
    pub(crate) fn live<S: Any + Send + Sync>(&self) -> Vec<Arc<S>> {
        let mut all = self.sources.lock().unwrap_or_else(|e| e.into_inner());
        all.retain(|w| w.strong_count() > 0);
        all.iter()
            .filter_map(Weak::upgrade)
            .filter_map(|s| s.downcast::<S>().ok())
            .collect()
    }
}

/// The categories this transport already listens on for operator requests
/// (see `control`).
#[derive(Default)]
pub(crate) struct Listening {
    pub(crate) topics: Mutex<HashSet<String>>,
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
    pub(crate) listening: Arc<Listening>,
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

impl fmt::Debug for KafkaTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KafkaTransport")
            .field("brokers", &self.cfg.brokers)
            .finish_non_exhaustive()
    }
}

impl KafkaTransport {
    /// A transport of `cfg` with these producers (see
    /// `KafkaTransport::connect`), nothing cached yet.
    pub(crate) fn with_producers(cfg: KafkaConfig, producer: FutureProducer, state_producer: FutureProducer) -> Self {
        KafkaTransport {
            cfg: Arc::new(cfg),
            producer,
            state_producer,
            registry: Arc::default(),
            listening: Arc::default(),
            ensured: Arc::default(),
            partitions: Arc::default(),
            layouts: Arc::default(),
        }
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
        .map_err(broker)?
        .map_err(broker)?;
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
            return Err(Error::broker(format!(
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
        .map_err(broker)?
        .map_err(broker)
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
        .map_err(broker)?;
        if !learned {
            return Err(Error::broker(format!(
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
            return Err(Error::broker(format!(
                "kafka: the state topic `{state}` is in use now (another process reset it or wrote to it); retrying"
            )));
        }
        let admin: AdminClient<DefaultClientContext> = base_config(&self.cfg).create().map_err(create_err)?;
        let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
        for r in admin.delete_topics(&[&state], &opts).await.map_err(broker)? {
            if let Err((topic, code)) = r {
                if code != RDKafkaErrorCode::UnknownTopicOrPartition {
                    return Err(Error::broker(format!(
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
                return Err(Error::broker(format!(
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
        let admin: AdminClient<DefaultClientContext> = base_config(&self.cfg).create().map_err(create_err)?;
        let results = admin
            .create_topics(
                topics,
                &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
            )
            .await
            .map_err(broker)?;
        for r in results {
            if let Err((topic, code)) = r {
                if code != RDKafkaErrorCode::TopicAlreadyExists {
                    let temporary = crate::error::code_is_temporary(code);
                    return Err(Error::Broker(
                        keyorder_core::BrokerError::new(format!("kafka: creating topic `{topic}`: {code}"))
                            .with_temporary(temporary),
                    ));
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
            Err((e, _)) => Err(crate::error::broker_as(
                format!("kafka: producing to `{topic}`: {e}"),
                e,
            )),
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
            Err((e, _)) => Err(crate::error::broker_as(
                format!("kafka: producing to `{topic}`: {e}"),
                e,
            )),
        }
    }
}
