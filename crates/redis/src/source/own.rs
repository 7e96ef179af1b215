//! Ownership upkeep: the heartbeat that renews the leases held, discovery
//! and rebalance over the live members, acquiring (with reclaim) and
//! joining partitions, the operator's resolved heads, trimming and reaping.

use std::collections::{BTreeSet, HashSet};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use keyorder_core::assign::assign;
use keyorder_core::key::label;
use keyorder_core::{Error, OrderingKey, Result, ScopeLease, SourceEvent};
use redis::Value;
use tokio::time::Instant;

use super::state::{ints, strings, Part, Source, Stream, CHUNK};
use crate::error::broker;
use crate::names::Names;
use crate::scripts;
use crate::wire::{text_pairs, texts};

/// The scope name of a partition: the category and the key's label (scope
/// names are logged; keys are not).
fn scope_of(category: &str, key: &str) -> Arc<str> {
    Arc::from(format!("{category}/{}", label(key)))
}

impl Source {
    fn holder(&self, generation: u64) -> String {
        format!("{}:{generation}", self.spec.instance)
    }

    /// Heartbeat and lease renewal, rebalance and discovery, acquire with
    /// reclaim, operator actions, trimming, reaping.
    pub(super) async fn maintain_now(&mut self) -> Result<()> {
        let sent = Instant::now();
        let ttl_ms = self.spec.lease.ttl.as_millis() as u64;
        let mut conn = self.t.conn.clone();
        // Renew what we hold; a lease not renewed is lost.
        let held: Vec<String> = self.parts.keys().cloned().collect();
        let mut inv = scripts::RENEW.prepare_invoke();
        inv.key(self.ctl.members(&self.group))
            .arg(&self.spec.instance)
            .arg(ttl_ms)
            .arg(&*self.group)
            .arg(self.cats.len());
        for n in &self.cats {
            inv.key(n.groups());
        }
        for k in &held {
            let p = &self.parts[k];
            inv.key(&p.lease_key).arg(p.generation);
        }
        let reply: Value = inv.invoke_async(&mut conn).await.map_err(broker)?;
        let (flags, live) = match &reply {
            Value::Array(two) if two.len() == 2 => (ints(&two[0]), strings(&two[1])),
            _ => return Err(Error::broker("redis: unexpected heartbeat reply")),
        };
        for (k, ok) in held.iter().zip(flags.iter().chain(std::iter::repeat(&0))) {
            if *ok == 1 {
                self.parts[k].lease.confirm(sent);
            } else if let Some(p) = self.drop_part(k, true) {
                metrics::counter!("keyorder_redis_leases_lost_total").increment(1);
                tracing::warn!(scope = %p.lease.scope(), generation = p.generation, "redis: partition lease lost");
            }
        }
        for r in &mut self.keyless {
            r.lease.confirm(sent);
            r.reclaim().await?;
        }
        // Discovery: the indexes list every live partition.
        let mut indexed: Vec<HashSet<String>> = Vec::with_capacity(self.cats.len());
        for n in &self.cats {
            let index: Vec<Vec<u8>> = redis::cmd("ZRANGE")
                .arg(n.index())
                .arg(0)
                .arg(-1)
                .query_async(&mut conn)
                .await
                .map_err(broker)?;
            let index = texts(index, "index member");
            let count = index.len();
            metrics::gauge!("keyorder_redis_partitions", "category" => n.category().to_owned()).set(count as f64);
            if count > self.t.cfg.partition_warn {
                if !self.warned {
                    tracing::warn!(
                        category = %n.category(),
                        partitions = count,
                        threshold = self.t.cfg.partition_warn,
                        "redis: many live partitions in one category; each costs a lease, a heartbeat entry and a \
                         read per wake-up (consider the Kafka adapter beyond low thousands of keys)"
                    );
                    metrics::counter!("keyorder_redis_partition_warnings_total").increment(1);
                    self.warned = true;
                }
            } else {
                self.warned = false;
            }
            // Members are key segments: decoded, and anything that is no
            // key's segment is skipped.
            indexed.push(
                index
                    .iter()
                    .filter_map(|m| Names::key_of(m))
                    .map(std::borrow::Cow::into_owned)
                    .collect(),
            );
        }
        let mut index: Vec<String> = indexed
            .iter()
            .flatten()
            .cloned()
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        index.retain(|k| OrderingKey::with_rules(k, &self.spec.key_rules).is_ok());
        let me = self.spec.instance.clone();
        let mut live = live;
        if !live.contains(&me) {
            live.push(me.clone());
        }
        live.sort();
        let owners = assign(&live, &index);
        self.soon = false;
        let mut want = Vec::new();
        for k in &index {
            let mine = owners.get(k.as_str()) == Some(&me.as_str());
            if let Some(p) = self.parts.get_mut(k) {
                if !mine && !p.revoking {
                    p.revoking = true;
                    self.events.push(SourceEvent::Revoke(p.lease.scope().clone()));
                }
            } else if mine {
                if let Ok(key) = OrderingKey::with_rules(k, &self.spec.key_rules) {
                    want.push(key);
                }
            }
        }
        // Only an owner reaps, so a partition missing from every index is gone.
        let gone: Vec<String> = self
            .parts
            .keys()
            .filter(|k| !owners.contains_key(k.as_str()))
            .cloned()
            .collect();
        for k in gone {
            if let Some(p) = self.parts.get_mut(&k) {
                if !p.revoking {
                    p.revoking = true;
                    self.events.push(SourceEvent::Revoke(p.lease.scope().clone()));
                }
            }
        }
        // Streams that appeared after their partition was acquired.
        let late = self.streams_where(|_| true, |k, s| !s.joined && indexed[s.cat].contains(k));
        for (k, i) in late {
            self.join(&k, i).await?;
        }
        let per_call = (CHUNK / self.cats.len()).max(1);
        for chunk in want.chunks(per_call) {
            self.acquire(chunk, sent).await?;
        }
        self.resolved().await?;
        self.trim().await?;
        self.reap().await?;
        self.last_maintain = Some(sent);
        Ok(())
    }

    /// Joins a stream of an owned partition that appeared after the acquire.
    async fn join(&mut self, key: &str, i: usize) -> Result<()> {
        let Some(p) = self.parts.get(key) else { return Ok(()) };
        let s = &p.streams[i];
        let done: i64 = scripts::JOIN_STREAM
            .key(&p.lease_key)
            .key(&s.stream)
            .key(self.cats[s.cat].index())
            .arg(&p.holder)
            .arg(&*self.group)
            .arg(&*Names::segment(key))
            .invoke_async(&mut self.t.conn.clone())
            .await
            .map_err(broker)?;
        match done {
            1 => {
                if let Some(p) = self.parts.get_mut(key) {
                    let s = &mut p.streams[i];
                    s.joined = true;
                    s.pending_after = Some("0".into());
                    s.last = "0".into();
                    s.dirty = true;
                }
            }
            0 => {
                if let Some(p) = self.drop_part(key, true) {
                    tracing::warn!(scope = %p.lease.scope(), "redis: partition lease lost while joining a stream");
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// Acquires free partitions (reclaiming earlier generations' pending entries).
    async fn acquire(&mut self, keys: &[OrderingKey], sent: Instant) -> Result<()> {
        let mut inv = scripts::ACQUIRE.prepare_invoke();
        inv.key(self.ctl.generation())
            .arg(&self.spec.instance)
            .arg(self.spec.lease.ttl.as_millis() as u64)
            .arg(&*self.group)
            .arg(self.cats.len());
        for n in &self.cats {
            inv.key(n.groups());
        }
        for k in keys {
            inv.key(self.ctl.lease(k.as_str(), &self.group));
            for n in &self.cats {
                inv.key(n.stream(k.as_str()));
            }
            for n in &self.cats {
                inv.key(n.index());
            }
            inv.arg(&*Names::segment(k.as_str())).arg(self.cats.len());
        }
        let reply: Value = inv.invoke_async(&mut self.t.conn.clone()).await.map_err(broker)?;
        let Value::Array(results) = reply else {
            return Err(Error::broker("redis: unexpected acquire reply"));
        };
        for (key, r) in keys.iter().zip(results) {
            let r = ints(&r);
            let gen = r.first().copied().unwrap_or(0);
            if gen <= 0 {
                // Held by its previous owner (handing over, or expiring).
                self.soon = true;
                continue;
            }
            let generation = gen as u64;
            let scope = scope_of(&self.scope_prefix, key.as_str());
            let lease = ScopeLease::new(scope.clone(), generation, &self.spec.lease, sent);
            tracing::debug!(scope = %scope, generation, "redis: partition acquired");
            let streams = self
                .cats
                .iter()
                .enumerate()
                .map(|(cat, n)| {
                    let joined = r.get(cat + 1) == Some(&1);
                    Stream {
                        cat,
                        stream: n.stream(key.as_str()),
                        joined,
                        pending_after: joined.then(|| "0".to_owned()),
                        last: "0".into(),
                        dirty: joined,
                        acked: Arc::default(),
                    }
                })
                .collect();
            self.scopes.insert(scope, key.as_str().to_owned());
            self.parts.insert(
                key.as_str().to_owned(),
                Part {
                    key: key.clone(),
                    lease_key: self.ctl.lease(key.as_str(), &self.group),
                    holder: self.holder(generation),
                    generation,
                    lease,
                    streams,
                    revoking: false,
                },
            );
        }
        Ok(())
    }

    /// Operator actions on halted heads of owned partitions.
    async fn resolved(&mut self) -> Result<()> {
        let mut conn = self.t.conn.clone();
        let all: Vec<(Vec<u8>, Vec<u8>)> = redis::cmd("HGETALL")
            .arg(self.ctl.resolved(&self.group))
            .query_async(&mut conn)
            .await
            .map_err(broker)?;
        let all = text_pairs(all, "resolved field");
        for (field, action) in all {
            // Fields are key segments.
            let Some(key) = Names::key_of(&field).map(std::borrow::Cow::into_owned) else {
                continue;
            };
            if !self.parts.contains_key(&key) {
                continue;
            }
            let removed: i64 = redis::cmd("HDEL")
                .arg(self.ctl.resolved(&self.group))
                .arg(&field)
                .query_async(&mut conn)
                .await
                .map_err(broker)?;
            if removed == 1 {
                if let Some(p) = self.parts.get_mut(&key) {
                    for s in &mut p.streams {
                        s.dirty = true;
                    }
                }
                self.events.push(SourceEvent::Resolved {
                    key,
                    drop_head: action != "resume",
                });
            }
        }
        Ok(())
    }

    /// Trims entries every group acknowledged, on streams with new acks.
    async fn trim(&mut self) -> Result<()> {
        let mut pipe = redis::pipe();
        let mut n = 0;
        for p in self.parts.values() {
            for s in &p.streams {
                if s.acked.swap(false, Ordering::Relaxed) {
                    pipe.invoke_script(scripts::TRIM.key(&s.stream).key(self.cats[s.cat].groups()));
                    n += 1;
                }
            }
        }
        if n > 0 {
            // Scripts not loaded yet (first use, or after a restart) are loaded once.
            scripts::TRIM
                .prepare_invoke()
                .load_async(&mut self.t.conn.clone())
                .await
                .map_err(broker)?;
            pipe.query_async::<Value>(&mut self.t.conn.clone())
                .await
                .map_err(broker)?;
        }
        Ok(())
    }

    /// Removes owned streams that are drained and idle past `reap_idle`; a
    /// single-stream partition goes with its lease.
    async fn reap(&mut self) -> Result<()> {
        let idle = self.t.cfg.reap_idle;
        if idle.is_zero()
            || self.last_reap.elapsed() < (idle / 4).clamp(Duration::from_millis(200), Duration::from_secs(60))
        {
            return Ok(());
        }
        self.last_reap = Instant::now();
        let single = self.cats.len() == 1;
        let candidates = self.streams_where(|_| true, |_, s| s.joined && s.pending_after.is_none());
        for (k, i) in candidates {
            let Some(p) = self.parts.get(&k) else { continue };
            let s = &p.streams[i];
            let done: i64 = scripts::REAP
                .key(&s.stream)
                .key(self.cats[s.cat].index())
                .key(&p.lease_key)
                .key(self.cats[s.cat].groups())
                .arg(&*Names::segment(&k))
                .arg(idle.as_millis() as u64)
                .arg(&p.holder)
                .arg(if single { "1" } else { "0" })
                .invoke_async(&mut self.t.conn.clone())
                .await
                .map_err(broker)?;
            if done == 1 {
                metrics::counter!("keyorder_redis_partitions_reaped_total").increment(1);
                if single {
                    if let Some(p) = self.drop_part(&k, false) {
                        tracing::debug!(scope = %p.lease.scope(), "redis: cold partition reaped");
                    }
                } else if let Some(p) = self.parts.get_mut(&k) {
                    p.streams[i].joined = false;
                }
            }
        }
        Ok(())
    }
}
