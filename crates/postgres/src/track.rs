//! What the ordered source and the settlements of its deliveries share
//! about an owned slot: read positions, and the slot's [`Track`] of what is
//! delivered and not yet settled (the source moves the slot's cursor below
//! it; a settlement takes its delivery off it).

use std::collections::{BTreeSet, HashSet};
use std::sync::Mutex;

/// A read position: `(transaction id, event id)`.
pub(crate) type Pos = (u64, i64);

/// The delivered, not yet settled events of one owned slot, by read position
/// (bounded by what the dispatcher holds, whatever the slot's throughput).
#[derive(Debug, Default)]
pub(crate) struct Track {
    pub(crate) unsettled: BTreeSet<Pos>,
    /// Heads an operator resumed: their attempt count starts again.
    pub(crate) resumed: HashSet<Pos>,
    /// Events settled here (acknowledged or parked) since the slot's last
    /// read started: their settlement committed, but perhaps after that
    /// read's snapshot, so the read may still return them as unsettled
    /// while they are no longer in `unsettled`. A read after a rewind (a
    /// resolved halt) skips them: without this, an acknowledgement that
    /// committed between the re-read's snapshot and the handling of its
    /// rows was in neither place, and its event ran again behind the key's
    /// next one (`b1, b2, b1`). Emptied when a read starts: every
    /// settlement in it committed before that read's snapshot.
    pub(crate) settled: HashSet<Pos>,
}

impl Track {
    /// How far the cursor may move: just below the first unsettled event,
    /// and never past what was read (`read`). Every event at or below the
    /// read position was either delivered or is a halted key's held event,
    /// which sits above its unsettled head.
    pub(crate) fn cursor_target(&self, read: Pos) -> Pos {
        match self.unsettled.first() {
            Some(&(txid, id)) => read.min((txid, id - 1)),
            None => read,
        }
    }
}

/// The track, whatever a panic left behind.
pub(crate) fn lock(track: &Mutex<Track>) -> std::sync::MutexGuard<'_, Track> {
    track.lock().unwrap_or_else(|e| e.into_inner())
}
