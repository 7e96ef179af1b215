//! Halted heads and hot keys across processes. A RabbitMQ halt lives in
//! the consumer that halted the key (its head stays unacknowledged on that
//! consumer's channel), and a key's held deliveries live in the consumers
//! that hold them, so an operator in another process (`keyorder head ...`,
//! `keyorder hot-keys`) asks the consumers: requests go to the topic
//! exchange [`CONTROL_EXCHANGE`] with the group's base name
//! `{category}:{group}` as routing key; every process consuming the
//! (category, group) pair (from its first source on) or holding a halt in
//! it has an exclusive queue bound there and answers on the
//! request's `reply_to` queue. `show` and `hot` gather the answers for a
//! short window; `skip`, `dlq` and `resume` run in the process that holds
//! the head and return once it answered. A request that no process is
//! bound to receive comes back unroutable at once (nobody consumes the
//! group). Keys travel in requests (as the operator typed them, or a
//! label); answers carry labels and redacted previews only.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use keyorder_core::key::redact;
use keyorder_core::{Error, HaltedKey, HeadAction, Result};
use lapin::options::{BasicPublishOptions, ExchangeDeclareOptions, QueueBindOptions};
use lapin::types::{FieldTable, ShortString};
use lapin::Confirmation;
use lapin::{BasicProperties, Channel, ExchangeKind};
use serde_json::{json, Value};

use crate::topology::{amqp, private_queue};
use crate::{confirm_channel, RabbitTransport};

/// The topic exchange operator requests go through (routing key: the
/// group's base name `{category}:{group}`).
pub const CONTROL_EXCHANGE: &str = "keyorder.control";

/// How long `show` waits for more answers after the last one.
const QUIET: Duration = Duration::from_millis(300);
/// The longest `show` waits for answers.
const GATHER: Duration = Duration::from_secs(2);
/// The longest `skip`, `dlq` or `resume` waits for the holder's answer.
const ACT: Duration = Duration::from_secs(10);

/// This transport's responder: the groups it answers for, and whether
/// its task runs.
#[derive(Default)]
pub(crate) struct Responder {
    groups: Mutex<HashSet<String>>,
    wake: tokio::sync::Notify,
    started: std::sync::atomic::AtomicBool,
}

fn halted_json(h: &HaltedKey) -> Value {
    json!({
        "label": h.label, "preview": h.preview, "scope": h.scope,
        "head_id": h.head_id, "attempts": h.attempts, "reason": h.reason,
    })
}

fn halted_of(v: &Value) -> Option<HaltedKey> {
    let s = |k: &str| v.get(k).and_then(Value::as_str).map(str::to_owned);
    Some(HaltedKey {
        label: s("label")?,
        preview: s("preview").unwrap_or_default(),
        scope: s("scope").unwrap_or_default(),
        head_id: s("head_id").unwrap_or_default(),
        attempts: v.get("attempts").and_then(Value::as_u64).unwrap_or(0) as u32,
        reason: s("reason").unwrap_or_default(),
        held: None,
    })
}

impl RabbitTransport {
    /// Answers operator requests for `group` from now on (called at a
    /// halt; the first call starts the responder task).
    pub(crate) fn answer_for(&self, group: &str) {
        let r = &self.shared.responder;
        let fresh = r
            .groups
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(group.to_owned());
        if !r.started.swap(true, std::sync::atomic::Ordering::SeqCst) {
            let t = self.clone();
            tokio::spawn(async move { t.respond().await });
        } else if fresh {
            r.wake.notify_one();
        }
    }

    /// The responder: (re)declares its queue, binds every group it
    /// answers for, and answers until the transport is dropped.
    async fn respond(self) {
        loop {
            if let Err(e) = self.respond_once().await {
                tracing::warn!(error = %e, "rabbitmq: operator control responder failed; restarting");
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
            // Stop once nothing else holds this transport's shared state.
            if Arc::strong_count(&self.shared) <= 1 {
                return;
            }
        }
    }

    async fn respond_once(&self) -> Result<()> {
        let conn = self.connection().await?;
        let ch = conn.create_channel().await.map_err(amqp)?;
        declare_exchange(&ch).await?;
        let (queue, mut consumer) = private_queue(&ch).await?;
        let mut bound: HashSet<String> = HashSet::new();
        loop {
            let wanted: Vec<String> = {
                let set = self.shared.responder.groups.lock().unwrap_or_else(|e| e.into_inner());
                set.iter().filter(|c| !bound.contains(*c)).cloned().collect()
            };
            for c in wanted {
                ch.queue_bind(
                    queue.as_str().into(),
                    CONTROL_EXCHANGE.into(),
                    c.as_str().into(),
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await
                .map_err(amqp)?;
                bound.insert(c);
            }
            tokio::select! {
                () = self.shared.responder.wake.notified() => {}
                () = tokio::time::sleep(Duration::from_secs(5)) => {
                    // Nothing but this task holds the transport: stop.
                    if Arc::strong_count(&self.shared) <= 1 {
                        return Ok(());
                    }
                }
                next = consumer.next() => {
                    let Some(Ok(d)) = next else {
                        return Err(Error::Broker("rabbitmq: the control queue's consumer ended".into()));
                    };
                    let Some(reply_to) = d.properties.reply_to().clone() else { continue };
                    let correlation = d.properties.correlation_id().clone();
                    let answer = self.answer(&d.data).await;
                    let mut props = BasicProperties::default();
                    if let Some(c) = correlation {
                        props = props.with_correlation_id(c);
                    }
                    let _ = ch
                        .basic_publish(
                            "".into(),
                            reply_to.as_str().into(),
                            BasicPublishOptions::default(),
                            answer.to_string().as_bytes(),
                            props,
                        )
                        .await;
                }
            }
        }
    }

    /// One request's answer.
    async fn answer(&self, body: &[u8]) -> Value {
        let Ok(req) = serde_json::from_slice::<Value>(body) else {
            return json!({"error": "unreadable request"});
        };
        let text = |k: &str| req.get(k).and_then(Value::as_str).unwrap_or_default().to_owned();
        let group = text("group");
        let admin = crate::admin::RabbitAdmin { t: self.clone() };
        match text("op").as_str() {
            "show" => {
                let list: Vec<Value> = admin.local_halted(&group).iter().map(halted_json).collect();
                json!({ "halted": list, "from": self.shared.id })
            }
            "hot" => {
                let list: Vec<Value> = admin
                    .local_hot(&group)
                    .into_iter()
                    .map(|(label, held)| json!({ "label": label, "held": held }))
                    .collect();
                json!({ "hot": list, "from": self.shared.id })
            }
            "act" => {
                let Some(action) = HeadAction::from_name(&text("action")) else {
                    return json!({"error": "unknown action"});
                };
                match admin.local_resolve(&group, &text("key"), action).await {
                    Ok(done) => json!({ "done": done }),
                    Err(e) => json!({ "done": false, "error": e.to_string() }),
                }
            }
            _ => json!({"error": "unknown operation"}),
        }
    }

    /// Sends `request` to every process answering for `group`; returns
    /// the answers gathered until `stop` says enough (or `limit` passes).
    /// No answer at all and an unroutable request (nobody bound) both give
    /// an empty list.
    async fn ask(
        &self,
        group: &str,
        request: Value,
        limit: Duration,
        stop: impl Fn(&[Value]) -> bool,
    ) -> Result<Vec<Value>> {
        let conn = self.connection().await?;
        // Asking creates nothing: without the exchange (declared by every
        // consumer that answers) nobody could answer.
        if !crate::topology::exchange_exists(&conn, CONTROL_EXCHANGE, ExchangeKind::Topic).await? {
            return Ok(Vec::new());
        }
        let ch = confirm_channel(&conn).await?;
        let (queue, mut replies) = private_queue(&ch).await?;
        let correlation = uuid::Uuid::new_v4().to_string();
        let props = BasicProperties::default()
            .with_reply_to(queue.as_str().into())
            .with_correlation_id(ShortString::from(correlation.clone()));
        let confirm = ch
            .basic_publish(
                CONTROL_EXCHANGE.into(),
                group.into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..Default::default()
                },
                request.to_string().as_bytes(),
                props,
            )
            .await
            .map_err(amqp)?
            .await
            .map_err(amqp)?;
        let mut out = Vec::new();
        if !matches!(confirm, Confirmation::Ack(Some(_))) {
            let deadline = tokio::time::Instant::now() + limit;
            loop {
                let wait = if out.is_empty() {
                    deadline.saturating_duration_since(tokio::time::Instant::now())
                } else {
                    QUIET.min(deadline.saturating_duration_since(tokio::time::Instant::now()))
                };
                let Ok(Some(Ok(d))) = tokio::time::timeout(wait, replies.next()).await else {
                    break;
                };
                if d.properties.correlation_id().as_ref().map(|c| c.as_str()) != Some(correlation.as_str()) {
                    continue;
                }
                if let Ok(v) = serde_json::from_slice::<Value>(&d.data) {
                    out.push(v);
                }
                if stop(&out) {
                    break;
                }
            }
        }
        let _ = ch.close(200, "done".into()).await;
        Ok(out)
    }

    /// The answers to `op` from every process but this one.
    async fn gather(&self, group: &str, op: &str) -> Result<Vec<Value>> {
        let answers = self
            .ask(group, json!({"op": op, "group": group}), GATHER, |_| false)
            .await?;
        Ok(answers
            .into_iter()
            .filter(|a| a.get("from").and_then(Value::as_str) != Some(self.shared.id.as_str()))
            .collect())
    }

    /// `(label, deliveries held)` per key in other processes, summed over them.
    pub(crate) async fn remote_hot(&self, group: &str) -> Result<Vec<(String, u64)>> {
        let answers = self.gather(group, "hot").await?;
        let mut sum: std::collections::HashMap<String, u64> = std::collections::HashMap::new();
        for entry in answers
            .iter()
            .filter_map(|a| a.get("hot").and_then(Value::as_array))
            .flatten()
        {
            if let (Some(label), Some(n)) = (
                entry.get("label").and_then(Value::as_str),
                entry.get("held").and_then(Value::as_u64),
            ) {
                *sum.entry(label.to_owned()).or_default() += n;
            }
        }
        Ok(sum.into_iter().collect())
    }

    /// Halted heads held by other processes in `group`.
    pub(crate) async fn remote_halted(&self, group: &str) -> Result<Vec<HaltedKey>> {
        let answers = self.gather(group, "show").await?;
        Ok(answers
            .iter()
            .filter_map(|a| a.get("halted").and_then(Value::as_array))
            .flatten()
            .filter_map(halted_of)
            .collect())
    }

    /// Has the process holding `key`'s halted head act on it.
    pub(crate) async fn remote_resolve(&self, group: &str, key: &str, action: HeadAction) -> Result<()> {
        let request = json!({"op": "act", "group": group, "key": key, "action": action.name()});
        let done = |a: &Value| a.get("done").and_then(Value::as_bool) == Some(true);
        let answers = self.ask(group, request, ACT, |got| got.iter().any(done)).await?;
        if answers.iter().any(done) {
            return Ok(());
        }
        if let Some(e) = answers.iter().find_map(|a| a.get("error").and_then(Value::as_str)) {
            // Another process's words, read off the broker: escaped.
            return Err(Error::Broker(format!(
                "rabbitmq: the process holding the head failed: {}",
                keyorder_core::redact::text(e)
            )));
        }
        Err(Error::NotFound(format!(
            "no live consumer holds a halted head for key {} in `{group}` (a RabbitMQ halt lives in the \
             consumer that halted it and ends when that consumer stops; `keyorder head show` lists the live ones)",
            redact(key)
        )))
    }
}

async fn declare_exchange(ch: &Channel) -> Result<()> {
    ch.exchange_declare(
        CONTROL_EXCHANGE.into(),
        ExchangeKind::Topic,
        ExchangeDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .map_err(amqp)
}
