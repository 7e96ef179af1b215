//! Asking: an operator's request goes to every process answering for the
//! group, and the answers are gathered (hot keys, halted heads) or the
//! holder's answer awaited (acting on a head).

use std::time::Duration;

use futures::StreamExt;
use keyorder_core::key::redact;
use keyorder_core::{Error, HaltedKey, HeadAction, Result};
use lapin::options::BasicPublishOptions;
use lapin::types::ShortString;
use lapin::Confirmation;
use lapin::{BasicProperties, ExchangeKind};
use serde_json::{json, Value};

use crate::channel::confirm_channel;
use crate::conn::Conn;
use crate::error::broker;
use crate::names::CONTROL_EXCHANGE;
use crate::topology::{exchange_exists, private_queue};

/// How long `show` waits for more answers after the last one.
const QUIET: Duration = Duration::from_millis(300);
/// The longest `show` waits for answers.
const GATHER: Duration = Duration::from_secs(2);
/// The longest `skip`, `dlq` or `resume` waits for the holder's answer.
const ACT: Duration = Duration::from_secs(10);

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

impl Conn {
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
        if !exchange_exists(&conn, CONTROL_EXCHANGE, ExchangeKind::Topic).await? {
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
            .map_err(broker)?
            .await
            .map_err(broker)?;
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
            return Err(Error::broker(format!(
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
