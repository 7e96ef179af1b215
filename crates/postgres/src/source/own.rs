//! Ownership of slots: the slots this member holds ([`Owned`]) under fenced
//! leases, the keeper that renews them every heartbeat on a connection of
//! its own ([`Kept`], [`keep_round`]), taking and freeing slots, their fair
//! share over the group's live members, and each slot's durable cursor,
//! moved over its settled prefix.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use keyorder_core::raw::assign;
use keyorder_core::{Result, ScopeLease, SourceEvent, SourceSpec};
use sqlx::postgres::PgPoolOptions;
use sqlx::Row;
use tokio::time::Instant;

use crate::error::{broker, group_removed};
use crate::exec::{q, Exec};
use crate::names::scope_name;
use crate::pg::{ttl_ms, Pg};
use crate::sql::Sql;
use crate::track::{lock, Pos, Track};

/// A slot this member owns: its lease and where its reads and cursor are.
pub(super) struct Owned {
    pub(super) generation: i64,
    pub(super) lease: Arc<ScopeLease>,
    /// The next read starts after this position.
    pub(super) read: Pos,
    /// The slot's durable cursor as this owner last wrote it.
    pub(super) cursor: Pos,
    /// The slot's read mark when this owner took it: an event at or below
    /// it with no attempts recorded was delivered once by an earlier owner.
    pub(super) prior_mark: Pos,
    pub(super) track: Arc<Mutex<Track>>,
    pub(super) revoking: bool,
    /// When a read last returned fewer rows than it asked of this slot (it
    /// had read to the end of what was readable), if it has not read more
    /// since: see `Reader::read`.
    pub(super) dry: Option<Instant>,
}

impl Owned {
    /// Read to its end within the last [`DRY_FOR`], with no notification since.
    pub(super) fn is_dry(&self, now: Instant) -> bool {
        self.dry.is_some_and(|t| now.duration_since(t) < DRY_FOR)
    }
}

/// How long a slot that was read to its end gets no share of the read room
/// while other slots have events (unless a publish to it is noticed first).
/// Short, because an event held back by the commit-safe horizon sends no
/// notification when it becomes readable: under load it waits at most this
/// much longer than before; when idle, a read that comes back empty reads
/// the dry slots at once (see `Reader::read`).
const DRY_FOR: Duration = Duration::from_millis(20);

/// What this member of the group owns, and how it keeps it.
pub(super) struct Ownership {
    pub(super) t: Pg,
    pub(super) spec: SourceSpec,
    pub(super) slots: u32,
    /// The epoch of the group this member joined (`join_group`).
    pub(super) epoch: i64,
    /// The group was found removed: nothing of it is left to release (and
    /// a member of the same name in a group created again keeps its rows).
    pub(super) removed: bool,
    pub(super) owned: BTreeMap<u32, Owned>,
    /// A slot this member should own is still held by another: retry soon
    /// rather than at the next heartbeat.
    pub(super) waiting: bool,
    /// What the keeper renews and found (the owned slots' leases).
    pub(super) kept: Arc<Mutex<Kept>>,
    /// The keeper's task (heartbeat and renewal every heartbeat).
    pub(super) keeper: Option<tokio::task::JoinHandle<()>>,
}

/// A duration in milliseconds, as the lease statements take it.
fn ms(d: Duration) -> f64 {
    d.as_millis() as f64
}

impl Ownership {
    /// Takes what the keeper found: lost leases leave `owned`; a removed
    /// group stops the source.
    pub(super) fn take_kept(&mut self) -> Result<()> {
        let (lost, gone) = {
            let mut kept = lock_kept(&self.kept);
            (std::mem::take(&mut kept.lost), kept.gone)
        };
        for slot in lost {
            self.owned.remove(&slot);
        }
        if gone {
            self.gone();
            return Err(group_removed(&self.spec.category, &self.spec.group));
        }
        Ok(())
    }

    /// Records the loop's progress (see `Kept::alive`).
    pub(super) fn touch(&self) {
        lock_kept(&self.kept).touched = Some(Instant::now());
    }

    /// Removes an owned slot here and from the keeper's renewals.
    pub(super) fn disown(&mut self, slot: u32) -> Option<Owned> {
        lock_kept(&self.kept).held.remove(&slot);
        self.owned.remove(&slot)
    }

    /// The group this member joined is gone: every lease is lost, and
    /// `close` releases nothing.
    pub(super) fn gone(&mut self) {
        self.removed = true;
        lock_kept(&self.kept).held.clear();
        for (_, o) in std::mem::take(&mut self.owned) {
            o.lease.lose_to_broker();
        }
    }

    /// `sql` with this subscription's queue, group and `slot` bound as
    /// `$1`-`$3`.
    fn on_slot(
        &self,
        sql: &Arc<str>,
        slot: u32,
    ) -> sqlx::query::Query<'static, sqlx::Postgres, sqlx::postgres::PgArguments> {
        q(sql)
            .bind(&self.spec.category)
            .bind(&self.spec.group)
            .bind(slot as i32)
    }

    /// Takes the free or expired slots of `slots` in one statement, then
    /// reads their read marks in one more; returns how many it took. Each
    /// lease counts as confirmed from when the acquisition was sent.
    pub(super) async fn acquire(&mut self, slots: &[u32]) -> Result<usize> {
        let sent = Instant::now();
        let want: Vec<i32> = slots.iter().map(|s| *s as i32).collect();
        let rows = self
            .t
            .db
            .all(
                q(&self.t.sql.acquire_many)
                    .bind(&self.spec.category)
                    .bind(&self.spec.group)
                    .bind(&want)
                    .bind(&self.spec.instance)
                    .bind(ms(self.spec.lease.ttl)),
            )
            .await
            .map_err(broker)?;
        if rows.is_empty() {
            return Ok(0);
        }
        let taken: Vec<(u32, i64, Pos)> = rows
            .iter()
            .map(|r| {
                let txid: String = r.get(2);
                (
                    r.get::<i32, _>(0) as u32,
                    r.get::<i64, _>(1),
                    (txid.parse().unwrap_or(0), r.get::<i64, _>(3)),
                )
            })
            .collect();
        // Recorded before the read marks are asked for: should that fail,
        // the leases are still renewed and released like any other.
        for (slot, generation, cursor) in &taken {
            let lease = ScopeLease::new(
                scope_name(&self.spec.category, *slot),
                *generation as u64,
                &self.spec.lease,
                sent,
            );
            tracing::debug!(slot, generation, "slot acquired");
            lock_kept(&self.kept).held.insert(*slot, (*generation, lease.clone()));
            self.owned.insert(
                *slot,
                Owned {
                    generation: *generation,
                    lease,
                    read: *cursor,
                    cursor: *cursor,
                    prior_mark: (0, 0),
                    track: Arc::default(),
                    revoking: false,
                    dry: None,
                },
            );
        }
        let marks = self
            .t
            .db
            .all(
                q(&self.t.sql.read_marks)
                    .bind(&self.spec.category)
                    .bind(&self.spec.group)
                    .bind(taken.iter().map(|t| t.0 as i32).collect::<Vec<_>>()),
            )
            .await;
        let marks = match marks {
            Ok(m) => m,
            Err(e) => {
                // Without its read mark a slot would count an earlier
                // owner's delivery as a first attempt: none of them is
                // used (the next look takes them again, as their owner).
                for (slot, _, _) in &taken {
                    if let Some(o) = self.disown(*slot) {
                        o.lease.lose();
                    }
                }
                return Err(broker(e));
            }
        };
        for m in marks {
            let slot = m.get::<i32, _>(0) as u32;
            if let Some(o) = self.owned.get_mut(&slot) {
                o.prior_mark = (m.get::<String, _>(1).parse().unwrap_or(0), m.get(2));
            }
        }
        Ok(taken.len())
    }

    /// Frees an owned slot at the database, then here (on failure it stays
    /// owned here and the release is retried); `false` if it was not owned.
    pub(super) async fn free(&mut self, slot: u32) -> Result<bool> {
        let Some(o) = self.owned.get(&slot) else {
            return Ok(false);
        };
        self.t
            .db
            .exec(
                self.on_slot(&self.t.sql.release, slot)
                    .bind(&self.spec.instance)
                    .bind(o.generation),
            )
            .await
            .map_err(broker)?;
        o.lease.lose();
        self.disown(slot);
        Ok(true)
    }

    /// Moves each owned slot's cursor over its settled prefix (fenced).
    pub(super) async fn advance_cursors(&mut self) -> Result<()> {
        let moves: Vec<(u32, i64, Pos)> = self
            .owned
            .iter()
            .map(|(slot, o)| (*slot, o.generation, lock(&o.track).cursor_target(o.read), o.cursor))
            .filter(|(_, _, target, cursor)| target > cursor)
            .map(|(slot, generation, target, _)| (slot, generation, target))
            .collect();
        if moves.is_empty() {
            return Ok(());
        }
        let query = q(&self.t.sql.advance)
            .bind(&self.spec.category)
            .bind(&self.spec.group)
            .bind(moves.iter().map(|m| m.0 as i32).collect::<Vec<_>>())
            .bind(moves.iter().map(|m| m.1).collect::<Vec<_>>())
            .bind(moves.iter().map(|m| m.2 .0.to_string()).collect::<Vec<_>>())
            .bind(moves.iter().map(|m| m.2 .1).collect::<Vec<_>>())
            .bind(&self.spec.instance);
        let still: HashSet<u32> = self
            .t
            .db
            .all(query)
            .await
            .map_err(broker)?
            .iter()
            .map(|r| r.get::<i32, _>(0) as u32)
            .collect();
        let mut lost = Vec::new();
        for (slot, _, target) in &moves {
            match self.owned.get_mut(slot) {
                Some(o) if still.contains(slot) => o.cursor = *target,
                Some(_) => lost.push(*slot),
                None => {}
            }
        }
        for slot in lost {
            if let Some(o) = self.disown(slot) {
                o.lease.lose_to_broker();
            }
        }
        Ok(())
    }

    /// Every owned slot may have more (its dry mark goes).
    pub(super) fn all_wet(&mut self) {
        self.owned.values_mut().for_each(|o| o.dry = None);
    }

    /// A fair share of the slots over the group's live members (by the
    /// database's clock; `keyorder_core::raw::assign`, so a join or leave
    /// moves few slots): a slot another member should own is revoked (its
    /// `Revoke` goes to `events`), those this member should own are taken;
    /// while one is still held by another member, `waiting` is set and a
    /// group found gone stops the source.
    pub(super) async fn rebalance(&mut self, events: &mut Vec<SourceEvent>) -> Result<()> {
        let sql = self.t.sql.clone();
        let ex = self.t.db.clone();
        let ex = &ex;
        let spec = self.spec.clone();
        let (queue, grp, me) = (&spec.category, &spec.group, &spec.instance);
        let ttl = self.spec.lease.ttl;
        // Fair share over live members, by the database's clock.
        let live: Vec<String> = ex
            .all(q(&sql.live_members).bind(queue).bind(grp).bind(ms(ttl)))
            .await
            .map_err(broker)?
            .iter()
            .map(|r| r.get::<String, _>(0))
            .collect();
        self.waiting = false;
        // A member that does not find itself live (its keeper's heartbeats
        // failing) leaves the shares as they are.
        if live.iter().any(|m| m == me) {
            let mut wanted = Vec::new();
            let names: Vec<String> = (0..self.slots).map(|s| s.to_string()).collect();
            let owners = assign(&live, &names);
            for slot in 0..self.slots {
                let mine = owners.get(names[slot as usize].as_str()) == Some(&me.as_str());
                if let Some(o) = self.owned.get_mut(&slot) {
                    if !mine && !o.revoking {
                        o.revoking = true;
                        events.push(SourceEvent::Revoke(o.lease.scope().clone()));
                    }
                } else if mine {
                    wanted.push(slot);
                }
            }
            self.touch();
            if !wanted.is_empty() && self.acquire(&wanted).await? < wanted.len() {
                // Some still held by their previous owner (handing over,
                // or expiring): look again soon.
                self.waiting = true;
            }
        }
        self.touch();
        if self.waiting {
            // Held by other members, or gone with the group (removed after
            // this heartbeat): one look for the whole group, not one per slot.
            let rows: i64 = ex
                .one(q(&sql.group_slot_rows).bind(queue).bind(grp).bind(self.epoch))
                .await
                .map_err(broker)?
                .get(0);
            if rows < i64::from(self.slots) {
                self.gone();
                return Err(group_removed(queue, grp));
            }
        }
        Ok(())
    }
}

/// The leases a source's keeper renews ([`spawn_keeper`]),
/// and what its renewals found, for the source's next `maintain`.
#[derive(Default)]
pub(super) struct Kept {
    /// Slot -> the generation and lease the source holds it under.
    pub(super) held: BTreeMap<u32, (i64, Arc<ScopeLease>)>,
    /// Slots a renewal found lost (their leases are marked lost already).
    pub(super) lost: Vec<u32>,
    /// The heartbeat found the group gone.
    pub(super) gone: bool,
    /// When the source's loop last showed progress: a call (`maintain`,
    /// `fetch`, `release`) began or ended, or one of its statements
    /// returned.
    pub(super) touched: Option<Instant>,
}

impl Kept {
    /// The source's loop progressed within `ttl`. A loop that stalled (no
    /// longer calls the source, or waits on one statement) is renewed no
    /// longer, so its leases expire as they did when `maintain` renewed
    /// them (and its member is no longer live).
    pub(super) fn alive(&self, ttl: Duration) -> bool {
        self.touched.is_some_and(|t| t.elapsed() <= ttl)
    }
}

/// Records the loop's progress when a call begins and when it ends.
pub(super) struct Busy(Arc<Mutex<Kept>>);

impl Busy {
    pub(super) fn new(kept: &Arc<Mutex<Kept>>) -> Busy {
        lock_kept(kept).touched = Some(Instant::now());
        Busy(kept.clone())
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        lock_kept(&self.0).touched = Some(Instant::now());
    }
}

/// Starts the keeper of a source's leases (see [`Kept`]): every
/// heartbeat, on a connection of its own, one statement records the
/// member as seen and renews the slots it holds, whatever the source's
/// loop is doing. Renewed in `maintain`, a renewal waited behind the
/// loop's reads, settlements and acquisitions: at 400 ms round trips
/// `maintain` ran about every 7 s and a 3 s lease lapsed again and
/// again (issue 34). The connection skips the pool's liveness round
/// trip (a failed statement drops it; the next heartbeat tries again).
/// Its first round runs here: the connection and the prepared statement
/// are ready before the link may slow down.
pub(super) async fn spawn_keeper(
    t: &Pg,
    spec: &SourceSpec,
    epoch: i64,
    kept: Arc<Mutex<Kept>>,
) -> Result<tokio::task::JoinHandle<()>> {
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .test_before_acquire(false)
        .acquire_timeout(Duration::from_secs(10))
        .connect_lazy(&t.cfg.url)
        .map_err(broker)?;
    let ex = Exec {
        pool,
        pooled: t.cfg.pooled,
    };
    let sql = t.sql.clone();
    let spec = spec.clone();
    if !keep_round(&ex, &sql, &spec, epoch, &kept).await.map_err(broker)? {
        return Err(group_removed(&spec.category, &spec.group));
    }
    Ok(tokio::spawn(async move {
        let mut tick = tokio::time::interval(spec.lease.heartbeat.max(Duration::from_millis(10)));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            if !lock_kept(&kept).alive(spec.lease.ttl) {
                continue;
            }
            match keep_round(&ex, &sql, &spec, epoch, &kept).await {
                Ok(true) => {}
                Ok(false) => break,
                Err(e) => {
                    tracing::warn!(error = %e, "postgres: lease renewal failed; retried at the next heartbeat")
                }
            }
        }
        ex.pool.close().await;
    }))
}

/// One round of the keeper: heartbeat and renewal in one statement. Each
/// lease renewed at the generation it is held under is confirmed as of
/// when the statement was *sent*; one held but not renewed is lost. A
/// slot the source acquired or freed meanwhile is left alone. `false` once
/// the group is gone (the keeper stops).
pub(super) async fn keep_round(
    ex: &Exec,
    sql: &Sql,
    spec: &SourceSpec,
    epoch: i64,
    kept: &Mutex<Kept>,
) -> std::result::Result<bool, sqlx::Error> {
    let held: Vec<(u32, i64)> = lock_kept(kept).held.iter().map(|(s, (g, _))| (*s, *g)).collect();
    let sent = Instant::now();
    let row = ex
        .one(
            q(&sql.keep)
                .bind(&spec.category)
                .bind(&spec.group)
                .bind(&spec.instance)
                .bind(ttl_ms(spec.lease.ttl))
                .bind(epoch)
                .bind(held.iter().map(|(s, _)| *s as i32).collect::<Vec<_>>()),
        )
        .await?;
    let seen: i64 = row.get(0);
    let slots: Vec<i32> = row.get(1);
    let generations: Vec<i64> = row.get(2);
    let renewed: HashMap<u32, i64> = slots.iter().map(|s| *s as u32).zip(generations).collect();
    let mut kept = lock_kept(kept);
    if seen == 0 {
        kept.gone = true;
        return Ok(false);
    }
    for (slot, generation) in held {
        if kept.held.get(&slot).map(|(g, _)| *g) != Some(generation) {
            continue;
        }
        if renewed.get(&slot) == Some(&generation) {
            if let Some((_, lease)) = kept.held.get(&slot) {
                lease.confirm(sent);
            }
        } else if let Some((_, lease)) = kept.held.remove(&slot) {
            tracing::warn!(slot, generation, "slot lease lost");
            lease.lose_to_broker();
            kept.lost.push(slot);
        }
    }
    Ok(true)
}

/// The keeper's findings, whatever a panic left behind.
pub(super) fn lock_kept(kept: &Mutex<Kept>) -> std::sync::MutexGuard<'_, Kept> {
    kept.lock().unwrap_or_else(|e| e.into_inner())
}
