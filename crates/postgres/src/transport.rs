//! `PgTransport`: connecting (`connect`, `from_url`) and the schema's upkeep
//! (`migrate`, `vacuum`, `durability`, `delete_queue`), a queue's slot count
//! and a consumer group's registration (`join_group`), and `impl Transport`,
//! which hands out the publishers, sources and admin of the other rooms.

use std::fmt;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use keyorder_core::{Admin, Capabilities, Error, Result, SourceSpec, Transport, TransportPublisher, TransportSource};
use sqlx::postgres::PgPoolOptions;
use sqlx::Row;

use crate::admin::{self, PgAdmin};
use crate::batch;
use crate::config::{Layout, PgConfig};
use crate::error::{broker, layout_error};
use crate::exec::{q, Exec};
use crate::pg::{ttl_ms, Pg};
use crate::plain;
use crate::publisher::PgPublisher;
use crate::schema;
use crate::source::Source;
use crate::sql::Sql;

/// What the PostgreSQL transport can do (with `layout=plain`, the benchmark
/// baseline, its publisher does not fence: `publish_fencing` is off).
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
    publish_fencing: true,
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
        admin::durability(&self.pg).await
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
        // A member stalled in here would hold the queue's row from every
        // other member and from retention: the server ends it after the
        // lease TTL.
        crate::exec::bound_idle(&mut tx, spec.lease.ttl).await.map_err(broker)?;
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
                    return Err(Error::broker(format!(
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
        if self.pg.cfg.layout == Layout::Plain {
            // The plain baseline's publisher appends without a fence.
            Capabilities {
                publish_fencing: false,
                ..CAPABILITIES
            }
        } else {
            CAPABILITIES
        }
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
        Ok(Box::new(Source::open(self.pg.clone(), spec, slots, epoch).await?))
    }

    fn admin(&self) -> Arc<dyn Admin> {
        Arc::new(PgAdmin { t: self.pg.clone() })
    }

    fn default_lease(&self) -> Option<keyorder_core::LeaseConfig> {
        self.pg.cfg.lease
    }
}
