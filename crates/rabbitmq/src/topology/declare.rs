//! Declaring one thing at a time: the arguments of keyorder's queues, a
//! queue of keyorder's own, a virtual host's stream, one of a group's
//! queues, and a private queue with its consumer.

use keyorder_core::{Error, Result};
use lapin::options::{BasicConsumeOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{Channel, Connection, Consumer};

use super::inspect::queue_state;
use crate::config::{QueueType, RabbitConfig, Topology};
use crate::error::{broker, explain};

/// Points each queue takes on the consistent-hash ring. With one point per
/// queue the ring splits keys very unevenly over few queues; more points
/// even it out. It is part of the topology (recorded on the exchange): a
/// change moves keys.
pub(crate) const RING_WEIGHT: u32 = 64;

/// The delivery limit pinned on quorum queues: never reached. RabbitMQ
/// 4.x gives a quorum queue without one a limit of 20 deliveries, past
/// which it drops the message (or dead-letters it where a dead-letter
/// exchange is set): a halted head, kept unacknowledged and redelivered at
/// every hand-over, would be lost. keyorder applies its own poison policy.
/// (`-1` cannot be used: RabbitMQ 3.x reads it as a limit, and drops a
/// message at its first return.)
pub(crate) const DELIVERY_LIMIT: i32 = i32::MAX;

fn queue_args(qt: QueueType, sac: bool, expires: Option<u32>) -> FieldTable {
    queue_args_limited(qt, sac, expires, true)
}

/// `queue_args`, with or without [`DELIVERY_LIMIT`] on a quorum queue
/// (without: as an earlier version declared it).
fn queue_args_limited(qt: QueueType, sac: bool, expires: Option<u32>, limit: bool) -> FieldTable {
    let mut args = FieldTable::default();
    if limit && qt == QueueType::Quorum {
        args.insert("x-delivery-limit".into(), AMQPValue::LongInt(DELIVERY_LIMIT));
    }
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

/// Declares a classic queue of keyorder's own (registry, lock, members)
/// with `expires`; one that exists with other arguments (another process's
/// `expires_ms`) is used as it is.
pub(crate) async fn declare_aux(conn: &Connection, queue: &str, expires: Option<u32>) -> Result<()> {
    declare_own(conn, queue, QueueType::Classic, expires, "a queue of keyorder's own").await
}

/// Declares `queue` (durable, of type `qt`, with `expires`) on a channel of
/// its own; one that exists with other arguments (an earlier version's
/// `x-expires`, another process's `expires_ms`) is used as it is.
pub(super) async fn declare_own(
    conn: &Connection,
    queue: &str,
    qt: QueueType,
    expires: Option<u32>,
    what: &str,
) -> Result<()> {
    let ch = conn.create_channel().await.map_err(broker)?;
    match ch
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            queue_args(qt, false, expires),
        )
        .await
    {
        Ok(_) => {
            let _ = ch.close(200, "declared".into()).await;
            Ok(())
        }
        Err(e) if e.to_string().contains("PRECONDITION_FAILED") => match queue_state(conn, queue).await? {
            Some(_) => {
                tracing::debug!(queue, what, "rabbitmq: exists with other arguments; used as it is");
                Ok(())
            }
            None => Err(broker(e)),
        },
        Err(e) => Err(broker(e)),
    }
}

/// Declares one of the virtual host's streams (claims, attempts); one that
/// exists with other retention arguments is used as it is.
pub(super) async fn declare_stream(conn: &Connection, stream: &str, args: FieldTable) -> Result<()> {
    let ch = conn.create_channel().await.map_err(broker)?;
    let declared = ch
        .queue_declare(
            stream.into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            args,
        )
        .await;
    match declared {
        Ok(_) => {
            let _ = ch.close(200, "declared".into()).await;
            Ok(())
        }
        Err(e) if e.to_string().contains("PRECONDITION_FAILED") && queue_state(conn, stream).await?.is_some() => {
            tracing::debug!(stream, "rabbitmq: stream exists with other arguments; used as it is");
            Ok(())
        }
        Err(e) => Err(broker(e)),
    }
}

/// Declares one of the group's queues. A quorum queue an earlier version
/// declared without [`DELIVERY_LIMIT`] (RabbitMQ refuses to redeclare it
/// with other arguments) is used as it is, with a warning naming the fix.
pub(super) async fn declare_queue(conn: &Connection, cfg: &RabbitConfig, name: &str) -> Result<()> {
    let qt = cfg.queue_type;
    let sac = cfg.topology != Topology::Plain;
    let expected = if sac {
        format!("x-queue-type={}, x-single-active-consumer=true", qt.name())
    } else {
        format!("x-queue-type={}", qt.name())
    };
    let declare = |limit: bool| async move {
        let ch = conn.create_channel().await.map_err(broker)?;
        let res = ch
            .queue_declare(
                name.into(),
                QueueDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                queue_args_limited(qt, sac, cfg.expires_ms, limit),
            )
            .await;
        if res.is_ok() {
            let _ = ch.close(200, "declared".into()).await;
        }
        Ok::<_, Error>(res)
    };
    let res = match declare(true).await? {
        Err(e) if qt == QueueType::Quorum && e.to_string().contains("'x-delivery-limit'") => {
            tracing::warn!(
                queue = name,
                "rabbitmq: this quorum queue was declared by an earlier keyorder without x-delivery-limit; used as \
                 it is. On RabbitMQ 4.x such a queue drops a message after 20 deliveries (a halted head handed \
                 over 20 times would be lost). Fix: drain the queue, delete it, and let keyorder declare it again \
                 (with x-delivery-limit={DELIVERY_LIMIT})"
            );
            declare(false).await?
        }
        other => other,
    };
    res.map(|_| ()).map_err(|e| {
        explain(
            e,
            &format!("queue `{name}`"),
            &format!("keyorder needs it with {expected}: delete it (after draining) or fix its arguments"),
        )
    })
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
        .map_err(broker)?;
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
        .map_err(broker)?;
    Ok((q.name().as_str().to_owned(), consumer))
}
