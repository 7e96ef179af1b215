//! Settling one delivery: every attempt, halt and acknowledgement is carried
//! by the partition's state record (see `state`), acknowledged by the
//! broker, before the call returns, so a later owner neither runs a
//! finished message again nor loses an attempt count. The fence is the
//! partition's lease: once it is lost, every call fails with `Fenced` and
//! writes nothing.

use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;
use keyorder_core::{Error, Result, Settle};
use rdkafka::message::OwnedHeaders;

use crate::error::fenced;
use crate::owned::{HeldHead, Part, Shared};
use crate::wire::{dead_letter_headers, key_text};

pub(crate) struct KafkaSettle {
    pub(crate) shared: Arc<Shared>,
    pub(crate) part: Arc<Part>,
    pub(crate) offset: i64,
    pub(crate) key: Option<Vec<u8>>,
    pub(crate) payload: keyorder_core::Bytes,
    pub(crate) headers: Option<OwnedHeaders>,
    pub(crate) message_id: String,
    /// Attempts earlier owners made (from the partition's saved state).
    pub(crate) earlier: u32,
}

impl fmt::Debug for KafkaSettle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KafkaSettle")
            .field("scope", self.part.lease.scope())
            .field("offset", &self.offset)
            .field("earlier", &self.earlier)
            .finish()
    }
}

impl KafkaSettle {
    fn fenced(&self) -> Error {
        fenced(&self.part.lease)
    }

    fn live(&self) -> Result<()> {
        if self.part.lease.is_lost() {
            metrics::counter!("keyorder_kafka_fenced_total").increment(1);
            return Err(self.fenced());
        }
        Ok(())
    }

    async fn durable(&self) -> Result<()> {
        if self.shared.ordered {
            self.shared.commit_through(&self.part).await
        } else {
            Ok(())
        }
    }
}

/// Copies a message to the dead-letter topic with `reason`, its origin and
/// group in headers, and waits for the delivery report.
pub(crate) async fn dead_letter(
    shared: &Shared,
    partition: i32,
    offset: i64,
    key: Option<&[u8]>,
    payload: &[u8],
    headers: Option<&OwnedHeaders>,
    reason: &str,
) -> Result<()> {
    let origin = format!("{}/{partition}@{offset}", shared.names.topic());
    let h = dead_letter_headers(headers, reason, &origin, &shared.group);
    shared.t.produce(&shared.names.dlq(), key, payload, h).await?;
    metrics::counter!("keyorder_kafka_dead_letters_total").increment(1);
    Ok(())
}

#[async_trait]
impl Settle for KafkaSettle {
    fn delivered_before(&self) -> bool {
        self.earlier > 0
    }

    async fn begin_attempt(&self) -> Result<u32> {
        self.live()?;
        let (n, save) = {
            let mut t = self.part.track();
            let n = t.begin(self.offset).ok_or_else(|| self.fenced())?;
            (n, t.begin_needs_save(self.offset, n))
        };
        if save {
            self.durable().await?;
        }
        Ok(n)
    }

    async fn ack(&self) -> Result<()> {
        self.live()?;
        self.part.track().done(self.offset);
        self.durable().await
    }

    async fn park(&self, reason: &str) -> Result<()> {
        self.live()?;
        dead_letter(
            &self.shared,
            self.part.partition,
            self.offset,
            self.key.as_deref(),
            &self.payload,
            self.headers.as_ref(),
            reason,
        )
        .await?;
        tracing::info!(scope = %self.part.lease.scope(), offset = self.offset, id = self.message_id.as_str(), "kafka: parked");
        self.ack().await
    }

    async fn halt(&self, reason: &str) -> Result<()> {
        self.live()?;
        self.part.track().halt(self.offset, reason);
        // From now on this process answers operator requests for the category.
        self.shared.t.answer_for(&self.shared.names);
        // The key as the dispatcher holds it (non-UTF-8 and over-long key
        // bytes by their text form), so a resolve names the same key.
        if let Some(key) = self.key.as_deref().filter(|k| !k.is_empty()) {
            self.part.hold_head(HeldHead {
                offset: self.offset,
                key: key_text(key),
                payload: self.payload.clone(),
                headers: self.headers.clone(),
            });
        }
        self.durable().await
    }
}
