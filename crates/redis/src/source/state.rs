//! What an ordered source holds: the owned partitions, their streams and
//! the subscription's names, with the lookups the ownership upkeep
//! ([`own`](super::own)) and the fenced read ([`read`](super::read)) share.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use keyorder_core::{OrderingKey, ScopeLease, SourceEvent, SourceSpec};
use redis::Value;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::conn::Conn;
use crate::names::Names;
use crate::plain::GroupReader;
use crate::wake::Wake;
use crate::wire::text;

/// Streams per script call (two keys each).
pub(super) const CHUNK: usize = 64;

/// Leases released per script call.
pub(super) const RELEASE_CHUNK: usize = 512;

/// One stream of an owned partition (one per category).
pub(super) struct Stream {
    pub(super) cat: usize,
    pub(super) stream: String,
    /// The group exists and this holder claimed what earlier ones left.
    pub(super) joined: bool,
    /// `Some(after)`: re-read this holder's own pending entries after `after`
    /// (after an acquire, to apply reclaimed entries first; after a failed
    /// read, whose entries may have been delivered to us) before new ones.
    pub(super) pending_after: Option<String>,
    /// The last entry handed to the dispatcher.
    pub(super) last: String,
    /// Maybe has unread entries.
    pub(super) dirty: bool,
    pub(super) acked: Arc<AtomicBool>,
}

/// One owned partition.
pub(super) struct Part {
    pub(super) key: OrderingKey,
    pub(super) lease_key: String,
    pub(super) holder: String,
    pub(super) generation: u64,
    pub(super) lease: Arc<ScopeLease>,
    pub(super) streams: Vec<Stream>,
    pub(super) revoking: bool,
}

pub(crate) struct Source {
    pub(super) t: Conn,
    pub(super) spec: SourceSpec,
    /// Per category (the subscription's first): its names.
    pub(super) cats: Vec<Arc<Names>>,
    /// Where leases, members, generations and halted records live.
    pub(super) ctl: Arc<Names>,
    pub(super) scope_prefix: String,
    pub(super) group: Arc<str>,
    pub(super) parts: HashMap<String, Part>,
    pub(super) scopes: HashMap<Arc<str>, String>,
    pub(super) wake: Arc<Wake>,
    pub(super) listeners: Vec<JoinHandle<()>>,
    pub(super) keyless: Vec<GroupReader>,
    pub(super) keyless_dirty: bool,
    pub(super) events: Vec<SourceEvent>,
    pub(super) last_maintain: Option<Instant>,
    pub(super) last_reap: Instant,
    /// Look again soon: a wanted partition is still held elsewhere, or a
    /// wake-up named a partition or stream not known yet.
    pub(super) soon: bool,
    /// Another instance said ownership moved (see [`crate::wake::OWNERS`]):
    /// the next upkeep runs at once.
    pub(super) owners_woken: bool,
    pub(super) rotate: usize,
    pub(super) warned: bool,
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

pub(super) fn ints(v: &Value) -> Vec<i64> {
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

pub(super) fn strings(v: &Value) -> Vec<String> {
    match v {
        Value::Array(items) => items.iter().filter_map(text).collect(),
        _ => Vec::new(),
    }
}

impl Source {
    /// `(key, stream index)` of every stream `stream` selects in the owned
    /// partitions that are not being handed over and that `part` selects.
    pub(super) fn streams_where(
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

    /// Forgets a partition; `lost` when the server refused this owner (a
    /// loss), not when it was released or reaped here.
    pub(super) fn drop_part(&mut self, key: &str, lost: bool) -> Option<Part> {
        let p = self.parts.remove(key)?;
        self.scopes.remove(p.lease.scope());
        if lost {
            p.lease.lose_to_broker();
        } else {
            p.lease.lose();
        }
        Some(p)
    }
}
