//! Answering: a process that consumes a group (or holds a halt in it)
//! binds a private queue to the control exchange for the group and answers
//! the operator's requests from its own halted heads and held deliveries.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use keyorder_core::{Error, HaltedKey, HeadAction, Result};
use lapin::options::{BasicPublishOptions, ExchangeDeclareOptions, QueueBindOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, ExchangeKind};
use serde_json::{json, Value};

use crate::admin::RabbitAdmin;
use crate::conn::Conn;
use crate::error::broker;
use crate::names::CONTROL_EXCHANGE;
use crate::topology::private_queue;

fn halted_json(h: &HaltedKey) -> Value {
    json!({
        "label": h.label, "preview": h.preview, "scope": h.scope,
        "head_id": h.head_id, "attempts": h.attempts, "reason": h.reason,
    })
}

impl Conn {
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
        let ch = conn.create_channel().await.map_err(broker)?;
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
                .map_err(broker)?;
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
                        return Err(Error::broker("rabbitmq: the control queue's consumer ended"));
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
        let admin = RabbitAdmin { t: self.clone() };
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
}

async fn declare_exchange(ch: &Channel) -> Result<()> {
    ch.exchange_declare(
        CONTROL_EXCHANGE.into(),
        ExchangeKind::Topic,
        ExchangeDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .map_err(broker)
}
