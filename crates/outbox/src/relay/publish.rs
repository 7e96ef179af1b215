//! One record's publish, fenced by its slot's lease, and what follows
//! from its outcome (resolve, abandon, poison).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use keyorder_core::key::{from_stored_text, label};
use keyorder_core::{Error, Message, OrderingKey, PoisonPolicy};
use sqlx::Row;
use tokio::task::{Id, JoinSet};

use crate::sql::LEASE_QUEUE;
use crate::{category_ok, q, SEQ_HEADER};

use super::config::*;
use super::state::*;

/// Publishes one record: the fenced begin (attempt counted, earlier
/// records of the key resolved, key not halted), the publish awaited, then
/// the fenced mark. Every failure path is decided here.
/// Starts one record's publish task and books it under its slot.
pub(super) fn launch(
    (running, by_slot, meta): (&mut JoinSet<Outcome>, &mut HashMap<u32, usize>, &mut HashMap<Id, Meta>),
    ctx: &Arc<Ctx>,
    m: Meta,
    rec: Arc<Record>,
) {
    let handle = running.spawn(publish_one(ctx.clone(), m.slot, m.generation, rec));
    *by_slot.entry(m.slot).or_default() += 1;
    meta.insert(handle.id(), m);
}

pub(super) async fn publish_one(ctx: Arc<Ctx>, slot: u32, generation: i64, rec: Arc<Record>) -> Outcome {
    let key_label = label(&rec.key);
    let key = match OrderingKey::with_rules(&rec.key, ctx.client.key_rules()) {
        Ok(k) if category_ok(&rec.category) => k,
        Ok(_) => return abandon(&ctx, slot, generation, &rec, "invalid category name").await,
        Err(e) => return abandon(&ctx, slot, generation, &rec, &e.to_string()).await,
    };
    let begin_sql = if ctx.ignore_ordering {
        &ctx.sql.begin_unordered
    } else {
        &ctx.sql.begin
    };
    let begin = q(begin_sql)
        .bind(LEASE_QUEUE)
        .bind(&ctx.group)
        .bind(slot as i32)
        .bind(&ctx.me)
        .bind(generation)
        .bind(rec.id)
        .fetch_one(&ctx.pool)
        .await;
    let row = match begin {
        Ok(row) => row,
        Err(e) => return db_failed(&ctx, e),
    };
    let (owned, exists, earlier, halted): (i64, i64, i64, i64) = (row.get(0), row.get(1), row.get(2), row.get(3));
    let attempts: Option<i32> = row.get(4);
    let lease_ms: Option<i64> = row.get(5);
    if owned == 0 {
        bump(&ctx.stats.fenced, "keyorder_outbox_fenced_total");
        return Outcome::Fenced;
    }
    if exists == 0 {
        return Outcome::Resolved;
    }
    if halted > 0 {
        return Outcome::Halted;
    }
    let Some(attempts) = attempts.filter(|_| earlier == 0) else {
        bump(&ctx.stats.blocked, "keyorder_outbox_blocked_total");
        return Outcome::Blocked;
    };
    // Self-fence: start no publish with less than the margin of lease left.
    if lease_ms.is_none_or(|ms| ms < ctx.margin.as_millis() as i64) {
        return Outcome::Retry(Duration::from_millis(100));
    }
    let publisher = {
        let mut cache = ctx.publishers.lock().await;
        match cache.get(&rec.category) {
            Some(p) => Ok(p.clone()),
            None => match ctx.client.publisher(&rec.category).await {
                Ok(p) => {
                    cache.insert(rec.category.clone(), p.clone());
                    Ok(p)
                }
                Err(e) => Err(e),
            },
        }
    };
    let result = match publisher {
        Ok(p) => {
            p.publish_fenced(message_of(&rec, key), &ctx.fence(slot, generation))
                .await
        }
        Err(e) => Err(e),
    };
    match result {
        Ok(()) => match resolve(&ctx, slot, generation, &rec, "published", None).await {
            Ok(true) => {
                bump(&ctx.stats.published, "keyorder_outbox_published_total");
                Outcome::Resolved
            }
            Ok(false) => {
                tracing::warn!(key = %key_label, seq = rec.seq, "outbox relay: late confirmation refused by the fence");
                bump(&ctx.stats.fenced, "keyorder_outbox_fenced_total");
                Outcome::Fenced
            }
            // Published but not marked: it is published again later (the
            // consumer's SequenceGuard drops the repeat).
            Err(e) => db_failed(&ctx, e),
        },
        Err(Error::Key(e)) => abandon(&ctx, slot, generation, &rec, &e.to_string()).await,
        // The broker refused the publish: a later owner of the slot has
        // published (this relay lost the slot while it was stalled). Nothing
        // reached consumers; the new owner publishes the record.
        Err(Error::Fenced { .. }) => {
            tracing::warn!(key = %key_label, seq = rec.seq, "outbox relay: late publish refused by the broker's fence");
            bump(&ctx.stats.fenced, "keyorder_outbox_fenced_total");
            Outcome::Fenced
        }
        // The category refuses every publish (its scope layout changed while
        // in use, C23): no fault of this record. It waits, without being
        // parked or halted, until an operator fixes the category.
        // A transport that cannot do what was asked of it is a deployment
        // error, not this record's: it waits the same way.
        Err(e @ (Error::Config(_) | Error::Unsupported { .. })) => {
            tracing::error!(key = %key_label, seq = rec.seq, error = %e, "outbox relay: the category refuses publishes; waiting");
            Outcome::Retry(ctx.retry.max_backoff)
        }
        Err(e) => {
            let attempts = attempts.max(1) as u32;
            let max = match ctx.poison {
                PoisonPolicy::Park { max_attempts } => max_attempts,
                PoisonPolicy::Halt => ctx.retry.max_attempts,
            }
            .max(1);
            if attempts < max {
                bump(&ctx.stats.retries, "keyorder_outbox_retries_total");
                tracing::warn!(key = %key_label, seq = rec.seq, attempts, error = %e, "outbox relay: publish failed; retrying");
                return Outcome::Retry(ctx.retry.backoff(attempts));
            }
            let reason = format!("publish failed {attempts} times: {e}");
            poison(&ctx, slot, generation, &rec, &reason).await
        }
    }
}

pub(super) fn message_of(rec: &Record, key: OrderingKey) -> Message {
    let mut msg = Message::new(rec.payload.clone()).with_id(rec.message_id.clone());
    if let Ok(headers) = serde_json::from_str::<BTreeMap<String, String>>(&rec.headers) {
        for (k, v) in headers {
            msg = msg.with_header(k, from_stored_text(&v));
        }
    }
    if let Some(c) = &rec.correlation_id {
        msg = msg.with_correlation_id(from_stored_text(c));
    }
    msg.with_ordering_key(key).with_header(SEQ_HEADER, rec.seq.to_string())
}

pub(super) fn db_failed(ctx: &Ctx, e: sqlx::Error) -> Outcome {
    tracing::warn!(error = %e, "outbox relay: database error; retrying the key");
    Outcome::Retry(ctx.retry.initial_backoff.max(Duration::from_millis(100)))
}

/// The fenced mark: `true` when this owner, at this generation, resolved the
/// record (or it was already resolved); `false` when fenced.
pub(super) async fn resolve(
    ctx: &Ctx,
    slot: u32,
    generation: i64,
    rec: &Record,
    state: &str,
    reason: Option<&str>,
) -> std::result::Result<bool, sqlx::Error> {
    let row = q(&ctx.sql.resolve)
        .bind(LEASE_QUEUE)
        .bind(&ctx.group)
        .bind(slot as i32)
        .bind(&ctx.me)
        .bind(generation)
        .bind(rec.id)
        .bind(state)
        .bind(reason)
        .fetch_one(&ctx.pool)
        .await?;
    Ok(row.get::<i64, _>(0) > 0)
}

pub(super) async fn abandon(ctx: &Ctx, slot: u32, generation: i64, rec: &Record, reason: &str) -> Outcome {
    let reason = format!("abandoned: {reason}");
    match resolve(ctx, slot, generation, rec, "abandoned", Some(&reason)).await {
        Ok(true) => {
            tracing::warn!(key = %label(&rec.key), id = rec.message_id.as_str(), reason = reason.as_str(), "outbox relay: record can never be published");
            bump(&ctx.stats.abandoned, "keyorder_outbox_abandoned_total");
            Outcome::Resolved
        }
        Ok(false) => {
            bump(&ctx.stats.fenced, "keyorder_outbox_fenced_total");
            Outcome::Fenced
        }
        Err(e) => db_failed(ctx, e),
    }
}

pub(super) async fn poison(ctx: &Ctx, slot: u32, generation: i64, rec: &Record, reason: &str) -> Outcome {
    match ctx.poison {
        PoisonPolicy::Park { .. } => match resolve(ctx, slot, generation, rec, "parked", Some(reason)).await {
            Ok(true) => {
                tracing::warn!(key = %label(&rec.key), seq = rec.seq, reason, "outbox relay: poison record parked");
                bump(&ctx.stats.parked, "keyorder_outbox_parked_total");
                Outcome::Resolved
            }
            Ok(false) => {
                bump(&ctx.stats.fenced, "keyorder_outbox_fenced_total");
                Outcome::Fenced
            }
            Err(e) => db_failed(ctx, e),
        },
        PoisonPolicy::Halt => {
            let row = q(&ctx.sql.halt)
                .bind(LEASE_QUEUE)
                .bind(&ctx.group)
                .bind(slot as i32)
                .bind(&ctx.me)
                .bind(generation)
                .bind(rec.id)
                .bind(reason)
                .fetch_one(&ctx.pool)
                .await;
            match row.map(|r| r.get::<i64, _>(0)) {
                Ok(0) => {
                    bump(&ctx.stats.fenced, "keyorder_outbox_fenced_total");
                    Outcome::Fenced
                }
                Ok(_) => {
                    tracing::warn!(key = %label(&rec.key), seq = rec.seq, reason, "outbox relay: key halted on a poison record");
                    bump(&ctx.stats.halted, "keyorder_outbox_halted_total");
                    Outcome::Halted
                }
                Err(e) => db_failed(ctx, e),
            }
        }
    }
}
