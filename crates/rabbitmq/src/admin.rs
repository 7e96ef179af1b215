//! The operator's view. Queue depth and consumer count come from the broker
//! (passive declarations); halted heads are held by the process that halted
//! them: this view lists its own and asks the other processes (see
//! [`crate::control`]), and acts on a head where it is held.

use std::fmt;

use async_trait::async_trait;
use keyorder_core::key::{label, redact};
use keyorder_core::{Admin, DeadLetter, Error, HaltedKey, HeadAction, HotKey, Result, ScopeInfo, SourceEvent};
use lapin::options::{BasicGetOptions, QueueDeclareOptions};
use lapin::types::FieldTable;

use crate::settle::{Held, ACK_WAIT, REASON_HEADER};
use crate::source::header_text;
use crate::topology::{amqp, Names};
use crate::{confirm_channel, RabbitTransport};

pub(crate) struct RabbitAdmin {
    pub(crate) t: RabbitTransport,
}

impl fmt::Debug for RabbitAdmin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitAdmin").finish_non_exhaustive()
    }
}

#[async_trait]
impl Admin for RabbitAdmin {
    async fn scopes(&self, category: &str, _group: &str) -> Result<Vec<ScopeInfo>> {
        let n = Names::new(category)?;
        let mut out = Vec::new();
        for q in n.queues(self.t.cfg.topology) {
            let ch = self.t.connection().await?.create_channel().await.map_err(amqp)?;
            let info = ch
                .queue_declare(
                    q.as_str().into(),
                    QueueDeclareOptions {
                        passive: true,
                        ..Default::default()
                    },
                    FieldTable::default(),
                )
                .await
                .map_err(|e| Error::NotFound(format!("queue `{q}`: {e}")))?;
            let _ = ch.close(200, "admin".into()).await;
            let scope = format!("{category}/{q}");
            let halted = self
                .t
                .shared
                .halted
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .values()
                .filter(|h| h.scope == scope)
                .count();
            out.push(ScopeInfo {
                scope,
                owner: (info.consumer_count() > 0).then(|| format!("{} consumer(s)", info.consumer_count())),
                generation: 0,
                lag: u64::from(info.message_count()),
                halted,
            });
        }
        Ok(out)
    }

    async fn halted(&self, category: &str, _group: &str) -> Result<Vec<HaltedKey>> {
        let mut out = self.local_halted(category);
        for h in self.t.remote_halted(category).await? {
            if !out.iter().any(|o| o.label == h.label) {
                out.push(h);
            }
        }
        out.sort_by(|a, b| a.label.cmp(&b.label));
        Ok(out)
    }

    /// RabbitMQ keeps no per-key backlog and a queue cannot be browsed
    /// without taking its messages, so the hot keys are the consumers':
    /// per key, the deliveries every live process holds (delivered, not yet
    /// settled; at most the consumers' prefetch). This process counts its
    /// own and asks the others through the control exchange. The queues'
    /// undelivered depth is in `scopes`.
    async fn hot_keys(&self, category: &str, _group: &str, limit: usize) -> Result<Vec<HotKey>> {
        let mut counts: std::collections::HashMap<String, u64> = self.local_hot(category).into_iter().collect();
        for (label, n) in self.t.remote_hot(category).await? {
            *counts.entry(label).or_default() += n;
        }
        Ok(HotKey::top(counts, limit))
    }

    async fn dead_letters(&self, category: &str, _group: &str) -> Result<Vec<DeadLetter>> {
        // Peek: get without acknowledging, then close the channel, which
        // returns every message to the dead-letter queue.
        let n = Names::new(category)?;
        let ch = self.t.connection().await?.create_channel().await.map_err(amqp)?;
        let mut out = Vec::new();
        while out.len() < 1000 {
            let Some(m) = ch
                .basic_get(n.dlq().as_str().into(), BasicGetOptions::default())
                .await
                .map_err(amqp)?
            else {
                break;
            };
            let props = &m.delivery.properties;
            let text = |name: &str| header_text(props, name);
            out.push(DeadLetter {
                id: props.message_id().as_ref().map(|s| s.to_string()).unwrap_or_default(),
                label: text(keyorder_core::KEY_HEADER).map_or_else(|| "keyless".into(), |k| label(&k)),
                reason: text(REASON_HEADER).unwrap_or_default(),
            });
        }
        let _ = ch.close(200, "peeked".into()).await;
        Ok(out)
    }

    async fn resolve(&self, category: &str, _group: &str, key: &str, action: HeadAction) -> Result<()> {
        if self.local_resolve(category, key, action).await? {
            return Ok(());
        }
        self.t.remote_resolve(category, key, action).await
    }
}

impl RabbitAdmin {
    /// `(label, deliveries held)` of every key this process holds
    /// deliveries of in `category`.
    pub(crate) fn local_hot(&self, category: &str) -> Vec<(String, u64)> {
        let map = self.t.shared.held_keys.lock().unwrap_or_else(|e| e.into_inner());
        map.get(category)
            .map(|keys| keys.iter().map(|(k, n)| (label(k), *n)).collect())
            .unwrap_or_default()
    }

    /// The halted heads this process holds in `category`.
    pub(crate) fn local_halted(&self, category: &str) -> Vec<HaltedKey> {
        let map = self.t.shared.halted.lock().unwrap_or_else(|e| e.into_inner());
        let mut out: Vec<HaltedKey> = map
            .iter()
            .filter(|((c, _), _)| c == category)
            .map(|((_, k), h)| HaltedKey {
                label: label(k),
                preview: redact(k),
                scope: h.scope.clone(),
                head_id: h.head_id.clone(),
                attempts: h.attempts,
                reason: h.reason.clone(),
                held: None,
            })
            .collect();
        out.sort_by(|a, b| a.label.cmp(&b.label));
        out
    }

    /// Acts on `key`'s halted head if this process holds it (`Ok(false)`:
    /// not held here).
    pub(crate) async fn local_resolve(&self, category: &str, key: &str, action: HeadAction) -> Result<bool> {
        let (found, held) = {
            let map = self.t.shared.halted.lock().unwrap_or_else(|e| e.into_inner());
            let Some(((_, k), h)) = map
                .iter()
                .find(|((c, k), _)| c == category && (k == key || label(k) == key))
            else {
                return Ok(false);
            };
            (k.clone(), h.settle.clone())
        };
        let drop_head = match action {
            HeadAction::Skip => {
                operator_ack(&held).await?;
                tracing::warn!(key = %label(&found), "operator skipped a halted head");
                true
            }
            HeadAction::DeadLetter => {
                let n = Names::new(category)?;
                let ch = confirm_channel(&*self.t.connection().await?).await?;
                held.dead_letter(&ch, &n.dlq(), "moved to the dead-letter queue by an operator")
                    .await?;
                operator_ack(&held).await?;
                true
            }
            HeadAction::Resume => {
                held.reset.store(true, std::sync::atomic::Ordering::SeqCst);
                false
            }
        };
        self.t
            .shared
            .halted
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&(category.to_owned(), found.clone()));
        self.t
            .shared
            .resolved
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(category.to_owned())
            .or_default()
            .push(SourceEvent::Resolved { key: found, drop_head });
        Ok(true)
    }
}

/// An operator's acknowledgement of a halted head, bounded like every
/// other (see [`Held::ack`]).
async fn operator_ack(held: &Held) -> Result<()> {
    match held.ack().await {
        Some(r) => r.map(|_| ()).map_err(amqp),
        None => Err(Error::Broker(format!(
            "rabbitmq: the head's acknowledgement was not written within {} s (the connection looks dead); retry once the owner reconnected",
            ACK_WAIT.as_secs()
        ))),
    }
}
