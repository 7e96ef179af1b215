//! The operator's view: partitions with owner, generation, pending, lag and
//! halted state; halted heads; skip, dead-letter or resume a head; hot keys;
//! dead letters.

use std::collections::HashMap;
use std::fmt;

use async_trait::async_trait;
use keyorder_core::key::{label, redact};
use keyorder_core::{Admin, DeadLetter, Error, GroupInfo, HaltedKey, HeadAction, HotKey, Result, ScopeInfo};
use redis::Value;

use crate::conn::Conn;
use crate::error::broker;
use crate::names::Names;
use crate::scripts;
use crate::wire::{entries, text, text_pairs, texts};

pub(crate) struct RedisAdmin {
    pub(crate) t: Conn,
}

impl fmt::Debug for RedisAdmin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisAdmin").finish_non_exhaustive()
    }
}

/// One partition as the SCOPES script reports it.
struct Row {
    key: String,
    owner: Option<String>,
    generation: u64,
    pending: u64,
    lag: u64,
    halted: bool,
}

fn int(v: Option<&Value>) -> u64 {
    match v {
        Some(Value::Int(n)) => (*n).max(0) as u64,
        Some(v) => text(v).and_then(|s| s.parse().ok()).unwrap_or(0),
        None => 0,
    }
}

impl RedisAdmin {
    async fn rows(&self, category: &str, group: &str) -> Result<Vec<Row>> {
        let n = Names::new(category)?;
        let reply: Value = scripts::SCOPES
            .key(n.index())
            .key(n.halted(group))
            .arg(category)
            .arg(group)
            .invoke_async(&mut self.t.conn.clone())
            .await
            .map_err(broker)?;
        let Value::Array(items) = reply else {
            return Ok(Vec::new());
        };
        Ok(items
            .iter()
            .filter_map(|i| {
                let Value::Array(f) = i else { return None };
                // Index members are key segments.
                let key = Names::key_of(&text(f.first()?)?)?.into_owned();
                let lease = f.get(1).and_then(text).unwrap_or_default();
                let (owner, generation) = match lease.rsplit_once(':') {
                    Some((o, g)) => (Some(o.to_owned()), g.parse().unwrap_or(0)),
                    None => (None, 0),
                };
                Some(Row {
                    key,
                    owner,
                    generation,
                    pending: int(f.get(2)),
                    lag: int(f.get(3)),
                    halted: int(f.get(4)) == 1,
                })
            })
            .collect())
    }

    /// The halted heads of `group`, by key (the hash's fields are key
    /// segments, decoded here).
    async fn halted_map(&self, n: &Names, group: &str) -> Result<HashMap<String, serde_json::Value>> {
        let all: Vec<(Vec<u8>, Vec<u8>)> = redis::cmd("HGETALL")
            .arg(n.halted(group))
            .query_async(&mut self.t.conn.clone())
            .await
            .map_err(broker)?;
        let all = text_pairs(all, "halted field");
        Ok(all
            .into_iter()
            .filter_map(|(k, v)| {
                let key = Names::key_of(&k)?.into_owned();
                Some((key, serde_json::from_str(&v).unwrap_or_default()))
            })
            .collect())
    }
}

#[async_trait]
impl Admin for RedisAdmin {
    async fn scopes(&self, category: &str, group: &str) -> Result<Vec<ScopeInfo>> {
        Ok(self
            .rows(category, group)
            .await?
            .into_iter()
            .map(|r| ScopeInfo {
                scope: format!("{category}/{}", label(&r.key)),
                owner: r.owner,
                generation: r.generation,
                lag: r.pending + r.lag,
                halted: usize::from(r.halted),
            })
            .collect())
    }

    async fn halted(&self, category: &str, group: &str) -> Result<Vec<HaltedKey>> {
        let n = Names::new(category)?;
        let mut out: Vec<HaltedKey> = self
            .halted_map(&n, group)
            .await?
            .into_iter()
            .map(|(key, v)| HaltedKey {
                label: label(&key),
                preview: redact(&key),
                scope: format!("{category}/{}", label(&key)),
                head_id: v["head"].as_str().unwrap_or_default().to_owned(),
                attempts: v["attempts"].as_u64().unwrap_or(0) as u32,
                reason: v["reason"].as_str().unwrap_or_default().to_owned(),
                held: None,
            })
            .collect();
        out.sort_by(|a, b| a.label.cmp(&b.label));
        Ok(out)
    }

    async fn hot_keys(&self, category: &str, group: &str, limit: usize) -> Result<Vec<HotKey>> {
        let mut rows = self.rows(category, group).await?;
        rows.sort_by_key(|r| std::cmp::Reverse(r.pending + r.lag));
        Ok(rows
            .into_iter()
            .filter(|r| r.pending + r.lag > 0)
            .take(limit)
            .map(|r| HotKey {
                label: label(&r.key),
                backlog: r.pending + r.lag,
            })
            .collect())
    }

    async fn dead_letters(&self, category: &str, group: &str) -> Result<Vec<DeadLetter>> {
        let n = Names::new(category)?;
        let mut conn = self.t.conn.clone();
        let members: Vec<Vec<u8>> = redis::cmd("SMEMBERS")
            .arg(n.dlq_index())
            .query_async(&mut conn)
            .await
            .map_err(broker)?;
        let members = texts(members, "dead-letter index member");
        // Members are key segments, or `__keyless__` (no key's segment) for
        // the keyless stream's dead letters.
        let mut keys: Vec<Option<String>> = members
            .iter()
            .filter_map(|m| match m.as_str() {
                "__keyless__" => Some(None),
                m => Names::key_of(m).map(|k| Some(k.into_owned())),
            })
            .collect();
        keys.sort();
        let mut out = Vec::new();
        for k in keys {
            let stream = match &k {
                None => n.keyless_dlq(),
                Some(k) => n.dlq(k),
            };
            let v: Value = redis::cmd("XRANGE")
                .arg(&stream)
                .arg("-")
                .arg("+")
                .query_async(&mut conn)
                .await
                .map_err(broker)?;
            for (_, fields) in entries(&v) {
                let Some(f) = fields else { continue };
                let field = |name: &str| f.get(name).map(|b| String::from_utf8_lossy(b).into_owned());
                if field("x-group").as_deref() != Some(group) {
                    continue;
                }
                out.push(DeadLetter {
                    id: field("id").unwrap_or_default(),
                    label: k.as_deref().map_or_else(|| "keyless".into(), label),
                    reason: field("x-reason").unwrap_or_default(),
                });
            }
        }
        Ok(out)
    }

    async fn resolve(&self, category: &str, group: &str, key: &str, action: HeadAction) -> Result<()> {
        let n = Names::new(category)?;
        let halted = self.halted_map(&n, group).await?;
        let Some((found, head)) = halted.iter().find(|(k, _)| *k == key || label(k) == key) else {
            return Err(Error::NotFound(format!("no halted key {}", redact(key))));
        };
        // A correlated subscription's record names the category its head is in.
        let own = match head["category"].as_str() {
            Some(c) if c != category => Names::new(c)?,
            _ => n.clone(),
        };
        let head = head["head"].as_str().unwrap_or_default().to_owned();
        let mut conn = self.t.conn.clone();
        let mark = match action {
            HeadAction::Skip => "skip",
            HeadAction::Resume => "resume",
            HeadAction::DeadLetter => {
                let _: i64 = scripts::PARK
                    .key(n.lease(found, group))
                    .key(own.stream(found))
                    .key(own.dlq(found))
                    .key(own.dlq_index())
                    .key(n.halted(group))
                    .arg("")
                    .arg(group)
                    .arg(&head)
                    .arg(&*Names::segment(found))
                    .arg("moved to the dead-letter stream by an operator")
                    .invoke_async(&mut conn)
                    .await
                    .map_err(broker)?;
                "dlq"
            }
        };
        let _: i64 = scripts::RESOLVE
            .key(own.stream(found))
            .key(n.halted(group))
            .key(n.resolved(group))
            .arg(group)
            .arg(&head)
            .arg(&*Names::segment(found))
            .arg(mark)
            .arg(own.wake())
            .invoke_async(&mut conn)
            .await
            .map_err(broker)?;
        if action == HeadAction::Skip {
            tracing::warn!(key = %label(found), "operator skipped a halted head");
        }
        Ok(())
    }

    async fn groups(&self, category: &str) -> Result<Vec<GroupInfo>> {
        let n = Names::new(category)?;
        let reply: Value = scripts::GROUPS
            .key(n.groups())
            .arg(category)
            .invoke_async(&mut self.t.conn.clone())
            .await
            .map_err(broker)?;
        let Value::Array(items) = reply else {
            return Ok(Vec::new());
        };
        let mut out: Vec<GroupInfo> = items
            .iter()
            .filter_map(|i| {
                let Value::Array(f) = i else { return None };
                Some(GroupInfo {
                    name: text(f.first()?)?,
                    live_members: int(f.get(1)) as usize,
                })
            })
            .collect();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    /// Not kept in a form keyorder owns: the error names the keys to delete.
    async fn delete_category(&self, category: &str) -> Result<String> {
        Err(Error::Unsupported {
            transport: "redis".into(),
            capability: "delete_category",
            fix: format!(
                "delete the category's keys `{0}` and `{0}:*` with no subscription running (the pattern also \
                 matches any other category whose name starts with `{0}:`)",
                category
            ),
        })
    }

    async fn remove_group(&self, category: &str, group: &str) -> Result<()> {
        let n = Names::new(category)?;
        let done: Vec<i64> = scripts::REMOVE_GROUP
            .key(n.groups())
            .key(n.index())
            .arg(category)
            .arg(group)
            .invoke_async(&mut self.t.conn.clone())
            .await
            .map_err(broker)?;
        match done.as_slice() {
            [1] => {
                tracing::warn!(category, group, "operator removed a consumer group");
                Ok(())
            }
            [2, live] => Err(Error::Config(format!(
                "redis: consumer group `{group}` of `{category}` has {live} live member(s); stop them first, then \
                 remove it"
            ))),
            [3, held] => Err(Error::Config(format!(
                "redis: consumer group `{group}` of `{category}` still holds {held} lease(s) (a member that stopped \
                 or stalled holds them until they expire); stop every member, wait for the lease TTL, then remove it"
            ))),
            _ => Err(Error::NotFound(format!(
                "redis: no consumer group `{group}` is registered for `{category}` (see `keyorder groups list`)"
            ))),
        }
    }
}
