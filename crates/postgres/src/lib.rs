#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]

mod admin;
mod batch;
mod config;
mod error;
mod exec;
mod names;
mod pg;
mod plain;
mod publisher;
mod schema;
mod settle;
pub mod shared;
mod sql;
mod track;
mod wire;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use futures::FutureExt;
use keyorder_core::key::from_stored_text;
use keyorder_core::{
    Admin, Capabilities, Error, Inbound, Result, ScopeLease, SourceEvent, SourceSpec, Transport, TransportPublisher,
    TransportSource,
};
use sqlx::postgres::{PgListener, PgPoolOptions};
use sqlx::Row;
use tokio::time::Instant;

use crate::admin::PgAdmin;
use crate::error::{broker, group_removed, layout_error};
use crate::exec::{q, Exec};
use crate::names::{members_payload, parse_scope, published_to, scope_name};
use crate::pg::{ttl_ms, Pg};
use crate::publisher::PgPublisher;
use crate::settle::PgSettle;
use crate::sql::Sql;
use crate::track::{lock, Pos, Track};
use crate::wire::row_message;

pub use config::{Layout, PgConfig, DEFAULT_SLOTS};
pub use names::slot_of;
pub use sqlx;

/// What the PostgreSQL transport can do (the same for every configuration).
pub const CAPABILITIES: Capabilities = Capabilities {
    cross_instance_affinity: true,
    fencing: true,
    self_fencing: true,
    crash_reclaim: true,
    halt_on_poison: true,
    park_and_release: true,
    correlated_ownership: false,
    dynamic_partitions: false,
    remap_window: false,
    multi_process: true,
    persistent: false,
};

/// The PostgreSQL transport. Clones share one pool.
#[derive(Clone)]
pub struct PgTransport {
    pg: Pg,
}

impl fmt::Debug for PgTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgTransport")
            .field("schema", &self.pg.cfg.schema)
            .field("slots", &self.pg.cfg.slots)
            .finish()
    }
}

/// Connections a transport opens, on demand, for settlements besides its
/// pool (`?pool=`): one statement in flight per kind and subscription.
pub const SETTLEMENT_CONNECTIONS: u32 = 4;

impl PgTransport {
    /// Connects (no migration: call [`PgTransport::migrate`] once per schema).
    pub async fn connect(cfg: PgConfig) -> Result<Self> {
        let pool = PgPoolOptions::new()
            .max_connections(cfg.max_connections)
            .acquire_timeout(Duration::from_secs(10))
            .connect(&cfg.url)
            .await
            .map_err(broker)?;
        let db = Exec {
            pool,
            pooled: cfg.pooled,
        };
        // Settlements (attempt counts, acknowledgements) are on every key's
        // path from one message to its next, so they get connections of
        // their own without sqlx's liveness round trip before each statement
        // (0.15 ms median here, about a tenth of an acknowledgement). A
        // connection that died is found by the statement itself, which
        // fails, is dropped by the pool and is retried by the dispatcher:
        // settlements are idempotent.
        let settle_pool = PgPoolOptions::new()
            .max_connections(SETTLEMENT_CONNECTIONS)
            .test_before_acquire(false)
            .acquire_timeout(Duration::from_secs(10))
            .connect_lazy(&cfg.url)
            .map_err(broker)?;
        let settle_db = Exec {
            pool: settle_pool,
            pooled: cfg.pooled,
        };
        let sql = Arc::new(Sql::new(&cfg.schema));
        let batcher = batch::Batcher::spawn(settle_db, sql.attempt_batch.clone(), sql.ack_batch.clone());
        let t = PgTransport {
            pg: Pg {
                db,
                sql,
                cfg: Arc::new(cfg),
                batcher,
            },
        };
        if t.pg.cfg.migrate {
            t.migrate().await?;
        }
        t.check_autovacuum().await;
        Ok(t)
    }

    /// Warns when the server runs without autovacuum: keyorder's tables
    /// take an insert and a delete per message (events, acknowledgements),
    /// so their dead rows would then pile up until a manual `VACUUM`, and
    /// every read and acknowledgement slows with them. Asked by the first
    /// transport a process connects, not by every one.
    async fn check_autovacuum(&self) {
        static CHECKED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        if CHECKED.swap(true, Ordering::Relaxed) {
            return;
        }
        let q = sqlx::query("select current_setting('autovacuum')").persistent(false);
        if let Ok(row) = self.pg.db.one(q).await {
            if row.try_get::<String, _>(0).is_ok_and(|v| v == "off") {
                tracing::warn!(
                    schema = %self.pg.cfg.schema,
                    "postgres: autovacuum is off on this server, so keyorder's tables keep their dead rows and \
                     slow down: turn autovacuum on, or run PgTransport::vacuum() (or `VACUUM`) on a schedule"
                );
            }
        }
    }

    /// `VACUUM (ANALYZE)` of every keyorder table of the schema: reclaims the
    /// dead rows that consumption leaves (each message is inserted once and
    /// deleted once, with its acknowledgement) and refreshes the planner's
    /// statistics. Autovacuum does this on a server where it is on (the
    /// default); call this on a schedule where it is off. Runs on a
    /// connection of its own to the direct URL (`direct=`), since `VACUUM`
    /// cannot run inside the transaction a pooler wraps around statements.
    /// It takes no lock that stops readers or writers.
    ///
    /// ```no_run
    /// # async fn run() -> keyorder_core::Result<()> {
    /// let t = keyorder_postgres::PgTransport::from_url(&"postgres://postgres@127.0.0.1/test".parse().unwrap()).await?;
    /// t.vacuum().await?;
    /// # Ok(()) }
    /// ```
    pub async fn vacuum(&self) -> Result<()> {
        schema::vacuum(self.pg.direct_url(), &self.pg.cfg.schema).await
    }

    /// What a commit of this transport's sessions waits for, as the server
    /// reports it to them: `synchronous_commit` and `fsync`, as
    /// `(name, value)` pairs. The ordering guarantee assumes
    /// `synchronous_commit` `on` (or stricter) and `fsync` `on`: with either
    /// relaxed (`?options=-c%20synchronous_commit%3Doff` on the URL, or the
    /// server's configuration), a crash of the server itself can lose
    /// acknowledgements, and then run a key's earlier messages again after
    /// its later ones. `keyorder bench` prints this, so a result measured
    /// on a relaxed set-up says so.
    ///
    /// ```no_run
    /// # async fn run() -> keyorder_core::Result<()> {
    /// let t = keyorder_postgres::PgTransport::from_url(&"postgres://postgres@127.0.0.1/test".parse().unwrap()).await?;
    /// for (name, value) in t.durability().await? {
    ///     println!("{name}={value}");
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn durability(&self) -> Result<Vec<(String, String)>> {
        let q = sqlx::query("select current_setting('synchronous_commit'), current_setting('fsync')").persistent(false);
        let row = self.pg.db.one(q).await.map_err(broker)?;
        Ok(vec![
            ("synchronous_commit".to_owned(), row.try_get(0).map_err(broker)?),
            ("fsync".to_owned(), row.try_get(1).map_err(broker)?),
        ])
    }

    /// Connects from a `postgres://` URL (see [`PgConfig::from_url`]).
    pub async fn from_url(url: &url::Url) -> Result<Self> {
        Self::connect(PgConfig::from_url(url)?).await
    }

    /// Applies the embedded migrations (`crates/postgres/migrations`) to the
    /// configured schema, creating it if needed, with sqlx's migrator: the
    /// applied versions are recorded in `<schema>._sqlx_migrations`, a
    /// changed migration is refused, and concurrent callers (several
    /// processes starting at once) take turns on the migrator's lock.
    ///
    /// Runs on a connection of its own to the direct URL (`direct=`), because
    /// the migrator's lock is a session-level advisory lock, which a
    /// transaction-mode pooler cannot keep.
    pub async fn migrate(&self) -> Result<()> {
        schema::migrate(self.pg.direct_url(), &self.pg.cfg.schema).await
    }

    /// Deletes a queue and everything kept for it (events of both layouts,
    /// slots, groups, acknowledgements, attempt counts, halted keys, dead
    /// letters, read marks, members, publish fences) in one transaction;
    /// returns the rows deleted. Refused while a slot of the queue has a
    /// live owner or a plain event is claimed: stop the queue's
    /// subscriptions first. A publisher still running would start the queue
    /// afresh.
    ///
    /// ```no_run
    /// # async fn run() -> keyorder_core::Result<()> {
    /// let t = keyorder_postgres::PgTransport::from_url(&"postgres://postgres@127.0.0.1/test".parse().unwrap()).await?;
    /// let rows = t.delete_queue("orders").await?;
    /// println!("deleted {rows} rows");
    /// # Ok(()) }
    /// ```
    pub async fn delete_queue(&self, queue: &str) -> Result<u64> {
        admin::delete_queue(&self.pg, queue).await
    }

    /// The queue's slot count, created with this transport's count if new;
    /// a different persisted count is refused (keys would move).
    async fn slots_of(&self, queue: &str) -> Result<u32> {
        self.pg
            .db
            .exec(q(&self.pg.sql.ensure_queue).bind(queue).bind(self.pg.cfg.slots as i32))
            .await
            .map_err(|e| self.pg.missing_schema(e))?;
        let n: i32 = self
            .pg
            .db
            .one(q(&self.pg.sql.queue_slots).bind(queue))
            .await
            .map_err(broker)?
            .get(0);
        if n as u32 != self.pg.cfg.slots {
            return Err(layout_error(queue, n as u32, "this transport", self.pg.cfg.slots));
        }
        Ok(n as u32)
    }

    /// Joins consumer group `grp` of `queue` as member `spec.instance`,
    /// creating the group on its first start: its slot count recorded (a
    /// different count is refused later), and a slot row per slot with its
    /// cursor at the start of the log, so a new group reads every event
    /// still retained, and its generation at the floor (above every
    /// generation a removed group of that name handed out). All in one
    /// transaction that first makes sure the queue's row exists (a
    /// `delete_queue` may have committed since `slots_of`) and holds it
    /// `for no key update`, which retention takes `for share` before it
    /// reads the groups' cursors: a retention statement that did not see the
    /// new group has committed before the group's first read, so the group
    /// starts at the oldest retained event and never reads a prefix of what
    /// that statement then deletes (a hole in its stream). The member's row
    /// is written in the same transaction, so a removal that comes after
    /// sees a live member (before its first heartbeat). Returns the group's
    /// epoch, which the member's heartbeats check.
    async fn join_group(&self, spec: &SourceSpec, slots: u32) -> Result<i64> {
        let (queue, grp) = (spec.category.as_str(), spec.group.as_str());
        let pooled = self.pg.cfg.pooled;
        let mut tx = self.pg.db.pool.begin().await.map_err(broker)?;
        // Created if missing, then locked; a deletion that commits in
        // between leaves nothing to lock (the locking read skips the
        // deleted row), so create it again.
        let mut tries = 0;
        let n: i32 = loop {
            q(&self.pg.sql.ensure_queue)
                .bind(queue)
                .bind(slots as i32)
                .persistent(!pooled)
                .execute(&mut *tx)
                .await
                .map_err(|e| self.pg.missing_schema(e))?;
            let row = q(&self.pg.sql.lock_queue_slots)
                .bind(queue)
                .persistent(!pooled)
                .fetch_optional(&mut *tx)
                .await
                .map_err(broker)?;
            match row {
                Some(r) => break r.get(0),
                None if tries < 5 => tries += 1,
                None => {
                    return Err(Error::Broker(format!(
                        "postgres: queue `{queue}` was deleted again and again while this member joined it; retrying"
                    )))
                }
            }
        };
        if n as u32 != slots {
            return Err(layout_error(queue, n as u32, "this transport", slots));
        }
        q(&self.pg.sql.ensure_group)
            .bind(queue)
            .bind(grp)
            .bind(slots as i32)
            .persistent(!pooled)
            .execute(&mut *tx)
            .await
            .map_err(broker)?;
        let row = q(&self.pg.sql.group_slots)
            .bind(queue)
            .bind(grp)
            .persistent(!pooled)
            .fetch_one(&mut *tx)
            .await
            .map_err(broker)?;
        let (n, epoch): (i32, i64) = (row.get(0), row.get(1));
        if n as u32 != slots {
            return Err(Error::Config(format!(
                "consumer group `{grp}` of queue `{queue}` started with {n} slots, the queue's layout now has \
                 {slots}: its slot leases and cursors are per slot. Fix: start a new group, or restore ?slots={n} \
                 (and the queue's count in the queues table)"
            )));
        }
        q(&self.pg.sql.ensure_slots)
            .bind(queue)
            .bind(grp)
            .bind(slots as i32)
            .persistent(!pooled)
            .execute(&mut *tx)
            .await
            .map_err(broker)?;
        q(&self.pg.sql.join_member)
            .bind(queue)
            .bind(grp)
            .bind(&spec.instance)
            .bind(ttl_ms(spec.lease.ttl))
            .persistent(!pooled)
            .execute(&mut *tx)
            .await
            .map_err(broker)?;
        tx.commit().await.map_err(broker)?;
        Ok(epoch)
    }
}

#[async_trait]
impl Transport for PgTransport {
    fn name(&self) -> &str {
        "postgres"
    }

    fn capabilities(&self) -> Capabilities {
        CAPABILITIES
    }

    fn affinity_fix(&self) -> String {
        "the PostgreSQL transport always pins a key to its slot's owner".into()
    }

    async fn publisher(&self, category: &str) -> Result<Arc<dyn TransportPublisher>> {
        if self.pg.cfg.layout == Layout::Plain {
            return plain::publisher(&self.pg, category).await;
        }
        let slots = self.slots_of(category).await?;
        Ok(Arc::new(PgPublisher::new(self.pg.clone(), category.to_owned(), slots)))
    }

    async fn open(&self, spec: &SourceSpec) -> Result<Box<dyn TransportSource>> {
        if self.pg.cfg.layout == Layout::Plain {
            return plain::open(&self.pg, spec).await;
        }
        let slots = self.slots_of(&spec.category).await?;
        let epoch = self.join_group(spec, slots).await?;
        // LISTEN keeps session state: its own direct connection.
        let listener = match self.listen().await {
            Ok(l) => l,
            Err(e) => {
                // Best effort: the member row written by `join_group` goes
                // (else it would hold off the group's removal for its TTL).
                let leave = q(&self.pg.sql.leave)
                    .bind(&spec.category)
                    .bind(&spec.group)
                    .bind(&spec.instance);
                let _ = self.pg.db.exec(leave).await;
                return Err(e);
            }
        };
        let kept = Arc::new(Mutex::new(Kept::default()));
        let mut source = PgSource {
            t: self.pg.clone(),
            spec: spec.clone(),
            slots,
            epoch,
            removed: false,
            owned: BTreeMap::new(),
            events: Vec::new(),
            listener,
            last_maintain: None,
            housekeeping: None,
            waiting: false,
            rotate: 0,
            kept: kept.clone(),
            keeper: None,
        };
        source.maintain_now().await?;
        lock_kept(&kept).touched = Some(Instant::now());
        source.keeper = Some(self.spawn_keeper(spec, epoch, kept).await?);
        source.announce().await;
        Ok(Box::new(source))
    }

    fn admin(&self) -> Arc<dyn Admin> {
        Arc::new(PgAdmin { t: self.pg.clone() })
    }
}

impl PgTransport {
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
    async fn spawn_keeper(
        &self,
        spec: &SourceSpec,
        epoch: i64,
        kept: Arc<Mutex<Kept>>,
    ) -> Result<tokio::task::JoinHandle<()>> {
        let pool = PgPoolOptions::new()
            .max_connections(1)
            .test_before_acquire(false)
            .acquire_timeout(Duration::from_secs(10))
            .connect_lazy(&self.pg.cfg.url)
            .map_err(broker)?;
        let ex = Exec {
            pool,
            pooled: self.pg.cfg.pooled,
        };
        let sql = self.pg.sql.clone();
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

    async fn listen(&self) -> Result<PgListener> {
        let mut listener = PgListener::connect(self.pg.direct_url()).await.map_err(broker)?;
        listener.listen(&self.pg.sql.channel).await.map_err(broker)?;
        Ok(listener)
    }
}

struct Owned {
    generation: i64,
    lease: Arc<ScopeLease>,
    /// The next read starts after this position.
    read: Pos,
    /// The slot's durable cursor as this owner last wrote it.
    cursor: Pos,
    /// The slot's read mark when this owner took it: an event at or below
    /// it with no attempts recorded was delivered once by an earlier owner.
    prior_mark: Pos,
    track: Arc<Mutex<Track>>,
    revoking: bool,
    /// When a read last returned fewer rows than it asked of this slot (it
    /// had read to the end of what was readable), if it has not read more
    /// since: see `PgSource::read`.
    dry: Option<Instant>,
}

impl Owned {
    /// Read to its end within the last [`DRY_FOR`], with no notification since.
    fn is_dry(&self, now: Instant) -> bool {
        self.dry.is_some_and(|t| now.duration_since(t) < DRY_FOR)
    }
}

/// How long a slot that was read to its end gets no share of the read room
/// while other slots have events (unless a publish to it is noticed first).
/// Short, because an event held back by the commit-safe horizon sends no
/// notification when it becomes readable: under load it waits at most this
/// much longer than before; when idle, a read that comes back empty reads
/// the dry slots at once (see `PgSource::read`).
const DRY_FOR: Duration = Duration::from_millis(20);

/// The leases a source's keeper renews (`PgTransport::spawn_keeper`),
/// and what its renewals found, for the source's next `maintain`.
#[derive(Default)]
struct Kept {
    /// Slot -> the generation and lease the source holds it under.
    held: BTreeMap<u32, (i64, Arc<ScopeLease>)>,
    /// Slots a renewal found lost (their leases are marked lost already).
    lost: Vec<u32>,
    /// The heartbeat found the group gone.
    gone: bool,
    /// When the source's loop last showed progress: a call (`maintain`,
    /// `fetch`, `release`) began or ended, or one of its statements
    /// returned.
    touched: Option<Instant>,
}

impl Kept {
    /// The source's loop progressed within `ttl`. A loop that stalled (no
    /// longer calls the source, or waits on one statement) is renewed no
    /// longer, so its leases expire as they did when `maintain` renewed
    /// them (and its member is no longer live).
    fn alive(&self, ttl: Duration) -> bool {
        self.touched.is_some_and(|t| t.elapsed() <= ttl)
    }
}

/// Records the loop's progress when a call begins and when it ends.
struct Busy(Arc<Mutex<Kept>>);

impl Busy {
    fn new(kept: &Arc<Mutex<Kept>>) -> Busy {
        lock_kept(kept).touched = Some(Instant::now());
        Busy(kept.clone())
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        lock_kept(&self.0).touched = Some(Instant::now());
    }
}

/// One round of the keeper: heartbeat and renewal in one statement. Each
/// lease renewed at the generation it is held under is confirmed as of
/// when the statement was *sent*; one held but not renewed is lost. A
/// slot the source acquired or freed meanwhile is left alone. `false` once
/// the group is gone (the keeper stops).
async fn keep_round(
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
            lease.lose();
            kept.lost.push(slot);
        }
    }
    Ok(true)
}

fn lock_kept(kept: &Mutex<Kept>) -> std::sync::MutexGuard<'_, Kept> {
    kept.lock().unwrap_or_else(|e| e.into_inner())
}

struct PgSource {
    t: Pg,
    spec: SourceSpec,
    slots: u32,
    /// The epoch of the group this member joined (`join_group`).
    epoch: i64,
    /// The group was found removed: nothing of it is left to release (and
    /// a member of the same name in a group created again keeps its rows).
    removed: bool,
    owned: BTreeMap<u32, Owned>,
    events: Vec<SourceEvent>,
    listener: PgListener,
    last_maintain: Option<Instant>,
    /// The acknowledgement sweep and retention in flight (`housekeep`).
    housekeeping: Option<tokio::task::JoinHandle<()>>,
    /// A slot this member should own is still held by another: retry soon
    /// rather than at the next heartbeat.
    waiting: bool,
    /// The slot number where the next read's ties start (modulo the slot count).
    rotate: usize,
    /// What the keeper renews and found (the owned slots' leases).
    kept: Arc<Mutex<Kept>>,
    /// The keeper's task (heartbeat and renewal every heartbeat).
    keeper: Option<tokio::task::JoinHandle<()>>,
}

impl Drop for PgSource {
    fn drop(&mut self) {
        if let Some(k) = self.keeper.take() {
            k.abort();
        }
    }
}

impl fmt::Debug for PgSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgSource")
            .field("queue", &self.spec.category)
            .field("group", &self.spec.group)
            .field("owned", &self.owned.keys().collect::<Vec<_>>())
            .finish()
    }
}

/// Runs one housekeeping statement; a failure is logged, and the next
/// heartbeat runs it again.
async fn housekeeping_step(ex: &Exec, query: exec::PgQuery<'_>, what: &str) {
    match ex.exec(query).await {
        Ok(done) if done.rows_affected() > 0 => tracing::debug!(deleted = done.rows_affected(), "{what}"),
        Ok(_) => {}
        Err(e) => tracing::warn!(error = %e, "postgres: {what} failed; retried at the next heartbeat"),
    }
}

/// Deletes, in each of `slots`, up to `batch` events every group of
/// `queue` has passed, in a transaction that first takes the queue's row
/// `for share`: a group created meanwhile waits for it (see
/// `PgTransport::join_group`), and the statement's snapshot, taken after
/// the lock, sees every group that exists.
async fn retention(ex: &Exec, sql: &Sql, queue: &str, slots: &[i32], batch: u32) -> Result<()> {
    let mut tx = ex.pool.begin().await.map_err(broker)?;
    q(&sql.share_queue)
        .bind(queue)
        .persistent(!ex.pooled)
        .execute(&mut *tx)
        .await
        .map_err(broker)?;
    let done = q(&sql.retention)
        .bind(queue)
        .bind(slots)
        .bind(i64::from(batch))
        .persistent(!ex.pooled)
        .execute(&mut *tx)
        .await
        .map_err(broker)?;
    tx.commit().await.map_err(broker)?;
    if done.rows_affected() > 0 {
        tracing::debug!(deleted = done.rows_affected(), "retention");
    }
    Ok(())
}

impl PgSource {
    fn ms(d: Duration) -> f64 {
        d.as_millis() as f64
    }

    /// A notification: a membership change makes the next step rebalance
    /// at once instead of at the next heartbeat.
    fn noticed(&mut self, payload: &str) {
        if payload.starts_with("members\n") && payload == members_payload(&self.spec.category, &self.spec.group) {
            self.last_maintain = None;
        } else {
            match published_to(payload, &self.spec.category) {
                Some(Some(slot)) => {
                    if let Some(o) = self.owned.get_mut(&slot) {
                        o.dry = None;
                    }
                }
                Some(None) => self.all_wet(),
                None => {}
            }
        }
    }

    /// Tells the group's other members to rebalance now (a join, a leave,
    /// a slot handed over). Best effort: the heartbeat is the fallback.
    async fn announce(&self) {
        let payload = members_payload(&self.spec.category, &self.spec.group);
        if let Err(e) = self
            .t
            .db
            .exec(
                sqlx::query("select pg_notify($1, $2)")
                    .bind(&self.t.sql.channel)
                    .bind(&payload),
            )
            .await
        {
            tracing::debug!(error = %e, "membership notification not sent; members rebalance at their heartbeat");
        }
    }

    /// Heartbeat and lease renewal (which the keeper also does, every
    /// heartbeat, see `PgTransport::spawn_keeper`), rebalance, cursor
    /// advance, operator actions.
    async fn maintain_now(&mut self) -> Result<()> {
        let sql = self.t.sql.clone();
        let ex = self.t.db.clone();
        let ex = &ex;
        let spec = self.spec.clone();
        let (queue, grp, me) = (&spec.category, &spec.group, &spec.instance);
        let ttl = self.spec.lease.ttl;
        let started = Instant::now();
        tracing::debug!(member = %me, owned = self.owned.len(), "maintain");
        // The keeper heartbeats and renews on its own cadence; this round
        // here as well finds the group removed under a member that stalled
        // (and renews what the keeper may not have). What either found (a
        // lease lost, the group gone) is taken first.
        keep_round(ex, &sql, &spec, self.epoch, &self.kept)
            .await
            .map_err(broker)?;
        self.take_kept()?;
        // The queue's layout is still the group's (C23): a count changed in
        // the table stops this subscription (in-flight work finishes).
        self.t
            .check_layout(queue, self.slots, "this consumer group", false)
            .await?;
        self.touch();
        self.advance_cursors().await?;
        self.touch();
        self.housekeep();
        // Fair share over live members, by the database's clock.
        let live: Vec<String> = ex
            .all(q(&sql.live_members).bind(queue).bind(grp).bind(Self::ms(ttl)))
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
            for slot in 0..self.slots {
                let want = &live[slot as usize % live.len()];
                let mine = want == me;
                if let Some(o) = self.owned.get_mut(&slot) {
                    if !mine && !o.revoking {
                        o.revoking = true;
                        self.events.push(SourceEvent::Revoke(o.lease.scope().clone()));
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
        // Operator actions on halted heads of our slots.
        let slots: Vec<i32> = self.owned.keys().map(|s| *s as i32).collect();
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
                if let Some(o) = self.owned.get_mut(&(slot as u32)) {
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

    /// Takes what the keeper found: lost leases leave `owned`; a removed
    /// group stops the source.
    fn take_kept(&mut self) -> Result<()> {
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
    fn touch(&self) {
        lock_kept(&self.kept).touched = Some(Instant::now());
    }

    /// Removes an owned slot here and from the keeper's renewals.
    fn disown(&mut self, slot: u32) -> Option<Owned> {
        lock_kept(&self.kept).held.remove(&slot);
        self.owned.remove(&slot)
    }

    /// The group this member joined is gone: every lease is lost, and
    /// `close` releases nothing.
    fn gone(&mut self) {
        self.removed = true;
        lock_kept(&self.kept).held.clear();
        for (_, o) in std::mem::take(&mut self.owned) {
            o.lease.lose();
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
    async fn acquire(&mut self, slots: &[u32]) -> Result<usize> {
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
                    .bind(Self::ms(self.spec.lease.ttl)),
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

    /// Housekeeping off the read path: the acknowledgements below this
    /// owner's durable cursors, then, in a bounded batch per owned slot,
    /// the events every group of the queue has passed. On a task of its
    /// own, one at a time (a heartbeat that finds the last one running
    /// skips it). Done inline, the two statements (100-130 ms together at
    /// 14,000 acknowledgements a second per instance, on 2 cores) held up
    /// the reads until the dispatcher's buffered work ran out. Off the read
    /// path the reads go on, though the sweep's own work still slows every
    /// key while it runs (BENCHMARKS.md, 2026-12-04, fourth session).
    /// Neither statement moves a cursor or needs the lease, so a sweep that
    /// outlives its slot is harmless; failures are logged and the next
    /// heartbeat tries again.
    fn housekeep(&mut self) {
        if self.owned.is_empty() || self.housekeeping.as_ref().is_some_and(|h| !h.is_finished()) {
            return;
        }
        let (db, sql) = (self.t.db.clone(), self.t.sql.clone());
        let (queue, grp, me) = (
            self.spec.category.clone(),
            self.spec.group.clone(),
            self.spec.instance.clone(),
        );
        let batch = self.t.cfg.retention_batch;
        let slots: Vec<i32> = self.owned.keys().map(|s| *s as i32).collect();
        self.housekeeping = Some(tokio::spawn(async move {
            let sweep = q(&sql.sweep_acked).bind(&queue).bind(&grp).bind(&me);
            housekeeping_step(&db, sweep, "acknowledgement sweep").await;
            if batch > 0 {
                if let Err(e) = retention(&db, &sql, &queue, &slots, batch).await {
                    tracing::warn!(error = %e, "postgres: retention failed; retried at the next heartbeat");
                }
            }
        }));
    }

    /// Frees an owned slot at the database, then here (on failure it stays
    /// owned here and the release is retried); `false` if it was not owned.
    async fn free(&mut self, slot: u32) -> Result<bool> {
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
    async fn advance_cursors(&mut self) -> Result<()> {
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
                o.lease.lose();
            }
        }
        Ok(())
    }

    /// Reads the readable owned slots. When only slots with no dry mark
    /// were read and they had nothing, the dry ones are read at once.
    async fn read(&mut self, max: usize, paused: &HashSet<Arc<str>>) -> Result<Vec<Inbound>> {
        let (batch, skipped_dry) = self.read_once(max, paused).await?;
        if !batch.is_empty() || !skipped_dry {
            return Ok(batch);
        }
        self.touch();
        self.all_wet();
        Ok(self.read_once(max, paused).await?.0)
    }

    /// Every owned slot may have more (its dry mark goes).
    fn all_wet(&mut self) {
        self.owned.values_mut().for_each(|o| o.dry = None);
    }

    /// One read statement; also says whether slots with a dry mark were
    /// left out.
    async fn read_once(&mut self, max: usize, paused: &HashSet<Arc<str>>) -> Result<(Vec<Inbound>, bool)> {
        let mut out = Vec::new();
        // Every readable owned slot in one round trip (one statement per
        // slot cost a round trip each on every fetch: milliseconds of
        // latency with a few slots).
        let readable: Vec<(u32, i64, Pos, usize)> = self
            .owned
            .iter()
            .filter(|(_, o)| !o.revoking && !paused.contains(o.lease.scope()) && !o.lease.is_lost())
            .map(|(slot, o)| (*slot, o.generation, o.read, lock(&o.track).unsettled.len()))
            .collect();
        if readable.is_empty() || max == 0 {
            return Ok((out, false));
        }
        // What was settled here before this point committed before the
        // statement below takes its snapshot, which shows it settled; what
        // settles from here on is remembered until the next read (see
        // `Track::settled`).
        for o in self.owned.values() {
            lock(&o.track).settled.clear();
        }
        // Slots that a recent read took to their end get no share while
        // others may have more: at 64 slots, the slots that had run out took
        // nearly all the room, those with a backlog got none once the room
        // was smaller than the slot count, the read came back empty, and
        // the fetch waited for a notification (100 ms gaps in a key's run).
        let now = Instant::now();
        let wet: Vec<(u32, i64, Pos, usize)> = readable
            .iter()
            .filter(|r| !self.owned.get(&r.0).is_some_and(|o| o.is_dry(now)))
            .copied()
            .collect();
        let skipped_dry = !wet.is_empty() && wet.len() < readable.len();
        let readable = if wet.is_empty() { readable } else { wet };
        // The room goes to the slots holding the least (water-filling), not
        // in even shares: a slot of few keys consumes slowly, and even
        // shares let its backlog fill the budget while a slot of many keys
        // starved. Ties start at the slot after the last read's start (by
        // slot number, whichever slots are readable), so every slot gets its
        // turn when there is less room than slots.
        let from = (self.rotate % self.slots.max(1) as usize) as u32;
        let start = readable.iter().position(|r| r.0 >= from).unwrap_or(0);
        let limits =
            keyorder_core::transport::fill_levels(&readable.iter().map(|r| r.3).collect::<Vec<_>>(), max, start);
        self.rotate = self.rotate.wrapping_add(1);
        let readable: Vec<(u32, i64, Pos, i32)> = readable
            .iter()
            .zip(&limits)
            .filter(|(_, lim)| **lim > 0)
            .map(|(r, lim)| (r.0, r.1, r.2, *lim as i32))
            .collect();
        if readable.is_empty() {
            return Ok((out, skipped_dry));
        }
        let rows = self
            .t
            .db
            .all(
                q(&self.t.sql.read)
                    .bind(&self.spec.category)
                    .bind(&self.spec.group)
                    .bind(readable.iter().map(|r| r.0 as i32).collect::<Vec<_>>())
                    .bind(readable.iter().map(|r| r.1).collect::<Vec<_>>())
                    .bind(readable.iter().map(|r| r.2 .0.to_string()).collect::<Vec<_>>())
                    .bind(readable.iter().map(|r| r.2 .1).collect::<Vec<_>>())
                    .bind(&self.spec.instance)
                    .bind(readable.iter().map(|r| r.3).collect::<Vec<_>>()),
            )
            .await
            .map_err(broker)?;
        let mut got: HashMap<u32, i32> = HashMap::new();
        for r in &rows {
            *got.entry(r.get::<i32, _>(0) as u32).or_default() += 1;
        }
        for (slot, _, _, lim) in &readable {
            if let Some(o) = self.owned.get_mut(slot) {
                o.dry = (got.get(slot).copied().unwrap_or(0) < *lim).then_some(now);
            }
        }
        for r in rows {
            let slot = r.get::<i32, _>(0) as u32;
            let Some(o) = self.owned.get_mut(&slot) else { continue };
            {
                let id: i64 = r.get(1);
                let txid: u64 = r.get::<String, _>(2).parse().unwrap_or(0);
                o.read = o.read.max((txid, id));
                // After a rewind (a resolved halt), what is still in flight
                // comes round again: it is delivered once; and what was
                // settled after this read's snapshot is not delivered again.
                {
                    let mut track = lock(&o.track);
                    if track.settled.contains(&(txid, id)) || !track.unsettled.insert((txid, id)) {
                        continue;
                    }
                }
                let (msg, key) = row_message(&r, 3, &self.spec.key_rules);
                let message_id = msg.id().to_owned();
                let recorded: i32 = r.get(8);
                // Attempts made before this delivery: as recorded, or one
                // if an earlier owner read it and recorded nothing.
                let before = if recorded > 0 {
                    recorded as u32
                } else {
                    u32::from((txid, id) <= o.prior_mark)
                };
                out.push(Inbound {
                    message: msg,
                    lease: o.lease.clone(),
                    settle: Box::new(PgSettle {
                        t: self.t.clone(),
                        queue: self.spec.category.clone(),
                        grp: self.spec.group.clone(),
                        me: self.spec.instance.clone(),
                        slot,
                        generation: o.generation,
                        pos: (txid, id),
                        made: AtomicU32::new(before),
                        message_id,
                        key,
                        track: o.track.clone(),
                    }),
                });
            }
        }
        Ok((out, skipped_dry))
    }
}

#[async_trait]
impl TransportSource for PgSource {
    async fn fetch(&mut self, max: usize, paused: &HashSet<Arc<str>>, wait: Duration) -> Result<Vec<Inbound>> {
        let _busy = Busy::new(&self.kept);
        // What the LISTEN connection already holds is taken on every fetch,
        // busy or not: left unread, the server's notification queue would
        // grow behind this listener for as long as the load lasts.
        while let Some(Ok(n)) = self.listener.recv().now_or_never() {
            self.noticed(n.payload());
        }
        let batch = self.read(max, paused).await?;
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
        self.touch();
        self.all_wet();
        self.read(max, paused).await
    }

    async fn maintain(&mut self) -> Result<Vec<SourceEvent>> {
        let _busy = Busy::new(&self.kept);
        self.take_kept()?;
        let every = if self.waiting {
            Duration::from_millis(100).min(self.spec.lease.heartbeat)
        } else {
            self.spec.lease.heartbeat
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
        let _busy = Busy::new(&self.kept);
        let Some(slot) = parse_scope(scope) else {
            return Err(Error::NotFound(format!("scope `{scope}`")));
        };
        self.advance_cursors().await?;
        if self.free(slot).await? {
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
        if let Some(k) = self.keeper.take() {
            k.abort();
            let _ = k.await;
        }
        if self.removed {
            return Ok(());
        }
        self.advance_cursors().await?;
        let slots: Vec<u32> = self.owned.keys().copied().collect();
        for slot in slots {
            self.free(slot).await?;
        }
        // `release_all` also frees a lease acquired by a statement whose
        // future was dropped at shutdown (not in `owned`: it would stay live,
        // and its keys wait, until it expires); then leave.
        for sql in [&self.t.sql.release_all, &self.t.sql.leave] {
            self.t
                .db
                .exec(
                    q(sql)
                        .bind(&self.spec.category)
                        .bind(&self.spec.group)
                        .bind(&self.spec.instance),
                )
                .await
                .map_err(broker)?;
        }
        self.announce().await;
        Ok(())
    }
}
