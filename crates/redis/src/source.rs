//! The ordered source: the partitions (one stream per key) this instance
//! owns through fenced leases, plus the category's keyless stream. A
//! correlated subscription (several categories, one correlation value) owns
//! a partition per value, spanning that value's stream in every category.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use keyorder_core::assign::assign;
use keyorder_core::key::label;
use keyorder_core::{Error, Inbound, OrderingKey, Result, ScopeLease, SourceEvent, SourceSpec, TransportSource};
use redis::Value;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::names::Names;
use crate::plain::GroupReader;
use crate::settle::{Mode, RedisSettle};
use crate::wake::{listen, Wake};
use crate::{broker, entries, message, RedisTransport};

/// Streams per script call (two keys each).
const CHUNK: usize = 64;

/// One stream of an owned partition (one per category).
struct Stream {
    cat: usize,
    stream: String,
    /// The group exists and this holder claimed what earlier ones left.
    joined: bool,
    /// `Some(after)`: re-read this holder's own pending entries after `after`
    /// (after an acquire, to apply reclaimed entries first; after a failed
    /// read, whose entries may have been delivered to us) before new ones.
    pending_after: Option<String>,
    /// The last entry handed to the dispatcher.
    last: String,
    /// Maybe has unread entries.
    dirty: bool,
    acked: Arc<AtomicBool>,
}

/// One owned partition.
struct Part {
    key: OrderingKey,
    lease_key: String,
    holder: String,
    generation: u64,
    lease: Arc<ScopeLease>,
    streams: Vec<Stream>,
    revoking: bool,
}

pub(crate) struct Source {
    t: RedisTransport,
    spec: SourceSpec,
    /// Per category (the subscription's first): its names.
    cats: Vec<Arc<Names>>,
    /// Where leases, members, generations and halted records live.
    ctl: Arc<Names>,
    scope_prefix: String,
    group: Arc<str>,
    parts: HashMap<String, Part>,
    scopes: HashMap<Arc<str>, String>,
    wake: Arc<Wake>,
    listeners: Vec<JoinHandle<()>>,
    keyless: Vec<GroupReader>,
    keyless_dirty: bool,
    events: Vec<SourceEvent>,
    last_maintain: Option<Instant>,
    last_reap: Instant,
    /// Look again soon: a wanted partition is still held elsewhere, or a
    /// wake-up named a partition or stream not known yet.
    soon: bool,
    rotate: usize,
    warned: bool,
}

impl fmt::Debug for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisSource")
            .field("category", &self.scope_prefix)
            .field("group", &self.spec.group)
            .field("owned", &self.parts.len())
            .finish()
    }
}

impl Drop for Source {
    fn drop(&mut self) {
        for l in &self.listeners {
            l.abort();
        }
    }
}

/// The scope name of a partition: the category and the key's label (scope
/// names are logged; keys are not).
fn scope_of(category: &str, key: &str) -> Arc<str> {
    Arc::from(format!("{category}/{}", label(key)))
}

fn ints(v: &Value) -> Vec<i64> {
    match v {
        Value::Array(items) => items
            .iter()
            .map(|i| match i {
                Value::Int(n) => *n,
                _ => 0,
            })
            .collect(),
        _ => Vec::new(),
    }
}

fn strings(v: &Value) -> Vec<String> {
    match v {
        Value::Array(items) => items.iter().filter_map(crate::text).collect(),
        _ => Vec::new(),
    }
}

impl Source {
    pub(crate) async fn open(t: RedisTransport, spec: SourceSpec) -> Result<Self> {
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
            crate::register_group(
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

    fn holder(&self, generation: u64) -> String {
        format!("{}:{generation}", self.spec.instance)
    }

    /// Takes wake-ups: owned partitions become readable; an unknown key means
    /// a new partition (or a stream of a correlated one) to discover.
    fn take_wakes(&mut self) {
        let (keys, all) = self.wake.take();
        if all {
            for p in self.parts.values_mut() {
                for s in &mut p.streams {
                    s.dirty = true;
                }
            }
            self.keyless_dirty = true;
            self.soon = true;
        }
        for k in keys {
            if k.is_empty() {
                self.keyless_dirty = true;
            } else if let Some(p) = self.parts.get_mut(&k) {
                for s in &mut p.streams {
                    s.dirty = true;
                    if !s.joined {
                        self.soon = true;
                    }
                }
            } else {
                self.soon = true;
            }
        }
    }

    /// `(key, stream index)` of every stream `stream` selects in the owned
    /// partitions that are not being handed over and that `part` selects.
    fn streams_where(
        &self,
        part: impl Fn(&Part) -> bool,
        stream: impl Fn(&str, &Stream) -> bool,
    ) -> Vec<(String, usize)> {
        let mut out = Vec::new();
        for (k, p) in &self.parts {
            if p.revoking || !part(p) {
                continue;
            }
            for (i, s) in p.streams.iter().enumerate() {
                if stream(k, s) {
                    out.push((k.clone(), i));
                }
            }
        }
        out
    }

    fn drop_part(&mut self, key: &str) -> Option<Part> {
        let p = self.parts.remove(key)?;
        self.scopes.remove(p.lease.scope());
        p.lease.lose();
        Some(p)
    }

    /// Heartbeat and lease renewal, rebalance and discovery, acquire with
    /// reclaim, operator actions, trimming, reaping.
    async fn maintain_now(&mut self) -> Result<()> {
        let sent = Instant::now();
        let ttl_ms = self.spec.lease.ttl.as_millis() as u64;
        let mut conn = self.t.conn.clone();
        // Renew what we hold; a lease not renewed is lost.
        let held: Vec<String> = self.parts.keys().cloned().collect();
        let mut inv = crate::scripts::RENEW.prepare_invoke();
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
            _ => return Err(Error::Broker("redis: unexpected heartbeat reply".into())),
        };
        for (k, ok) in held.iter().zip(flags.iter().chain(std::iter::repeat(&0))) {
            if *ok == 1 {
                self.parts[k].lease.confirm(sent);
            } else if let Some(p) = self.drop_part(k) {
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
            let index = crate::texts(index, "index member");
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
        let done: i64 = crate::scripts::JOIN_STREAM
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
                if let Some(p) = self.drop_part(key) {
                    tracing::warn!(scope = %p.lease.scope(), "redis: partition lease lost while joining a stream");
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// Acquires free partitions (reclaiming earlier generations' pending entries).
    async fn acquire(&mut self, keys: &[OrderingKey], sent: Instant) -> Result<()> {
        let mut inv = crate::scripts::ACQUIRE.prepare_invoke();
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
            return Err(Error::Broker("redis: unexpected acquire reply".into()));
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
        let all = crate::text_pairs(all, "resolved field");
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
                    pipe.invoke_script(crate::scripts::TRIM.key(&s.stream).key(self.cats[s.cat].groups()));
                    n += 1;
                }
            }
        }
        if n > 0 {
            // Scripts not loaded yet (first use, or after a restart) are loaded once.
            crate::scripts::TRIM
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
            let done: i64 = crate::scripts::REAP
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
                    if let Some(p) = self.drop_part(&k) {
                        tracing::debug!(scope = %p.lease.scope(), "redis: cold partition reaped");
                    }
                } else if let Some(p) = self.parts.get_mut(&k) {
                    p.streams[i].joined = false;
                }
            }
        }
        Ok(())
    }

    /// One fenced read over the readable owned streams, then the keyless streams.
    async fn read(&mut self, max: usize, paused: &HashSet<Arc<str>>) -> Result<Vec<Inbound>> {
        let mut out = Vec::new();
        let mut ready = self.streams_where(
            |p| !paused.contains(p.lease.scope()) && !p.lease.is_lost(),
            |_, s| s.joined && (s.dirty || s.pending_after.is_some()),
        );
        ready.sort_unstable();
        if !ready.is_empty() {
            let n = ready.len();
            ready.rotate_left(self.rotate % n);
            self.rotate = self.rotate.wrapping_add(1);
            let share = (max / n).clamp(1, 1000);
            for chunk in ready.chunks(CHUNK) {
                if out.len() >= max {
                    break;
                }
                match self.read_chunk(chunk, share, &mut out).await {
                    Ok(()) => {}
                    Err(e) if !out.is_empty() => {
                        tracing::warn!(error = %e, "redis: read failed; delivering what was read");
                        break;
                    }
                    Err(e) => return Err(e),
                }
            }
        }
        if out.len() < max && self.keyless_dirty {
            let mut conn = self.t.conn.clone();
            let mut more = false;
            for r in &mut self.keyless {
                let room = max.saturating_sub(out.len());
                if room == 0 {
                    more = true;
                    break;
                }
                let got = match r.read(&mut conn, room, None).await {
                    Ok(got) => got,
                    // The partitions' entries read above are pending at
                    // this holder: deliver them rather than drop them.
                    Err(e) if !out.is_empty() => {
                        tracing::warn!(error = %e, "redis: keyless read failed; delivering what was read");
                        more = true;
                        break;
                    }
                    Err(e) => return Err(e),
                };
                more |= got.len() >= room;
                out.extend(got);
            }
            self.keyless_dirty = more;
        }
        Ok(out)
    }

    async fn read_chunk(&mut self, chunk: &[(String, usize)], share: usize, out: &mut Vec<Inbound>) -> Result<()> {
        let sent = Instant::now();
        let mut inv = crate::scripts::READ.prepare_invoke();
        inv.arg(&*self.group)
            .arg(&self.spec.instance)
            .arg(self.spec.lease.ttl.as_millis() as u64);
        for (k, i) in chunk {
            let p = &self.parts[k];
            let s = &p.streams[*i];
            inv.key(&p.lease_key).key(&s.stream);
            inv.arg(p.generation)
                .arg(s.pending_after.as_deref().unwrap_or(">"))
                .arg(share);
        }
        let reply = match inv.invoke_async::<Value>(&mut self.t.conn.clone()).await {
            Ok(v) => v,
            Err(e) => {
                // The read may have run: its entries would now be pending at
                // this holder. Re-read them before anything new.
                for (k, i) in chunk {
                    if let Some(p) = self.parts.get_mut(k) {
                        let s = &mut p.streams[*i];
                        if s.pending_after.is_none() {
                            s.pending_after = Some(s.last.clone());
                        }
                    }
                }
                return Err(broker(e));
            }
        };
        let Value::Array(results) = reply else {
            return Err(Error::Broker("redis: unexpected read reply".into()));
        };
        for ((k, i), r) in chunk.iter().zip(results) {
            if matches!(r, Value::Int(0)) {
                if let Some(p) = self.drop_part(k) {
                    metrics::counter!("keyorder_redis_fence_rejections_total").increment(1);
                    tracing::warn!(scope = %p.lease.scope(), generation = p.generation, "redis: fenced read rejected");
                }
                continue;
            }
            let (got, attempts) = match &r {
                Value::Array(two) if two.len() == 2 && crate::text(&two[0]).as_deref() == Some("error") => {
                    // This stream's read failed; the others of the call went on.
                    let why = two.get(1).and_then(crate::text).unwrap_or_default();
                    if let Some(p) = self.parts.get_mut(k) {
                        p.streams[*i].dirty = true;
                        tracing::warn!(
                            scope = %p.lease.scope(),
                            error = %crate::scrub(&why),
                            "redis: a stream's fenced read failed; it is read again on the next fetch"
                        );
                    }
                    self.soon = true;
                    continue;
                }
                Value::Array(two) if two.len() == 2 => (entries(&two[0]), ints(&two[1])),
                _ => (Vec::new(), Vec::new()),
            };
            let Some(p) = self.parts.get_mut(k) else { continue };
            // The read extended the lease (a renewal), sent at `sent`.
            p.lease.confirm(sent);
            let names = self.cats[p.streams[*i].cat].clone();
            let count = got.len();
            for ((entry, fields), attempt) in got.into_iter().zip(attempts.into_iter().chain(std::iter::repeat(0))) {
                let s = &mut p.streams[*i];
                s.last = entry.clone();
                let Some(fields) = fields else {
                    // Deleted while pending: nothing to deliver.
                    continue;
                };
                out.push(Inbound {
                    message: message(&fields, Some(p.key.clone())),
                    lease: p.lease.clone(),
                    settle: Box::new(RedisSettle {
                        t: self.t.clone(),
                        names: names.clone(),
                        ctl: self.ctl.clone(),
                        group: self.group.clone(),
                        mode: Mode::Fenced,
                        key: p.key.as_str().to_owned(),
                        stream: s.stream.clone(),
                        holder: p.holder.clone(),
                        consumer: p.holder.clone(),
                        generation: p.generation,
                        scope: p.lease.scope().clone(),
                        entry,
                        acked: s.acked.clone(),
                        local_attempts: AtomicU32::new(0),
                        counted: AtomicU32::new(attempt.clamp(0, i64::from(u32::MAX)) as u32),
                        redelivered: attempt == 0,
                    }),
                });
            }
            let s = &mut p.streams[*i];
            if s.pending_after.is_some() {
                if count == 0 {
                    s.pending_after = None;
                    s.dirty = true;
                } else {
                    s.pending_after = Some(s.last.clone());
                }
            } else if count < share {
                s.dirty = false;
            }
        }
        Ok(())
    }
}

#[async_trait]
impl TransportSource for Source {
    async fn fetch(&mut self, max: usize, paused: &HashSet<Arc<str>>, wait: Duration) -> Result<Vec<Inbound>> {
        self.take_wakes();
        let batch = self.read(max, paused).await?;
        if !batch.is_empty() {
            return Ok(batch);
        }
        let _ = tokio::time::timeout(wait, self.wake.notify.notified()).await;
        self.take_wakes();
        self.read(max, paused).await
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
            let _: i64 = crate::scripts::RELEASE
                .key(&p.lease_key)
                .arg(&p.holder)
                .invoke_async(&mut self.t.conn.clone())
                .await
                .map_err(broker)?;
            metrics::counter!("keyorder_redis_partitions_released_total").increment(1);
        }
        self.drop_part(&key);
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
