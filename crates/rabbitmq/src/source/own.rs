//! Owning queues: every heartbeat the leases held are confirmed by a round
//! trip on each queue's channel, lost channels are given up, and (`hash`)
//! the live members are confirmed and the plan decides which queues this
//! instance consumes; the operator's resolved heads are picked up.

use std::collections::{HashMap, HashSet};

use keyorder_core::{Result, SourceEvent};
use lapin::options::{BasicPublishOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Connection};
use tokio::time::Instant;

use super::state::{Owned, Source, CLOSE_WAIT, SETTLE_FENCED};
use crate::error::{broker, not_found};
use crate::plan::Plan;
use crate::presence::{Announcer, CONFIRMS_PER_HEARTBEAT, NONCE_HEADER};

/// Whether the queue `name` is an exclusive queue of another connection
/// (`Some(true)`), absent or not exclusive (`Some(false)`), or unknown (no
/// answer, `None`).
async fn live_elsewhere(conn: &Connection, name: &str) -> Option<bool> {
    let ch = conn.create_channel().await.ok()?;
    let passive = ch
        .queue_declare(
            name.into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await;
    match passive {
        Ok(_) => {
            let _ = ch.close(200, "checked".into()).await;
            Some(false)
        }
        Err(e) if e.to_string().contains("RESOURCE_LOCKED") => Some(true),
        Err(e) if not_found(&e) => Some(false),
        Err(_) => None,
    }
}

impl Source {
    pub(super) async fn maintain_now(&mut self) -> Result<()> {
        let sent = Instant::now();
        let healthy = self.link.as_ref().is_some_and(|l| l.conn.status().connected());
        if !healthy {
            self.lose_all("connection closed");
            self.link = None;
            self.connect().await?;
        }
        if self
            .link
            .as_ref()
            .is_some_and(|l| !l.claims.alive() || !l.attempts.alive())
        {
            // No activation could get its token: start over. The connection
            // is closed before the consumers go: dropping a consumer sends
            // `basic.cancel`, and a cancel that reached the broker first
            // would let the next single active consumer start while this
            // channel still held unacknowledged deliveries (the model's
            // CANCEL_BEFORE_CLOSE, verification/rabbitmq.pml).
            for o in self.owned.values() {
                if let Some(l) = o.lease() {
                    l.lose_to_broker();
                }
            }
            if let Some(link) = self.link.take() {
                let _ = tokio::time::timeout(CLOSE_WAIT, link.conn.close(200, "claims reader stopped".into())).await;
            }
            self.lose_all("claims reader stopped");
            self.connect().await?;
        }
        // Confirm what we hold: a round trip on each queue's channel, all
        // at once (one after another, latency alone could outlast the
        // lease). One not answered within the TTL confirms nothing; the
        // broker's heartbeat decides whether the channel is gone.
        let ttl = self.spec.lease.ttl;
        let checks = self.owned.iter().map(|(q, o)| async move {
            // A lease lost here (its settlement fenced: lapin refused an
            // acknowledgement) leaves every later delivery discarded and
            // unacknowledged: the queue is handed back (below) and consumed
            // anew.
            if o.ended.load(std::sync::atomic::Ordering::SeqCst) || !o.channel.status().connected() {
                return (q.clone(), Err("channel closed"));
            }
            if o.barrier.broken() {
                return (q.clone(), Err("acknowledgements no longer confirmed"));
            }
            if o.lease().is_some_and(|l| l.is_lost()) {
                return (q.clone(), Err(SETTLE_FENCED));
            }
            let passive = QueueDeclareOptions {
                passive: true,
                ..Default::default()
            };
            let answer = tokio::time::timeout(
                ttl,
                o.channel
                    .queue_declare(q.as_str().into(), passive, FieldTable::default()),
            )
            .await;
            match answer {
                Ok(Ok(_)) => (q.clone(), Ok(true)),
                Ok(Err(_)) => (q.clone(), Err("channel closed")),
                Err(_) => (q.clone(), Ok(false)),
            }
        });
        let mut lost = Vec::new();
        let mut whys = HashMap::new();
        for (q, alive) in futures::future::join_all(checks).await {
            match alive {
                Ok(true) => {
                    if let Some(l) = self.owned.get(&q).and_then(Owned::lease) {
                        l.confirm(sent);
                    }
                }
                Ok(false) => tracing::debug!(queue = %q, "rabbitmq: lease round trip unanswered within the TTL"),
                Err(SETTLE_FENCED) => {
                    // The channel is sound: the queue is revoked, so its
                    // in-flight handlers return before the close hands their
                    // messages on (a close now would let the next owner run
                    // them alongside).
                    // Bounded: a handler that does not return within the
                    // TTL no longer holds the queue, which is then given up
                    // at once as a closed channel is (the handler's own
                    // store fences it by the token).
                    if let Some(o) = self.owned.get_mut(&q) {
                        let since = *o.fenced_since.get_or_insert(sent);
                        if since.elapsed() >= ttl {
                            whys.insert(q.clone(), "a settlement was fenced; the hand-back outlasted the TTL");
                            lost.push(q);
                        } else if !o.revoking {
                            o.revoking = true;
                            tracing::warn!(scope = %o.scope, "rabbitmq: a settlement was fenced; handing the queue back");
                            self.events.push(SourceEvent::Revoke(o.scope.clone()));
                        }
                    }
                }
                Err(why) => {
                    whys.insert(q.clone(), why);
                    lost.push(q);
                }
            }
        }
        // First the leases (nothing buffered starts once the broker may
        // hand a queue on), then every lost channel closed at once, then
        // the consumers: dropping one sends `basic.cancel`, and a cancel
        // before the close would let the next single active consumer start
        // while the channel still held unacknowledged deliveries. A close
        // that is not answered was still sent first.
        for q in &lost {
            if let Some(l) = self.owned.get(q).and_then(Owned::lease) {
                l.lose_to_broker();
            }
        }
        let closes = lost
            .iter()
            .filter_map(|q| self.owned.get(q))
            .filter(|o| o.channel.status().connected())
            .map(|o| tokio::time::timeout(CLOSE_WAIT, o.channel.close(200, "queue lost".into())));
        futures::future::join_all(closes).await;
        for q in lost {
            if let Some(o) = self.drop_owned(&q) {
                metrics::counter!("keyorder_rabbitmq_queues_lost_total").increment(1);
                let why = whys.get(&q).copied().unwrap_or("channel closed");
                tracing::warn!(scope = %o.scope, why, "rabbitmq: queue lost");
            }
        }
        let me = self.spec.instance.clone();
        let mine: HashSet<String> = if self.spreads() {
            let ttl = self.spec.lease.ttl;
            let fresh = self.board.lock().unwrap_or_else(|e| e.into_inner()).fresh(&me, ttl);
            // Declared again once a TTL (idempotent on this connection), so a
            // queue deleted by someone else comes back.
            if self.live_at.is_none_or(|at| at.elapsed() >= ttl) {
                if let Some(conn) = self.link.as_ref().map(|l| l.conn.clone()) {
                    self.hold_live(&conn).await;
                }
            }
            // One announcement per member: a restarted one's newest (the
            // larger join claim), a reconnected one's newest (heard first
            // later: `fresh` is in that order).
            let mut by_who: HashMap<String, Announcer> = HashMap::new();
            for a in self.confirm(fresh).await {
                if by_who.get(&a.who).is_none_or(|b| b.started <= a.started) {
                    by_who.insert(a.who.clone(), a);
                }
            }
            let mut live: Vec<(u64, String)> = by_who.values().map(|a| (a.started, a.who.clone())).collect();
            live.push((self.joined_at.unwrap_or(u64::MAX), me.clone()));
            live.sort();
            let members: Vec<String> = live.into_iter().map(|(_, m)| m).collect();
            let plan = if members.first() == Some(&me) {
                match &self.plan {
                    Some(p) if p.members == members => p.clone(),
                    _ => {
                        // Alone, every queue is this instance's: no depths
                        // needed. With an instance that does not follow
                        // plans, the count share, which it computes too.
                        let follow = {
                            let board = self.board.lock().unwrap_or_else(|e| e.into_inner());
                            members
                                .iter()
                                .all(|m| *m == me || by_who.get(m).is_some_and(|a| board.follows(a)))
                        };
                        let depths = if members.len() > 1 && follow {
                            self.depths().await
                        } else {
                            Vec::new()
                        };
                        let floor = u64::from(self.t.cfg.prefetch) * self.queues.len() as u64;
                        let plan = Plan::make(&members, &self.queues, &depths, floor);
                        tracing::debug!(members = members.len(), owners = ?plan.owners, ?depths, "rabbitmq: queue plan");
                        self.plan = Some(plan.clone());
                        plan
                    }
                }
            } else {
                self.plan = None;
                // The leader's plan for this member list, else the count share.
                let board = self.board.lock().unwrap_or_else(|e| e.into_inner());
                by_who
                    .get(&members[0])
                    .and_then(|a| board.plan(a))
                    .filter(|p| p.members == members)
                    .unwrap_or_else(|| Plan::make(&members, &self.queues, &[], 0))
            };
            if let Some((ch, _)) = self
                .link
                .as_ref()
                .and_then(|l| l.presence.as_ref())
                .filter(|_| self.live_at.is_some())
            {
                let mut headers = Plan::header(self.plan.as_ref());
                headers.insert(NONCE_HEADER.into(), AMQPValue::LongString(self.nonce.as_str().into()));
                let props = BasicProperties::default().with_headers(headers);
                ch.basic_publish(
                    self.names.presence().as_str().into(),
                    "".into(),
                    BasicPublishOptions::default(),
                    format!("{}:{me}", self.joined_at.unwrap_or(u64::MAX)).as_bytes(),
                    props,
                )
                .await
                .map_err(broker)?;
            }
            plan.mine(&me, &self.queues).into_iter().cloned().collect()
        } else {
            self.queues.iter().cloned().collect()
        };
        for (q, o) in &mut self.owned {
            if !mine.contains(q) && !o.revoking {
                o.revoking = true;
                self.events.push(SourceEvent::Revoke(o.scope.clone()));
            }
        }
        self.soon = false;
        for q in self.queues.clone() {
            if mine.contains(&q) && !self.owned.contains_key(&q) {
                self.consume(&q).await?;
            }
        }
        let resolved = self
            .t
            .shared
            .resolved
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(self.names.base());
        self.events.extend(resolved.unwrap_or_default());
        self.last_maintain = Some(sent);
        Ok(())
    }

    /// The announcements (this source's excluded) that the broker
    /// confirms: each one's live queue exists and is locked to another
    /// connection (the `presence` module). One not confirmed is ignored for
    /// a lease TTL and its id reported once; one not yet checked (over the
    /// budget, or no answer) waits. A confirmation lasts one lease TTL;
    /// confirmed members are checked again before new ones.
    async fn confirm(&mut self, fresh: Vec<Announcer>) -> Vec<Announcer> {
        let ttl = self.spec.lease.ttl;
        let current: HashSet<&Announcer> = fresh.iter().collect();
        let confirmed: HashMap<Announcer, Instant> = {
            let mut board = self.board.lock().unwrap_or_else(|e| e.into_inner());
            let c = board.confirmed();
            c.retain(|a, at| at.elapsed() < ttl * 4 && current.contains(a));
            c.clone()
        };
        let Some(conn) = self.link.as_ref().map(|l| l.conn.clone()) else {
            return Vec::new();
        };
        if self.confirm_window.0.elapsed() >= self.spec.lease.heartbeat {
            self.confirm_window = (Instant::now(), 0);
        }
        // Enough for every confirmed member's re-check and some news, so a
        // large group is never starved by its own size.
        let budget = (CONFIRMS_PER_HEARTBEAT + 2 * confirmed.len()).saturating_sub(self.confirm_window.1);
        let mut due: Vec<Announcer> = fresh
            .iter()
            .filter(|a| confirmed.get(*a).is_some_and(|at| at.elapsed() >= ttl))
            .cloned()
            .collect();
        due.extend(fresh.iter().filter(|a| !confirmed.contains_key(*a)).cloned());
        due.truncate(budget);
        self.confirm_window.1 += due.len();
        let wait = self.presence_wait();
        let checks = due.into_iter().map(|a| {
            let name = self.names.live(a.started, &a.who, &a.nonce);
            let conn = conn.clone();
            async move {
                let verdict = tokio::time::timeout(wait, live_elsewhere(&conn, &name))
                    .await
                    .ok()
                    .flatten();
                (a, verdict)
            }
        });
        let verdicts = futures::future::join_all(checks).await;
        let mut board = self.board.lock().unwrap_or_else(|e| e.into_inner());
        for (a, verdict) in verdicts {
            match verdict {
                Some(true) => {
                    board.confirmed().insert(a, Instant::now());
                }
                // Confirmed before: checked again next round before it is
                // given up (a member between two connections).
                Some(false) if confirmed.contains_key(&a) => {
                    board.confirmed().remove(&a);
                }
                Some(false) => {
                    board.reject(&a);
                    metrics::counter!("keyorder_rabbitmq_presence_unconfirmed_total").increment(1);
                    if self.unconfirmed_reported.len() < 1000 && self.unconfirmed_reported.insert(a.who.clone()) {
                        tracing::warn!(
                            member = a.who.as_str(),
                            "rabbitmq: an announcement on the presence exchange is not confirmed by the broker (no \
                             live queue held for it): ignored. A forged or replayed announcement, or one of an \
                             older keyorder; see SECURITY.md for the permissions that keep publishers off the \
                             presence exchange"
                        );
                    }
                }
                // No answer: the last verdict stands.
                None => {}
            }
        }
        let confirmed = board.confirmed();
        fresh.into_iter().filter(|a| confirmed.contains_key(a)).collect()
    }

    /// Every queue's ready messages, read on a channel of its own (a
    /// failed passive declaration closes its channel); empty when any read
    /// fails (the plan then falls back to the count share).
    async fn depths(&self) -> Vec<u64> {
        let Some(link) = &self.link else { return Vec::new() };
        let Ok(ch) = link.conn.create_channel().await else {
            return Vec::new();
        };
        let passive = QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        let mut depths = Vec::with_capacity(self.queues.len());
        for q in &self.queues {
            match ch
                .queue_declare(q.as_str().into(), passive, FieldTable::default())
                .await
            {
                Ok(d) => depths.push(u64::from(d.message_count())),
                Err(_) => return Vec::new(),
            }
        }
        let _ = ch.close(200, "depths read".into()).await;
        depths
    }
}
