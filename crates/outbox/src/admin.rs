//! Operations: the outbox's status, the records given up on, and the
//! operator's retry and discard; retention of published records.

use std::fmt;
use std::time::Duration;

use keyorder_core::key::{from_stored_text, label};
use keyorder_core::{Error, Result};
use sqlx::Row;

use crate::{db, q, Outbox};

/// The most records [`Outbox::abandoned`] returns in one call.
pub const MAX_LIST: usize = 10_000;

/// What the outbox holds now (one statement; [`Outbox::status`]). The relay
/// reports the same numbers as gauges.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct OutboxStatus {
    /// Records not yet published (held records included).
    pub pending: u64,
    /// How long the oldest pending record has waited (`None`: nothing pending).
    pub oldest_pending_age: Option<Duration>,
    /// Records abandoned (can never be published as they are).
    pub abandoned: u64,
    /// Records parked by the `Park` poison policy.
    pub parked: u64,
    /// Keys halted on a poison record (policy `Halt`): their records wait.
    pub held_keys: u64,
}

/// The state of an outbox record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordState {
    /// Waiting for a relay.
    Pending,
    /// Pending, and the head its key is halted on: nothing of the key moves
    /// until an operator retries or discards it.
    Held,
    /// Published and confirmed.
    Published,
    /// Given up on at once: it can never be published as it is.
    Abandoned,
    /// Parked in the dead table by the `Park` poison policy.
    Parked,
    /// Discarded by an operator.
    Discarded,
}

impl RecordState {
    fn parse(state: &str, held: bool) -> RecordState {
        match state {
            "pending" if held => RecordState::Held,
            "pending" => RecordState::Pending,
            "published" => RecordState::Published,
            "abandoned" => RecordState::Abandoned,
            "parked" => RecordState::Parked,
            _ => RecordState::Discarded,
        }
    }
}

impl fmt::Display for RecordState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            RecordState::Pending => "pending",
            RecordState::Held => "held",
            RecordState::Published => "published",
            RecordState::Abandoned => "abandoned",
            RecordState::Parked => "parked",
            RecordState::Discarded => "discarded",
        })
    }
}

/// A record given up on (abandoned or parked), as [`Outbox::abandoned`]
/// lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AbandonedRecord {
    /// The record's row id (what `retry` and `discard` take).
    pub record_id: i64,
    /// Its message id.
    pub message_id: String,
    /// The category.
    pub category: String,
    /// The key's log-safe label (`k#` + stable hash), never its value.
    pub label: String,
    /// Its per-key sequence.
    pub seq: u64,
    /// [`RecordState::Abandoned`] or [`RecordState::Parked`].
    pub state: RecordState,
    /// Why.
    pub reason: String,
}

/// The record an operator action applied to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Acted {
    /// The record's row id.
    pub record_id: i64,
    /// The category.
    pub category: String,
    /// The key's log-safe label.
    pub label: String,
    /// Its per-key sequence.
    pub seq: u64,
    /// Its state before the action.
    pub was: RecordState,
}

impl fmt::Display for Acted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "record {} ({} seq {} of {}, was {})",
            self.record_id, self.category, self.seq, self.label, self.was
        )
    }
}

/// The locked record of an operator action.
struct Locked {
    acted: Acted,
    category: String,
    /// The key's stored form (what the statements match).
    stored_key: String,
    /// The record its key is halted on, if the key is halted.
    halted_on: Option<i64>,
}

impl Outbox {
    /// Pending records, the age of the oldest, records abandoned and parked,
    /// and held keys, from one statement (through partial indexes: its cost
    /// grows with the pending records, not the table).
    pub async fn status(&self) -> Result<OutboxStatus> {
        let r = q(&self.sql.status)
            .fetch_one(&self.pool)
            .await
            .map_err(|e| self.missing_schema(e))?;
        let n = |i: usize| r.get::<i64, _>(i).max(0) as u64;
        let age: Option<f64> = r.get(1);
        Ok(OutboxStatus {
            pending: n(0),
            oldest_pending_age: age.map(|s| Duration::from_secs_f64(s.clamp(0.0, 1e12))),
            abandoned: n(2),
            parked: n(3),
            held_keys: n(4),
        })
    }

    /// Records given up on (abandoned or parked), by id, after `after_id`
    /// (0 for the first page), at most `limit` (capped at [`MAX_LIST`]).
    pub async fn abandoned(&self, after_id: i64, limit: usize) -> Result<Vec<AbandonedRecord>> {
        let rows = q(&self.sql.stuck)
            .bind(after_id)
            .bind(limit.min(MAX_LIST) as i64)
            .fetch_all(&self.pool)
            .await
            .map_err(|e| self.missing_schema(e))?;
        Ok(rows
            .iter()
            .map(|r| AbandonedRecord {
                record_id: r.get(0),
                message_id: r.get(1),
                category: r.get(2),
                label: label(&from_stored_text(&r.get::<String, _>(3))),
                seq: r.get::<i64, _>(4) as u64,
                state: RecordState::parse(&r.get::<String, _>(5), false),
                reason: r.get(6),
            })
            .collect())
    }

    /// Deletes one batch of at most `batch` published records, oldest
    /// first (pending, held, abandoned, parked and discarded records are
    /// never touched; the per-key counters stay, so sequences never go
    /// back). Returns how many were deleted. The relay runs it by itself
    /// when [`crate::RelayConfig::retention_batch`] is not 0.
    pub async fn delete_published(&self, batch: usize) -> Result<u64> {
        if batch == 0 {
            return Ok(0);
        }
        let done = q(&self.sql.retain)
            .bind(batch.min(1_000_000) as i64)
            .execute(&self.pool)
            .await
            .map_err(|e| self.missing_schema(e))?;
        Ok(done.rows_affected())
    }

    /// Releases a held record's key: its attempts start again and the halt goes.
    async fn release_key(&self, tx: &mut sqlx::PgConnection, l: &Locked) -> Result<()> {
        for stmt in [&self.sql.reset_attempts, &self.sql.unhalt] {
            q(stmt)
                .bind(&l.category)
                .bind(&l.stored_key)
                .execute(&mut *tx)
                .await
                .map_err(db)?;
        }
        Ok(())
    }

    async fn lock(&self, tx: &mut sqlx::PgConnection, record_id: i64) -> Result<Locked> {
        let row = q(&self.sql.lock_record)
            .bind(record_id)
            .fetch_optional(&mut *tx)
            .await
            .map_err(|e| self.missing_schema(e))?;
        let Some(r) = row else {
            return Err(Error::NotFound(format!(
                "no outbox record {record_id} in schema `{}`: list them with `keyorder outbox abandoned` \
                 or `keyorder outbox held`",
                self.cfg.schema
            )));
        };
        let (category, stored_key): (String, String) = (r.get(1), r.get(2));
        let halted_on: Option<i64> = r.get(5);
        let state: String = r.get(4);
        Ok(Locked {
            acted: Acted {
                record_id,
                category: category.clone(),
                label: label(&from_stored_text(&stored_key)),
                seq: r.get::<i64, _>(3) as u64,
                was: RecordState::parse(&state, halted_on == Some(record_id)),
            },
            category,
            stored_key,
            halted_on,
        })
    }

    /// Puts an abandoned, parked, discarded or held record back to pending,
    /// so the relays publish it again, in its key's sequence order: a held
    /// record's key is released (attempts reset); any other record gets a
    /// fresh transaction id, so running relays read it like a newly staged
    /// one, and later pending records of its key wait for it. Retry a key's
    /// records in sequence order.
    ///
    /// # Errors
    /// [`Error::NotFound`] when no such record exists, when it is published
    /// or pending (nothing to retry), or when a later record of its key was
    /// already published (or deleted): publishing this one now would reach
    /// consumers out of order (their `SequenceGuard` drops it); discard it
    /// instead, or stage its payload again as a new record.
    pub async fn retry(&self, record_id: i64) -> Result<Acted> {
        let mut tx = self.pool.begin().await.map_err(db)?;
        let l = self.lock(&mut tx, record_id).await?;
        let id = record_id;
        match l.acted.was {
            RecordState::Held => {
                self.release_key(&mut tx, &l).await?;
            }
            RecordState::Pending => {
                let why = match l.halted_on {
                    Some(head) => format!("its key is held on record {head}: retry or discard that one"),
                    None => "the relay publishes it; nothing to retry".to_owned(),
                };
                return Err(Error::NotFound(format!("outbox record {id} is pending: {why}")));
            }
            RecordState::Published => {
                return Err(Error::NotFound(format!(
                    "outbox record {id} is already published; nothing to retry"
                )));
            }
            RecordState::Abandoned | RecordState::Parked | RecordState::Discarded => {
                let r = q(&self.sql.later)
                    .bind(&l.category)
                    .bind(&l.stored_key)
                    .bind(l.acted.seq as i64)
                    .fetch_one(&mut *tx)
                    .await
                    .map_err(db)?;
                let (published, present, last): (i64, i64, Option<i64>) = (r.get(0), r.get(1), r.get(2));
                let expected = last.unwrap_or(0) - l.acted.seq as i64;
                if published > 0 || present < expected {
                    return Err(Error::NotFound(format!(
                        "outbox record {id} ({}) cannot be retried in order: a later record of its key was \
                         already published, so consumers would see seq {} out of order (SequenceGuard drops \
                         it); discard it with `keyorder outbox discard {id}`, or stage its payload again as a \
                         new record",
                        l.acted.label, l.acted.seq
                    )));
                }
                q(&self.sql.requeue).bind(id).execute(&mut *tx).await.map_err(db)?;
                q(&self.sql.undead).bind(id).execute(&mut *tx).await.map_err(db)?;
            }
        }
        tx.commit().await.map_err(db)?;
        tracing::warn!(record = id, key = %l.acted.label, seq = l.acted.seq, was = %l.acted.was,
            "operator retried an outbox record");
        Ok(l.acted)
    }

    /// Discards a held, abandoned or parked record: it is marked discarded
    /// (never published; kept for the record). Discarding a held record
    /// releases its key, so the key's later records flow.
    ///
    /// # Errors
    /// [`Error::NotFound`] when no such record exists, or it is published,
    /// already discarded, or pending and not held (a relay may be publishing
    /// it: only a held record is discarded while pending).
    pub async fn discard(&self, record_id: i64) -> Result<Acted> {
        let mut tx = self.pool.begin().await.map_err(db)?;
        let l = self.lock(&mut tx, record_id).await?;
        let id = record_id;
        match l.acted.was {
            RecordState::Held => {
                q(&self.sql.discard).bind(id).execute(&mut *tx).await.map_err(db)?;
                self.release_key(&mut tx, &l).await?;
            }
            RecordState::Abandoned | RecordState::Parked => {
                q(&self.sql.discard).bind(id).execute(&mut *tx).await.map_err(db)?;
                q(&self.sql.undead).bind(id).execute(&mut *tx).await.map_err(db)?;
            }
            RecordState::Pending => {
                let why = match l.halted_on {
                    Some(head) => format!("its key is held on record {head}: discard that one to release the key"),
                    None => {
                        "a relay may be publishing it; only held, abandoned or parked records are discarded".to_owned()
                    }
                };
                return Err(Error::NotFound(format!("outbox record {id} is pending: {why}")));
            }
            RecordState::Published | RecordState::Discarded => {
                return Err(Error::NotFound(format!(
                    "outbox record {id} is already {}; nothing to discard",
                    l.acted.was
                )));
            }
        }
        tx.commit().await.map_err(db)?;
        tracing::warn!(record = id, key = %l.acted.label, seq = l.acted.seq, was = %l.acted.was,
            "operator discarded an outbox record");
        Ok(l.acted)
    }
}
