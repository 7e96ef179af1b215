//! A category's group registry: which groups it has and the topology each
//! was declared with, read and changed under the registry's lock; and
//! reserving a group's topology there before its queues are declared.

use std::collections::BTreeMap;
use std::time::Duration;

use keyorder_core::{Error, Result};
use lapin::options::{
    BasicConsumeOptions, BasicGetOptions, BasicNackOptions, BasicPublishOptions, ConfirmSelectOptions,
    QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection, Consumer};
use serde_json::{json, Value};

use super::declare::declare_aux;
use super::inspect::{check_queues, describe, drift, parse_topology, queue_state};
use crate::config::RabbitConfig;
use crate::error::{broker, not_found};
use crate::names::{GroupNames, Names};

/// One registry record: a group and the topology it was declared with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Record {
    pub(crate) group: String,
    pub(crate) topology: String,
}

/// The registry of one category, locked: read, changed, then released.
pub(crate) struct Registry {
    ch: Channel,
    /// The exclusive consumer on the lock queue: dropping it would cancel
    /// it (and release the lock) early.
    _lock: Consumer,
    queue: String,
    /// Every record read, by delivery tag (unacknowledged until released).
    read: Vec<(u64, Record)>,
    /// Tags to acknowledge at release (removed groups, duplicates).
    drop: Vec<u64>,
    /// Tags of messages that are no valid record (returned at release).
    skipped: Vec<u64>,
}

/// How long a registry lock is waited for. The lock is held only to read,
/// compare and record a group (a few round trips, never while a group's
/// queues are declared), so a wait this long means a holder that stalled.
const LOCK_WAIT: Duration = Duration::from_secs(120);

impl Registry {
    /// Takes the lock of `names`' registry (an exclusive consumer on its
    /// lock queue, waited for up to [`LOCK_WAIT`]) and reads every record.
    /// With `declare`, the registry and lock queues are declared first
    /// (and again when another process deleted them meanwhile:
    /// `delete_category`); without, they must exist.
    pub(crate) async fn lock(conn: &Connection, names: &Names, declare: bool) -> Result<Registry> {
        let registry = names.registry();
        let lock = names.registry_lock();
        let deadline = tokio::time::Instant::now() + LOCK_WAIT;
        let mut pause = Duration::from_millis(10);
        let mut declared = false;
        let (ch, lock_consumer) = loop {
            if declare && !declared {
                // Never `x-expires`: nothing consumes them while the groups
                // run, and a registry that expired would let drift through.
                for q in [&registry, &lock] {
                    declare_aux(conn, q, None).await?;
                }
                declared = true;
            }
            let ch = conn.create_channel().await.map_err(broker)?;
            ch.confirm_select(ConfirmSelectOptions::default())
                .await
                .map_err(broker)?;
            match ch
                .basic_consume(
                    lock.as_str().into(),
                    "lock".into(),
                    BasicConsumeOptions {
                        exclusive: true,
                        no_ack: true,
                        ..Default::default()
                    },
                    FieldTable::default(),
                )
                .await
            {
                Ok(consumer) => break (ch, consumer),
                Err(e) if not_found(&e) && declare => {
                    // Deleted by `delete_category` while this waited.
                    declared = false;
                }
                Err(e) if not_found(&e) => {
                    return Err(Error::Config(format!(
                        "rabbitmq: queue `{lock}` (the lock of the group registry `{registry}`) is missing; set \
                         `declare=true` or create it (see the table in the crate's `topology` module)"
                    )))
                }
                Err(e) => {
                    let text = e.to_string();
                    if !(text.contains("ACCESS_REFUSED") || text.contains("403")) {
                        return Err(broker(e));
                    }
                }
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(Error::broker(format!(
                    "rabbitmq: the group registry of `{}` stayed locked for {} s (another process holds an \
                     exclusive consumer on `{lock}` and stalled: it is released when that process's connection \
                     closes)",
                    names.category(),
                    LOCK_WAIT.as_secs()
                )));
            }
            // Held by another process: it releases within a few round trips.
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(200));
        };
        let mut read = Vec::new();
        let mut drop = Vec::new();
        let mut skipped = Vec::new();
        while let Some(m) = ch
            .basic_get(registry.as_str().into(), BasicGetOptions::default())
            .await
            .map_err(broker)?
        {
            let tag = m.delivery.delivery_tag;
            let v: Value = serde_json::from_slice(&m.delivery.data).unwrap_or(Value::Null);
            let field = |k: &str| v.get(k).and_then(Value::as_str).map(str::to_owned);
            let record = match (field("group"), field("topology")) {
                (Some(group), Some(topology)) if names.group(&group).is_ok() && parse_topology(&topology).is_some() => {
                    Some(Record { group, topology })
                }
                _ => None,
            };
            match record {
                Some(r) if read.iter().any(|(_, o): &(u64, Record)| o.group == r.group) => drop.push(tag),
                Some(r) => read.push((tag, r)),
                // Not a record keyorder wrote: left as it is, and skipped
                // (it names no group that could be used).
                None => skipped.push(tag),
            }
        }
        if !skipped.is_empty() {
            tracing::warn!(
                registry = %registry,
                skipped = skipped.len(),
                "rabbitmq: the group registry holds records that are not a valid group and topology; skipped"
            );
        }
        Ok(Registry {
            ch,
            _lock: lock_consumer,
            queue: registry,
            read,
            drop,
            skipped,
        })
    }

    /// The recorded groups, by name.
    pub(crate) fn records(&self) -> BTreeMap<String, String> {
        self.read
            .iter()
            .map(|(_, r)| (r.group.clone(), r.topology.clone()))
            .collect()
    }

    /// Records `group` with `topology` (a persistent message, confirmed).
    pub(crate) async fn add(&mut self, group: &str, topology: &str) -> Result<()> {
        let body = json!({"group": group, "topology": topology}).to_string();
        let confirm = self
            .ch
            .basic_publish(
                "".into(),
                self.queue.as_str().into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..Default::default()
                },
                body.as_bytes(),
                BasicProperties::default().with_delivery_mode(2),
            )
            .await
            .map_err(broker)?
            .await
            .map_err(broker)?;
        match confirm {
            lapin::Confirmation::Ack(None) => Ok(()),
            _ => Err(Error::broker(format!(
                "rabbitmq: the registry `{}` did not take the record of group `{group}`",
                self.queue
            ))),
        }
    }

    /// Forgets `group` (its record goes at release).
    pub(crate) fn remove(&mut self, group: &str) {
        let tags: Vec<u64> = self
            .read
            .iter()
            .filter(|(_, r)| r.group == group)
            .map(|(t, _)| *t)
            .collect();
        self.read.retain(|(_, r)| r.group != group);
        self.drop.extend(tags);
    }

    /// Acknowledges the dropped records, returns the others to the
    /// registry and then releases the lock. The returns are sent before a
    /// synchronous round trip to the registry queue (a passive
    /// declaration), so the next holder of the lock reads them all.
    pub(crate) async fn release(self) -> Result<()> {
        for tag in &self.drop {
            self.ch
                .basic_ack(*tag, lapin::options::BasicAckOptions::default())
                .await
                .map_err(broker)?;
        }
        for tag in self.read.iter().map(|(t, _)| t).chain(&self.skipped) {
            self.ch
                .basic_nack(
                    *tag,
                    BasicNackOptions {
                        multiple: false,
                        requeue: true,
                    },
                )
                .await
                .map_err(broker)?;
        }
        self.ch
            .queue_declare(
                self.queue.as_str().into(),
                QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(broker)?;
        let _ = self.ch.close(200, "registry released".into()).await;
        Ok(())
    }
}

impl Registry {
    /// Ends the lock of a registry that was deleted while it was held
    /// (`delete_category`): deletes the lock queue (which ends this
    /// consumer; a process waiting for the lock declares both anew).
    pub(crate) async fn delete(self, lock: &str) -> Result<()> {
        let res = self
            .ch
            .queue_delete(lock.into(), QueueDeleteOptions::default())
            .await
            .map(|_| ())
            .map_err(broker);
        let _ = self.ch.close(200, "registry deleted".into()).await;
        res
    }
}

/// Reads, compares and (when new) records group `g`'s topology under the
/// registry's lock, with the group's existing queues checked against it;
/// the lock is held for these few round trips only.
pub(super) async fn reserve(conn: &Connection, cfg: &RabbitConfig, names: &Names, g: &GroupNames) -> Result<()> {
    let declare = cfg.declare;
    if !declare && queue_state(conn, &names.registry()).await?.is_none() {
        // A manually declared topology without a registry: its queues.
        return check_queues(conn, g, cfg.topology, false).await;
    }
    let mut registry = Registry::lock(conn, names, declare).await?;
    let res = async {
        let recorded = registry.records().get(g.group()).and_then(|t| parse_topology(t));
        if let Some(had) = recorded {
            if had != cfg.topology {
                return Err(drift(g, had, cfg.topology, "was declared with topology"));
            }
        }
        check_queues(conn, g, cfg.topology, recorded.is_some()).await?;
        if recorded.is_none() && declare {
            registry.add(g.group(), &describe(cfg.topology)).await?;
        }
        Ok(())
    }
    .await;
    let released = registry.release().await;
    res.and(released)
}
