//! `impl Settle`: acknowledges, retries, halts and parks, fenced on
//! (member, generation).

use std::sync::Arc;

use async_trait::async_trait;

use crate::error::Result;
use crate::key::OrderingKey;
use crate::transport::{DeadLetter, Settle};

use super::broker::{Broker, Group, Halt};

#[derive(Debug)]
pub(super) struct MemorySettle {
    pub(super) broker: Arc<Broker>,
    pub(super) category: String,
    pub(super) group: String,
    pub(super) member: String,
    pub(super) scope: Arc<str>,
    pub(super) generation: u64,
    pub(super) part: u32,
    pub(super) offset: u64,
    pub(super) key: Option<OrderingKey>,
    pub(super) id: String,
}

impl MemorySettle {
    pub(super) fn with_group<T>(&self, f: impl FnOnce(&mut Group) -> T) -> Result<T> {
        let mut st = self.broker.lock();
        let cat = self.broker.category(&mut st, &self.category);
        let group = cat.group_mut(&self.group)?;
        group.fence(self.part, &self.member, self.generation, &self.scope)?;
        let out = f(group);
        cat.trim();
        Ok(out)
    }
}

#[async_trait]
impl Settle for MemorySettle {
    async fn begin_attempt(&self) -> Result<u32> {
        self.with_group(|g| {
            let n = g.attempts.entry((self.part, self.offset)).or_insert(0);
            *n += 1;
            *n
        })
    }

    async fn ack(&self) -> Result<()> {
        self.with_group(|g| g.settle(self.part, self.offset))?;
        self.broker.notify.notify_waiters();
        Ok(())
    }

    async fn park(&self, reason: &str) -> Result<()> {
        self.with_group(|g| {
            g.dead.push(DeadLetter {
                id: self.id.clone(),
                label: self.key.as_ref().map_or_else(|| "keyless".into(), OrderingKey::label),
                reason: reason.to_owned(),
            });
            g.settle(self.part, self.offset);
        })?;
        self.broker.notify.notify_waiters();
        Ok(())
    }

    async fn halt(&self, reason: &str) -> Result<()> {
        self.with_group(|g| {
            g.halted.retain(|h| !(h.part == self.part && h.offset == self.offset));
            g.halted.push(Halt {
                part: self.part,
                offset: self.offset,
                key: self.key.as_ref().map_or_else(String::new, |k| k.as_str().to_owned()),
                id: self.id.clone(),
                reason: reason.to_owned(),
            });
        })
    }
}
