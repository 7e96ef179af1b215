//! What a relay holds: the records of its owned slots, per key, and the
//! context its publish tasks share.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use keyorder_core::{Client, PoisonPolicy, PublishFence, Publisher, RetryPolicy};
use sqlx::postgres::PgPool;
use tokio::sync::Mutex as AsyncMutex;
use tokio::time::Instant;

use crate::sql::Sql;

use super::config::*;

/// One record as read.
#[derive(Debug)]
pub(super) struct Record {
    pub(super) id: i64,
    pub(super) message_id: String,
    pub(super) category: String,
    /// The key itself, decoded from its stored form.
    pub(super) key: String,
    pub(super) seq: i64,
    pub(super) correlation_id: Option<String>,
    pub(super) headers: String,
    pub(super) payload: Vec<u8>,
}

type KeyId = (String, String);

#[derive(Debug, Default)]
pub(super) struct KeyQueue {
    pub(super) records: BTreeMap<i64, Arc<Record>>,
    pub(super) busy: bool,
    /// The sequences being published ([`RelayConfig::ignore_ordering`] only,
    /// where one key has several publishes at once).
    pub(super) in_flight: BTreeSet<i64>,
    pub(super) not_before: Option<Instant>,
}

#[derive(Debug)]
pub(super) struct Owned {
    pub(super) generation: i64,
    pub(super) pos: (String, i64),
    pub(super) keys: HashMap<KeyId, KeyQueue>,
    pub(super) held: usize,
    pub(super) revoking: bool,
}

/// What one publish attempt came to.
#[derive(Debug)]
pub(super) enum Outcome {
    /// Published, abandoned, parked, or already resolved: the key moves on.
    Resolved,
    /// An earlier record of the key is still pending (not yet readable).
    Blocked,
    /// The key is halted.
    Halted,
    /// Try again after the delay.
    Retry(Duration),
    /// This relay no longer holds the slot at this generation.
    Fenced,
}

#[derive(Debug, Clone)]
pub(super) struct Meta {
    pub(super) slot: u32,
    pub(super) generation: i64,
    pub(super) key: KeyId,
    pub(super) seq: i64,
}

/// What every publish task shares.
pub(super) struct Ctx {
    pub(super) pool: PgPool,
    pub(super) sql: Arc<Sql>,
    pub(super) group: String,
    pub(super) me: String,
    pub(super) client: Client,
    pub(super) publishers: AsyncMutex<HashMap<String, Publisher>>,
    pub(super) retry: RetryPolicy,
    pub(super) poison: PoisonPolicy,
    pub(super) margin: Duration,
    pub(super) ignore_ordering: bool,
    pub(super) stats: Arc<RelayStats>,
    /// `outbox/{epoch}/{group hash}/`: a slot's publish fence scope is this
    /// and the slot number (set at the first step).
    pub(super) fence_prefix: std::sync::OnceLock<String>,
}

impl Ctx {
    /// The publish fence of `slot` at `generation`: brokers that fence
    /// publishes refuse this relay's publish once a later owner of the slot
    /// published.
    pub(super) fn fence(&self, slot: u32, generation: i64) -> PublishFence {
        PublishFence {
            scope: format!("{}{slot}", self.fence_prefix.get().map_or("outbox/", String::as_str)),
            token: generation.max(0) as u64,
        }
    }
}
