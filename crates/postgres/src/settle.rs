//! `PgSettle`: `impl Settle` for a delivery of an owned slot. Attempt
//! counts and acknowledgements go through the batcher (`batch.rs`), parks
//! and halts run one statement each; every one is fenced on the slot's
//! owner and generation, and what it settled leaves the slot's track.

use std::fmt;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use keyorder_core::{Error, OrderingKey, Result, Settle};
use sqlx::Row;

use crate::batch;
use crate::error::broker;
use crate::exec::q;
use crate::names::scope_name;
use crate::pg::Pg;
use crate::track::{lock, Pos, Track};
use crate::wire::stored_key;

/// The settlement of one delivery: its slot, the generation it was read
/// under, and its read position.
pub(crate) struct PgSettle {
    pub(crate) t: Pg,
    pub(crate) queue: String,
    pub(crate) grp: String,
    pub(crate) me: String,
    pub(crate) slot: u32,
    pub(crate) generation: i64,
    /// The event's read position (its id is `pos.1`).
    pub(crate) pos: Pos,
    /// Attempts made so far, durable ones included.
    pub(crate) made: AtomicU32,
    pub(crate) message_id: String,
    pub(crate) key: Option<OrderingKey>,
    pub(crate) track: Arc<Mutex<Track>>,
}

impl fmt::Debug for PgSettle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgSettle")
            .field("slot", &self.slot)
            .field("event_id", &self.pos.1)
            .finish()
    }
}

impl PgSettle {
    fn fenced(&self) -> Error {
        Error::Fenced {
            scope: scope_name(&self.queue, self.slot).to_string(),
            generation: self.generation as u64,
        }
    }

    fn bind_own<'q>(
        &'q self,
        query: sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>,
    ) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
        query
            .bind(&self.queue)
            .bind(&self.grp)
            .bind(self.slot as i32)
            .bind(&self.me)
            .bind(self.generation)
            .bind(self.pos.1)
    }

    /// An attempt record (attempt number `n`) or acknowledgement, batched
    /// with other deliveries'.
    async fn batched(&self, kind: batch::Kind, n: u32) -> Result<Option<i32>> {
        self.t
            .batcher
            .ask(|reply| batch::Req {
                kind,
                queue: self.queue.clone(),
                grp: self.grp.clone(),
                me: self.me.clone(),
                slot: self.slot as i32,
                generation: self.generation,
                event_id: self.pos.1,
                txid: self.pos.0,
                n: n as i32,
                reply,
            })
            .await
    }

    /// Runs a fenced statement that answers how many owner rows matched.
    async fn fenced_exec(
        &self,
        query: sqlx::query::Query<'_, sqlx::Postgres, sqlx::postgres::PgArguments>,
    ) -> Result<()> {
        let owned: i64 = self.t.db.one(query).await.map_err(broker)?.get(0);
        if owned == 0 {
            Err(self.fenced())
        } else {
            Ok(())
        }
    }

    /// Acknowledged or parked, durably: no longer in flight, and not to be
    /// delivered again by a read whose snapshot predates the commit.
    fn settled(&self) {
        let mut track = lock(&self.track);
        track.unsettled.remove(&self.pos);
        track.settled.insert(self.pos);
    }
}

#[async_trait]
impl Settle for PgSettle {
    fn delivered_before(&self) -> bool {
        self.made.load(Ordering::SeqCst) > 0
    }

    async fn begin_attempt(&self) -> Result<u32> {
        if lock(&self.track).resumed.remove(&self.pos) {
            self.made.store(0, Ordering::SeqCst);
        }
        let n = self.made.load(Ordering::SeqCst) + 1;
        if n == 1 {
            // The read that delivered it moved the slot's read mark first,
            // durably: a later owner counts this attempt without a write.
            self.made.store(1, Ordering::SeqCst);
            return Ok(1);
        }
        match self.batched(batch::Kind::Attempt, n).await? {
            Some(recorded) => {
                self.made.store(recorded as u32, Ordering::SeqCst);
                Ok(recorded as u32)
            }
            None => Err(self.fenced()),
        }
    }

    async fn ack(&self) -> Result<()> {
        match self.batched(batch::Kind::Ack, 0).await? {
            Some(_) => {
                self.settled();
                Ok(())
            }
            None => Err(self.fenced()),
        }
    }

    async fn park(&self, reason: &str) -> Result<()> {
        let query = self
            .bind_own(q(&self.t.sql.park))
            .bind(&self.message_id)
            .bind(self.key.as_ref().map(stored_key))
            .bind(reason);
        self.fenced_exec(query).await?;
        self.settled();
        Ok(())
    }

    async fn halt(&self, reason: &str) -> Result<()> {
        let query = self
            .bind_own(q(&self.t.sql.halt))
            .bind(&self.message_id)
            .bind(self.key.as_ref().map_or(std::borrow::Cow::Borrowed(""), stored_key))
            .bind(reason)
            .bind(self.pos.0.to_string());
        self.fenced_exec(query).await
    }

    fn unread(&self) -> bool {
        // Held at the database: the read skips a halted key's later events,
        // and resolving the halt rewinds the slot's read to the head. The
        // cursor stays below the head meanwhile, so nothing is passed.
        lock(&self.track).unsettled.remove(&self.pos);
        true
    }
}
