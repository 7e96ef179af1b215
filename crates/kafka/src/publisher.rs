//! `KafkaPublisher`: `impl TransportPublisher`. A keyed record goes to its
//! key's partition under the topic's layout; keyless records go round robin.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

use async_trait::async_trait;
use keyorder_core::{Message, Result, TransportPublisher};

use crate::broker::KafkaTransport;
use crate::names::Names;
use crate::wire::{headers_of, partition_for};

/// A category's publisher.
pub(crate) struct KafkaPublisher {
    t: KafkaTransport,
    names: Names,
    /// The next keyless record's partition (round robin).
    next: AtomicU64,
}

impl KafkaPublisher {
    /// A publisher to `names`' topic.
    pub(crate) fn new(t: KafkaTransport, names: Names) -> Self {
        KafkaPublisher {
            t,
            names,
            next: AtomicU64::new(0),
        }
    }
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
            None => (self.next.fetch_add(1, Ordering::Relaxed) % count.max(1) as u64) as i32,
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
