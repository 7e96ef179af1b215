//! The operator's view: partitions with owner, committed offset and lag
//! (from the group's state records and membership, so it works from any
//! process), halted heads (from the state records), hot keys (a bounded
//! scan of the unconsumed backlog), dead letters, and resolving a halted
//! head.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use keyorder_core::key::{label, redact};
use keyorder_core::{
    Admin, DeadLetter, Error, GroupInfo, HaltedKey, HeadAction, HotKey, Result, ScopeInfo, SourceEvent,
};
use rdkafka::admin::{AdminClient, AdminOptions};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Headers;
use rdkafka::{Message as _, Offset, TopicPartitionList};

use crate::broker::KafkaTransport;
use crate::config::base_config;
use crate::error::{create_err, kafka_err, layout_changed};
use crate::names::Names;
use crate::owned::Shared;
use crate::settle::dead_letter;
use crate::state;
use crate::track::decode;
use crate::wire::{key_text, partition_for, GROUP_HEADER, ID_HEADER, REASON_HEADER};

/// The most messages a hot-key or dead-letter scan reads.
const SCAN_LIMIT: usize = 100_000;

#[derive(Debug)]
pub(crate) struct KafkaAdmin {
    pub(crate) t: KafkaTransport,
}

/// One partition as the group's state record describes it.
struct Committed {
    partition: i32,
    offset: i64,
    meta: String,
}

/// Reads the member assignment a consumer-protocol member carries:
/// version, then (topic, partitions) pairs.
fn assigned(bytes: &[u8], topic: &str) -> Vec<i32> {
    fn take<'a>(b: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
        if b.len() < n {
            return None;
        }
        let (h, t) = b.split_at(n);
        *b = t;
        Some(h)
    }
    fn i16_(b: &mut &[u8]) -> Option<i16> {
        take(b, 2).map(|s| i16::from_be_bytes([s[0], s[1]]))
    }
    fn i32_(b: &mut &[u8]) -> Option<i32> {
        take(b, 4).map(|s| i32::from_be_bytes([s[0], s[1], s[2], s[3]]))
    }
    let mut out = Vec::new();
    let mut b = bytes;
    let parse = |b: &mut &[u8], out: &mut Vec<i32>| -> Option<()> {
        i16_(b)?;
        let topics = i32_(b)?;
        for _ in 0..topics.max(0) {
            let len = i16_(b)?;
            let name = take(b, len.max(0) as usize)?;
            let n = i32_(b)?;
            for _ in 0..n.max(0) {
                let p = i32_(b)?;
                if name == topic.as_bytes() {
                    out.push(p);
                }
            }
        }
        Some(())
    };
    let _ = parse(&mut b, &mut out);
    out
}

impl KafkaAdmin {
    fn consumer(&self, group: &str) -> Result<BaseConsumer> {
        let mut c = base_config(&self.t.cfg);
        c.set("group.id", group)
            .set("enable.auto.commit", "false")
            .set("enable.partition.eof", "false");
        c.create().map_err(create_err)
    }

    /// The partition count of `topic`, which must exist: an operator's
    /// command names a category, and one that does not exist is said at
    /// once (no wait for a topic that was just created, nothing created).
    async fn existing(&self, topic: &str) -> Result<i32> {
        self.t.topic_count(topic).await?.ok_or_else(|| {
            Error::NotFound(format!(
                "kafka: topic `{}` does not exist",
                keyorder_core::redact::text(topic)
            ))
        })
    }

    async fn committed(&self, names: &Names, group: &str) -> Result<(i32, Vec<Committed>)> {
        let n = self.existing(names.topic()).await?;
        let c = self.consumer(&names.group_id(group))?;
        let mut rc = base_config(&self.t.cfg);
        rc.set("group.id", "keyorder-state-reader")
            .set("enable.auto.commit", "false");
        let reader: state::Reader = rc.create().map_err(create_err)?;
        let producer = self.t.state_producer.clone();
        let (n2, g2) = (names.clone(), names.group_id(group));
        let saved = tokio::task::spawn_blocking(move || {
            let parts: Vec<i32> = (0..n).collect();
            state::read_saved(
                &c,
                &reader,
                &producer,
                &n2,
                &g2,
                &parts,
                Duration::from_secs(10),
                state::Limit::none(),
            )
        })
        .await
        .map_err(kafka_err)?
        .map_err(kafka_err)?;
        let out = saved
            .into_iter()
            .map(|s| Committed {
                partition: s.partition,
                offset: if s.known { s.committed } else { -1 },
                meta: s.meta,
            })
            .collect();
        Ok((n, out))
    }

    /// Reads `topic` partitions from the given offsets up to their high
    /// watermarks (at most `limit` messages), calling `each`.
    async fn scan(
        &self,
        topic: &str,
        from: Vec<(i32, i64, i64)>,
        limit: usize,
        each: impl FnMut(i32, i64, Option<&[u8]>, Option<&rdkafka::message::BorrowedHeaders>, &[u8]) + Send + 'static,
    ) -> Result<()> {
        let mut rc = base_config(&self.t.cfg);
        rc.set("group.id", "keyorder-admin-scan")
            .set("enable.auto.commit", "false");
        let c: state::Reader = rc.create().map_err(create_err)?;
        let topic = topic.to_owned();
        tokio::task::spawn_blocking(move || -> Result<()> {
            let mut each = each;
            let mut tpl = TopicPartitionList::new();
            let mut ends = HashMap::new();
            for (p, o, min_end) in from {
                let (low, high) = c
                    .fetch_watermarks(&topic, p, Duration::from_secs(10))
                    .map_err(kafka_err)?;
                // At least `min_end`: a broker's high watermark may lag (tansu 0.6).
                let high = high.max(min_end);
                let start = o.max(low);
                if start < high {
                    tpl.add_partition_offset(&topic, p, Offset::Offset(start))
                        .map_err(kafka_err)?;
                    ends.insert(p, high);
                }
            }
            if ends.is_empty() {
                return Ok(());
            }
            c.assign(&tpl).map_err(kafka_err)?;
            let deadline = std::time::Instant::now() + Duration::from_secs(30);
            let mut read = 0;
            while !ends.is_empty() && read < limit && std::time::Instant::now() < deadline {
                let Some(r) = c.poll(Duration::from_millis(200)) else {
                    continue;
                };
                let m = r.map_err(kafka_err)?;
                let p = m.partition();
                let Some(end) = ends.get(&p).copied() else { continue };
                if m.offset() >= end {
                    ends.remove(&p);
                    continue;
                }
                read += 1;
                each(p, m.offset(), m.key(), m.headers(), m.payload().unwrap_or_default());
                if m.offset() + 1 >= end {
                    ends.remove(&p);
                }
            }
            Ok(())
        })
        .await
        .map_err(kafka_err)?
    }

    /// The live sources of this process for (topic, group).
    fn local(&self, names: &Names, group: &str) -> Vec<Arc<Shared>> {
        self.t
            .registry
            .live::<Shared>()
            .into_iter()
            .filter(|s| s.names == *names && s.group == group)
            .collect()
    }
}

#[async_trait]
impl Admin for KafkaAdmin {
    async fn scopes(&self, category: &str, group: &str) -> Result<Vec<ScopeInfo>> {
        let names = Names::new(category)?;
        // A layout changed under the groups is what the operator must see
        // first (C23): the partitions no longer say where keys are.
        if let (Some(now), Some(layout)) = (
            self.t.topic_count(names.topic()).await?,
            self.t.topic_count(&names.state()).await?,
        ) {
            if now != layout {
                return Err(layout_changed(&names, layout, now));
            }
        }
        let (n, committed) = self.committed(&names, group).await?;
        let c = self.consumer(&names.group_id(group))?;
        let topic = names.topic().to_owned();
        let g = names.group_id(group);
        let (highs, owners) = tokio::task::spawn_blocking(move || -> Result<(Vec<i64>, HashMap<i32, String>)> {
            let mut highs = Vec::new();
            for p in 0..n {
                highs.push(
                    c.fetch_watermarks(&topic, p, Duration::from_secs(10))
                        .map_err(kafka_err)?
                        .1,
                );
            }
            let mut owners = HashMap::new();
            if let Ok(list) = c.fetch_group_list(Some(&g), Duration::from_secs(10)) {
                for grp in list.groups() {
                    for m in grp.members() {
                        let who = m.client_id().strip_prefix("keyorder-").unwrap_or(m.client_id());
                        for p in assigned(m.assignment().unwrap_or_default(), &topic) {
                            owners.insert(p, who.to_owned());
                        }
                    }
                }
            }
            Ok((highs, owners))
        })
        .await
        .map_err(kafka_err)??;
        let local: HashMap<i32, u64> = self
            .local(&names, group)
            .iter()
            .flat_map(|s| {
                s.parts
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .values()
                    .map(|p| (p.partition, p.lease.generation()))
                    .collect::<Vec<_>>()
            })
            .collect();
        Ok(committed
            .into_iter()
            .map(|c| {
                let high = highs.get(c.partition as usize).copied().unwrap_or(0);
                let r = decode(c.offset.max(0), &c.meta);
                ScopeInfo {
                    scope: names.scope(c.partition),
                    owner: owners.get(&c.partition).cloned(),
                    generation: local.get(&c.partition).copied().unwrap_or(0),
                    lag: (high - c.offset.max(0)).max(0) as u64,
                    halted: r.unfinished.values().filter(|e| e.halted.is_some()).count(),
                }
            })
            .collect())
    }

    async fn halted(&self, category: &str, group: &str) -> Result<Vec<HaltedKey>> {
        let names = Names::new(category)?;
        let (_, committed) = self.committed(&names, group).await?;
        let mut heads = Vec::new();
        for c in &committed {
            if c.offset < 0 {
                continue;
            }
            for (off, e) in decode(c.offset, &c.meta).unfinished {
                if let Some(reason) = e.halted {
                    heads.push((c.partition, off, e.attempts, reason));
                }
            }
        }
        let wanted: HashMap<(i32, i64), (u32, String)> =
            heads.iter().map(|(p, o, a, r)| ((*p, *o), (*a, r.clone()))).collect();
        let found = Arc::new(std::sync::Mutex::new(Vec::new()));
        let sink = found.clone();
        let topic = names.topic().to_owned();
        let mut firsts: HashMap<i32, (i64, i64)> = HashMap::new();
        for (p, o, _, _) in &heads {
            let e = firsts.entry(*p).or_insert((*o, *o + 1));
            *e = (e.0.min(*o), e.1.max(*o + 1));
        }
        self.scan(
            names.topic(),
            firsts.into_iter().map(|(p, (from, end))| (p, from, end)).collect(),
            SCAN_LIMIT,
            move |p, o, key, headers, _| {
                let Some((attempts, reason)) = wanted.get(&(p, o)) else {
                    return;
                };
                let key = key.map(key_text).unwrap_or_default();
                let id = headers
                    .and_then(|h| {
                        h.iter()
                            .find(|x| x.key == ID_HEADER)
                            .and_then(|x| x.value.map(|v| String::from_utf8_lossy(v).into_owned()))
                    })
                    .unwrap_or_else(|| format!("{topic}-{p}-{o}"));
                sink.lock().unwrap_or_else(|e| e.into_inner()).push(HaltedKey {
                    label: label(&key),
                    preview: redact(&key),
                    scope: format!("{topic}/{p}"),
                    head_id: id,
                    attempts: *attempts,
                    reason: reason.clone(),
                    held: None,
                });
            },
        )
        .await?;
        let out = std::mem::take(&mut *found.lock().unwrap_or_else(|e| e.into_inner()));
        Ok(out)
    }

    async fn hot_keys(&self, category: &str, group: &str, limit: usize) -> Result<Vec<HotKey>> {
        let names = Names::new(category)?;
        let (_, committed) = self.committed(&names, group).await?;
        let counts = Arc::new(std::sync::Mutex::new(HashMap::<String, u64>::new()));
        let sink = counts.clone();
        self.scan(
            names.topic(),
            committed.iter().map(|c| (c.partition, c.offset.max(0), 0)).collect(),
            SCAN_LIMIT,
            move |_, _, key, _, _| {
                if let Some(k) = key {
                    *sink
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .entry(key_text(k))
                        .or_default() += 1;
                }
            },
        )
        .await?;
        let all: Vec<(String, u64)> = counts.lock().unwrap_or_else(|e| e.into_inner()).drain().collect();
        Ok(HotKey::top(all.into_iter().map(|(k, n)| (label(&k), n)), limit))
    }

    async fn dead_letters(&self, category: &str, group: &str) -> Result<Vec<DeadLetter>> {
        let names = Names::new(category)?;
        let dlq = names.dlq();
        let n = self.existing(&dlq).await?;
        let found = Arc::new(std::sync::Mutex::new(Vec::new()));
        let sink = found.clone();
        let g = group.to_owned();
        self.scan(
            &dlq,
            (0..n).map(|p| (p, 0, 0)).collect(),
            SCAN_LIMIT,
            move |_, _, key, headers, _| {
                let get = |name: &str| {
                    headers.and_then(|h| {
                        h.iter()
                            .find(|x| x.key == name)
                            .and_then(|x| x.value.map(|v| String::from_utf8_lossy(v).into_owned()))
                    })
                };
                if get(GROUP_HEADER).as_deref() != Some(g.as_str()) {
                    return;
                }
                let key = key.map(key_text).unwrap_or_default();
                sink.lock().unwrap_or_else(|e| e.into_inner()).push(DeadLetter {
                    id: get(ID_HEADER).unwrap_or_default(),
                    label: label(&key),
                    reason: get(REASON_HEADER).unwrap_or_default(),
                });
            },
        )
        .await?;
        let out = std::mem::take(&mut *found.lock().unwrap_or_else(|e| e.into_inner()));
        Ok(out)
    }

    async fn resolve(&self, category: &str, group: &str, key: &str, action: HeadAction) -> Result<()> {
        let names = Names::new(category)?;
        if self.resolve_here(&names, group, key, action).await? {
            return Ok(());
        }
        // The owner is another process: ask it through the control topic.
        self.t.remote_resolve(&names, group, key, action).await
    }

    async fn groups(&self, category: &str) -> Result<Vec<GroupInfo>> {
        let names = Names::new(category)?;
        let suffix = format!(".{}", names.topic());
        let c = self.consumer("keyorder-admin-groups")?;
        let mut out: Vec<GroupInfo> = tokio::task::spawn_blocking(move || {
            let list = c.fetch_group_list(None, Duration::from_secs(10))?;
            Ok::<_, rdkafka::error::KafkaError>(
                list.groups()
                    .iter()
                    .filter_map(|g| {
                        let name = g.name().strip_suffix(suffix.as_str())?;
                        (!name.is_empty()).then(|| GroupInfo {
                            name: name.to_owned(),
                            live_members: g.members().len(),
                        })
                    })
                    .collect(),
            )
        })
        .await
        .map_err(kafka_err)?
        .map_err(kafka_err)?;
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    async fn remove_group(&self, category: &str, group: &str) -> Result<()> {
        let Some(found) = self.groups(category).await?.into_iter().find(|g| g.name == group) else {
            return Err(Error::NotFound(format!(
                "kafka: no consumer group `{group}` on `{category}` (see `keyorder groups list`)"
            )));
        };
        if found.live_members > 0 {
            return Err(Error::Config(format!(
                "kafka: consumer group `{group}` of `{category}` has {} live member(s); stop them first, then remove it",
                found.live_members
            )));
        }
        let names = Names::new(category)?;
        let admin: AdminClient<DefaultClientContext> = base_config(&self.t.cfg).create().map_err(create_err)?;
        let id = names.group_id(group);
        let results = admin
            .delete_groups(
                &[id.as_str()],
                &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
            )
            .await
            .map_err(kafka_err)?;
        for r in results {
            if let Err((_, code)) = r {
                return Err(Error::Broker(format!(
                    "kafka: deleting consumer group `{id}`: {code} (the broker must support DeleteGroups)"
                )));
            }
        }
        tracing::warn!(category, group, "operator removed a consumer group");
        Ok(())
    }
}

impl KafkaAdmin {
    /// Acts on `key`'s halted head if this process owns its partition
    /// (`Ok(false)`: another process does; `NotFound`: no such halted key).
    pub(crate) async fn resolve_here(&self, names: &Names, group: &str, key: &str, action: HeadAction) -> Result<bool> {
        let category = names.topic();
        let names = names.clone();
        let n = self.t.partition_count(names.topic()).await?;
        // `key` is the value or its label: find the halted head it names.
        let heads = self.halted(category, group).await?;
        let head = heads
            .iter()
            .find(|h| h.label == key || h.label == label(key))
            .ok_or_else(|| Error::NotFound(format!("no halted key {} in {category}/{group}", label(key))))?;
        let partition: i32 = head
            .scope
            .rsplit('/')
            .next()
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| partition_for(key.as_bytes(), n));
        // The owner settles it (only the owner writes its state): in this process.
        for s in self.local(&names, group) {
            let Some(part) = s.part(partition) else { continue };
            let Some(held) = part.held_head(&head.label) else {
                continue;
            };
            match action {
                HeadAction::Skip => {
                    tracing::warn!(scope = %part.lease.scope(), offset = held.offset, key = %head.label, "kafka: operator skipped a halted head");
                    part.track().done(held.offset);
                }
                HeadAction::DeadLetter => {
                    dead_letter(
                        &s,
                        partition,
                        held.offset,
                        Some(held.key.as_bytes()),
                        &held.payload,
                        held.headers.as_ref(),
                        "operator: dead-lettered a halted head",
                    )
                    .await?;
                    part.track().done(held.offset);
                }
                HeadAction::Resume => {
                    part.track().reset(held.offset);
                }
            }
            s.commit_through(&part).await?;
            part.forget_head(held.offset);
            s.events
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(SourceEvent::Resolved {
                    key: held.key.clone(),
                    drop_head: action != HeadAction::Resume,
                });
            return Ok(true);
        }
        Ok(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_a_consumer_protocol_assignment() {
        let mut b = vec![0, 1];
        b.extend(2i32.to_be_bytes());
        for (t, ps) in [("other", vec![0i32]), ("orders", vec![3, 5])] {
            b.extend((t.len() as i16).to_be_bytes());
            b.extend(t.as_bytes());
            b.extend((ps.len() as i32).to_be_bytes());
            for p in ps {
                b.extend(p.to_be_bytes());
            }
        }
        b.extend((-1i32).to_be_bytes());
        assert_eq!(assigned(&b, "orders"), vec![3, 5]);
        assert!(assigned(&b[..7], "orders").is_empty());
    }
}
