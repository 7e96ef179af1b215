//! A category's and a group's topology as a whole: declared (or, with
//! `declare=false`, verified) behind the category's entry exchange, and
//! deleted.

use keyorder_core::{Error, Result};
use lapin::options::{
    ExchangeBindOptions, ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection, ExchangeKind};

use super::declare::{declare_aux, declare_own, declare_queue, declare_stream, RING_WEIGHT};
use super::inspect::{exchange_exists, legacy_queues, queue_state};
use super::registry::reserve;
use crate::config::{RabbitConfig, Topology};
use crate::error::{broker, explain};
use crate::names::{GroupNames, Names};

/// Refuses a category that still has queues of the layout before consumer
/// groups (their messages would never reach the groups' queues), then
/// declares (or with `declare=false` verifies) its entry exchange.
pub(crate) async fn ensure_category(conn: &Connection, cfg: &RabbitConfig, names: &Names) -> Result<()> {
    let old = legacy_queues(conn, names).await?;
    if !old.is_empty() {
        return Err(Error::Config(format!(
            "rabbitmq: category `{c}` has queues of the layout before consumer groups ({list}); this version \
             gives every consumer group queues of its own (`{c}:<group>.*`) behind the exchange `{c}:entry`, and \
             would leave those queues' messages behind. Drain them with the previous keyorder version (run its \
             subscriptions until the queues are empty), then delete them with `keyorder delete-queue --url <url> \
             --category {c} --yes`, and start this version",
            c = names.category(),
            list = old.iter().map(|q| format!("`{q}`")).collect::<Vec<_>>().join(", ")
        )));
    }
    let entry = names.entry();
    let ch = conn.create_channel().await.map_err(broker)?;
    ch.exchange_declare(
        entry.as_str().into(),
        ExchangeKind::Fanout,
        ExchangeDeclareOptions {
            passive: !cfg.declare,
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .map_err(|e| {
        explain(
            e,
            &format!("exchange `{entry}`"),
            "keyorder needs it as a durable fanout exchange: set `declare=true` or create it",
        )
    })?;
    let _ = ch.close(200, "declared".into()).await;
    Ok(())
}

/// Declares (or, with `declare=false`, verifies) the topology of one
/// group behind its category's entry exchange, and records the group in
/// the registry. A group recorded with another topology, or whose queues
/// say it has another one, is refused. The registry's lock is held only
/// to read and record; the queues are declared after (declarations are
/// idempotent: two processes declaring one group declare the same).
pub(crate) async fn ensure_group(conn: &Connection, cfg: &RabbitConfig, names: &Names, g: &GroupNames) -> Result<()> {
    reserve(conn, cfg, names, g).await?;
    if cfg.declare {
        declare_group(conn, cfg, names, g).await
    } else {
        verify_group(conn, cfg, names, g).await
    }
}

async fn declare_group(conn: &Connection, cfg: &RabbitConfig, names: &Names, g: &GroupNames) -> Result<()> {
    let qt = cfg.queue_type;
    // Dead letters never expire (nothing consumes them while the group
    // runs). One declared by an earlier version with `x-expires` is used
    // as it is.
    declare_own(conn, &g.dlq(), qt, None, "the group's dead-letter queue").await?;
    declare_aux(conn, &g.members(), cfg.expires_ms).await?;
    declare_stream(conn, crate::claims::STREAM, crate::claims::stream_args()).await?;
    declare_stream(conn, crate::attempts::STREAM, crate::attempts::stream_args()).await?;
    for name in g.queues(cfg.topology) {
        declare_queue(conn, cfg, &name).await?;
    }
    let ch = conn.create_channel().await.map_err(broker)?;
    let res = declare_on(&ch, cfg, names, g).await;
    let _ = ch.close(200, "declared".into()).await;
    res
}

/// The group's exchange and bindings, on one channel.
async fn declare_on(ch: &Channel, cfg: &RabbitConfig, names: &Names, g: &GroupNames) -> Result<()> {
    let entry = names.entry();
    // Again here: another process may have deleted the category since
    // this one declared it (`delete_category`).
    ch.exchange_declare(
        entry.as_str().into(),
        ExchangeKind::Fanout,
        ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .map_err(|e| {
        explain(
            e,
            &format!("exchange `{entry}`"),
            "keyorder needs it as a durable fanout exchange",
        )
    })?;
    // The queues were declared before (`declare_queue`), each on a channel
    // of its own.
    match cfg.topology {
        Topology::ConsistentHash { queues: count } => {
            let x = g.hash_exchange();
            let mut args = FieldTable::default();
            args.insert("x-keyorder-queues".into(), AMQPValue::LongUInt(u32::from(count)));
            args.insert("x-keyorder-weight".into(), AMQPValue::LongUInt(RING_WEIGHT));
            ch.exchange_declare(
                x.as_str().into(),
                ExchangeKind::Custom("x-consistent-hash".into()),
                ExchangeDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                args,
            )
            .await
            .map_err(|e| {
                explain(
                    e,
                    &format!("exchange `{x}`"),
                    "the plugin rabbitmq_consistent_hash_exchange must be enabled",
                )
            })?;
            // Every queue is on the ring before the ring gets messages.
            for i in 0..count {
                ch.queue_bind(
                    g.hash_queue(i).as_str().into(),
                    x.as_str().into(),
                    RING_WEIGHT.to_string().as_str().into(),
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await
                .map_err(broker)?;
            }
            ch.exchange_bind(
                x.as_str().into(),
                entry.as_str().into(),
                "".into(),
                ExchangeBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(broker)?;
        }
        Topology::SingleActiveConsumer | Topology::Plain => {
            let q = &g.queues(cfg.topology)[0];
            ch.queue_bind(
                q.as_str().into(),
                entry.as_str().into(),
                "".into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(broker)?;
        }
    }
    Ok(())
}

/// `declare=false`: every name of the group must exist (passive checks);
/// the topology was compared with the registry's record and the group's
/// queues before ([`reserve`](super::registry::reserve)).
async fn verify_group(conn: &Connection, cfg: &RabbitConfig, names: &Names, g: &GroupNames) -> Result<()> {
    let create = "set `declare=true` or create it (see the table in the crate's `topology` module)";
    if !exchange_exists(conn, &names.entry(), ExchangeKind::Fanout).await? {
        return Err(Error::Config(format!(
            "rabbitmq: exchange `{}` is missing; {create}",
            names.entry()
        )));
    }
    if let Topology::ConsistentHash { .. } = cfg.topology {
        let x = g.hash_exchange();
        if !exchange_exists(conn, &x, ExchangeKind::Custom("x-consistent-hash".into())).await? {
            return Err(Error::Config(format!("rabbitmq: exchange `{x}` is missing; {create}")));
        }
    }
    for q in g.queues(cfg.topology).into_iter().chain([
        g.dlq(),
        g.members(),
        crate::claims::STREAM.to_owned(),
        crate::attempts::STREAM.to_owned(),
    ]) {
        if queue_state(conn, &q).await?.is_none() {
            return Err(Error::Config(format!("rabbitmq: queue `{q}` is missing; {create}")));
        }
    }
    Ok(())
}

/// The queues that `topology` (a registry record) names for group `g`,
/// with its dead-letter and members queues.
pub(crate) fn group_queues(g: &GroupNames, topology: Option<Topology>) -> Vec<String> {
    let mut qs = match topology {
        Some(t) => g.queues(t),
        // Unknown: every kind but the hash queues (whose count is unknown).
        None => vec![g.sac_queue(), g.plain_queue()],
    };
    qs.push(g.dlq());
    qs.push(g.members());
    qs
}

/// Deletes group `g`'s queues and exchanges (what `topology` names; the
/// hash queues are also probed beyond a recorded count). Returns the names
/// deleted.
pub(crate) async fn delete_group(conn: &Connection, g: &GroupNames, topology: Option<Topology>) -> Result<Vec<String>> {
    let mut gone = Vec::new();
    let mut queues = group_queues(g, topology);
    // Hash queues beyond the recorded count, or all of them when unknown.
    let from = match topology {
        Some(Topology::ConsistentHash { queues }) => queues,
        _ => 0,
    };
    for i in from..1024 {
        if queue_state(conn, &g.hash_queue(i)).await?.is_none() {
            break;
        }
        queues.push(g.hash_queue(i));
    }
    let ch = conn.create_channel().await.map_err(broker)?;
    for x in [g.hash_exchange(), g.presence()] {
        ch.exchange_delete(x.as_str().into(), ExchangeDeleteOptions::default())
            .await
            .map_err(broker)?;
    }
    for q in queues {
        ch.queue_delete(q.as_str().into(), QueueDeleteOptions::default())
            .await
            .map_err(broker)?;
        gone.push(q);
    }
    let _ = ch.close(200, "deleted".into()).await;
    Ok(gone)
}
