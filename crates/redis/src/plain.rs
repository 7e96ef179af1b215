//! Plain competing consumers on one stream: the keyless stream of the
//! partitioned layout, and every message with `layout=single` (the
//! benchmark baseline: XREADGROUP with BLOCK, XACK).

use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU32};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use keyorder_core::raw::Room;
use keyorder_core::{Inbound, OrderingKey, Result, ScopeLease, SourceEvent, SourceSpec, TransportSource};
use redis::aio::ConnectionManager;
use redis::Value;
use tokio::time::Instant;

use crate::config::Layout;
use crate::conn::{manager, register_group, Conn};
use crate::error::broker;
use crate::names::Names;
use crate::scripts;
use crate::settle::{Mode, RedisSettle};
use crate::wake::{listen, Wake};
use crate::wire::{entries, message, text, texts, Entry};
use tokio::task::JoinHandle;

/// One consumer of one stream in a plain group.
pub(crate) struct GroupReader {
    t: Conn,
    names: Arc<Names>,
    group: Arc<str>,
    consumer: String,
    stream: String,
    mode: Mode,
    pub(crate) lease: Arc<ScopeLease>,
    rules: keyorder_core::KeyRules,
    /// Entries claimed from crashed consumers, delivered first.
    claimed: VecDeque<Entry>,
    last_claim: Option<Instant>,
    claim_idle: Duration,
    acked: Arc<AtomicBool>,
}

impl GroupReader {
    pub(crate) async fn new(
        t: &Conn,
        names: Arc<Names>,
        spec: &SourceSpec,
        stream: String,
        scope: String,
        mode: Mode,
    ) -> Result<Self> {
        let sent = Instant::now();
        // At `0`, never `$`: nothing published before the group existed is skipped.
        let created: redis::RedisResult<Value> = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(&stream)
            .arg(&spec.group)
            .arg("0")
            .arg("MKSTREAM")
            .query_async(&mut t.conn.clone())
            .await;
        if let Err(e) = created {
            if e.code() != Some("BUSYGROUP") {
                return Err(broker(e));
            }
        }
        Ok(GroupReader {
            t: t.clone(),
            names,
            group: Arc::from(spec.group.as_str()),
            consumer: spec.instance.clone(),
            stream,
            mode,
            lease: ScopeLease::new(scope, 0, &spec.lease, sent),
            rules: spec.key_rules.clone(),
            claimed: VecDeque::new(),
            last_claim: None,
            claim_idle: spec.lease.ttl,
            acked: Arc::default(),
        })
    }

    /// Claims entries pending longer than the lease TTL at other (crashed)
    /// consumers; they are delivered by the next read.
    pub(crate) async fn reclaim(&mut self) -> Result<()> {
        if self.last_claim.is_some_and(|t| t.elapsed() < self.claim_idle / 2) || self.claimed.len() > 1000 {
            return Ok(());
        }
        self.last_claim = Some(Instant::now());
        let mut cursor = "0-0".to_owned();
        loop {
            let r: Value = redis::cmd("XAUTOCLAIM")
                .arg(&self.stream)
                .arg(&*self.group)
                .arg(&self.consumer)
                .arg(self.claim_idle.as_millis() as u64)
                .arg(&cursor)
                .arg("COUNT")
                .arg(100)
                .query_async(&mut self.t.conn.clone())
                .await
                .map_err(broker)?;
            let Value::Array(parts) = r else { break };
            cursor = match parts.first() {
                Some(Value::BulkString(b)) => String::from_utf8_lossy(b).into_owned(),
                Some(Value::SimpleString(s)) => s.clone(),
                _ => "0-0".into(),
            };
            if let Some(v) = parts.get(1) {
                self.claimed.extend(entries(v));
            }
            if cursor == "0-0" || self.claimed.len() > 1000 {
                break;
            }
        }
        Ok(())
    }

    /// Reads up to `count` entries (`block`: wait for them, on `conn`).
    pub(crate) async fn read(
        &mut self,
        conn: &mut ConnectionManager,
        count: usize,
        block: Option<Duration>,
    ) -> Result<Vec<Inbound>> {
        let sent = Instant::now();
        let mut got: Vec<Entry> = Vec::new();
        while got.len() < count {
            match self.claimed.pop_front() {
                Some(e) => got.push(e),
                None => break,
            }
        }
        // Claimed entries were delivered before: their count is read back at
        // the first attempt. A new entry's delivery count is 1.
        let claimed = got.len();
        if got.len() < count {
            let mut cmd = redis::cmd("XREADGROUP");
            cmd.arg("GROUP").arg(&*self.group).arg(&self.consumer);
            cmd.arg("COUNT").arg(count - got.len());
            if let Some(b) = block.filter(|_| got.is_empty()) {
                cmd.arg("BLOCK").arg(b.as_millis().max(1) as u64);
            }
            cmd.arg("STREAMS").arg(&self.stream).arg(">");
            let r: Value = cmd.query_async(conn).await.map_err(broker)?;
            if let Value::Array(streams) = r {
                for s in streams {
                    if let Value::Array(pair) = s {
                        if let Some(v) = pair.get(1) {
                            got.extend(entries(v));
                        }
                    }
                }
            }
            self.lease.confirm(sent);
        }
        Ok(got
            .into_iter()
            .enumerate()
            .filter_map(|(i, e)| self.inbound(e, i >= claimed))
            .collect())
    }

    fn inbound(&self, (entry, fields): Entry, fresh: bool) -> Option<Inbound> {
        let fields = fields?;
        let key = fields
            .get("k")
            .and_then(|k| OrderingKey::with_rules(String::from_utf8_lossy(k), &self.rules).ok());
        let key_text = key.as_ref().map(|k| k.as_str().to_owned()).unwrap_or_default();
        let msg = message(&fields, key);
        Some(Inbound {
            message: msg,
            lease: self.lease.clone(),
            settle: Box::new(RedisSettle {
                t: self.t.clone(),
                names: self.names.clone(),
                ctl: self.names.clone(),
                group: self.group.clone(),
                mode: self.mode,
                key: if self.mode == Mode::Plain {
                    String::new()
                } else {
                    key_text
                },
                stream: self.stream.clone(),
                holder: String::new(),
                consumer: self.consumer.clone(),
                generation: 0,
                scope: self.lease.scope().clone(),
                entry,
                acked: self.acked.clone(),
                local_attempts: AtomicU32::new(0),
                counted: AtomicU32::new(u32::from(fresh)),
                redelivered: !fresh,
            }),
        })
    }
}

/// The unordered source: plain competing consumers, on the single stream
/// (`layout=single`, with BLOCK) or on every partition stream and the
/// keyless stream (the partitioned layout, woken by the wake channel).
pub(crate) struct PlainSource {
    reader: GroupReader,
    /// Blocking reads get a connection of their own (a BLOCK holds its
    /// connection) with a response timeout above the block time.
    blocking: Option<ConnectionManager>,
    block_timeout: Duration,
    t: Conn,
    spec: SourceSpec,
    names: Arc<Names>,
    /// Partition streams with the group created (partitioned layout).
    streams: HashSet<String>,
    dirty: HashSet<String>,
    wake: Option<(Arc<Wake>, JoinHandle<()>)>,
    last_maintain: Option<Instant>,
    acked: Arc<AtomicBool>,
}

impl fmt::Debug for PlainSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PlainSource")
            .field("category", &self.spec.category)
            .finish_non_exhaustive()
    }
}

impl Drop for PlainSource {
    fn drop(&mut self) {
        if let Some((_, h)) = &self.wake {
            h.abort();
        }
    }
}

impl PlainSource {
    pub(crate) async fn open(t: Conn, spec: SourceSpec) -> Result<Self> {
        let names = Arc::new(Names::new(&spec.category)?);
        let (stream, mode, wake) = match t.cfg.layout {
            Layout::Single => (names.single(), Mode::Plain, None),
            Layout::Partitioned => {
                let wake = Arc::new(Wake::default());
                let h = listen(t.client.clone(), names.wake(), &spec.group, wake.clone());
                (names.keyless(), Mode::Unfenced, Some((wake, h)))
            }
        };
        let scope = format!("{}/all", spec.category);
        // The group registry first, before anything is read: from now on
        // trimming and reaping of the key streams keep what this group has
        // not read (the single layout has no key streams: nothing to keep).
        if wake.is_some() {
            let members = names.members(&spec.group);
            register_group(&t, &names, &spec.group, &members, &spec.instance, spec.lease.ttl).await?;
        }
        let reader = GroupReader::new(&t, names.clone(), &spec, stream, scope, mode).await?;
        let mut source = PlainSource {
            reader,
            blocking: None,
            block_timeout: t.cfg.response_timeout,
            t,
            spec,
            names,
            streams: HashSet::new(),
            dirty: HashSet::new(),
            wake,
            last_maintain: None,
            acked: Arc::default(),
        };
        source.discover().await?;
        Ok(source)
    }

    /// Joins `keys`' streams again after a read met one without the group:
    /// at `0` where the stream exists (it was reaped and published again),
    /// and a stream that is gone is forgotten until discovery finds it.
    async fn rejoin(&mut self, keys: &[String]) -> Result<()> {
        let mut conn = self.t.conn.clone();
        for k in keys {
            let joined: i64 = scripts::JOIN_PLAIN
                .key(self.names.groups())
                .key(self.names.stream(k))
                .arg(&self.spec.group)
                .arg("0")
                .invoke_async(&mut conn)
                .await
                .map_err(broker)?;
            if joined == 0 {
                // The stream is gone.
                self.streams.remove(k);
                self.dirty.remove(k);
            }
        }
        Ok(())
    }

    /// Partitioned layout: joins the group on every indexed partition.
    async fn discover(&mut self) -> Result<()> {
        if self.wake.is_none() {
            return Ok(());
        }
        let mut conn = self.t.conn.clone();
        let index: Vec<Vec<u8>> = redis::cmd("ZRANGE")
            .arg(self.names.index())
            .arg(0)
            .arg(-1)
            .query_async(&mut conn)
            .await
            .map_err(broker)?;
        let index = texts(index, "index member");
        // Members are key segments: decoded, and anything that is no key's
        // segment is skipped.
        for k in index
            .iter()
            .filter_map(|m| Names::key_of(m))
            .map(std::borrow::Cow::into_owned)
        {
            if self.streams.contains(&k) || OrderingKey::with_rules(&k, &self.spec.key_rules).is_err() {
                continue;
            }
            let _: i64 = scripts::JOIN_PLAIN
                .key(self.names.groups())
                .key(self.names.stream(&k))
                .arg(&self.spec.group)
                .arg("1")
                .invoke_async(&mut conn)
                .await
                .map_err(broker)?;
            self.dirty.insert(k.clone());
            self.streams.insert(k);
        }
        Ok(())
    }

    /// Partitioned layout: reads the woken partition streams (non-blocking).
    async fn read_partitions(&mut self, max: usize) -> Result<Vec<Inbound>> {
        let mut out = Vec::new();
        let keys: Vec<String> = self.dirty.iter().cloned().collect();
        for chunk in keys.chunks(64) {
            if out.len() >= max {
                break;
            }
            let sent = Instant::now();
            let mut cmd = redis::cmd("XREADGROUP");
            cmd.arg("GROUP")
                .arg(&self.spec.group)
                .arg(&self.spec.instance)
                .arg("COUNT")
                .arg((max - out.len()).div_ceil(chunk.len()).max(1))
                .arg("STREAMS");
            // The reply names each stream: its key is found by that name.
            let by_stream: HashMap<String, &String> = chunk.iter().map(|k| (self.names.stream(k), k)).collect();
            for k in chunk {
                cmd.arg(self.names.stream(k));
            }
            for _ in chunk {
                cmd.arg(">");
            }
            let r: Value = match cmd.query_async(&mut self.t.conn.clone()).await {
                Ok(r) => r,
                Err(e) if e.code() == Some("NOGROUP") => {
                    // A stream of the chunk was reaped (every registered
                    // group had read it to its end) and maybe published
                    // again: join the new stream at its start, forget a
                    // stream that is gone (discovery joins it when it comes
                    // back), and read the chunk again on the next fetch.
                    self.rejoin(chunk).await?;
                    continue;
                }
                Err(e) => return Err(broker(e)),
            };
            self.reader.lease.confirm(sent);
            for k in chunk {
                self.dirty.remove(k);
            }
            let Value::Array(streams) = r else { continue };
            for s in streams {
                let Value::Array(pair) = s else { continue };
                let (Some(name), Some(v)) = (pair.first().and_then(text), pair.get(1)) else {
                    continue;
                };
                let Some(key_text) = by_stream.get(&name).map(|k| (*k).clone()) else {
                    continue;
                };
                let Ok(key) = OrderingKey::with_rules(&key_text, &self.spec.key_rules) else {
                    continue;
                };
                let got = entries(v);
                if !got.is_empty() {
                    // Possibly more: read it again.
                    self.dirty.insert(key_text.clone());
                }
                for (entry, fields) in got {
                    let Some(fields) = fields else { continue };
                    out.push(Inbound {
                        message: message(&fields, Some(key.clone())),
                        lease: self.reader.lease.clone(),
                        settle: Box::new(RedisSettle {
                            t: self.t.clone(),
                            names: self.names.clone(),
                            ctl: self.names.clone(),
                            group: Arc::from(self.spec.group.as_str()),
                            mode: Mode::Unfenced,
                            key: key_text.clone(),
                            stream: name.clone(),
                            holder: String::new(),
                            consumer: self.spec.instance.clone(),
                            generation: 0,
                            scope: self.reader.lease.scope().clone(),
                            entry,
                            acked: self.acked.clone(),
                            local_attempts: AtomicU32::new(0),
                            counted: AtomicU32::new(1),
                            redelivered: false,
                        }),
                    });
                }
            }
        }
        Ok(out)
    }

    fn take_wakes(&mut self) {
        let Some((wake, _)) = &self.wake else { return };
        let (keys, all) = wake.take();
        if all {
            self.dirty.extend(self.streams.iter().cloned());
            self.dirty.insert(String::new());
        }
        for k in keys {
            if k.is_empty() || self.streams.contains(&k) {
                self.dirty.insert(k);
            } else {
                // A new partition: discovered at the next maintain, made sooner.
                self.last_maintain = None;
            }
        }
    }
}

#[async_trait]
impl TransportSource for PlainSource {
    async fn fetch(&mut self, room: &Room, wait: Duration) -> Result<Vec<Inbound>> {
        let max = room.max();
        let max = max.max(1);
        if self.wake.is_none() {
            if self.blocking.is_none() {
                let timeout = wait + self.block_timeout;
                self.blocking = Some(manager(&self.t.client, &self.t.cfg, Some(timeout)).await?);
            }
            let conn = self.blocking.as_mut().expect("set above");
            return self.reader.read(conn, max, Some(wait)).await;
        }
        for round in 0..2 {
            self.take_wakes();
            let keyless = self.dirty.remove("");
            let mut out = self.read_partitions(max).await?;
            if keyless && out.len() < max {
                let mut conn = self.t.conn.clone();
                let got = self.reader.read(&mut conn, max - out.len(), None).await?;
                if !got.is_empty() {
                    self.dirty.insert(String::new());
                }
                out.extend(got);
            }
            if !out.is_empty() || round == 1 {
                return Ok(out);
            }
            if let Some((wake, _)) = &self.wake {
                let _ = tokio::time::timeout(wait, wake.notify.notified()).await;
            }
        }
        Ok(Vec::new())
    }

    async fn maintain(&mut self) -> Result<Vec<SourceEvent>> {
        if self
            .last_maintain
            .is_none_or(|t| t.elapsed() >= self.spec.lease.heartbeat)
        {
            let sent = Instant::now();
            // A heartbeat in the group's members (no leases): the operator
            // sees the group as live and will not remove it.
            if self.wake.is_some() {
                let _: Value = scripts::RENEW
                    .key(self.names.members(&self.spec.group))
                    .key(self.names.groups())
                    .arg(&self.spec.instance)
                    .arg(self.spec.lease.ttl.as_millis() as u64)
                    .arg(&self.spec.group)
                    .arg(1)
                    .invoke_async(&mut self.t.conn.clone())
                    .await
                    .map_err(broker)?;
            }
            self.reader.reclaim().await?;
            self.discover().await?;
            self.reader.lease.confirm(sent);
            self.dirty.extend(self.streams.iter().cloned());
            self.dirty.insert(String::new());
            self.last_maintain = Some(sent);
        }
        Ok(Vec::new())
    }

    async fn release(&mut self, _scope: &str) -> Result<()> {
        Ok(())
    }

    async fn close(&mut self) -> Result<()> {
        if let Some((_, h)) = &self.wake {
            h.abort();
        }
        Ok(())
    }
}
