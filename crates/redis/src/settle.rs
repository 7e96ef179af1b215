//! Settling one delivery: every call on an owned partition is a fenced script.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;

use async_trait::async_trait;
use keyorder_core::{Error, Result, Settle};
use redis::Value;

use crate::batch::{Kind, Op};
use crate::conn::Conn;
use crate::error::broker;
use crate::names::Names;
use crate::scripts;

/// How a delivery is settled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// An owned partition: every call is fenced by the holder.
    Fenced,
    /// No owner (the keyless stream, or an unordered subscription on the
    /// partitioned layout): durable attempts, no fence.
    Unfenced,
    /// The single layout (plain competing consumers): XACK, attempts in memory.
    Plain,
}

pub(crate) struct RedisSettle {
    pub(crate) t: Conn,
    /// The names of the delivery's category (stream, dead letters).
    pub(crate) names: Arc<Names>,
    /// The names the lease and the halted record live under (the category's
    /// own, or a correlated subscription's `{c1}+{c2}...`).
    pub(crate) ctl: Arc<Names>,
    pub(crate) group: Arc<str>,
    pub(crate) mode: Mode,
    /// The partition's key, raw (`""` when keyless); [`Names`] encodes it.
    pub(crate) key: String,
    pub(crate) stream: String,
    pub(crate) holder: String,
    /// The consumer the entry is pending at (the holder; the instance when unfenced).
    pub(crate) consumer: String,
    pub(crate) generation: u64,
    pub(crate) scope: Arc<str>,
    pub(crate) entry: String,
    /// Set once an acknowledgement made the partition trimmable.
    pub(crate) acked: Arc<AtomicBool>,
    pub(crate) local_attempts: AtomicU32,
    /// The attempt count the fenced read already incremented durably (the
    /// first `begin_attempt` returns it; later ones increment again).
    pub(crate) counted: AtomicU32,
    /// Delivered before without being settled (a re-read of a pending entry).
    pub(crate) redelivered: bool,
}

impl fmt::Debug for RedisSettle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisSettle")
            .field("scope", &self.scope)
            .field("entry", &self.entry)
            .field("generation", &self.generation)
            .finish_non_exhaustive()
    }
}

impl RedisSettle {
    fn fenced(&self) -> Error {
        metrics::counter!("keyorder_redis_fence_rejections_total").increment(1);
        Error::Fenced {
            scope: self.scope.to_string(),
            generation: self.generation,
        }
    }

    fn holder(&self) -> &str {
        if self.mode == Mode::Fenced {
            &self.holder
        } else {
            ""
        }
    }

    fn lease_key(&self) -> String {
        self.ctl.lease(&self.key, &self.group)
    }

    async fn batched(&self, kind: Kind) -> Result<i64> {
        self.t
            .batcher
            .ask(|reply| Op {
                kind,
                lease: self.lease_key(),
                stream: self.stream.clone(),
                holder: self.holder().to_owned(),
                group: self.group.to_string(),
                entry: self.entry.clone(),
                consumer: self.consumer.clone(),
                reply,
            })
            .await
    }

    fn dlq(&self) -> String {
        if self.key.is_empty() {
            self.names.keyless_dlq()
        } else {
            self.names.dlq(&self.key)
        }
    }
}

#[async_trait]
impl Settle for RedisSettle {
    fn delivered_before(&self) -> bool {
        self.redelivered
    }

    async fn begin_attempt(&self) -> Result<u32> {
        if self.mode == Mode::Plain {
            return Ok(self.local_attempts.fetch_add(1, Ordering::SeqCst) + 1);
        }
        let counted = self.counted.swap(0, Ordering::SeqCst);
        if counted > 0 {
            return Ok(counted);
        }
        match self.batched(Kind::Attempt).await? {
            0 => Err(self.fenced()),
            n if n < 0 => Err(Error::broker(format!(
                "redis: entry {} of {} is no longer pending (settled by an operator?)",
                self.entry, self.scope
            ))),
            n => Ok(n as u32),
        }
    }

    async fn ack(&self) -> Result<()> {
        let mut conn = self.t.conn.clone();
        if self.mode == Mode::Plain {
            redis::cmd("XACK")
                .arg(&self.stream)
                .arg(&*self.group)
                .arg(&self.entry)
                .query_async::<Value>(&mut conn)
                .await
                .map_err(broker)?;
            return Ok(());
        }
        let n = self.batched(Kind::Ack).await?;
        if n == 0 {
            return Err(self.fenced());
        }
        self.acked.store(true, Ordering::Relaxed);
        Ok(())
    }

    async fn park(&self, reason: &str) -> Result<()> {
        // The dead-letter index and the halted hash hold key segments;
        // `__keyless__` (no key's segment) marks the keyless stream's.
        let member = if self.key.is_empty() {
            std::borrow::Cow::Borrowed("__keyless__")
        } else {
            Names::segment(&self.key)
        };
        let n: i64 = scripts::PARK
            .key(self.lease_key())
            .key(&self.stream)
            .key(self.dlq())
            .key(self.names.dlq_index())
            .key(self.ctl.halted(&self.group))
            .arg(self.holder())
            .arg(&*self.group)
            .arg(&self.entry)
            .arg(&*member)
            .arg(reason)
            .invoke_async(&mut self.t.conn.clone())
            .await
            .map_err(broker)?;
        if n == 0 {
            return Err(self.fenced());
        }
        self.acked.store(true, Ordering::Relaxed);
        Ok(())
    }

    async fn halt(&self, reason: &str) -> Result<()> {
        if self.key.is_empty() {
            return Err(Error::Unsupported {
                transport: "redis".into(),
                capability: "halt_on_poison",
                fix: "a keyless message has no partition to halt; give it a key or use the Park poison policy".into(),
            });
        }
        let n: i64 = scripts::HALT
            .key(self.lease_key())
            .key(self.ctl.halted(&self.group))
            .key(&self.stream)
            .arg(self.holder())
            .arg(&*Names::segment(&self.key))
            .arg(&self.entry)
            .arg(reason)
            .arg(&*self.group)
            .arg(self.names.category())
            .invoke_async(&mut self.t.conn.clone())
            .await
            .map_err(broker)?;
        if n == 0 {
            return Err(self.fenced());
        }
        metrics::counter!("keyorder_redis_halts_total").increment(1);
        Ok(())
    }
}
