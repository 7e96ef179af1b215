//! `impl TransportPublisher`: appends to the key's partition log.

use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;

use crate::error::{Error, Result};
use crate::message::Message;
use crate::transport::{PublishFence, TransportPublisher};

use super::broker::{Broker, Stored};

pub(super) struct MemoryPublisher {
    pub(super) broker: Arc<Broker>,
    pub(super) category: String,
}

impl fmt::Debug for MemoryPublisher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryPublisher")
            .field("category", &self.category)
            .finish()
    }
}

#[async_trait]
impl TransportPublisher for MemoryPublisher {
    async fn publish(&self, message: Message) -> Result<()> {
        self.append(message, None)
    }

    async fn publish_fenced(&self, message: Message, fence: &PublishFence) -> Result<()> {
        self.append(message, Some(fence))
    }
}

impl MemoryPublisher {
    pub(super) fn append(&self, message: Message, fence: Option<&PublishFence>) -> Result<()> {
        let partitions = self.broker.partitions;
        {
            let mut st = self.broker.lock();
            let cat = self.broker.category(&mut st, &self.category);
            if let Some(f) = fence {
                let seen = cat.fences.entry(f.scope.clone()).or_insert(0);
                if *seen > f.token {
                    return Err(Error::Fenced {
                        scope: f.scope.clone(),
                        generation: f.token,
                    });
                }
                *seen = f.token;
            }
            let part = match message.key() {
                Some(key) => (key.stable_hash() % u64::from(partitions)) as u32,
                None => {
                    cat.next_keyless = (cat.next_keyless + 1) % partitions;
                    cat.next_keyless
                }
            };
            cat.logs[part as usize].entries.push_back(Stored { message });
        }
        self.broker.notify.notify_waiters();
        Ok(())
    }
}
