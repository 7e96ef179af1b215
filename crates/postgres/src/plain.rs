//! The plain layout (`?layout=plain`): an unordered `FOR UPDATE SKIP LOCKED`
//! competing-consumer queue on the shape of `events`, the baseline
//! `keyorder bench` measures the ordered slot consumer against.
//!
//! A consumer claims rows (`locked_by`, `locked_until` on the database's
//! clock, `attempts` incremented by the claim), renews the locks of its
//! in-flight rows every heartbeat, and deletes a row to acknowledge it. Every
//! settlement is fenced by the claim, `(locked_by, attempts)`: once a lock
//! expired and another consumer (or this one, again) claimed the row, the
//! earlier delivery's acknowledgement and park fail with `Error::Fenced` and
//! change nothing. Every delivery has a lease of its own (one scope name per
//! queue), confirmed by the claim and by each renewal, so the self-fence
//! pauses exactly the rows whose locks are in doubt and a lost row loses only
//! itself. There is no per-key order and no halt.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use keyorder_core::raw::Room;
use keyorder_core::{
    Error, Inbound, Message, Result, ScopeLease, Settle, SourceEvent, SourceSpec, TransportPublisher, TransportSource,
};
use sqlx::postgres::PgListener;
use sqlx::{AssertSqlSafe, Row};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use crate::error::broker;
use crate::exec::{q, Exec};
use crate::pg::Pg;
use crate::wire::{headers_of, row_message, stored_key};

/// The most acknowledgements one statement carries.
const MAX_BATCH: usize = 256;

/// The statements of the plain layout for one schema (`AssertSqlSafe`: the
/// schema name was validated as an identifier before it is formatted in).
#[derive(Debug)]
struct PlainSql {
    /// `$1` queue, `$2` key, `$3` message id, `$4` correlation id, `$5`
    /// headers, `$6` payload, `$7` channel.
    publish: Arc<str>,
    /// `$1` queue, `$2` consumer, `$3` limit, `$4` lock TTL in ms.
    claim: Arc<str>,
    /// `$1` consumer, `$2` ids, `$3` claim tokens (attempts at the claim).
    ack: Arc<str>,
    /// `$1` consumer, `$2` lock TTL in ms, `$3` ids, `$4` claim tokens.
    renew: Arc<str>,
    /// `$1` consumer, `$2` ids, `$3` claim tokens, `$4` whether started.
    release: Arc<str>,
    /// `$1` id, `$2` consumer, `$3` claim token, `$4` group, `$5` reason.
    park: Arc<str>,
}

impl PlainSql {
    fn new(schema: &str) -> PlainSql {
        let f = |t: &str| -> Arc<str> { Arc::from(t.replace("{s}", schema)) };
        PlainSql {
            publish: f(
                "with ins as (insert into {s}.plain_events (queue, slot, key, message_id, correlation_id, headers, \
                 payload) values ($1, 0, $2, $3, $4, $5::jsonb, $6) returning 1) \
                 select pg_notify($7, $1) from ins",
            ),
            // Materialized: the locked ids are chosen once, then updated.
            claim: f(
                "with c as materialized (select id from {s}.plain_events where queue = $1 \
                 and (locked_until is null or locked_until < clock_timestamp()) \
                 order by id limit $3 for update skip locked) \
                 update {s}.plain_events p set locked_by = $2, \
                 locked_until = clock_timestamp() + make_interval(secs => $4::float8 / 1000), \
                 attempts = p.attempts + 1 from c where p.id = c.id \
                 returning p.id, p.attempts, p.key, p.message_id, p.correlation_id, p.headers::text, p.payload",
            ),
            // Acknowledgements, renewals and releases of one consumer touch
            // the same rows from concurrent statements: each locks its rows
            // in id order first (`l`), so two of them never deadlock (in
            // unnest order they did, and a deadlock stalls both for
            // `deadlock_timeout`).
            ack: f("with l as materialized (select p.id from {s}.plain_events p \
                 join unnest($2::bigint[], $3::int[]) as r(id, att) on p.id = r.id and p.attempts = r.att \
                 where p.locked_by = $1 order by p.id for update of p) \
                 delete from {s}.plain_events p using l where p.id = l.id returning p.id"),
            renew: f("with l as materialized (select p.id from {s}.plain_events p \
                 join unnest($3::bigint[], $4::int[]) as r(id, att) on p.id = r.id and p.attempts = r.att \
                 where p.locked_by = $1 order by p.id for update of p) \
                 update {s}.plain_events p \
                 set locked_until = clock_timestamp() + make_interval(secs => $2::float8 / 1000) \
                 from l where p.id = l.id returning p.id, p.attempts"),
            // A row handed back unstarted does not count the claim's attempt.
            release: f(
                "with l as materialized (select p.id, r.started from {s}.plain_events p \
                 join unnest($2::bigint[], $3::int[], $4::bool[]) as r(id, att, started) \
                 on p.id = r.id and p.attempts = r.att \
                 where p.locked_by = $1 order by p.id for update of p) \
                 update {s}.plain_events p set locked_by = null, locked_until = null, \
                 attempts = p.attempts - case when l.started then 0 else 1 end \
                 from l where p.id = l.id",
            ),
            park: f(
                "with d as (delete from {s}.plain_events where id = $1 and locked_by = $2 and attempts = $3 \
                 returning queue, id, message_id, key) \
                 insert into {s}.dead (queue, grp, event_id, message_id, key, reason) \
                 select queue, $4, id, message_id, key, $5 from d returning event_id",
            ),
        }
    }
}

/// The fix named when an ordered subscription meets the plain layout.
pub(crate) fn ordered_refused() -> Error {
    Error::Config(
        "an ordered subscription needs the slot layout: `layout=plain` is an unordered FOR UPDATE SKIP LOCKED \
         queue (the benchmark baseline); use `layout=slots` (the default: remove `layout=plain` from the \
         postgres:// URL)"
            .into(),
    )
}

/// A publisher of the plain layout.
pub(crate) async fn publisher(t: &Pg, queue: &str) -> Result<Arc<dyn TransportPublisher>> {
    Ok(Arc::new(PlainPublisher {
        t: t.clone(),
        queue: queue.to_owned(),
        sql: Arc::new(PlainSql::new(&t.cfg.schema)),
    }))
}

/// A source of the plain layout (unordered only).
pub(crate) async fn open(t: &Pg, spec: &SourceSpec) -> Result<Box<dyn TransportSource>> {
    if spec.ordered {
        return Err(ordered_refused());
    }
    Ok(Box::new(PlainSource::open(t.clone(), spec.clone()).await?))
}

struct PlainPublisher {
    t: Pg,
    queue: String,
    sql: Arc<PlainSql>,
}

impl fmt::Debug for PlainPublisher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PlainPublisher").field("queue", &self.queue).finish()
    }
}

#[async_trait]
impl TransportPublisher for PlainPublisher {
    async fn publish(&self, message: Message) -> Result<()> {
        let headers = headers_of(&message)?;
        let query = q(&self.sql.publish)
            .bind(&self.queue)
            .bind(message.key().map(stored_key))
            .bind(message.id())
            .bind(message.correlation_id().map(keyorder_core::key::stored_text))
            .bind(headers)
            .bind(message.payload().as_ref())
            .bind(&self.t.sql.channel);
        self.t.db.exec(query).await.map_err(|e| self.t.missing_schema(e))?;
        Ok(())
    }
}

/// One claimed row this consumer holds: its lease and whether a handler
/// started on it.
#[derive(Debug)]
struct Held {
    lease: Arc<ScopeLease>,
    started: AtomicBool,
}

/// The rows a source holds, by `(id, claim token)`, and those whose delivery
/// was dropped unsettled (handed back at the next heartbeat).
#[derive(Debug, Default)]
struct Holdings {
    held: HashMap<(i64, i32), Arc<Held>>,
    abandoned: Vec<(i64, i32, bool)>,
}

type Shared = Arc<Mutex<Holdings>>;

fn lock(h: &Shared) -> std::sync::MutexGuard<'_, Holdings> {
    h.lock().unwrap_or_else(|e| e.into_inner())
}

/// One acknowledgement for the batching task; the reply says whether the
/// claim still held (`false`: fenced).
struct AckReq {
    id: i64,
    token: i32,
    reply: oneshot::Sender<Result<bool>>,
}

/// Acknowledgements of concurrent deliveries share one statement (and one
/// commit); at low load a batch is one request, so nothing waits for a timer.
#[derive(Debug, Clone)]
struct Acker {
    tx: mpsc::UnboundedSender<AckReq>,
}

impl Acker {
    fn spawn(db: Exec, sql: Arc<str>, me: String) -> Acker {
        let (tx, mut rx) = mpsc::unbounded_channel::<AckReq>();
        tokio::spawn(async move {
            while let Some(batch) = crate::batch::next_batch(&mut rx, MAX_BATCH).await {
                let ids: Vec<i64> = batch.iter().map(|r| r.id).collect();
                let tokens: Vec<i32> = batch.iter().map(|r| r.token).collect();
                let query = sqlx::query(AssertSqlSafe(sql.clone()))
                    .bind(&me)
                    .bind(&ids)
                    .bind(&tokens);
                let rows = db.all(query).await;
                match rows {
                    Ok(rows) => {
                        let done: HashSet<i64> = rows.iter().map(|r| r.get::<i64, _>(0)).collect();
                        for req in batch {
                            let _ = req.reply.send(Ok(done.contains(&req.id)));
                        }
                    }
                    Err(e) => {
                        let msg = format!("postgres: {e}");
                        let temporary = crate::error::is_temporary(&e);
                        for req in batch {
                            let _ = req.reply.send(Err(Error::Broker(
                                keyorder_core::BrokerError::new(msg.clone()).with_temporary(temporary),
                            )));
                        }
                    }
                }
            }
        });
        Acker { tx }
    }

    async fn ack(&self, id: i64, token: i32) -> Result<bool> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(AckReq { id, token, reply })
            .map_err(|_| Error::broker("postgres: the acknowledgement batcher stopped"))?;
        rx.await
            .map_err(|_| Error::broker("postgres: the acknowledgement batcher dropped a request"))?
    }
}

/// The unordered source: claims with `FOR UPDATE SKIP LOCKED`, woken by
/// `LISTEN/NOTIFY` with a polling fallback.
pub(crate) struct PlainSource {
    t: Pg,
    spec: SourceSpec,
    sql: Arc<PlainSql>,
    scope: Arc<str>,
    listener: PgListener,
    holdings: Shared,
    acker: Acker,
    last_maintain: Option<Instant>,
}

impl fmt::Debug for PlainSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PlainSource")
            .field("queue", &self.spec.category)
            .field("group", &self.spec.group)
            .finish_non_exhaustive()
    }
}

fn ms(d: Duration) -> f64 {
    d.as_millis() as f64
}

impl PlainSource {
    async fn open(t: Pg, spec: SourceSpec) -> Result<Self> {
        let sql = Arc::new(PlainSql::new(&t.cfg.schema));
        // LISTEN keeps session state: its own direct connection.
        let mut listener = PgListener::connect(t.direct_url()).await.map_err(broker)?;
        listener.listen(&t.sql.channel).await.map_err(broker)?;
        let acker = Acker::spawn(t.db.clone(), sql.ack.clone(), spec.instance.clone());
        Ok(PlainSource {
            scope: Arc::from(format!("{}/all", spec.category)),
            t,
            spec,
            sql,
            listener,
            holdings: Shared::default(),
            acker,
            last_maintain: Some(Instant::now()),
        })
    }

    /// Claims up to `max` rows.
    async fn claim(&mut self, max: usize) -> Result<Vec<Inbound>> {
        let sent = Instant::now();
        let query = q(&self.sql.claim)
            .bind(&self.spec.category)
            .bind(&self.spec.instance)
            .bind(max.max(1) as i64)
            .bind(ms(self.spec.lease.ttl));
        let mut rows = self.t.db.all(query).await.map_err(|e| self.t.missing_schema(e))?;
        rows.sort_by_key(|r| r.get::<i64, _>(0));
        let mut out = Vec::with_capacity(rows.len());
        let mut holdings = lock(&self.holdings);
        for r in rows {
            let id: i64 = r.get(0);
            let token: i32 = r.get(1);
            let (msg, _) = row_message(&r, 2, &self.spec.key_rules);
            // Each row is its own lease: fresh from the claim's send time.
            let lease = ScopeLease::new(self.scope.clone(), token as u64, &self.spec.lease, sent);
            let held = Arc::new(Held {
                lease: lease.clone(),
                started: AtomicBool::new(false),
            });
            holdings.held.insert((id, token), held.clone());
            out.push(Inbound {
                message: msg,
                lease,
                settle: Box::new(PlainSettle {
                    t: self.t.clone(),
                    sql: self.sql.clone(),
                    acker: self.acker.clone(),
                    holdings: self.holdings.clone(),
                    held,
                    me: self.spec.instance.clone(),
                    grp: self.spec.group.clone(),
                    scope: self.scope.clone(),
                    id,
                    token,
                    retries: AtomicU32::new(0),
                    settled: AtomicBool::new(false),
                }),
            });
        }
        Ok(out)
    }

    /// Renews the locks of every held row; a row not renewed was claimed by
    /// another consumer after its lock expired: its lease is lost.
    async fn renew(&mut self) -> Result<()> {
        let rows: Vec<((i64, i32), Arc<Held>)> =
            lock(&self.holdings).held.iter().map(|(k, h)| (*k, h.clone())).collect();
        if rows.is_empty() {
            return Ok(());
        }
        let sent = Instant::now();
        let ids: Vec<i64> = rows.iter().map(|((id, _), _)| *id).collect();
        let tokens: Vec<i32> = rows.iter().map(|((_, t), _)| *t).collect();
        let query = q(&self.sql.renew)
            .bind(&self.spec.instance)
            .bind(ms(self.spec.lease.ttl))
            .bind(&ids)
            .bind(&tokens);
        let renewed: HashSet<(i64, i32)> = self
            .t
            .db
            .all(query)
            .await
            .map_err(broker)?
            .iter()
            .map(|r| (r.get::<i64, _>(0), r.get::<i32, _>(1)))
            .collect();
        let mut lost = 0usize;
        let mut holdings = lock(&self.holdings);
        for (k, held) in rows {
            if renewed.contains(&k) {
                held.lease.confirm(sent);
            } else if let Some(h) = holdings.held.remove(&k) {
                // Settled meanwhile (gone from `held` then), or lost.
                h.lease.lose_to_broker();
                lost += 1;
            }
        }
        drop(holdings);
        if lost > 0 {
            tracing::warn!(lost, queue = %self.spec.category, "plain: row locks lost to another consumer");
        }
        Ok(())
    }

    /// Hands rows back to the queue at once (no wait for the lock to expire).
    async fn hand_back(&self, rows: Vec<(i64, i32, bool)>) -> Result<()> {
        if rows.is_empty() {
            return Ok(());
        }
        let ids: Vec<i64> = rows.iter().map(|r| r.0).collect();
        let tokens: Vec<i32> = rows.iter().map(|r| r.1).collect();
        let started: Vec<bool> = rows.iter().map(|r| r.2).collect();
        let query = q(&self.sql.release)
            .bind(&self.spec.instance)
            .bind(&ids)
            .bind(&tokens)
            .bind(&started);
        self.t.db.exec(query).await.map_err(broker)?;
        Ok(())
    }

    async fn release_abandoned(&self) -> Result<()> {
        let rows = std::mem::take(&mut lock(&self.holdings).abandoned);
        if let Err(e) = self.hand_back(rows.clone()).await {
            // Retried at the next heartbeat; the locks expire meanwhile anyway.
            lock(&self.holdings).abandoned.extend(rows);
            return Err(e);
        }
        Ok(())
    }
}

#[async_trait]
impl TransportSource for PlainSource {
    async fn fetch(&mut self, room: &Room, wait: Duration) -> Result<Vec<Inbound>> {
        let max = room.max();
        let batch = self.claim(max).await?;
        if !batch.is_empty() {
            return Ok(batch);
        }
        // LISTEN/NOTIFY wakes us early; the timeout is the polling fallback
        // (and finds locks that expired).
        match tokio::time::timeout(wait, self.listener.recv()).await {
            Ok(Ok(_)) => while self.listener.next_buffered().is_some() {},
            Ok(Err(e)) => tracing::warn!(error = %e, "LISTEN connection failed; polling"),
            Err(_) => {}
        }
        self.claim(max).await
    }

    async fn maintain(&mut self) -> Result<Vec<SourceEvent>> {
        if self
            .last_maintain
            .is_none_or(|t| t.elapsed() >= self.spec.lease.heartbeat)
        {
            let sent = Instant::now();
            self.renew().await?;
            self.release_abandoned().await?;
            self.last_maintain = Some(sent);
        }
        Ok(Vec::new())
    }

    async fn release(&mut self, _scope: &str) -> Result<()> {
        Ok(())
    }

    async fn close(&mut self) -> Result<()> {
        // After the drain nothing runs: every row still held goes back.
        let rows: Vec<(i64, i32, bool)> = {
            let mut h = lock(&self.holdings);
            let mut rows = std::mem::take(&mut h.abandoned);
            for ((id, token), held) in h.held.drain() {
                held.lease.lose();
                rows.push((id, token, held.started.load(Ordering::SeqCst)));
            }
            rows
        };
        self.hand_back(rows).await
    }
}

struct PlainSettle {
    t: Pg,
    sql: Arc<PlainSql>,
    acker: Acker,
    holdings: Shared,
    held: Arc<Held>,
    me: String,
    grp: String,
    scope: Arc<str>,
    id: i64,
    /// The claim: `attempts` as the claim set it (the fence, with `me`).
    token: i32,
    /// Attempts after the first within this claim (counted here).
    retries: AtomicU32,
    settled: AtomicBool,
}

impl fmt::Debug for PlainSettle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PlainSettle")
            .field("id", &self.id)
            .field("token", &self.token)
            .finish()
    }
}

impl PlainSettle {
    fn fenced(&self) -> Error {
        Error::Fenced {
            scope: self.scope.to_string(),
            generation: self.token as u64,
        }
    }

    /// The row is settled (or no longer ours): stop renewing it.
    fn done(&self) {
        self.settled.store(true, Ordering::SeqCst);
        lock(&self.holdings).held.remove(&(self.id, self.token));
    }

    fn outcome(&self, ours: bool) -> Result<()> {
        self.done();
        if ours {
            Ok(())
        } else {
            self.held.lease.lose_to_broker();
            Err(self.fenced())
        }
    }
}

impl Drop for PlainSettle {
    fn drop(&mut self) {
        if self.settled.load(Ordering::SeqCst) {
            return;
        }
        // Dropped unsettled (shutdown, a lost lease): hand the row back.
        let mut h = lock(&self.holdings);
        if h.held.remove(&(self.id, self.token)).is_some() {
            h.abandoned
                .push((self.id, self.token, self.held.started.load(Ordering::SeqCst)));
        }
    }
}

#[async_trait]
impl Settle for PlainSettle {
    /// The claim counted the attempt durably (no round trip); a retry within
    /// the same claim is counted here, and the next claim counts again.
    async fn begin_attempt(&self) -> Result<u32> {
        if self.held.lease.is_lost() {
            return Err(self.fenced());
        }
        self.held.started.store(true, Ordering::SeqCst);
        Ok(self.token.max(1) as u32 + self.retries.fetch_add(1, Ordering::SeqCst))
    }

    async fn ack(&self) -> Result<()> {
        let ours = self.acker.ack(self.id, self.token).await?;
        self.outcome(ours)
    }

    async fn park(&self, reason: &str) -> Result<()> {
        let query = q(&self.sql.park)
            .bind(self.id)
            .bind(&self.me)
            .bind(self.token)
            .bind(&self.grp)
            .bind(reason);
        let row = self.t.db.opt(query).await.map_err(broker)?;
        self.outcome(row.is_some())
    }

    async fn halt(&self, _reason: &str) -> Result<()> {
        Err(Error::Unsupported {
            transport: "postgres".into(),
            capability: "halt_on_poison",
            fix: "the plain layout (`layout=plain`) is unordered and has no key to halt: use the Park poison policy, \
                  or an ordered subscription on `layout=slots`"
                .into(),
        })
    }
}
