//! Operator actions across processes. Only a partition's owner writes its
//! state record, so `skip`, `dlq` and `resume` of a halted head must run in the
//! process that owns the partition. An operator elsewhere (`keyorder head
//! ...`) produces a request to the category's control topic
//! `<topic>.keyorder-control` (one partition); every process holding a
//! halted head of the category reads that topic from its first halt on and
//! acts on a request whose head it holds, then produces an answer there.
//! The operator reads the topic from where it stood before its request and
//! returns on the answer (or fails with `NotFound` after a while: no live
//! owner holds that head).

use std::time::Duration;

use keyorder_core::key::redact;
use keyorder_core::{Error, HeadAction, Result};
use rdkafka::admin::{NewTopic, TopicReplication};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::{Message as _, Offset, TopicPartitionList};
use serde_json::{json, Value};

use crate::admin::KafkaAdmin;
use crate::broker::KafkaTransport;
use crate::config::base_config;
use crate::error::{create_err, kafka_err};
use crate::names::Names;
use crate::owned::Shared;

/// The longest an operator waits for the owner's answer.
const ANSWER: Duration = Duration::from_secs(15);

/// A consumer of the control topic from its current end; returns it with
/// the position it starts at.
fn tail(t: &KafkaTransport, topic: &str) -> Result<BaseConsumer> {
    let mut rc = base_config(&t.cfg);
    rc.set("group.id", "keyorder-control-reader")
        .set("enable.auto.commit", "false")
        .set("fetch.wait.max.ms", "50");
    let c: BaseConsumer = rc.create().map_err(create_err)?;
    let (_, high) = c
        .fetch_watermarks(topic, 0, Duration::from_secs(10))
        .map_err(kafka_err)?;
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(topic, 0, Offset::Offset(high))
        .map_err(kafka_err)?;
    c.assign(&tpl).map_err(kafka_err)?;
    Ok(c)
}

impl KafkaTransport {
    /// Creates the control topic when missing (and allowed).
    async fn ensure_control(&self, names: &Names) -> Result<String> {
        let topic = names.control();
        if self.cfg.create {
            self.create_topics(&[NewTopic::new(&topic, 1, TopicReplication::Fixed(self.cfg.replication))])
                .await?;
        }
        self.partition_count(&topic).await?;
        Ok(topic)
    }

    /// Answers operator requests for `names` from now on (called at a
    /// halt; once per category and transport).
    pub(crate) fn answer_for(&self, names: &Names) {
        let fresh = self
            .listening
            .topics
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(names.topic().to_owned());
        if !fresh {
            return;
        }
        let t = self.clone();
        let names = names.clone();
        tokio::spawn(async move {
            let topic = match t.ensure_control(&names).await {
                Ok(topic) => topic,
                Err(e) => {
                    tracing::warn!(error = %e, "kafka: no operator control topic; operator actions only in this process");
                    return;
                }
            };
            let handle = tokio::runtime::Handle::current();
            let _ = tokio::task::spawn_blocking(move || listen(t, names, topic, handle)).await;
        });
    }

    /// Has the process owning `key`'s halted head act on it.
    pub(crate) async fn remote_resolve(&self, names: &Names, group: &str, key: &str, action: HeadAction) -> Result<()> {
        let topic = self.ensure_control(names).await?;
        let id = uuid::Uuid::new_v4().to_string();
        let t = self.clone();
        let t2 = topic.clone();
        let reader = tokio::task::spawn_blocking(move || tail(&t, &t2))
            .await
            .map_err(kafka_err)??;
        let request = json!({"op": "act", "id": id, "group": group, "key": key, "action": action.name()});
        self.produce_to(&topic, Some(0), None, request.to_string().as_bytes(), None)
            .await?;
        let answer = tokio::task::spawn_blocking(move || -> Option<Value> {
            let deadline = std::time::Instant::now() + ANSWER;
            while std::time::Instant::now() < deadline {
                let Some(Ok(m)) = reader.poll(Duration::from_millis(100)) else {
                    continue;
                };
                let Some(v) = m.payload().and_then(|p| serde_json::from_slice::<Value>(p).ok()) else {
                    continue;
                };
                if v.get("answers").and_then(Value::as_str) == Some(id.as_str()) {
                    return Some(v);
                }
            }
            None
        })
        .await
        .map_err(kafka_err)?;
        match answer {
            Some(v) if v.get("done").and_then(Value::as_bool) == Some(true) => Ok(()),
            Some(v) => Err(Error::Broker(format!(
                "kafka: the owning process failed the action: {}",
                v.get("error").and_then(Value::as_str).unwrap_or("unknown error")
            ))),
            None => Err(Error::NotFound(format!(
                "no live owner answered for key {} in {}/{group} within {}s: the partition's owner holds a halted \
                 head in its memory only while it runs (check `keyorder head show` and that the owner is up)",
                redact(key),
                names.topic(),
                ANSWER.as_secs()
            ))),
        }
    }
}

/// The owner's side: reads requests, acts on the heads this process holds,
/// answers. Ends when the transport's sources are gone.
fn listen(t: KafkaTransport, names: Names, topic: String, handle: tokio::runtime::Handle) {
    let reader = match tail(&t, &topic) {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(error = %e, "kafka: cannot read the operator control topic");
            return;
        }
    };
    let admin = KafkaAdmin { t: t.clone() };
    let mut idle_checks = 0u32;
    loop {
        let live = t.registry.live::<Shared>().iter().any(|s| s.names == names);
        idle_checks = if live { 0 } else { idle_checks + 1 };
        // No source of this category left for a while: stop listening.
        if idle_checks > 50 {
            t.listening
                .topics
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(names.topic());
            return;
        }
        let Some(Ok(m)) = reader.poll(Duration::from_millis(200)) else {
            continue;
        };
        let Some(req) = m.payload().and_then(|p| serde_json::from_slice::<Value>(p).ok()) else {
            continue;
        };
        if req.get("op").and_then(Value::as_str) != Some("act") {
            continue;
        }
        let text = |k: &str| req.get(k).and_then(Value::as_str).unwrap_or_default().to_owned();
        let (id, group, key) = (text("id"), text("group"), text("key"));
        let Some(action) = HeadAction::from_name(&text("action")) else {
            continue;
        };
        let answer = match handle.block_on(admin.resolve_here(&names, &group, &key, action)) {
            Ok(true) => json!({"answers": id, "done": true}),
            Ok(false) => continue,
            Err(Error::NotFound(_)) => continue,
            Err(e) => json!({"answers": id, "done": false, "error": e.to_string()}),
        };
        let _ = handle.block_on(t.produce_to(&topic, Some(0), None, answer.to_string().as_bytes(), None));
    }
}
