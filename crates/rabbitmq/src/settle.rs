//! Settling one delivery. The fence is the channel: a delivery tag is only
//! valid on the channel it came on, so once the broker closed a stale
//! consumer's channel (handing its queue to the next consumer) its
//! acknowledgements fail and change nothing.

use std::fmt;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use async_trait::async_trait;
use keyorder_core::key::label;
use keyorder_core::{Error, Result, Settle};
use lapin::Channel;

use crate::conn::Conn;
use crate::held::{Held, ACK_WAIT};
use crate::shared::Halted;

pub(crate) struct RabbitSettle {
    pub(crate) t: Conn,
    pub(crate) dlq_channel: Channel,
    /// The (category, group) pair's base name (`GroupNames::base`).
    pub(crate) group: String,
    pub(crate) dlq: String,
    pub(crate) key: Option<String>,
    pub(crate) scope: Arc<str>,
    pub(crate) generation: u64,
    pub(crate) message_id: String,
    /// Delivered before and not settled (`redelivered`).
    pub(crate) redelivered: bool,
    /// Attempts begun here.
    pub(crate) attempts: AtomicU32,
    /// The id of the attempt being begun, kept until its record was read
    /// back: begun again after a time-out, it is written with the same id
    /// and counted once.
    pub(crate) pending: std::sync::Mutex<Option<String>>,
    /// The last attempt's number (what a halt shows).
    pub(crate) counted: AtomicU32,
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

    fn unrecorded(&self) -> Error {
        Error::broker(format!(
            "rabbitmq: an attempt's record on `{}` was not read back within {} s",
            crate::attempts::STREAM,
            self.held.ledger_wait.as_secs()
        ))
    }

    /// A settled message's records are no longer needed (best effort: a
    /// count left behind only costs memory, up to the bound).
    async fn forget(&self) {
        if self.redelivered || self.attempts.load(Ordering::SeqCst) > 1 {
            self.held.ledger.reset(&self.held.subject, None).await;
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
                    "rabbitmq: acknowledgement not written or not confirmed in time; treating the channel as lost"
                );
                Err(self.fenced())
            }
        }
    }
}

#[async_trait]
impl Settle for RabbitSettle {
    fn delivered_before(&self) -> bool {
        self.redelivered
    }

    async fn begin_attempt(&self) -> Result<u32> {
        if self.held.reset.swap(false, Ordering::SeqCst) {
            // An operator's resume, its reset record already read back
            // (`local_resolve`): the count starts again.
            self.attempts.store(1, Ordering::SeqCst);
            self.counted.store(1, Ordering::SeqCst);
            return Ok(1);
        }
        let begun = self.attempts.load(Ordering::SeqCst);
        // A first delivery's first attempt: nothing ran it before, and it
        // is not written down (the `attempts` module).
        let n = if !self.redelivered && begun == 0 {
            1
        } else {
            let id = self
                .pending
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get_or_insert_with(|| uuid::Uuid::new_v4().simple().to_string())
                .clone();
            match self
                .held
                .ledger
                .begin(&self.held.subject, &id, self.held.ledger_wait)
                .await
            {
                Some(written) => {
                    *self.pending.lock().unwrap_or_else(|e| e.into_inner()) = None;
                    written.saturating_add(1)
                }
                None => return Err(self.unrecorded()),
            }
        };
        self.attempts.fetch_add(1, Ordering::SeqCst);
        self.counted.store(n, Ordering::SeqCst);
        Ok(n)
    }

    async fn ack(&self) -> Result<()> {
        self.ack_now().await?;
        self.forget().await;
        Ok(())
    }

    async fn park(&self, reason: &str) -> Result<()> {
        // The dead letter is confirmed before the head is acknowledged.
        self.held.dead_letter(&self.dlq_channel, &self.dlq, reason).await?;
        self.ack_now().await?;
        self.forget().await;
        Ok(())
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
                attempts: self.counted.load(Ordering::SeqCst),
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
