//! A delivery held until it is settled: its acknowledgement, made known to
//! the broker through the channel's [`AckBarrier`], its dead letter, and
//! its attempts' records. A halted head keeps its [`Held`] so an operator
//! can settle it later.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use keyorder_core::Result;
use lapin::options::{BasicAckOptions, ExchangeDeclareOptions};
use lapin::types::{AMQPValue, LongString};
use lapin::Acker;
use lapin::{BasicProperties, Channel, ExchangeKind};

use crate::attempts::Attempts;
use crate::channel::publish_confirmed;

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
                Err(keyorder_core::Error::broker(format!(
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
