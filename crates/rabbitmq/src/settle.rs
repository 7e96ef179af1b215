//! Settling one delivery. The fence is the channel: a delivery tag is only
//! valid on the channel it came on, so once the broker closed a stale
//! consumer's channel (handing its queue to the next consumer) its
//! acknowledgements fail and change nothing.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;

use async_trait::async_trait;
use keyorder_core::key::label;
use keyorder_core::{Error, Result, Settle};
use lapin::options::BasicAckOptions;
use lapin::types::{AMQPValue, LongString};
use lapin::Acker;
use lapin::{BasicProperties, Channel};

use crate::{publish_confirmed, Halted, RabbitTransport};

/// What a halted head keeps so an operator can settle it later.
pub(crate) struct Held {
    pub(crate) acker: Acker,
    pub(crate) payload: keyorder_core::Bytes,
    pub(crate) properties: BasicProperties,
    /// Set by an operator's resume: the next attempt counts from 1 again.
    pub(crate) reset: AtomicBool,
}

impl Held {
    /// Acknowledges the delivery, waiting at most [`ACK_WAIT`] for the frame
    /// to be written: `None` past it. lapin writes the frame through its
    /// connection task; on a connection that died while the process was
    /// stopped the write may never be answered, and an unbounded wait held a
    /// worker's graceful shutdown forever. Unwritten, the delivery stays
    /// unacknowledged and the broker requeues it with the channel.
    pub(crate) async fn ack(&self) -> Option<lapin::Result<bool>> {
        tokio::time::timeout(ACK_WAIT, self.acker.ack(BasicAckOptions::default()))
            .await
            .ok()
    }

    /// Publishes a copy of the message to the dead-letter queue `dlq` with
    /// `reason` in `x-keyorder-reason`, and waits for the broker's confirm.
    pub(crate) async fn dead_letter(&self, ch: &Channel, dlq: &str, reason: &str) -> Result<()> {
        let mut headers = self.properties.headers().clone().unwrap_or_default();
        headers.insert(REASON_HEADER.into(), AMQPValue::LongString(LongString::from(reason)));
        let props = self.properties.clone().with_headers(headers);
        publish_confirmed(ch, "", dlq, &self.payload, props).await
    }
}

/// The longest an acknowledgement's frame may take to be written.
pub(crate) const ACK_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// The header a dead letter carries its reason in.
pub(crate) const REASON_HEADER: &str = "x-keyorder-reason";

pub(crate) struct RabbitSettle {
    pub(crate) t: RabbitTransport,
    pub(crate) dlq_channel: Channel,
    /// The (category, group) pair's base name (`GroupNames::base`).
    pub(crate) group: String,
    pub(crate) dlq: String,
    pub(crate) key: Option<String>,
    pub(crate) scope: Arc<str>,
    pub(crate) generation: u64,
    pub(crate) message_id: String,
    /// Deliveries before this one (`x-delivery-count`, or 1 when only
    /// `redelivered` is known).
    pub(crate) earlier: u32,
    pub(crate) attempts: AtomicU32,
    pub(crate) held: Arc<Held>,
}

impl fmt::Debug for RabbitSettle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitSettle")
            .field("scope", &self.scope)
            .field("generation", &self.generation)
            .finish_non_exhaustive()
    }
}

impl Drop for RabbitSettle {
    fn drop(&mut self) {
        if let Some(key) = &self.key {
            self.t.shared.unhold(&self.group, key);
        }
    }
}

impl RabbitSettle {
    fn fenced(&self) -> Error {
        metrics::counter!("keyorder_rabbitmq_fence_rejections_total").increment(1);
        Error::Fenced {
            scope: self.scope.to_string(),
            generation: self.generation,
        }
    }

    async fn ack_now(&self) -> Result<()> {
        // Unwritten in time, it is left to the broker as a fenced one is.
        match self.held.ack().await {
            Some(Ok(true)) => Ok(()),
            Some(Ok(false) | Err(_)) => Err(self.fenced()),
            None => {
                tracing::warn!(
                    scope = %self.scope,
                    wait_s = ACK_WAIT.as_secs(),
                    "rabbitmq: acknowledgement not written in time; treating the channel as lost"
                );
                Err(self.fenced())
            }
        }
    }
}

#[async_trait]
impl Settle for RabbitSettle {
    async fn begin_attempt(&self) -> Result<u32> {
        if self.held.reset.swap(false, Ordering::SeqCst) {
            self.attempts.store(1, Ordering::SeqCst);
            return Ok(1);
        }
        let n = self.attempts.fetch_add(1, Ordering::SeqCst) + 1;
        Ok(self.earlier + n)
    }

    async fn ack(&self) -> Result<()> {
        self.ack_now().await
    }

    async fn park(&self, reason: &str) -> Result<()> {
        // The dead letter is confirmed before the head is acknowledged.
        self.held.dead_letter(&self.dlq_channel, &self.dlq, reason).await?;
        self.ack_now().await
    }

    async fn halt(&self, reason: &str) -> Result<()> {
        let Some(key) = &self.key else {
            return Err(Error::Unsupported {
                transport: "rabbitmq".into(),
                capability: "halt_on_poison",
                fix: "a keyless message has no key to halt; give it a key or use the Park poison policy".into(),
            });
        };
        // The head stays unacknowledged: the broker keeps it for the next
        // owner if this one goes away.
        self.t.shared.halted.lock().unwrap_or_else(|e| e.into_inner()).insert(
            (self.group.clone(), key.clone()),
            Halted {
                scope: self.scope.to_string(),
                head_id: self.message_id.clone(),
                attempts: self.earlier + self.attempts.load(Ordering::SeqCst),
                reason: reason.to_owned(),
                settle: self.held.clone(),
            },
        );
        self.t.answer_for(&self.group);
        metrics::counter!("keyorder_rabbitmq_halts_total").increment(1);
        tracing::warn!(key = %label(key), scope = %self.scope, "rabbitmq: key halted at its head");
        Ok(())
    }
}
