//! The source's link: a connection of its own (its AMQP heartbeat is the
//! stall fence) with the claims and attempts readers, the members queue's
//! consumer, the presence listener and this instance's live queue; and how
//! a refused consume is read (the group removed by another process).

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use keyorder_core::Result;
use lapin::options::{BasicConsumeOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{Connection, ExchangeKind};
use tokio::time::Instant;

use super::state::{Link, Source, CLOSE_WAIT};
use crate::attempts::Attempts;
use crate::channel::confirm_channel;
use crate::claims::Claims;
use crate::conn::connect_uri;
use crate::error::broker;
use crate::plan::{Plan, PLAN_HEADER};
use crate::presence::{Announcer, NONCE_HEADER};
use crate::topology::private_queue;
use crate::wire::{header_text, short};

impl Source {
    /// Connects and sets up the link, within a deadline (the lease TTL, at
    /// least 10 s): a broker that just restarted can take a while to start a
    /// stream, and a consume it never answers must not hold the source up.
    /// A connection whose set-up failed is closed in the background.
    pub(super) async fn connect(&mut self) -> Result<()> {
        let uri = self.t.cfg.uri_with_heartbeat(self.heartbeat_secs());
        let conn = Arc::new(connect_uri(&uri, &self.t.cfg).await?);
        watch_unreadable(&conn, &self.unreadable_reported, self.names.base());
        let wait = self.spec.lease.ttl.max(Duration::from_secs(10));
        let failed = match tokio::time::timeout(wait, self.set_up(conn.clone())).await {
            Ok(Ok(())) => return Ok(()),
            Ok(Err(e)) => e,
            Err(_) => keyorder_core::Error::broker(format!(
                "rabbitmq: setting up the consumer's connection took longer than {} s (the claims stream \
                 not ready yet?); retrying",
                wait.as_secs()
            )),
        };
        tokio::spawn(async move {
            let _ = tokio::time::timeout(CLOSE_WAIT, conn.close(200, "set-up failed".into())).await;
        });
        Err(failed)
    }

    async fn set_up(&mut self, conn: Arc<Connection>) -> Result<()> {
        let dlq_channel = confirm_channel(&conn).await?;
        let stream = crate::claims::STREAM;
        let tag = short("instance id", &format!("{}-claims", self.spec.instance))?;
        let claims = Arc::new(Claims::open(&conn, stream, tag).await.map_err(|e| match e {
            // "NOT_FOUND - home node ... of durable queue ... is down or
            // inaccessible" right after a restart is transient (retried);
            // only "no queue" means it is gone.
            keyorder_core::Error::Broker(b) if b.message().contains("no queue") => {
                // Declared with every group (`ensure_group`): this process
                // declares it again when the subscription is built again.
                self.t.forget(self.names.base());
                self.t.forget(self.names.category());
                keyorder_core::Error::NotFound(format!(
                    "rabbitmq: the claims stream `{stream}` (fencing tokens) does not exist: it was deleted, or the \
                     group `{}` of category `{}` was declared by an earlier version (or with `declare=false`) \
                     without it. Build the subscription again (with `declare=true`) to declare it",
                    self.names.group(),
                    self.names.category()
                ))
            }
            e => e,
        })?);
        let ledger = crate::attempts::STREAM;
        let tag = short("instance id", &format!("{}-attempts", self.spec.instance))?;
        let attempts = Arc::new(Attempts::open(&conn, ledger, tag).await.map_err(|e| match e {
            keyorder_core::Error::Broker(b) if b.message().contains("no queue") => {
                self.t.forget(self.names.base());
                self.t.forget(self.names.category());
                keyorder_core::Error::NotFound(format!(
                    "rabbitmq: the attempts stream `{ledger}` (attempts counted per started attempt) does not \
                     exist: it was deleted, or the group `{}` of category `{}` was declared by an earlier version \
                     (or with `declare=false`) without it. Build the subscription again (with `declare=true`) to \
                     declare it",
                    self.names.group(),
                    self.names.category()
                ))
            }
            e => e,
        })?);
        if self.joined_at.is_none() {
            let wait = self.spec.lease.ttl.max(Duration::from_secs(5));
            let Some(offset) = claims.claim(None, wait).await else {
                return Err(keyorder_core::Error::broker(format!(
                    "rabbitmq: the join claim on `{stream}` was not read back within {} s",
                    wait.as_secs()
                )));
            };
            self.joined_at = Some(offset);
        }
        // Declared with the group (`ensure_group`), never here: a group
        // removed meanwhile is not half re-created by its members queue.
        let member_channel = conn.create_channel().await.map_err(broker)?;
        let member = member_channel
            .basic_consume(
                self.names.members().as_str().into(),
                short("instance id", &format!("{}-member", self.spec.instance))?,
                BasicConsumeOptions {
                    no_ack: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(|e| self.gone(&self.names.members(), e))?;
        let presence = if self.spreads() {
            let ch = conn.create_channel().await.map_err(broker)?;
            ch.exchange_declare(
                self.names.presence().as_str().into(),
                ExchangeKind::Fanout,
                ExchangeDeclareOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(broker)?;
            let (queue, mut consumer) = private_queue(&ch).await?;
            ch.queue_bind(
                queue.as_str().into(),
                self.names.presence().as_str().into(),
                "".into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(broker)?;
            let board = self.board.clone();
            let joined = self.joined.clone();
            let queues = self.queues.len();
            let task = tokio::spawn(async move {
                while let Some(Ok(d)) = consumer.next().await {
                    // `started:who`: a u64, a colon and an AMQP name at most.
                    if d.data.len() > 300 {
                        continue;
                    }
                    let text = String::from_utf8_lossy(&d.data).into_owned();
                    let Some((started, who)) = text.split_once(':') else {
                        continue;
                    };
                    let Ok(started) = started.parse() else {
                        continue;
                    };
                    let announcer = Announcer {
                        started,
                        who: who.to_owned(),
                        nonce: header_text(&d.properties, NONCE_HEADER).unwrap_or_default(),
                    };
                    // No plan header: an instance that does not follow
                    // plans (an older version); empty: one that follows but
                    // makes none.
                    if !board.lock().unwrap_or_else(|e| e.into_inner()).admits(&announcer) {
                        continue;
                    }
                    let plan = header_text(&d.properties, PLAN_HEADER)
                        .filter(|text| text.len() <= 64 * 1024)
                        .map(|text| Plan::parse(&text, queues));
                    if board.lock().unwrap_or_else(|e| e.into_inner()).hear(announcer, plan) {
                        joined.store(true, std::sync::atomic::Ordering::SeqCst);
                    }
                }
            });
            Some((ch, task))
        } else {
            None
        };
        if self.spreads() {
            self.nonce = crate::presence::nonce();
            self.live_at = None;
            self.hold_live(&conn).await;
        }
        self.link = Some(Link {
            conn,
            dlq_channel,
            claims,
            attempts,
            _member: member,
            presence,
        });
        Ok(())
    }

    /// Declares this source's live queue on `conn` (exclusive: the broker
    /// deletes it with the connection), so that the others believe its
    /// announcements. Refused while an earlier connection of this source
    /// still holds it (the broker has not yet noticed that one died): tried
    /// again at the next maintenance; until then the others leave this
    /// source out of their plans, and single active consumers keep every
    /// queue consumed once.
    pub(super) async fn hold_live(&mut self, conn: &Connection) {
        let Some(started) = self.joined_at else {
            return;
        };
        let name = self.names.live(started, &self.spec.instance, &self.nonce);
        let declare = async {
            let ch = conn.create_channel().await?;
            ch.queue_declare(
                name.as_str().into(),
                QueueDeclareOptions {
                    exclusive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await?;
            let _ = ch.close(200, "declared".into()).await;
            Ok::<_, lapin::Error>(())
        };
        match tokio::time::timeout(self.presence_wait(), declare).await {
            Ok(Ok(())) => {
                self.live_warned = false;
                self.live_at = Some(Instant::now());
            }
            Ok(Err(e)) if !self.live_warned => {
                self.live_at = None;
                self.live_warned = true;
                tracing::warn!(
                    error = %e,
                    "rabbitmq: cannot declare this instance's live queue yet (an earlier connection may still \
                     hold it); the other instances leave it out of their plans until it is declared"
                );
            }
            Ok(Err(_)) => self.live_at = None,
            // No answer: the last state stands.
            Err(_) => {}
        }
    }

    /// A consume refused: a queue that no longer exists means the group
    /// was removed (or its category deleted) by another process; this
    /// transport forgets that it declared the group, so building the
    /// subscription again declares it anew.
    pub(super) fn gone(&self, queue: &str, e: lapin::Error) -> keyorder_core::Error {
        let text = e.to_string();
        if !(text.contains("NOT_FOUND") || text.contains("404")) {
            return broker(e);
        }
        self.t.forget(self.names.base());
        self.t.forget(self.names.category());
        keyorder_core::Error::NotFound(format!(
            "rabbitmq: queue `{queue}` of group `{}` of category `{}` no longer exists: the group was removed \
             (`Admin::remove_group`, `keyorder groups remove`) or its category deleted (`keyorder delete-queue`) \
             by another process. Build the subscription again to declare the group anew (it then receives what is \
             published from then on)",
            self.names.group(),
            self.names.category()
        ))
    }
}

/// Reports, once per subscription, a delivery the AMQP client cannot read
/// and counts each (`keyorder_rabbitmq_unreadable_deliveries_total`): a
/// routing key (an AMQP short string) that is no UTF-8. AMQP forbids it,
/// RabbitMQ routes it anyway, and the client closes the connection on it,
/// so the message returns to its queue and stops it, every reconnect, until
/// it is removed. Nothing here can settle it (its delivery tag is in the
/// frame that could not be read), so the report names the fix.
fn watch_unreadable(conn: &Connection, reported: &Arc<AtomicBool>, category: &str) {
    let mut events = conn.events_listener();
    let (reported, category) = (reported.clone(), category.to_owned());
    tokio::spawn(async move {
        while let Some(event) = events.next().await {
            let lapin::Event::Error(e) = event else { continue };
            if !matches!(e.kind(), lapin::ErrorKind::ParsingError(_)) {
                continue;
            }
            metrics::counter!("keyorder_rabbitmq_unreadable_deliveries_total").increment(1);
            if !reported.swap(true, std::sync::atomic::Ordering::SeqCst) {
                tracing::error!(
                    category = %category,
                    error = %e,
                    "rabbitmq: a delivery could not be read (a routing key that is no UTF-8, which AMQP forbids but \
                     RabbitMQ routes); the connection closed and the message went back to its queue, which it stops \
                     until it is removed. Remove it with a client that reads raw bytes (the management UI's Get \
                     messages with Ack mode \"Reject requeue false\", or pika's basic_get and basic_ack), and make its \
                     producer send UTF-8 routing keys (reported once; counted in \
                     keyorder_rabbitmq_unreadable_deliveries_total)"
                );
            }
        }
    });
}
