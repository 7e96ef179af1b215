//! Names, declaration and verification of a category's topology.
//!
//! | Name | Kind | What |
//! |---|---|---|
//! | `{c}.hash` | `x-consistent-hash` exchange, arguments `x-keyorder-queues: N`, `x-keyorder-weight: W` | the `hash` topology's entry |
//! | `{c}.hash.{i}` | queue, single active consumer, bound with weight W (`RING_WEIGHT`) | one of the N queues |
//! | `{c}.sac` | queue, single active consumer | the `sac` topology |
//! | `{c}.plain` | queue | the `plain` topology |
//! | `{c}.dlq` | queue | dead letters (published with a confirm, then the head is acknowledged) |
//! | `{c}.presence` | fanout exchange (transient) | instances announce themselves every heartbeat |

use keyorder_core::{Error, Result};
use lapin::options::{BasicConsumeOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{Channel, Connection, Consumer, ExchangeKind};

use crate::config::{QueueType, RabbitConfig, Topology};

pub(crate) fn amqp(e: lapin::Error) -> Error {
    Error::Broker(format!("rabbitmq: {e}"))
}

/// The names of one category.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Names {
    c: String,
}

impl Names {
    /// The names of `category` (1 to 200 bytes, no control characters).
    pub fn new(category: &str) -> Result<Self> {
        if category.is_empty() || category.len() > 200 || category.chars().any(char::is_control) {
            return Err(Error::Config(format!(
                "rabbitmq: category `{}` is not usable: 1 to 200 bytes without control characters",
                category.escape_debug()
            )));
        }
        Ok(Names { c: category.to_owned() })
    }
    /// The category.
    pub fn category(&self) -> &str {
        &self.c
    }
    /// The consistent-hash exchange.
    pub fn hash_exchange(&self) -> String {
        format!("{}.hash", self.c)
    }
    /// Queue `i` of the hash topology.
    pub fn hash_queue(&self, i: u16) -> String {
        format!("{}.hash.{i}", self.c)
    }
    /// The single-active-consumer queue.
    pub fn sac_queue(&self) -> String {
        format!("{}.sac", self.c)
    }
    /// The plain queue.
    pub fn plain_queue(&self) -> String {
        format!("{}.plain", self.c)
    }
    /// The dead-letter queue.
    pub fn dlq(&self) -> String {
        format!("{}.dlq", self.c)
    }
    /// The presence exchange.
    pub fn presence(&self) -> String {
        format!("{}.presence", self.c)
    }
    /// The queues a topology consumes.
    pub fn queues(&self, t: Topology) -> Vec<String> {
        match t {
            Topology::Plain => vec![self.plain_queue()],
            Topology::SingleActiveConsumer => vec![self.sac_queue()],
            Topology::ConsistentHash { queues } => (0..queues).map(|i| self.hash_queue(i)).collect(),
        }
    }
    /// Where a message of `key` is published: (exchange, routing key).
    pub fn route(&self, t: Topology, key: &str) -> (String, String) {
        match t {
            Topology::Plain => (String::new(), self.plain_queue()),
            Topology::SingleActiveConsumer => (String::new(), self.sac_queue()),
            Topology::ConsistentHash { .. } => (self.hash_exchange(), key.to_owned()),
        }
    }
}

/// Points each queue takes on the consistent-hash ring. With one point per
/// queue the ring splits keys very unevenly over few queues; more points
/// even it out. It is part of the topology (recorded on the exchange): a
/// change moves keys, so it is refused like a change of N.
pub(crate) const RING_WEIGHT: u32 = 64;

fn queue_args(qt: QueueType, sac: bool, expires: Option<u32>) -> FieldTable {
    let mut args = FieldTable::default();
    if let Some(ms) = expires {
        args.insert("x-expires".into(), AMQPValue::LongUInt(ms));
    }
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString(LongString::from(qt.name())),
    );
    if sac {
        args.insert("x-single-active-consumer".into(), AMQPValue::Boolean(true));
    }
    args
}

fn explain(e: lapin::Error, what: &str, fix: &str) -> Error {
    let text = e.to_string();
    if text.contains("PRECONDITION_FAILED") || text.contains("406") {
        Error::Config(format!("rabbitmq: {what} exists with other arguments ({text}); {fix}"))
    } else if text.contains("NOT_FOUND") || text.contains("404") {
        Error::Config(format!("rabbitmq: {what} is missing ({text}); {fix}"))
    } else {
        amqp(e)
    }
}

/// Declares (or, with `declare=false`, verifies) the category's topology.
/// Each check runs on a channel of its own: a refused declaration closes it.
pub(crate) async fn ensure(conn: &Connection, cfg: &RabbitConfig, n: &Names) -> Result<()> {
    let qt = cfg.queue_type;
    let create = "set `declare=true` or create it";
    let queue = |name: String, sac: bool| {
        let expected = if sac {
            format!("x-queue-type={}, x-single-active-consumer=true", qt.name())
        } else {
            format!("x-queue-type={}", qt.name())
        };
        (name, sac, expected)
    };
    let mut queues = match cfg.topology {
        Topology::Plain => vec![queue(n.plain_queue(), false)],
        Topology::SingleActiveConsumer => vec![queue(n.sac_queue(), true)],
        Topology::ConsistentHash { queues } => (0..queues).map(|i| queue(n.hash_queue(i), true)).collect(),
    };
    queues.push(queue(n.dlq(), false));
    if let Topology::ConsistentHash { queues: count } = cfg.topology {
        let x = n.hash_exchange();
        let mut args = FieldTable::default();
        args.insert("x-keyorder-queues".into(), AMQPValue::LongUInt(u32::from(count)));
        args.insert("x-keyorder-weight".into(), AMQPValue::LongUInt(RING_WEIGHT));
        let fix = format!(
            "the queue count is fixed for a category (keys would move): drain and delete exchange `{x}` and queues \
             `{x}.*` before changing `queues`, or keep queues={count} as declared before; the plugin \
             rabbitmq_consistent_hash_exchange must be enabled"
        );
        if !cfg.declare {
            let ch = conn.create_channel().await.map_err(amqp)?;
            ch.exchange_declare(
                x.as_str().into(),
                ExchangeKind::Custom("x-consistent-hash".into()),
                ExchangeDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(|e| explain(e, &format!("exchange `{x}`"), create))?;
        }
        let ch = conn.create_channel().await.map_err(amqp)?;
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
        .map_err(|e| explain(e, &format!("exchange `{x}`"), &fix))?;
    }
    for (name, sac, expected) in &queues {
        if !cfg.declare {
            let ch = conn.create_channel().await.map_err(amqp)?;
            ch.queue_declare(
                name.as_str().into(),
                QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(|e| explain(e, &format!("queue `{name}`"), create))?;
        }
        let ch = conn.create_channel().await.map_err(amqp)?;
        ch.queue_declare(
            name.as_str().into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            queue_args(qt, *sac, cfg.expires_ms),
        )
        .await
        .map_err(|e| {
            explain(
                e,
                &format!("queue `{name}`"),
                &format!("keyorder needs it with {expected}: delete it (after draining) or fix its arguments"),
            )
        })?;
        let _ = ch.close(200, "declared".into()).await;
    }
    if let Topology::ConsistentHash { queues: count } = cfg.topology {
        let ch = conn.create_channel().await.map_err(amqp)?;
        for i in 0..count {
            ch.queue_bind(
                n.hash_queue(i).as_str().into(),
                n.hash_exchange().as_str().into(),
                RING_WEIGHT.to_string().as_str().into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(amqp)?;
        }
        let _ = ch.close(200, "bound".into()).await;
    }
    Ok(())
}

/// A server-named, exclusive, auto-deleted queue on `ch` and a consumer of
/// it without acknowledgements (presence announcements, operator requests
/// and their answers); returns the queue's name and the consumer.
pub(crate) async fn private_queue(ch: &Channel) -> Result<(String, Consumer)> {
    let q = ch
        .queue_declare(
            "".into(),
            QueueDeclareOptions {
                exclusive: true,
                auto_delete: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .map_err(amqp)?;
    let consumer = ch
        .basic_consume(
            q.name().clone(),
            "".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .map_err(amqp)?;
    Ok((q.name().as_str().to_owned(), consumer))
}
