//! Consuming the owned queues: a consumer per queue on a channel of its
//! own, its token taken when the broker activates it, and its deliveries
//! turned into the dispatcher's [`Inbound`]s (held while their scope is
//! paused).

use std::sync::atomic::{AtomicBool, AtomicU32};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use keyorder_core::raw::Room;
use keyorder_core::{Inbound, Message, OrderingKey, Result, ScopeLease, KEY_HEADER};
use lapin::message::Delivery;
use lapin::options::{BasicConsumeOptions, BasicQosOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::Channel;
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::state::{Arrival, Owned, Slot, Source, CLOSE_WAIT};
use crate::attempts;
use crate::claims::Claims;
use crate::config::QueueType;
use crate::error::broker;
use crate::held::{AckBarrier, Held};
use crate::settle::RabbitSettle;
use crate::wire::{header_int, header_text, is_delivery_header, keyless_routing_key, short, EPOCH_HEADER};

/// One consumer's task: its token at its activation, then its deliveries.
struct Activation {
    consumer_id: u64,
    queue: String,
    scope: Arc<str>,
    lease_cfg: keyorder_core::LeaseConfig,
    claims: Arc<Claims>,
    channel: Channel,
    slot: Slot,
    ended: Arc<AtomicBool>,
    tx: mpsc::UnboundedSender<Arrival>,
    consumer: lapin::Consumer,
}

/// Forwards a consumer's deliveries, each with the consumer's lease. The
/// first delivery is the broker's activation of this consumer: the claim
/// is published on the consumer's channel and read back first (later
/// deliveries wait in the consumer meanwhile). When the consumer's stream
/// ends or fails (its channel or connection closed, the consumer was
/// cancelled) the lease is lost at once: the self-fence discards whatever
/// of it is buffered before any of it starts.
async fn activation(mut a: Activation) {
    let mut lease: Option<Arc<ScopeLease>> = None;
    loop {
        let d = match a.consumer.next().await {
            Some(Ok(d)) => d,
            Some(Err(e)) => {
                // The broker's reason (a consumer timeout, a node shutting
                // down, a channel error): lapin logs it under
                // `lapin::channel`, which applications filter out for the
                // channels this adapter closes on purpose. No key in it:
                // the queue's name holds the category and group only.
                tracing::warn!(scope = %a.scope, error = %e, "rabbitmq: the broker ended the consumer");
                break;
            }
            None => break,
        };
        let l = match &lease {
            Some(l) => l.clone(),
            None => {
                let sent = Instant::now();
                let Some(offset) = a.claims.claim(Some(&a.channel), a.lease_cfg.ttl).await else {
                    tracing::warn!(scope = %a.scope, ttl_s = a.lease_cfg.ttl.as_secs(), "rabbitmq: activation claim not read back in time; giving the queue back");
                    let _ = tokio::time::timeout(CLOSE_WAIT, a.channel.close(200, "no claim".into())).await;
                    break;
                };
                // Offsets start at 0; a token is at least 1.
                let l = ScopeLease::new(a.scope.clone(), offset + 1, &a.lease_cfg, sent);
                *a.slot.lock().unwrap_or_else(|e| e.into_inner()) = Some(l.clone());
                tracing::debug!(scope = %a.scope, generation = offset + 1, "rabbitmq: activated");
                lease = Some(l.clone());
                l
            }
        };
        if a.tx.send((a.queue.clone(), a.consumer_id, l, d)).is_err() {
            // The source is gone: the channel is closed before this task
            // drops its consumer (a `basic.cancel` first would let the next
            // single active consumer start while the channel still held
            // unacknowledged deliveries).
            if let Some(l) = a.slot.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
                l.lose();
            }
            let _ = tokio::time::timeout(CLOSE_WAIT, a.channel.close(200, "subscription dropped".into())).await;
            break;
        }
    }
    a.ended.store(true, std::sync::atomic::Ordering::SeqCst);
    // The broker ended the consumer (a release here marked the lease lost
    // before closing its channel: counted as a loss only when it was not).
    if let Some(l) = a.slot.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
        l.lose_to_broker();
    }
}

impl Source {
    pub(super) async fn consume(&mut self, queue: &str) -> Result<()> {
        let Some(link) = &self.link else { return Ok(()) };
        let ch = link.conn.create_channel().await.map_err(broker)?;
        ch.basic_qos(self.t.cfg.prefetch, BasicQosOptions::default())
            .await
            .map_err(broker)?;
        // The fencing token is not known yet: it is taken when the broker
        // activates this consumer (the `claims` module).
        self.consumers += 1;
        let id = self.consumers;
        let tag = short(
            "instance id",
            &format!("{}-{}-{id}", self.spec.instance, uuid::Uuid::new_v4().simple()),
        )?;
        let mut args = FieldTable::default();
        if let Some(ms) = self.timeout_arg {
            // A halted head stays unacknowledged: no redelivery while halted.
            args.insert("x-consumer-timeout".into(), AMQPValue::LongLongInt(ms));
        }
        let consumer = ch
            .basic_consume(queue.into(), tag, BasicConsumeOptions::default(), args)
            .await
            .map_err(|e| self.gone(queue, e))?;
        let scope: Arc<str> = Arc::from(format!("{}/{queue}", self.names.category()));
        let slot: Slot = Arc::default();
        let ended = Arc::new(AtomicBool::new(false));
        let task = tokio::spawn(activation(Activation {
            consumer_id: id,
            queue: queue.to_owned(),
            scope: scope.clone(),
            lease_cfg: self.spec.lease,
            claims: link.claims.clone(),
            channel: ch.clone(),
            slot: slot.clone(),
            ended: ended.clone(),
            tx: self.tx.clone(),
            consumer,
        }));
        tracing::debug!(scope = %scope, "rabbitmq: consuming");
        self.scopes.insert(scope.clone(), queue.to_owned());
        self.owned.insert(
            queue.to_owned(),
            Owned {
                barrier: AckBarrier::new(ch.clone()),
                channel: ch,
                consumer: id,
                scope,
                lease: slot,
                ended,
                revoking: false,
                fenced_since: None,
                task,
            },
        );
        Ok(())
    }

    pub(super) fn inbound(&self, queue: &str, consumer: u64, lease: Arc<ScopeLease>, d: Delivery) -> Option<Inbound> {
        let o = self.owned.get(queue).filter(|o| o.consumer == consumer)?;
        let link = self.link.as_ref()?;
        let generation = lease.generation();
        let mut props = d.properties.clone();
        // One buffer for the message and the copy kept for a dead letter.
        let payload = keyorder_core::Bytes::from(d.data);
        let mut msg = Message::new(payload.clone());
        if let Some(id) = props.message_id() {
            msg = msg.with_id(id.as_str());
        }
        if let Some(c) = props.correlation_id() {
            msg = msg.with_correlation_id(c.as_str());
        }
        if let Some(h) = props.headers() {
            for k in h.inner().keys() {
                // `x-` headers too (a key source may name one), but not
                // what the broker or keyorder itself set on a delivery or
                // a dead letter: re-published with the message, they would
                // tell a false history.
                if k.as_str() == EPOCH_HEADER || is_delivery_header(k.as_str()) {
                    continue;
                }
                if let Some(v) = header_text(&props, k.as_str()) {
                    msg = msg.with_header(k.as_str(), v);
                }
            }
        }
        // The key is what the message was placed by: its routing key (what
        // the ring hashed) unless that is keyorder's routing of a keyless
        // message (a hash of its id, or, before, the id itself) or empty;
        // else keyorder's `keyorder-key` header. A header that differs from
        // the routing key is kept as it came: the key source selects it and
        // the subscription parks the message as routed by another key.
        // A routing key that is the delivering queue's own name was a
        // publish straight to the queue (the default exchange: an
        // operator's move, a shovel), not a placement by the ring.
        let rk = d.routing_key.as_str();
        let id = props.message_id().as_ref().map(|s| s.as_str().to_owned());
        let not_routed = rk.is_empty()
            || rk == queue
            || id
                .as_deref()
                .is_some_and(|id| rk == id || rk == keyless_routing_key(id));
        let header_key = header_text(&props, KEY_HEADER);
        let routed_by = (!not_routed).then(|| rk.to_owned());
        let stamp = header_key.is_none() && routed_by.is_some();
        let key_text = routed_by.clone().or(header_key);
        let key = match key_text
            .as_deref()
            .map(|k| OrderingKey::with_rules(k, &self.spec.key_rules))
        {
            Some(Ok(k)) => Some(k),
            Some(Err(e)) => {
                // Not a key keyorder can carry: run under the keyless
                // policy, counted, and said once per queue.
                metrics::counter!("keyorder_rabbitmq_invalid_routing_keys_total").increment(1);
                let first = self
                    .warned_invalid
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(queue.to_owned());
                if first {
                    tracing::warn!(queue, error = %e, "rabbitmq: a message's routing key is not a valid ordering key; such messages run under the keyless policy (unordered) and are counted in keyorder_rabbitmq_invalid_routing_keys_total: route by keys that meet the key rules (see Keys in the README)");
                }
                None
            }
            None => None,
        };
        if let Some(k) = &key {
            msg = msg.with_ordering_key(k.clone());
            if stamp {
                // Routed by the routing key alone: what
                // `KeySource::routing_key()` selects, and what a dead
                // letter of it keeps.
                msg = msg.with_header(KEY_HEADER, k.as_str());
                let mut h = props.headers().clone().unwrap_or_default();
                h.insert(
                    KEY_HEADER.into(),
                    AMQPValue::LongString(k.as_str().as_bytes().to_vec().into()),
                );
                props = props.with_headers(h);
            }
        }
        // Attempts are counted on the attempts stream, not from the
        // delivery: a quorum queue's `x-delivery-count` also counts
        // prefetched messages a dead consumer never started, a classic
        // queue only flags a redelivery (the `attempts` module).
        // `x-delivery-count` only from a quorum queue, which sets it: on a
        // classic queue the header can only be the publisher's (issue 37).
        let quorum = self.t.cfg.queue_type == QueueType::Quorum;
        let redelivered = d.redelivered || (quorum && header_int(&props, "x-delivery-count").is_some_and(|n| n > 0));
        let subject = attempts::subject(
            self.names.base(),
            props.message_id().as_ref().map(|s| s.as_str()),
            key_text.as_deref(),
            &payload,
        );
        let message_id = msg.id().to_owned();
        let key = key.map(|k| k.as_str().to_owned());
        if let Some(k) = &key {
            // Counted until the settle handle goes (`RabbitSettle::drop`).
            self.t.shared.hold(self.names.base(), k);
        }
        Some(Inbound {
            message: msg,
            lease: lease.clone(),
            settle: Box::new(RabbitSettle {
                t: self.t.clone(),
                dlq_channel: link.dlq_channel.clone(),
                group: self.names.base().to_owned(),
                dlq: self.names.dlq(),
                key,
                scope: o.scope.clone(),
                generation,
                message_id,
                redelivered,
                attempts: AtomicU32::new(0),
                pending: std::sync::Mutex::new(None),
                counted: AtomicU32::new(0),
                held: Arc::new(Held {
                    acker: d.acker.clone(),
                    payload,
                    properties: props,
                    reset: AtomicBool::new(false),
                    ledger: link.attempts.clone(),
                    subject,
                    ledger_wait: self.spec.lease.ttl.max(Duration::from_secs(5)),
                    barrier: o.barrier.clone(),
                }),
            }),
        })
    }

    pub(super) fn take(&mut self, room: &Room, out: &mut Vec<Inbound>) {
        let max = room.max();
        // Held deliveries of scopes no longer paused go first, in order.
        for (q, buf) in &mut self.held {
            let Some(o) = self.owned.get(q) else { continue };
            if room.is_paused(&o.scope) {
                continue;
            }
            while out.len() < max {
                match buf.pop_front() {
                    Some(i) => out.push(i),
                    None => break,
                }
            }
        }
        self.held.retain(|_, b| !b.is_empty());
        while out.len() < max {
            let Ok((q, consumer, lease, d)) = self.rx.try_recv() else {
                break;
            };
            let Some(i) = self.inbound(&q, consumer, lease, d) else {
                continue;
            };
            let paused_now = self.held.contains_key(&q) || room.is_paused(i.lease.scope());
            if paused_now {
                // Bounded by the queue's prefetch.
                self.held.entry(q).or_default().push_back(i);
            } else {
                out.push(i);
            }
        }
    }
}
