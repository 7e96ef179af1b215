//! The source: a connection of its own (its AMQP heartbeat is the stall
//! fence), a consumer per queue this instance owns, and presence.
//!
//! Ordered `sac`: every instance consumes the one queue; the broker keeps the
//! first consumer active until it goes away, then activates the next.
//!
//! Ordered `hash`: instances announce themselves on the category's
//! presence exchange every heartbeat; every instance computes the same fair
//! share of the queues over the live ones and consumes only its share. The
//! queues' single active consumer keeps a queue from being consumed twice
//! while instances disagree during a change. A queue is handed over by
//! finishing and acknowledging its in-flight work and then closing its
//! channel, so the broker activates the next consumer with nothing of the old
//! one outstanding.
//!
//! Fencing token: taken when the broker activates a consumer (its first
//! delivery), from the virtual host's claims stream: see the `claims` module.
//! Deliveries wait until it is known.
//!
//! Self-fence: a scope's lease is confirmed by a round trip on its channel
//! (a passive queue declaration; all of them concurrently) every heartbeat.
//! A consumer whose channel or connection the broker closed (or whose
//! stream of deliveries ended) loses its lease at once, from its consumer
//! task, so nothing it buffered starts after the broker requeued it.
//! Stalls: RabbitMQ closes a connection it received nothing on for between
//! 2 and 3 heartbeat intervals (it checks every interval and gives up after
//! two checks without data). The heartbeat asked for is half the self-fence's
//! freshness (`ttl - margin`, rounded up to whole seconds), so the broker
//! hands a stalled consumer's queues over no earlier than the self-fence
//! paused them (a lease is fresh for `ttl - margin` after the confirming
//! round trip was sent, and that round trip reached the broker after it was
//! sent), and at most about 1.5 × (`ttl - margin`) + 1 s after the stall.
//!
//! [`state`] holds what a source keeps, [`link`] its connection and what
//! runs on it, [`own`] the upkeep of the queues it owns, [`consume`] their
//! consumers and deliveries; this room opens a source and answers the
//! consumer's calls.

mod consume;
mod link;
mod own;
mod state;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use keyorder_core::raw::Room;
use keyorder_core::{Inbound, Result, SourceEvent, SourceSpec, TransportSource};
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::conn::Conn;
use crate::names::GroupNames;
use crate::presence::{nonce, Board};

pub(crate) use state::Source;
use state::CLOSE_WAIT;

impl Source {
    pub(crate) async fn open(timeout_arg: Option<i64>, t: Conn, spec: SourceSpec, names: GroupNames) -> Result<Self> {
        let (tx, rx) = mpsc::unbounded_channel();
        let board = Arc::new(Mutex::new(Board::new(&spec.instance)));
        let mut source = Source {
            timeout_arg,
            warned_invalid: std::sync::Mutex::default(),
            unreadable_reported: Arc::default(),
            queues: names.queues(t.cfg.topology),
            t,
            spec,
            names,
            link: None,
            board,
            nonce: nonce(),
            joined_at: None,
            joined: Arc::default(),
            plan: None,
            unconfirmed_reported: HashSet::new(),
            confirm_window: (Instant::now(), 0),
            live_warned: false,
            live_at: None,
            owned: HashMap::new(),
            scopes: HashMap::new(),
            tx,
            rx,
            held: HashMap::new(),
            events: Vec::new(),
            last_maintain: None,
            consumers: 0,
            soon: false,
        };
        source.maintain_now().await?;
        Ok(source)
    }
}

#[async_trait]
impl TransportSource for Source {
    async fn fetch(&mut self, room: &Room, wait: Duration) -> Result<Vec<Inbound>> {
        let mut out = Vec::new();
        self.take(room, &mut out);
        if out.is_empty() {
            if let Ok(Some((q, consumer, lease, d))) = tokio::time::timeout(wait, self.rx.recv()).await {
                if let Some(i) = self.inbound(&q, consumer, lease, d) {
                    if room.is_paused(i.lease.scope()) || self.held.contains_key(&q) {
                        self.held.entry(q).or_default().push_back(i);
                    } else {
                        out.push(i);
                    }
                }
                self.take(room, &mut out);
            }
        }
        Ok(out)
    }

    async fn maintain(&mut self) -> Result<Vec<SourceEvent>> {
        let every = if self.soon {
            Duration::from_millis(100).min(self.spec.lease.heartbeat)
        } else {
            self.spec.lease.heartbeat
        };
        // An announcement looks again at once, but not more often than every
        // 100 ms: a flood of them must not turn maintenance into a loop.
        let early = self
            .last_maintain
            .is_none_or(|t| t.elapsed() >= Duration::from_millis(100).min(self.spec.lease.heartbeat));
        let joined = early && self.joined.swap(false, std::sync::atomic::Ordering::SeqCst);
        if joined || self.last_maintain.is_none_or(|t| t.elapsed() >= every) {
            self.maintain_now().await?;
        }
        Ok(std::mem::take(&mut self.events))
    }

    async fn release(&mut self, scope: &str) -> Result<()> {
        let Some(q) = self.scopes.get(scope).cloned() else {
            return Ok(());
        };
        // Close the channel while its consumer is still registered, and only
        // then end the consumer task: lapin cancels a consumer whose stream
        // is dropped (`basic.cancel`), and a cancel before the close lets
        // RabbitMQ activate the next single active consumer at once, while
        // this one still holds its prefetched, unacknowledged deliveries;
        // those come back only at the close, after the next consumer was
        // given later messages of their keys. A close alone returns them
        // first, in order, and then activates the next consumer (nothing is
        // in flight: the subscription drained the scope).
        if let Some(o) = self.owned.get(&q) {
            if let Some(l) = o.lease() {
                l.lose();
            }
            // The close frame is sent before the wait: a broker that does not
            // answer (a connection it already dropped) cannot hold this up.
            if tokio::time::timeout(CLOSE_WAIT, o.channel.close(200, "handed over".into()))
                .await
                .is_err()
            {
                tracing::warn!(scope = %scope, wait_s = CLOSE_WAIT.as_secs(), "rabbitmq: no close-ok for a released queue's channel in time");
            }
        }
        if self.drop_owned(&q).is_some() {
            metrics::counter!("keyorder_rabbitmq_queues_released_total").increment(1);
            // Consumed anew at once where it is still this instance's.
            self.soon = true;
        }
        Ok(())
    }

    async fn close(&mut self) -> Result<()> {
        let scopes: Vec<Arc<str>> = self.scopes.keys().cloned().collect();
        // On a connection that is gone there is no channel to close (the
        // broker already returned the deliveries): only forget them.
        let connected = self.link.as_ref().is_some_and(|l| l.conn.status().connected());
        for s in scopes {
            if connected {
                self.release(&s).await?;
            } else if let Some(q) = self.scopes.get(&s).cloned() {
                self.drop_owned(&q);
            }
        }
        if let Some(link) = self.link.take() {
            if let Some((_, h)) = &link.presence {
                h.abort();
            }
            if tokio::time::timeout(CLOSE_WAIT, link.conn.close(200, "closing".into()))
                .await
                .is_err()
            {
                tracing::warn!(
                    wait_s = CLOSE_WAIT.as_secs(),
                    "rabbitmq: no close-ok for the connection in time"
                );
            }
        }
        Ok(())
    }
}
