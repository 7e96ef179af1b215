//! The ordered source: the partitions (one stream per key) this instance
//! owns through fenced leases, plus the category's keyless stream. A
//! correlated subscription (several categories, one correlation value) owns
//! a partition per value, spanning that value's stream in every category.
//!
//! [`state`] holds what a source keeps, [`own`] its leases and upkeep,
//! [`read`] the fenced reads; this room opens a source and answers the
//! consumer's calls.

mod own;
mod read;
mod state;

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use keyorder_core::raw::Room;
use keyorder_core::{Inbound, Result, SourceEvent, SourceSpec, TransportSource};
use tokio::time::Instant;

use crate::conn::{register_group, Conn};
use crate::error::broker;
use crate::names::Names;
use crate::plain::GroupReader;
use crate::scripts;
use crate::settle::Mode;
use crate::wake::{listen, owners_message, Wake};

pub(crate) use state::Source;
use state::RELEASE_CHUNK;

/// The least time between two upkeeps that other instances' ownership
/// wake-ups cause (a burst of them costs one).
const OWNERS_SPACING: Duration = Duration::from_millis(20);

impl Source {
    pub(crate) async fn open(t: Conn, spec: SourceSpec) -> Result<Self> {
        let mut names = vec![Arc::new(Names::new(&spec.category)?)];
        for c in &spec.correlated {
            names.push(Arc::new(Names::new(c)?));
        }
        let ctl = if names.len() == 1 {
            names[0].clone()
        } else {
            let sorted: BTreeSet<&str> = names.iter().map(|n| n.category()).collect();
            Arc::new(Names::new(&sorted.into_iter().collect::<Vec<_>>().join("+"))?)
        };
        let wake = Arc::new(Wake::default());
        let listeners = names
            .iter()
            .map(|n| listen(t.client.clone(), n.wake(), &spec.group, wake.clone()))
            .collect();
        // The group registry of every category first, before anything is
        // read: from now on trimming and reaping keep what this group has
        // not read. Its members heartbeat under the control name.
        for n in &names {
            register_group(
                &t,
                n,
                &spec.group,
                &ctl.members(&spec.group),
                &spec.instance,
                spec.lease.ttl,
            )
            .await?;
        }
        let mut keyless = Vec::new();
        for n in &names {
            keyless.push(
                GroupReader::new(
                    &t,
                    n.clone(),
                    &spec,
                    n.keyless(),
                    format!("{}/keyless", n.category()),
                    Mode::Unfenced,
                )
                .await?,
            );
        }
        let mut source = Source {
            group: Arc::from(spec.group.as_str()),
            scope_prefix: ctl.category().to_owned(),
            t,
            spec,
            cats: names,
            ctl,
            parts: HashMap::new(),
            scopes: HashMap::new(),
            wake,
            listeners,
            keyless,
            keyless_dirty: true,
            events: Vec::new(),
            last_maintain: None,
            last_reap: Instant::now(),
            soon: false,
            owners_woken: false,
            rotate: 0,
            warned: false,
        };
        source.maintain_now().await?;
        // The others hand this one its share now, not at their next heartbeat.
        source.owners_moved().await;
        Ok(source)
    }
}

impl Source {
    /// Tells every consumer of the categories that ownership moved (best
    /// effort: without it they look at their next heartbeat).
    async fn owners_moved(&self) {
        let message = owners_message(&self.spec.group);
        for n in &self.cats {
            let sent: redis::RedisResult<i64> = redis::cmd("PUBLISH")
                .arg(n.wake())
                .arg(&message)
                .query_async(&mut self.t.conn.clone())
                .await;
            if let Err(e) = sent {
                tracing::debug!(error = %e, "redis: ownership wake-up not sent");
            }
        }
    }
}

#[async_trait]
impl TransportSource for Source {
    async fn fetch(&mut self, room: &Room, wait: Duration) -> Result<Vec<Inbound>> {
        self.take_wakes();
        let batch = self.read(room).await?;
        if !batch.is_empty() {
            return Ok(batch);
        }
        let _ = tokio::time::timeout(wait, self.wake.notify.notified()).await;
        self.take_wakes();
        self.read(room).await
    }

    async fn maintain(&mut self) -> Result<Vec<SourceEvent>> {
        if self.wake.take_owners() {
            self.owners_woken = true;
        }
        let every = if self.owners_woken {
            OWNERS_SPACING.min(self.spec.lease.heartbeat)
        } else if self.soon {
            Duration::from_millis(100).min(self.spec.lease.heartbeat)
        } else {
            self.spec.lease.heartbeat
        };
        if self.last_maintain.is_none_or(|t| t.elapsed() >= every) {
            let woken = std::mem::take(&mut self.owners_woken);
            if let Err(e) = self.maintain_now().await {
                // Not forgotten: the retry still runs at the wake-up's pace.
                self.owners_woken |= woken;
                return Err(e);
            }
            // A periodic full look covers any lost wake-up (an ownership
            // wake-up is no sign of one: the streams stay as they are).
            if !woken {
                for p in self.parts.values_mut() {
                    for s in &mut p.streams {
                        s.dirty = true;
                    }
                }
                self.keyless_dirty = true;
            }
        }
        Ok(std::mem::take(&mut self.events))
    }

    async fn release(&mut self, scope: &str) -> Result<()> {
        self.release_all(&[Arc::from(scope)]).await
    }

    async fn release_all(&mut self, scopes: &[Arc<str>]) -> Result<()> {
        let keys: Vec<String> = scopes
            .iter()
            .filter_map(|s| self.scopes.get(s).cloned())
            .filter(|k| self.parts.contains_key(k))
            .collect();
        for chunk in keys.chunks(RELEASE_CHUNK) {
            // Released at the server first, a chunk per round trip: on a
            // failure these partitions stay owned here and are released
            // again at the next call (one already gone is skipped).
            let mut inv = scripts::RELEASE_MANY.prepare_invoke();
            for k in chunk {
                let p = &self.parts[k];
                inv.key(&p.lease_key).arg(&p.holder);
            }
            let released: i64 = inv.invoke_async(&mut self.t.conn.clone()).await.map_err(broker)?;
            metrics::counter!("keyorder_redis_partitions_released_total").increment(released.max(0) as u64);
            for k in chunk {
                self.drop_part(k, false);
            }
        }
        if !keys.is_empty() {
            self.owners_moved().await;
        }
        Ok(())
    }

    async fn close(&mut self) -> Result<()> {
        let scopes: Vec<Arc<str>> = self.scopes.keys().cloned().collect();
        self.release_all(&scopes).await?;
        let _: i64 = redis::cmd("ZREM")
            .arg(self.ctl.members(&self.group))
            .arg(&self.spec.instance)
            .query_async(&mut self.t.conn.clone())
            .await
            .map_err(broker)?;
        self.owners_moved().await;
        for l in &self.listeners {
            l.abort();
        }
        Ok(())
    }
}
