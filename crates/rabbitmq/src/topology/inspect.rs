//! Looking without changing: passive checks of queues and exchanges, the
//! topology a registry record names, and the drift checks that refuse a
//! group asked for with another topology than it has.

use keyorder_core::{Error, Result};
use lapin::options::{ExchangeDeclareOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{Channel, Connection, ExchangeKind};

use crate::config::Topology;
use crate::error::{broker, not_found};
use crate::names::{GroupNames, Names};

/// A topology as the registry records it: `plain`, `sac` or `hash:N`.
pub(crate) fn describe(t: Topology) -> String {
    match t {
        Topology::Plain => "plain".into(),
        Topology::SingleActiveConsumer => "sac".into(),
        Topology::ConsistentHash { queues } => format!("hash:{queues}"),
    }
}

/// The topology a registry record names.
pub(crate) fn parse_topology(s: &str) -> Option<Topology> {
    match s {
        "plain" => Some(Topology::Plain),
        "sac" => Some(Topology::SingleActiveConsumer),
        _ => s
            .strip_prefix("hash:")
            .and_then(|n| n.parse().ok())
            .filter(|n| (1..=1024).contains(n))
            .map(|queues| Topology::ConsistentHash { queues }),
    }
}

/// The URL options that declare `t`.
pub(super) fn url_options(t: Topology) -> String {
    match t {
        Topology::Plain => "topology=plain".into(),
        Topology::SingleActiveConsumer => "topology=sac".into(),
        Topology::ConsistentHash { queues } => format!("topology=hash&queues={queues}"),
    }
}

/// A passive declaration of `queue` on a channel of its own (a refused one
/// closes its channel): `(messages ready, consumers)`, `None` when the queue
/// does not exist.
pub(crate) async fn queue_state(conn: &Connection, queue: &str) -> Result<Option<(u32, u32)>> {
    let ch = conn.create_channel().await.map_err(broker)?;
    let passive = QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    match ch.queue_declare(queue.into(), passive, FieldTable::default()).await {
        Ok(q) => {
            let _ = ch.close(200, "checked".into()).await;
            Ok(Some((q.message_count(), q.consumer_count())))
        }
        Err(e) if not_found(&e) => Ok(None),
        Err(e) => Err(broker(e)),
    }
}

pub(crate) async fn exchange_exists(conn: &Connection, exchange: &str, kind: ExchangeKind) -> Result<bool> {
    let ch = conn.create_channel().await.map_err(broker)?;
    let passive = ExchangeDeclareOptions {
        passive: true,
        ..Default::default()
    };
    match ch
        .exchange_declare(exchange.into(), kind, passive, FieldTable::default())
        .await
    {
        Ok(()) => {
            let _ = ch.close(200, "checked".into()).await;
            Ok(true)
        }
        Err(e) if not_found(&e) => Ok(false),
        Err(e) => Err(broker(e)),
    }
}

/// The queues of the layout before consumer groups that `names`' category
/// still has.
pub(crate) async fn legacy_queues(conn: &Connection, names: &Names) -> Result<Vec<String>> {
    let mut found = Vec::new();
    for q in names.legacy_queues() {
        if queue_state(conn, &q).await?.is_some() {
            found.push(q);
        }
    }
    Ok(found)
}

/// Passive checks of queues on one channel (a refused check closes its
/// channel: the next check opens another).
struct Probe<'a> {
    conn: &'a Connection,
    ch: Option<Channel>,
}

impl<'a> Probe<'a> {
    fn new(conn: &'a Connection) -> Self {
        Probe { conn, ch: None }
    }

    async fn queue(&mut self, queue: &str) -> Result<bool> {
        let ch = match &self.ch {
            Some(ch) if ch.status().connected() => ch.clone(),
            _ => {
                let ch = self.conn.create_channel().await.map_err(broker)?;
                self.ch = Some(ch.clone());
                ch
            }
        };
        let passive = QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        match ch.queue_declare(queue.into(), passive, FieldTable::default()).await {
            Ok(_) => Ok(true),
            Err(e) if not_found(&e) => {
                self.ch = None;
                Ok(false)
            }
            Err(e) => Err(broker(e)),
        }
    }

    /// How many hash queues `g` has, counted from `from` (which exists).
    async fn hash_count(&mut self, g: &GroupNames, from: u16) -> Result<u16> {
        let mut n = from;
        while n < 1024 && self.queue(&g.hash_queue(n)).await? {
            n += 1;
        }
        Ok(n)
    }

    async fn close(self) {
        if let Some(ch) = self.ch {
            let _ = ch.close(200, "checked".into()).await;
        }
    }
}

/// The refusal of `wanted` for group `g`, declared with `had`.
pub(super) fn drift(g: &GroupNames, had: Topology, wanted: Topology, how: &str) -> Error {
    Error::Config(format!(
        "rabbitmq: group `{}` of category `{}` {how} {} and is now asked for {}: a group's topology and queue \
         count are fixed (keys would move, or queues would fill that no consumer reads). Keep `{}` in the URLs \
         of this group's subscriptions and of publishers that name it in `groups=`, or stop the group, drain it \
         and remove it (`Admin::remove_group`, `keyorder groups remove`) before declaring it anew",
        g.group(),
        g.category(),
        describe(had),
        describe(wanted),
        url_options(had)
    ))
}

/// Checks the queues group `g` already has against `wanted`: a hash queue
/// beyond its count, or a queue of another kind, is refused; without a
/// registry `record` (a registry lost or deleted, or that expired under an
/// earlier version), so is a ring with fewer queues. The record alone does
/// not suffice: RabbitMQ does not compare a custom exchange's arguments,
/// and a queue declared beside the record would take keys.
pub(super) async fn check_queues(conn: &Connection, g: &GroupNames, wanted: Topology, recorded: bool) -> Result<()> {
    let mut p = Probe::new(conn);
    let res = async {
        let had = "has queues of topology";
        match wanted {
            Topology::ConsistentHash { queues } => {
                if queues < 1024 && p.queue(&g.hash_queue(queues)).await? {
                    let m = p.hash_count(g, queues + 1).await?;
                    return Err(drift(g, Topology::ConsistentHash { queues: m }, wanted, had));
                }
                if !recorded && p.queue(&g.hash_queue(0)).await? && !p.queue(&g.hash_queue(queues - 1)).await? {
                    let m = p.hash_count(g, 1).await?;
                    return Err(drift(g, Topology::ConsistentHash { queues: m }, wanted, had));
                }
            }
            Topology::SingleActiveConsumer | Topology::Plain => {
                if p.queue(&g.hash_queue(0)).await? {
                    let m = p.hash_count(g, 1).await?;
                    return Err(drift(g, Topology::ConsistentHash { queues: m }, wanted, had));
                }
            }
        }
        for other in [Topology::SingleActiveConsumer, Topology::Plain] {
            if other != wanted && p.queue(&g.queues(other)[0]).await? {
                return Err(drift(g, other, wanted, had));
            }
        }
        Ok(())
    }
    .await;
    p.close().await;
    res
}
