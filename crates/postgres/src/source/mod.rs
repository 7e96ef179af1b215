//! `Source`, the ordered source of the slot layout (`impl TransportSource`):
//! a member of a consumer group that owns slots under fenced leases
//! (`own.rs`), reads what their owner has not settled (`read.rs`), tidies
//! the group's rows off the read path (`housekeep.rs`), and hears publishes
//! and membership changes on the schema's channel. Each heartbeat
//! (`maintain`) moves the cursors, rebalances and takes the operator's
//! actions on halted heads.

mod housekeep;
mod own;
mod read;

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use futures::FutureExt;
use keyorder_core::key::from_stored_text;
use keyorder_core::raw::Room;
use keyorder_core::{Error, Inbound, Result, SourceEvent, SourceSpec, TransportSource};
use sqlx::postgres::PgListener;
use sqlx::Row;
use tokio::time::Instant;

use self::own::{keep_round, lock_kept, spawn_keeper, Busy, Kept, Ownership};
use self::read::Reader;
use crate::error::broker;
use crate::exec::q;
use crate::names::{members_payload, parse_scope, published_to};
use crate::pg::Pg;
use crate::track::{lock, Pos};

/// The ordered source: a member of one consumer group of one queue.
pub(crate) struct Source {
    /// The slots this member owns, and their keeper.
    own: Ownership,
    /// Where the next read's ties start.
    reader: Reader,
    /// What the next `maintain` reports (revoked scopes, resolved heads).
    events: Vec<SourceEvent>,
    /// The LISTEN connection: publishes and membership changes.
    listener: PgListener,
    /// When the last heartbeat (`maintain_now`) started.
    last_maintain: Option<Instant>,
    /// The acknowledgement sweep and retention in flight (`housekeep`).
    housekeeping: Option<tokio::task::JoinHandle<()>>,
}

impl Drop for Source {
    fn drop(&mut self) {
        if let Some(k) = self.own.keeper.take() {
            k.abort();
        }
    }
}

impl fmt::Debug for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Source")
            .field("queue", &self.own.spec.category)
            .field("group", &self.own.spec.group)
            .field("owned", &self.own.owned.keys().collect::<Vec<_>>())
            .finish()
    }
}

/// A LISTEN connection of its own (it keeps session state) on the schema's
/// channel, to the server itself.
async fn listen(t: &Pg) -> Result<PgListener> {
    let mut listener = PgListener::connect(t.direct_url()).await.map_err(broker)?;
    listener.listen(&t.sql.channel).await.map_err(broker)?;
    Ok(listener)
}

impl Source {
    /// Opens member `spec.instance` of the group it joined (at `epoch`,
    /// with `slots` slots): its LISTEN connection, a first heartbeat that
    /// takes its share of the slots, and the keeper of their leases.
    pub(crate) async fn open(t: Pg, spec: &SourceSpec, slots: u32, epoch: i64) -> Result<Source> {
        // LISTEN keeps session state: its own direct connection.
        let listener = match listen(&t).await {
            Ok(l) => l,
            Err(e) => {
                // Best effort: the member row written by `join_group` goes
                // (else it would hold off the group's removal for its TTL).
                let leave = q(&t.sql.leave)
                    .bind(&spec.category)
                    .bind(&spec.group)
                    .bind(&spec.instance);
                let _ = t.db.exec(leave).await;
                return Err(e);
            }
        };
        let kept = Arc::new(Mutex::new(Kept::default()));
        let mut source = Source {
            own: Ownership {
                t: t.clone(),
                spec: spec.clone(),
                slots,
                epoch,
                removed: false,
                owned: BTreeMap::new(),
                waiting: false,
                kept: kept.clone(),
                keeper: None,
            },
            reader: Reader::default(),
            events: Vec::new(),
            listener,
            last_maintain: None,
            housekeeping: None,
        };
        source.maintain_now().await?;
        lock_kept(&kept).touched = Some(Instant::now());
        source.own.keeper = Some(spawn_keeper(&t, spec, epoch, kept).await?);
        source.announce().await;
        Ok(source)
    }

    /// A notification: a membership change makes the next step rebalance
    /// at once instead of at the next heartbeat.
    fn noticed(&mut self, payload: &str) {
        if payload.starts_with("members\n") && payload == members_payload(&self.own.spec.category, &self.own.spec.group)
        {
            self.last_maintain = None;
        } else {
            match published_to(payload, &self.own.spec.category) {
                Some(Some(slot)) => {
                    if let Some(o) = self.own.owned.get_mut(&slot) {
                        o.dry = None;
                    }
                }
                Some(None) => self.own.all_wet(),
                None => {}
            }
        }
    }

    /// Tells the group's other members to rebalance now (a join, a leave,
    /// a slot handed over). Best effort: the heartbeat is the fallback.
    async fn announce(&self) {
        let payload = members_payload(&self.own.spec.category, &self.own.spec.group);
        if let Err(e) = self
            .own
            .t
            .db
            .exec(
                sqlx::query("select pg_notify($1, $2)")
                    .bind(&self.own.t.sql.channel)
                    .bind(&payload),
            )
            .await
        {
            tracing::debug!(error = %e, "membership notification not sent; members rebalance at their heartbeat");
        }
    }

    /// Heartbeat and lease renewal (which the keeper also does, every
    /// heartbeat, see `own::spawn_keeper`), rebalance, cursor
    /// advance, operator actions.
    async fn maintain_now(&mut self) -> Result<()> {
        let sql = self.own.t.sql.clone();
        let ex = self.own.t.db.clone();
        let ex = &ex;
        let spec = self.own.spec.clone();
        let (queue, grp, me) = (&spec.category, &spec.group, &spec.instance);
        let started = Instant::now();
        tracing::debug!(member = %me, owned = self.own.owned.len(), "maintain");
        // The keeper heartbeats and renews on its own cadence; this round
        // here as well finds the group removed under a member that stalled
        // (and renews what the keeper may not have). What either found (a
        // lease lost, the group gone) is taken first.
        keep_round(ex, &sql, &spec, self.own.epoch, &self.own.kept)
            .await
            .map_err(broker)?;
        self.own.take_kept()?;
        // The queue's layout is still the group's (C23): a count changed in
        // the table stops this subscription (in-flight work finishes).
        self.own
            .t
            .check_layout(queue, self.own.slots, "this consumer group", false)
            .await?;
        self.own.touch();
        self.own.advance_cursors().await?;
        self.own.touch();
        housekeep::start(&mut self.housekeeping, &self.own);
        self.own.rebalance(&mut self.events).await?;
        // Operator actions on halted heads of our slots.
        let slots: Vec<i32> = self.own.owned.keys().map(|s| *s as i32).collect();
        if !slots.is_empty() {
            for r in ex
                .all(q(&sql.resolved).bind(queue).bind(grp).bind(&slots).bind(me))
                .await
                .map_err(broker)?
            {
                let key = from_stored_text(&r.get::<String, _>(0)).into_owned();
                let action: String = r.get(1);
                let drop_head = action != "resume";
                let (slot, event_id): (i32, i64) = (r.get(2), r.get(3));
                let head: Pos = (
                    r.get::<Option<String>, _>(4).and_then(|t| t.parse().ok()).unwrap_or(0),
                    event_id,
                );
                if let Some(o) = self.own.owned.get_mut(&(slot as u32)) {
                    // The key's held events lie after its head: read them
                    // again from there (what is settled or in flight is
                    // skipped). The cursor never passed the head.
                    o.read = o.read.min(head);
                    o.dry = None;
                    if drop_head {
                        // Settled at the database by the operator: the cursor may pass it.
                        lock(&o.track).unsettled.remove(&head);
                    } else {
                        lock(&o.track).resumed.insert(head);
                    }
                }
                self.events.push(SourceEvent::Resolved { key, drop_head });
            }
        }
        self.last_maintain = Some(started);
        Ok(())
    }
}

#[async_trait]
impl TransportSource for Source {
    async fn fetch(&mut self, room: &Room, wait: Duration) -> Result<Vec<Inbound>> {
        let _busy = Busy::new(&self.own.kept);
        // What the LISTEN connection already holds is taken on every fetch,
        // busy or not: left unread, the server's notification queue would
        // grow behind this listener for as long as the load lasts.
        while let Some(Ok(n)) = self.listener.recv().now_or_never() {
            self.noticed(n.payload());
        }
        let batch = self.reader.read(&mut self.own, room).await?;
        if !batch.is_empty() {
            return Ok(batch);
        }
        // LISTEN/NOTIFY wakes us early; the timeout is the polling fallback.
        match tokio::time::timeout(wait, self.listener.recv()).await {
            Ok(Ok(n)) => {
                self.noticed(n.payload());
                while let Some(n) = self.listener.next_buffered() {
                    self.noticed(n.payload());
                }
            }
            Ok(Err(e)) => tracing::warn!(error = %e, "LISTEN connection failed; polling"),
            Err(_) => {}
        }
        // The polling fallback reads every slot (a notification may be lost).
        self.own.touch();
        self.own.all_wet();
        self.reader.read(&mut self.own, room).await
    }

    async fn maintain(&mut self) -> Result<Vec<SourceEvent>> {
        let _busy = Busy::new(&self.own.kept);
        self.own.take_kept()?;
        let every = if self.own.waiting {
            Duration::from_millis(100).min(self.own.spec.lease.heartbeat)
        } else {
            self.own.spec.lease.heartbeat
        };
        let due = self.last_maintain.is_none_or(|t| t.elapsed() >= every);
        // The cursor advances with the heartbeat, not on every fetch: each
        // advance is a write, and acknowledgements are durable anyway.
        if due {
            self.maintain_now().await?;
        }
        Ok(std::mem::take(&mut self.events))
    }

    async fn release(&mut self, scope: &str) -> Result<()> {
        let _busy = Busy::new(&self.own.kept);
        let Some(slot) = parse_scope(scope) else {
            return Err(Error::NotFound(format!("scope `{scope}`")));
        };
        self.own.advance_cursors().await?;
        if self.own.free(slot).await? {
            self.announce().await;
        }
        Ok(())
    }

    async fn close(&mut self) -> Result<()> {
        // Every cursor in one statement, then each slot freed; one
        // announcement at the end.
        // The housekeeping in flight first: it ends on its own.
        if let Some(h) = self.housekeeping.take() {
            let _ = h.await;
        }
        // The keeper stops before the leases go (its pool closes with it).
        if let Some(k) = self.own.keeper.take() {
            k.abort();
            let _ = k.await;
        }
        if self.own.removed {
            return Ok(());
        }
        self.own.advance_cursors().await?;
        let slots: Vec<u32> = self.own.owned.keys().copied().collect();
        for slot in slots {
            self.own.free(slot).await?;
        }
        // `release_all` also frees a lease acquired by a statement whose
        // future was dropped at shutdown (not in `owned`: it would stay live,
        // and its keys wait, until it expires); then leave.
        for sql in [&self.own.t.sql.release_all, &self.own.t.sql.leave] {
            self.own
                .t
                .db
                .exec(
                    q(sql)
                        .bind(&self.own.spec.category)
                        .bind(&self.own.spec.group)
                        .bind(&self.own.spec.instance),
                )
                .await
                .map_err(broker)?;
        }
        self.announce().await;
        Ok(())
    }
}
