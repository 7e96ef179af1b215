//! The operator's view. Queue depth and consumer count come from the broker
//! (passive declarations); halted heads are held by the process that halted
//! them: this view lists its own and asks the other processes (see
//! [`crate::control`]), and acts on a head where it is held.

use std::fmt;

use async_trait::async_trait;
use keyorder_core::key::{label, redact};
use keyorder_core::{
    Admin, DeadLetter, Error, GroupInfo, HaltedKey, HeadAction, HotKey, Result, ScopeInfo, SourceEvent,
};
use lapin::options::BasicGetOptions;

use crate::channel::confirm_channel;
use crate::config::Topology;
use crate::conn::Conn;
use crate::error::broker;
use crate::held::{Held, ACK_WAIT, REASON_HEADER};
use crate::names::{GroupNames, Names};
use crate::topology::{self, parse_topology, queue_state, Registry};
use crate::wire::header_text;

pub(crate) struct RabbitAdmin {
    pub(crate) t: Conn,
}

impl fmt::Debug for RabbitAdmin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitAdmin").finish_non_exhaustive()
    }
}

#[async_trait]
impl Admin for RabbitAdmin {
    async fn scopes(&self, category: &str, group: &str) -> Result<Vec<ScopeInfo>> {
        let n = Names::new(category)?;
        let g = n.group(group)?;
        let topology = self.topology_of(&n, &g).await?;
        let conn = self.t.connection().await?;
        let mut out = Vec::new();
        for q in g.queues(topology) {
            let (messages, consumers) = queue_state(&conn, &q)
                .await?
                .ok_or_else(|| Error::NotFound(format!("rabbitmq: queue `{q}` does not exist")))?;
            let scope = format!("{category}/{q}");
            let halted = self
                .t
                .shared
                .halted
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .values()
                .filter(|h| h.scope == scope)
                .count();
            out.push(ScopeInfo {
                scope,
                owner: (consumers > 0).then(|| format!("{consumers} consumer(s)")),
                generation: 0,
                lag: u64::from(messages),
                halted,
            });
        }
        Ok(out)
    }

    async fn halted(&self, category: &str, group: &str) -> Result<Vec<HaltedKey>> {
        let g = Names::new(category)?.group(group)?;
        let category = g.base();
        let mut out = self.local_halted(category);
        for h in self.t.remote_halted(category).await? {
            if !out.iter().any(|o| o.label == h.label) {
                out.push(h);
            }
        }
        out.sort_by(|a, b| a.label.cmp(&b.label));
        Ok(out)
    }

    /// RabbitMQ keeps no per-key backlog and a queue cannot be browsed
    /// without taking its messages, so the hot keys are the consumers':
    /// per key, the deliveries every live process holds (delivered, not yet
    /// settled; at most the consumers' prefetch). This process counts its
    /// own and asks the others through the control exchange. The queues'
    /// undelivered depth is in `scopes`.
    async fn hot_keys(&self, category: &str, group: &str, limit: usize) -> Result<Vec<HotKey>> {
        let g = Names::new(category)?.group(group)?;
        let category = g.base();
        let mut counts: std::collections::HashMap<String, u64> = self.local_hot(category).into_iter().collect();
        for (label, n) in self.t.remote_hot(category).await? {
            *counts.entry(label).or_default() += n;
        }
        Ok(HotKey::top(counts, limit))
    }

    async fn dead_letters(&self, category: &str, group: &str) -> Result<Vec<DeadLetter>> {
        // Peek: get without acknowledging, then close the channel, which
        // returns every message to the dead-letter queue.
        let n = Names::new(category)?.group(group)?;
        if queue_state(&*self.t.connection().await?, &n.dlq()).await?.is_none() {
            return Ok(Vec::new());
        }
        let ch = self.t.connection().await?.create_channel().await.map_err(broker)?;
        let mut out = Vec::new();
        while out.len() < 1000 {
            let Some(m) = ch
                .basic_get(n.dlq().as_str().into(), BasicGetOptions::default())
                .await
                .map_err(broker)?
            else {
                break;
            };
            let props = &m.delivery.properties;
            let text = |name: &str| header_text(props, name);
            out.push(DeadLetter {
                id: props.message_id().as_ref().map(|s| s.to_string()).unwrap_or_default(),
                label: text(keyorder_core::KEY_HEADER).map_or_else(|| "keyless".into(), |k| label(&k)),
                reason: text(REASON_HEADER).unwrap_or_default(),
            });
        }
        let _ = ch.close(200, "peeked".into()).await;
        Ok(out)
    }

    async fn resolve(&self, category: &str, group: &str, key: &str, action: HeadAction) -> Result<()> {
        let g = Names::new(category)?.group(group)?;
        if self.local_resolve(g.base(), key, action).await? {
            return Ok(());
        }
        self.t.remote_resolve(g.base(), key, action).await
    }

    /// The groups the category's registry records (every group declared by
    /// a subscription, or by a publisher's `groups=`, and not removed),
    /// with the consumers of each group's members queue (one per running
    /// source). A category without a registry has none.
    async fn groups(&self, category: &str) -> Result<Vec<GroupInfo>> {
        let n = Names::new(category)?;
        let conn = self.t.connection().await?;
        if queue_state(&conn, &n.registry()).await?.is_none() {
            return Ok(Vec::new());
        }
        let registry = Registry::lock(&conn, &n, true).await?;
        let records = registry.records();
        registry.release().await?;
        let mut out = Vec::new();
        for group in records.keys() {
            let g = n.group(group)?;
            let live_members = queue_state(&conn, &g.members()).await?.map_or(0, |(_, c)| c as usize);
            out.push(GroupInfo {
                name: group.clone(),
                live_members,
            });
        }
        Ok(out)
    }

    /// Deletes the category with every group's queues and exchanges
    /// ([`topology::delete_category`](crate::topology::delete_category)):
    /// refused while a group has a live member, whose queues would go
    /// under it.
    async fn delete_category(&self, category: &str) -> Result<String> {
        let live: Vec<String> = self
            .groups(category)
            .await?
            .into_iter()
            .filter(|g| g.live_members > 0)
            .map(|g| format!("{} ({} live)", keyorder_core::redact::text(&g.name), g.live_members))
            .collect();
        if !live.is_empty() {
            return Err(Error::Config(format!(
                "rabbitmq: consumer groups of `{}` have live members: {}; stop their subscriptions first",
                keyorder_core::redact::text(category),
                live.join(", ")
            )));
        }
        let gone = crate::topology::delete_category(&self.t, category).await?;
        Ok(format!("{} queues and their exchanges", gone.len()))
    }

    /// Deletes a stopped group's queues (its backlog and dead letters with
    /// them) and exchanges, and its registry record; the category's entry
    /// exchange and the other groups stay.
    async fn remove_group(&self, category: &str, group: &str) -> Result<()> {
        let n = Names::new(category)?;
        let g = n.group(group)?;
        let conn = self.t.connection().await?;
        let unknown = || {
            Error::NotFound(format!(
                "rabbitmq: category `{category}` has no consumer group `{group}` (`groups` lists the ones it has)"
            ))
        };
        // Whether any queue of the group exists (it may have queues but no
        // record: a registry lost or deleted).
        let has_queues = || async {
            for q in [g.hash_queue(0), g.sac_queue(), g.plain_queue(), g.dlq(), g.members()] {
                if queue_state(&conn, &q).await?.is_some() {
                    return Ok::<_, Error>(true);
                }
            }
            Ok(false)
        };
        if queue_state(&conn, &n.registry()).await?.is_none() && !has_queues().await? {
            return Err(unknown());
        }
        let mut registry = Registry::lock(&conn, &n, true).await?;
        let res = async {
            let topology = match registry.records().get(group) {
                Some(recorded) => parse_topology(recorded),
                // Removed like a group of unknown topology.
                None if has_queues().await? => None,
                None => return Err(unknown()),
            };
            // Members, and any consumer of its queues (a source of a version
            // without the members queue, a tool).
            let mut live = 0;
            for q in topology::group_queues(&g, topology) {
                if let Some((_, consumers)) = queue_state(&conn, &q).await? {
                    live = live.max(consumers);
                }
            }
            if live > 0 {
                return Err(Error::Config(format!(
                    "rabbitmq: group `{group}` of category `{category}` has {live} live consumer(s): stop its \
                     subscriptions first, then remove it (its queues, backlog and dead letters are deleted)"
                )));
            }
            topology::delete_group(&conn, &g, topology).await?;
            registry.remove(group);
            Ok(())
        }
        .await;
        let released = registry.release().await;
        res.and(released)?;
        self.t.forget(g.base());
        Ok(())
    }
}

impl RabbitAdmin {
    /// The topology the registry records for group `g`; the URL's when
    /// it records none (a manually declared topology, `declare=false`).
    async fn topology_of(&self, n: &Names, g: &GroupNames) -> Result<Topology> {
        let conn = self.t.connection().await?;
        if queue_state(&conn, &n.registry()).await?.is_none() {
            return Ok(self.t.cfg.topology);
        }
        let registry = Registry::lock(&conn, n, true).await?;
        let recorded = registry.records().get(g.group()).cloned();
        registry.release().await?;
        Ok(recorded
            .as_deref()
            .and_then(parse_topology)
            .unwrap_or(self.t.cfg.topology))
    }

    /// `(label, deliveries held)` of every key this process holds
    /// deliveries of in group `category` (a group's base name).
    pub(crate) fn local_hot(&self, category: &str) -> Vec<(String, u64)> {
        let map = self.t.shared.held_keys.lock().unwrap_or_else(|e| e.into_inner());
        map.get(category)
            .map(|keys| keys.iter().map(|(k, n)| (label(k), *n)).collect())
            .unwrap_or_default()
    }

    /// The halted heads this process holds in group `category` (a group's
    /// base name).
    pub(crate) fn local_halted(&self, category: &str) -> Vec<HaltedKey> {
        let map = self.t.shared.halted.lock().unwrap_or_else(|e| e.into_inner());
        let mut out: Vec<HaltedKey> = map
            .iter()
            .filter(|((c, _), _)| c == category)
            .map(|((_, k), h)| HaltedKey {
                label: label(k),
                preview: redact(k),
                scope: h.scope.clone(),
                head_id: h.head_id.clone(),
                attempts: h.attempts,
                reason: h.reason.clone(),
                held: None,
            })
            .collect();
        out.sort_by(|a, b| a.label.cmp(&b.label));
        out
    }

    /// Acts on `key`'s halted head in group `category` (a group's base
    /// name) if this process holds it (`Ok(false)`: not held here).
    pub(crate) async fn local_resolve(&self, category: &str, key: &str, action: HeadAction) -> Result<bool> {
        let (found, held) = {
            let map = self.t.shared.halted.lock().unwrap_or_else(|e| e.into_inner());
            let Some(((_, k), h)) = map
                .iter()
                .find(|((c, k), _)| c == category && (k == key || label(k) == key))
            else {
                return Ok(false);
            };
            (k.clone(), h.settle.clone())
        };
        let drop_head = match action {
            HeadAction::Skip => {
                operator_ack(&held).await?;
                held.forget_attempts().await;
                tracing::warn!(key = %label(&found), "operator skipped a halted head");
                true
            }
            HeadAction::DeadLetter => {
                let ch = confirm_channel(&*self.t.connection().await?).await?;
                // `GroupNames::dlq` of the group whose base name this is.
                let dlq = format!("{category}.dlq");
                held.dead_letter(&ch, &dlq, "moved to the dead-letter queue by an operator")
                    .await?;
                operator_ack(&held).await?;
                held.forget_attempts().await;
                true
            }
            HeadAction::Resume => {
                // Durable before the resume returns: an owner that takes
                // the head over next counts from 1 too.
                if !held.ledger.reset(&held.subject, Some(held.ledger_wait)).await {
                    return Err(Error::broker(format!(
                        "rabbitmq: the head's attempts could not be reset (its record on `{}` was not read back \
                         within {} s); retry",
                        crate::attempts::STREAM,
                        held.ledger_wait.as_secs()
                    )));
                }
                held.reset.store(true, std::sync::atomic::Ordering::SeqCst);
                false
            }
        };
        self.t
            .shared
            .halted
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&(category.to_owned(), found.clone()));
        self.t
            .shared
            .resolved
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(category.to_owned())
            .or_default()
            .push(SourceEvent::Resolved { key: found, drop_head });
        Ok(true)
    }
}

/// An operator's acknowledgement of a halted head, bounded like every
/// other (see [`Held::ack`]).
async fn operator_ack(held: &Held) -> Result<()> {
    match held.ack().await {
        Some(Ok(true)) => Ok(()),
        Some(Ok(false)) => Err(Error::broker(
            "rabbitmq: the head is no longer held on its channel (the channel closed and the broker requeued it, \
             or it was settled already); retry once its owner holds it again (`keyorder head show`)",
        )),
        Some(Err(e)) => Err(broker(e)),
        None => Err(Error::broker(format!(
            "rabbitmq: the head's acknowledgement was not written or not confirmed within {} s (the connection \
             looks dead); retry once the owner reconnected",
            ACK_WAIT.as_secs()
        ))),
    }
}
