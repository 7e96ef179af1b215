//! Settling one delivery. The fence is the channel: a delivery tag is only
//! valid on the channel it came on, so once the broker closed a stale
//! consumer's channel (handing its queue to the next consumer) its
//! acknowledgements fail and change nothing.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use async_trait::async_trait;
use keyorder_core::key::label;
use keyorder_core::{Error, Result, Settle};
use lapin::options::{BasicAckOptions, ExchangeDeclareOptions};
use lapin::types::{AMQPValue, LongString};
use lapin::Acker;
use lapin::{BasicProperties, Channel, ExchangeKind};

use crate::attempts::Attempts;
use crate::{publish_confirmed, Halted, RabbitTransport};

/// What a halted head keeps so an operator can settle it later.
pub(crate) struct Held {
    pub(crate) acker: Acker,
    pub(crate) payload: keyorder_core::Bytes,
    pub(crate) properties: BasicProperties,
    /// Set by an operator's resume (after its reset record was read back):
    /// the next attempt counts from 1 again.
    pub(crate) reset: AtomicBool,
    /// Where attempts are written down and counted (the `attempts` module).
    pub(crate) ledger: Arc<Attempts>,
    /// This message's records' subject there.
    pub(crate) subject: String,
    /// How long a record may take to be read back.
    pub(crate) ledger_wait: std::time::Duration,
    /// The consumer channel's barrier: the acknowledgement is known to the
    /// broker before [`Held::ack`] returns.
    pub(crate) barrier: Arc<AckBarrier>,
}

/// Makes acknowledgements written on a consumer channel known to the broker.
///
/// AMQP does not confirm `basic.ack`: a frame written to the socket is lost
/// with the connection, and the broker then requeues a message that was
/// applied. Had the next message of its key started meanwhile, the requeued
/// one would run after it (C19 on `sac` and `hash`; `tests/ack_cut.rs`). A
/// channel handles its frames in order, so the answer to a synchronous
/// method sent after the acknowledgements (a passive declaration of
/// `amq.direct`) says the broker has them. A round trip covers every
/// acknowledgement written before it was sent; a settle whose ticket no
/// round on the wire covers sends one at once (rounds are pipelined, so a
/// settle waits one round trip, not the rest of another one first).
pub(crate) struct AckBarrier {
    channel: Channel,
    /// Acknowledgements written (tickets handed out).
    written: AtomicU64,
    /// The highest ticket a round sent so far covers.
    sent: AtomicU64,
    /// The highest ticket the broker is known to hold (answered rounds).
    confirmed: tokio::sync::watch::Sender<u64>,
    /// Set when a round trip failed or was not answered in time.
    broken: AtomicBool,
}

impl Held {
    /// The head was settled by an operator: its attempts are forgotten,
    /// read back before this returns, so a message with its id that comes
    /// later (a producer's duplicate) counts from 1 (best effort: a reset
    /// not read back in time is logged).
    pub(crate) async fn forget_attempts(&self) {
        if !self.ledger.reset(&self.subject, Some(self.ledger_wait)).await {
            tracing::warn!("rabbitmq: a settled head's attempt count was not reset in time");
        }
    }
}

impl AckBarrier {
    pub(crate) fn new(channel: Channel) -> Arc<AckBarrier> {
        Arc::new(AckBarrier {
            channel,
            written: AtomicU64::new(0),
            sent: AtomicU64::new(0),
            confirmed: tokio::sync::watch::Sender::new(0),
            broken: AtomicBool::new(false),
        })
    }

    /// Whether a round trip failed or went unanswered: the channel's
    /// acknowledgements can no longer be confirmed, and the source gives
    /// the queue up (closing the channel, so the broker requeues what it
    /// holds unacknowledged) rather than keep a consumer whose settles all
    /// fail.
    pub(crate) fn broken(&self) -> bool {
        self.broken.load(Ordering::SeqCst)
    }

    fn break_off(&self) {
        self.broken.store(true, Ordering::SeqCst);
        // Wakes the settles waiting on another one's round.
        self.confirmed.send_modify(|_| {});
    }

    /// Waits until the broker holds every acknowledgement written on the
    /// channel so far, at most [`ACK_WAIT`] in all (a wait on another
    /// settle's round trip included): `None` past it or once the barrier is
    /// broken. A round runs as a task of its own, so a settle cancelled
    /// while it waits (a worker aborted, an operator's request dropped)
    /// never leaves the settles that share its round waiting on nothing.
    async fn confirm(self: &Arc<Self>) -> Option<()> {
        let deadline = tokio::time::Instant::now() + ACK_WAIT;
        let ticket = self.written.fetch_add(1, Ordering::SeqCst) + 1;
        let mut answered = self.confirmed.subscribe();
        loop {
            if *answered.borrow_and_update() >= ticket {
                return Some(());
            }
            if self.broken() {
                return None;
            }
            let sent = self.sent.load(Ordering::SeqCst);
            if sent >= ticket {
                // A round sent after this acknowledgement is on the wire.
                match tokio::time::timeout_at(deadline, answered.changed()).await {
                    Ok(Ok(())) => continue,
                    // Answered as the deadline passed: still confirmed.
                    _ if *answered.borrow() >= ticket => return Some(()),
                    _ => {
                        self.break_off();
                        return None;
                    }
                }
            }
            let upto = self.written.load(Ordering::SeqCst);
            if self
                .sent
                .compare_exchange(sent, upto, Ordering::SeqCst, Ordering::SeqCst)
                .is_err()
            {
                continue;
            }
            // Every acknowledgement up to `upto` was written before its
            // ticket was taken, so before this round's frame is queued.
            let barrier = Arc::clone(self);
            let guard = RoundGuard(Some(Arc::clone(self)));
            tokio::spawn(async move {
                let mut guard = guard;
                let passive = ExchangeDeclareOptions {
                    passive: true,
                    ..Default::default()
                };
                let round = barrier.channel.exchange_declare(
                    "amq.direct".into(),
                    ExchangeKind::Direct,
                    passive,
                    lapin::types::FieldTable::default(),
                );
                match tokio::time::timeout(ACK_WAIT, round).await {
                    Ok(Ok(())) => barrier.confirmed.send_modify(|c| *c = (*c).max(upto)),
                    Ok(Err(_)) | Err(_) => barrier.break_off(),
                }
                guard.0 = None;
            });
        }
    }
}

/// Breaks the barrier if a round's task is dropped before it finished (its
/// runtime shut down): the settles it covers fail at once instead of
/// waiting out their deadline.
struct RoundGuard(Option<Arc<AckBarrier>>);

impl Drop for RoundGuard {
    fn drop(&mut self) {
        if let Some(b) = self.0.take() {
            b.break_off();
        }
    }
}

impl Held {
    /// Acknowledges the delivery and waits until the broker has the
    /// acknowledgement ([`AckBarrier`]), at most [`ACK_WAIT`] for the frame
    /// to be written and as long again for the broker's answer (20 s in
    /// all): `None` past
    /// either, or when the channel's barrier broke earlier. `Some(Ok(false))`:
    /// lapin refused it (the channel closed, or it was acknowledged before). lapin writes the frame through its connection task; on a
    /// connection that died while the process was stopped the write may
    /// never be answered, and an unbounded wait held a worker's graceful
    /// shutdown forever. Unconfirmed, the delivery may stay unacknowledged
    /// and the broker requeue it with the channel.
    pub(crate) async fn ack(&self) -> Option<lapin::Result<bool>> {
        let written = tokio::time::timeout(ACK_WAIT, self.acker.ack(BasicAckOptions::default()))
            .await
            .ok()?;
        if !matches!(written, Ok(true)) {
            return Some(written);
        }
        self.barrier.confirm().await.map(|()| Ok(true))
    }

    /// Publishes a copy of the message to the dead-letter queue `dlq` with
    /// `reason` in `x-keyorder-reason`, and waits for the broker's confirm.
    pub(crate) async fn dead_letter(&self, ch: &Channel, dlq: &str, reason: &str) -> Result<()> {
        let mut headers = self.properties.headers().clone().unwrap_or_default();
        headers.insert(REASON_HEADER.into(), AMQPValue::LongString(LongString::from(reason)));
        let props = self.properties.clone().with_headers(headers);
        // Bounded: a confirm that never comes must not hold the key's
        // settlement (and a revoke waiting on it) forever; the park is
        // retried, so a dead letter may be published twice.
        tokio::time::timeout(ACK_WAIT, publish_confirmed(ch, "", dlq, &self.payload, props))
            .await
            .unwrap_or_else(|_| {
                Err(keyorder_core::Error::Broker(format!(
                    "rabbitmq: dead letter not confirmed within {} s; retrying",
                    ACK_WAIT.as_secs()
                )))
            })
    }
}

/// The longest an acknowledgement's frame may take to be written.
pub(crate) const ACK_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// The header a dead letter carries its reason in.
pub(crate) const REASON_HEADER: &str = "x-keyorder-reason";

pub(crate) struct RabbitSettle {
    pub(crate) t: RabbitTransport,
    pub(crate) dlq_channel: Channel,
    /// The (category, group) pair's base name (`GroupNames::base`).
    pub(crate) group: String,
    pub(crate) dlq: String,
    pub(crate) key: Option<String>,
    pub(crate) scope: Arc<str>,
    pub(crate) generation: u64,
    pub(crate) message_id: String,
    /// Delivered before and not settled (`redelivered`).
    pub(crate) redelivered: bool,
    /// Attempts begun here.
    pub(crate) attempts: AtomicU32,
    /// The id of the attempt being begun, kept until its record was read
    /// back: begun again after a time-out, it is written with the same id
    /// and counted once.
    pub(crate) pending: std::sync::Mutex<Option<String>>,
    /// The last attempt's number (what a halt shows).
    pub(crate) counted: AtomicU32,
    pub(crate) held: Arc<Held>,
}

impl fmt::Debug for RabbitSettle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitSettle")
            .field("scope", &self.scope)
            .field("generation", &self.generation)
            .finish_non_exhaustive()
    }
}

impl Drop for RabbitSettle {
    fn drop(&mut self) {
        if let Some(key) = &self.key {
            self.t.shared.unhold(&self.group, key);
        }
    }
}

impl RabbitSettle {
    fn fenced(&self) -> Error {
        metrics::counter!("keyorder_rabbitmq_fence_rejections_total").increment(1);
        Error::Fenced {
            scope: self.scope.to_string(),
            generation: self.generation,
        }
    }

    fn unrecorded(&self) -> Error {
        Error::Broker(format!(
            "rabbitmq: an attempt's record on `{}` was not read back within {} s",
            crate::attempts::STREAM,
            self.held.ledger_wait.as_secs()
        ))
    }

    /// A settled message's records are no longer needed (best effort: a
    /// count left behind only costs memory, up to the bound).
    async fn forget(&self) {
        if self.redelivered || self.attempts.load(Ordering::SeqCst) > 1 {
            self.held.ledger.reset(&self.held.subject, None).await;
        }
    }

    async fn ack_now(&self) -> Result<()> {
        // Unwritten in time, it is left to the broker as a fenced one is.
        match self.held.ack().await {
            Some(Ok(true)) => Ok(()),
            Some(Ok(false) | Err(_)) => Err(self.fenced()),
            None => {
                tracing::warn!(
                    scope = %self.scope,
                    wait_s = ACK_WAIT.as_secs(),
                    "rabbitmq: acknowledgement not written or not confirmed in time; treating the channel as lost"
                );
                Err(self.fenced())
            }
        }
    }
}

#[async_trait]
impl Settle for RabbitSettle {
    fn delivered_before(&self) -> bool {
        self.redelivered
    }

    async fn begin_attempt(&self) -> Result<u32> {
        if self.held.reset.swap(false, Ordering::SeqCst) {
            // An operator's resume, its reset record already read back
            // (`local_resolve`): the count starts again.
            self.attempts.store(1, Ordering::SeqCst);
            self.counted.store(1, Ordering::SeqCst);
            return Ok(1);
        }
        let begun = self.attempts.load(Ordering::SeqCst);
        // A first delivery's first attempt: nothing ran it before, and it
        // is not written down (the `attempts` module).
        let n = if !self.redelivered && begun == 0 {
            1
        } else {
            let id = self
                .pending
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get_or_insert_with(|| uuid::Uuid::new_v4().simple().to_string())
                .clone();
            match self
                .held
                .ledger
                .begin(&self.held.subject, &id, self.held.ledger_wait)
                .await
            {
                Some(written) => {
                    *self.pending.lock().unwrap_or_else(|e| e.into_inner()) = None;
                    written.saturating_add(1)
                }
                None => return Err(self.unrecorded()),
            }
        };
        self.attempts.fetch_add(1, Ordering::SeqCst);
        self.counted.store(n, Ordering::SeqCst);
        Ok(n)
    }

    async fn ack(&self) -> Result<()> {
        self.ack_now().await?;
        self.forget().await;
        Ok(())
    }

    async fn park(&self, reason: &str) -> Result<()> {
        // The dead letter is confirmed before the head is acknowledged.
        self.held.dead_letter(&self.dlq_channel, &self.dlq, reason).await?;
        self.ack_now().await?;
        self.forget().await;
        Ok(())
    }

    async fn halt(&self, reason: &str) -> Result<()> {
        let Some(key) = &self.key else {
            return Err(Error::Unsupported {
                transport: "rabbitmq".into(),
                capability: "halt_on_poison",
                fix: "a keyless message has no key to halt; give it a key or use the Park poison policy".into(),
            });
        };
        // The head stays unacknowledged: the broker keeps it for the next
        // owner if this one goes away.
        self.t.shared.halted.lock().unwrap_or_else(|e| e.into_inner()).insert(
            (self.group.clone(), key.clone()),
            Halted {
                scope: self.scope.to_string(),
                head_id: self.message_id.clone(),
                attempts: self.counted.load(Ordering::SeqCst),
                reason: reason.to_owned(),
                settle: self.held.clone(),
            },
        );
        self.t.answer_for(&self.group);
        metrics::counter!("keyorder_rabbitmq_halts_total").increment(1);
        tracing::warn!(key = %label(key), scope = %self.scope, "rabbitmq: key halted at its head");
        Ok(())
    }
}
