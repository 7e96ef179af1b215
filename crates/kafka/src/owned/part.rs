//! One owned partition: its lease (the fence), its track of unfinished
//! messages, what its state rounds sent and saved, and the halted heads it
//! holds for the operator.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex};

use keyorder_core::ScopeLease;

use crate::track::Track;

/// One owned partition, shared with its deliveries' settles.
pub(crate) struct Part {
    pub(crate) partition: i32,
    pub(crate) lease: Arc<ScopeLease>,
    pub(crate) track: Mutex<Track>,
    /// The track version the newest state write carried (sent, durable).
    pub(crate) sent_version: AtomicU64,
    pub(crate) saved_version: AtomicU64,
    /// Being handed over: the committer still writes its state.
    pub(crate) releasing: AtomicBool,
    /// Halted heads held here, by offset (for the operator's actions).
    heads: Mutex<HashMap<i64, HeldHead>>,
    /// Generations of earlier owners' records the claim found, whose keys
    /// are deleted after this owner's first checked pointer move.
    pub(crate) superseded: Mutex<Vec<u64>>,
    /// The marker this owner's claim appended (see [`crate::state::newer_claims`]).
    pub(crate) claim: String,
}

/// A halted head as the owner keeps it.
#[derive(Clone)]
pub(crate) struct HeldHead {
    pub(crate) offset: i64,
    pub(crate) key: String,
    pub(crate) payload: keyorder_core::Bytes,
    pub(crate) headers: Option<rdkafka::message::OwnedHeaders>,
}

impl Part {
    /// Partition `partition`, owned under `lease`, with `track` (restored
    /// from its saved state), the generations of earlier owners' records its
    /// claim found (`superseded`), and the marker its claim appended.
    pub(crate) fn new(
        partition: i32,
        lease: Arc<ScopeLease>,
        track: Track,
        superseded: Vec<u64>,
        claim: String,
    ) -> Self {
        Part {
            partition,
            lease,
            track: Mutex::new(track),
            sent_version: AtomicU64::new(0),
            saved_version: AtomicU64::new(0),
            releasing: AtomicBool::new(false),
            heads: Mutex::default(),
            superseded: Mutex::new(superseded),
            claim,
        }
    }

    pub(crate) fn hold_head(&self, head: HeldHead) {
        self.heads
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(head.offset, head);
    }

    pub(crate) fn held_head(&self, key_label: &str) -> Option<HeldHead> {
        self.heads
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .find(|h| keyorder_core::key::label(&h.key) == key_label)
            .cloned()
    }

    pub(crate) fn forget_head(&self, offset: i64) {
        self.heads.lock().unwrap_or_else(|e| e.into_inner()).remove(&offset);
    }

    pub(crate) fn track(&self) -> std::sync::MutexGuard<'_, Track> {
        self.track.lock().unwrap_or_else(|e| e.into_inner())
    }
}
