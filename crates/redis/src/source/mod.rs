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
use crate::wake::{listen, Wake};

pub(crate) use state::Source;

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
            .map(|n| listen(t.client.clone(), n.wake(), wake.clone()))
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
            rotate: 0,
            warned: false,
        };
        source.maintain_now().await?;
        Ok(source)
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
        let every = if self.soon {
            Duration::from_millis(100).min(self.spec.lease.heartbeat)
        } else {
            self.spec.lease.heartbeat
        };
        if self.last_maintain.is_none_or(|t| t.elapsed() >= every) {
            self.maintain_now().await?;
            // A periodic full look covers any lost wake-up.
            for p in self.parts.values_mut() {
                for s in &mut p.streams {
                    s.dirty = true;
                }
            }
            self.keyless_dirty = true;
        }
        Ok(std::mem::take(&mut self.events))
    }

    async fn release(&mut self, scope: &str) -> Result<()> {
        let Some(key) = self.scopes.get(scope).cloned() else {
            return Ok(());
        };
        if let Some(p) = self.parts.get(&key) {
            // Release at the server first: on failure the partition stays
            // owned here and the release is retried.
            let _: i64 = scripts::RELEASE
                .key(&p.lease_key)
                .arg(&p.holder)
                .invoke_async(&mut self.t.conn.clone())
                .await
                .map_err(broker)?;
            metrics::counter!("keyorder_redis_partitions_released_total").increment(1);
        }
        self.drop_part(&key, false);
        Ok(())
    }

    async fn close(&mut self) -> Result<()> {
        let scopes: Vec<Arc<str>> = self.scopes.keys().cloned().collect();
        for s in scopes {
            self.release(&s).await?;
        }
        let _: i64 = redis::cmd("ZREM")
            .arg(self.ctl.members(&self.group))
            .arg(&self.spec.instance)
            .query_async(&mut self.t.conn.clone())
            .await
            .map_err(broker)?;
        for l in &self.listeners {
            l.abort();
        }
        Ok(())
    }
}
