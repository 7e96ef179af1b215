//! `impl Admin`: the operator's verbs on the in-process broker.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;
use tokio::time::Instant;

use crate::error::{Error, Result};
use crate::transport::{Admin, DeadLetter, HaltedKey, HeadAction, HotKey, ScopeInfo, SourceEvent};

use super::broker::{Broker, Category};
use super::names::scope_name;

pub(super) struct MemoryAdmin {
    pub(super) broker: Arc<Broker>,
}

impl fmt::Debug for MemoryAdmin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryAdmin").finish()
    }
}

impl MemoryAdmin {
    pub(super) fn with_group<T>(
        &self,
        category: &str,
        group: &str,
        f: impl FnOnce(&mut Category, &str) -> Result<T>,
    ) -> Result<T> {
        let mut st = self.broker.lock();
        let Some(cat) = st.categories.get_mut(category) else {
            return Err(Error::NotFound(format!("category `{category}`")));
        };
        cat.group_mut(group)?;
        f(cat, group)
    }
}

#[async_trait]
impl Admin for MemoryAdmin {
    async fn scopes(&self, category: &str, group: &str) -> Result<Vec<ScopeInfo>> {
        self.with_group(category, group, |cat, group| {
            let g = &cat.groups[group];
            Ok(cat
                .logs
                .iter()
                .zip(&g.parts)
                .enumerate()
                .map(|(p, (log, part))| ScopeInfo {
                    scope: scope_name(category, p as u32).to_string(),
                    owner: part.owner.as_ref().map(|(o, _)| o.clone()),
                    generation: part.generation,
                    lag: log.end().saturating_sub(part.acked_upto) - part.acked.len() as u64,
                    halted: g.halted.iter().filter(|h| h.part == p as u32).count(),
                })
                .collect())
        })
    }

    async fn halted(&self, category: &str, group: &str) -> Result<Vec<HaltedKey>> {
        self.with_group(category, group, |cat, group| {
            let g = &cat.groups[group];
            Ok(g.halted
                .iter()
                .map(|h| HaltedKey {
                    label: crate::key::label(&h.key),
                    preview: crate::key::redact(&h.key),
                    scope: scope_name(category, h.part).to_string(),
                    head_id: h.id.clone(),
                    attempts: g.attempts.get(&(h.part, h.offset)).copied().unwrap_or(0),
                    reason: h.reason.clone(),
                    held: None,
                })
                .collect())
        })
    }

    async fn hot_keys(&self, category: &str, group: &str, limit: usize) -> Result<Vec<HotKey>> {
        self.with_group(category, group, |cat, group| {
            let g = &cat.groups[group];
            let mut counts: HashMap<String, u64> = HashMap::new();
            for (log, part) in cat.logs.iter().zip(&g.parts) {
                for off in part.acked_upto..log.end() {
                    if part.is_acked(off) {
                        continue;
                    }
                    if let Some(key) = log.get(off).and_then(|s| s.message.key()) {
                        *counts.entry(key.label()).or_default() += 1;
                    }
                }
            }
            Ok(HotKey::top(counts, limit))
        })
    }

    async fn dead_letters(&self, category: &str, group: &str) -> Result<Vec<DeadLetter>> {
        self.with_group(category, group, |cat, group| Ok(cat.groups[group].dead.clone()))
    }

    async fn resolve(&self, category: &str, group: &str, key: &str, action: HeadAction) -> Result<()> {
        self.with_group(category, group, |cat, group| {
            let g = cat.groups.get_mut(group).expect("checked");
            let label_of = crate::key::label;
            let Some(i) = g.halted.iter().position(|h| h.key == key || label_of(&h.key) == key) else {
                return Err(Error::NotFound(format!("no halted key {}", crate::key::redact(key))));
            };
            let h = g.halted.remove(i);
            let drop_head = match action {
                HeadAction::Skip => {
                    tracing::warn!(key = %label_of(&h.key), id = &*h.id, "operator skipped a halted head");
                    g.settle(h.part, h.offset);
                    true
                }
                HeadAction::DeadLetter => {
                    g.dead.push(DeadLetter {
                        id: h.id.clone(),
                        label: label_of(&h.key),
                        reason: format!("operator: {}", h.reason),
                    });
                    g.settle(h.part, h.offset);
                    true
                }
                HeadAction::Resume => {
                    g.attempts.remove(&(h.part, h.offset));
                    false
                }
            };
            if let Some((owner, _)) = &g.parts[h.part as usize].owner {
                if let Some(m) = g.members.get_mut(owner) {
                    m.events.push(SourceEvent::Resolved {
                        key: h.key.clone(),
                        drop_head,
                    });
                }
            }
            cat.trim();
            Ok(())
        })?;
        self.broker.notify.notify_waiters();
        Ok(())
    }

    async fn groups(&self, category: &str) -> Result<Vec<crate::GroupInfo>> {
        let st = self.broker.lock();
        let now = Instant::now();
        let mut out: Vec<crate::GroupInfo> = st
            .categories
            .get(category)
            .map(|cat| {
                cat.groups
                    .iter()
                    .map(|(name, g)| crate::GroupInfo {
                        name: name.clone(),
                        live_members: g
                            .members
                            .values()
                            .filter(|m| now.duration_since(m.last_seen) <= m.ttl)
                            .count(),
                    })
                    .collect()
            })
            .unwrap_or_default();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    async fn remove_group(&self, category: &str, group: &str) -> Result<()> {
        self.with_group(category, group, |cat, group| {
            let now = Instant::now();
            let live = cat.groups[group]
                .members
                .values()
                .filter(|m| now.duration_since(m.last_seen) <= m.ttl)
                .count();
            if live > 0 {
                return Err(Error::Config(format!(
                    "memory: consumer group `{group}` has {live} live member(s); stop them first, then remove it"
                )));
            }
            cat.groups.remove(group);
            cat.trim();
            Ok(())
        })
    }
}
