//! Reading the owned partitions: wake-ups mark streams readable, and one
//! fenced script call reads a chunk of them (each read renews its lease),
//! then the keyless streams.

use std::sync::atomic::AtomicU32;
use std::sync::Arc;

use keyorder_core::raw::Room;
use keyorder_core::{Error, Inbound, Result};
use redis::Value;
use tokio::time::Instant;

use super::state::{ints, Source, CHUNK};
use crate::error::{broker, scrub};
use crate::scripts;
use crate::settle::{Mode, RedisSettle};
use crate::wire::{entries, message, text};

impl Source {
    /// Takes wake-ups: owned partitions become readable; an unknown key means
    /// a new partition (or a stream of a correlated one) to discover.
    pub(super) fn take_wakes(&mut self) {
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

    /// One fenced read over the readable owned streams, then the keyless streams.
    pub(super) async fn read(&mut self, room: &Room) -> Result<Vec<Inbound>> {
        let max = room.max();
        let mut out = Vec::new();
        let mut ready = self.streams_where(
            |p| !room.is_paused(p.lease.scope()) && !p.lease.is_lost(),
            |_, s| s.joined && (s.dirty || s.pending_after.is_some()),
        );
        ready.sort_unstable();
        if !ready.is_empty() {
            let n = ready.len();
            ready.rotate_left(self.rotate % n);
            self.rotate = self.rotate.wrapping_add(1);
            // The room is shared by the one policy (`Room::split`). When
            // there is less room than streams, some get none in the first
            // pass; what the read streams left unused (a stream marked
            // readable can turn out empty) goes to those in a second pass,
            // so a fetch does not come back empty while streams it skipped
            // hold entries. A stream still given none stays readable for the
            // next fetch, whose rotation starts elsewhere.
            let scopes: Vec<Arc<str>> = ready.iter().map(|(k, _)| self.parts[k].lease.scope().clone()).collect();
            let shares = room.split(&scopes, max, 0);
            let (first, skipped): (Vec<_>, Vec<_>) = ready.into_iter().zip(shares).partition(|(_, share)| *share > 0);
            self.read_streams(first, &mut out).await?;
            let left = max.saturating_sub(out.len());
            // (The first pass may have dropped a fenced partition.)
            let skipped: Vec<((String, usize), Arc<str>)> = skipped
                .into_iter()
                .filter_map(|(s, _)| Some((s.clone(), self.parts.get(&s.0)?.lease.scope().clone())))
                .collect();
            if left > 0 && !skipped.is_empty() {
                let scopes: Vec<&Arc<str>> = skipped.iter().map(|(_, scope)| scope).collect();
                let shares = room.split(&scopes, left, 0);
                let second = skipped.iter().map(|(s, _)| s.clone()).zip(shares).collect();
                self.read_streams(second, &mut out).await?;
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

    /// Reads `streams` (each with its count; those given none are left
    /// out) in chunks of one script call each. A failed call ends the read
    /// with what was read, unless nothing was.
    async fn read_streams(&mut self, streams: Vec<((String, usize), usize)>, out: &mut Vec<Inbound>) -> Result<()> {
        let streams: Vec<(String, usize, usize)> = streams
            .into_iter()
            .filter(|(_, share)| *share > 0)
            .map(|((k, i), share)| (k, i, share.min(1000)))
            .collect();
        for chunk in streams.chunks(CHUNK) {
            match self.read_chunk(chunk, out).await {
                Ok(()) => {}
                Err(e) if !out.is_empty() => {
                    tracing::warn!(error = %e, "redis: read failed; delivering what was read");
                    break;
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    async fn read_chunk(&mut self, chunk: &[(String, usize, usize)], out: &mut Vec<Inbound>) -> Result<()> {
        let sent = Instant::now();
        let mut inv = scripts::READ.prepare_invoke();
        inv.arg(&*self.group)
            .arg(&self.spec.instance)
            .arg(self.spec.lease.ttl.as_millis() as u64);
        for (k, i, share) in chunk {
            let p = &self.parts[k];
            let s = &p.streams[*i];
            inv.key(&p.lease_key).key(&s.stream);
            inv.arg(p.generation)
                .arg(s.pending_after.as_deref().unwrap_or(">"))
                .arg(*share);
        }
        let reply = match inv.invoke_async::<Value>(&mut self.t.conn.clone()).await {
            Ok(v) => v,
            Err(e) => {
                // The read may have run: its entries would now be pending at
                // this holder. Re-read them before anything new.
                for (k, i, _) in chunk {
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
            return Err(Error::broker("redis: unexpected read reply"));
        };
        for ((k, i, share), r) in chunk.iter().zip(results) {
            if matches!(r, Value::Int(0)) {
                if let Some(p) = self.drop_part(k, true) {
                    metrics::counter!("keyorder_redis_fence_rejections_total").increment(1);
                    tracing::warn!(scope = %p.lease.scope(), generation = p.generation, "redis: fenced read rejected");
                }
                continue;
            }
            let (got, attempts) = match &r {
                Value::Array(two) if two.len() == 2 && text(&two[0]).as_deref() == Some("error") => {
                    // This stream's read failed; the others of the call went on.
                    let why = two.get(1).and_then(text).unwrap_or_default();
                    if let Some(p) = self.parts.get_mut(k) {
                        p.streams[*i].dirty = true;
                        tracing::warn!(
                            scope = %p.lease.scope(),
                            error = %scrub(&why),
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
            } else if count < *share {
                s.dirty = false;
            }
        }
        Ok(())
    }
}
