//! Where a partition's progress is kept durably.
//!
//! Every durable step (an attempt begun, a halt, an acknowledgement) is a
//! *state record* in the category's state topic (`<topic>.keyorder-state`,
//! compacted, same partition count): partition `p` of the state topic holds
//! the state of the topic's partition `p`, keyed by the consumer group. A
//! record carries the owner's generation for the partition, the committed
//! offset (never past an unfinished message), and the unfinished offsets
//! above it with their attempts and halts (see `track`). A step is durable
//! once its record is acknowledged by the broker (`acks=all`).
//!
//! Records are keyed by the group *and generation* (`<group>#<generation>`):
//! compaction keeps the newest record of each key, so a stale owner's late
//! record can only replace its own generation's, never a newer owner's.
//!
//! A new owner *claims* a partition: it reads the group's pointer into the
//! state partition, appends a *marker* record, and reads from the pointer up
//! to its marker. The newest record of the highest generation is the saved
//! state. The claim's generation (the fencing token) is one more than the
//! larger of the marker's offset and every generation read: markers land in
//! the order claims are made, so a later claim always takes a higher
//! generation, whether or not the owners before it saved anything, and no
//! generation repeats.
//!
//! The pointer (the group's committed offset on the state partition) only
//! shortens that read, and it is moved with a check: at most every
//! [`CHECKPOINT_EVERY`] and at a hand-over the owner appends
//! a marker, reads from the pointer to it, and moves the pointer to its
//! newest record only if no record of a higher generation was found (else
//! the partition was lost: it is dropped at once). So the pointer names a
//! record that ranked highest when it was moved; a newer owner's records
//! all land after that, and a stalled owner's late commit cannot hide them
//! from the next claim. The topic partition's committed offset (for lag and
//! other tools) is committed without waiting, at most every 250 ms.
//!
//! Kafka's own commit metadata could carry the same text, but not every
//! Kafka-protocol broker keeps it (the test broker, tansu 0.6, drops it), and
//! a commit is refused while the group rebalances, which is exactly when a
//! hand-over needs its state.
//!
//! The rooms: `record` (the keys and values of the records), `read` (the
//! reader and the bounded read up to a marker), `claim` (claims, reads that
//! own nothing, pointer checks, tombstones) and `incarnation` (a static
//! member's incarnation records).

mod claim;
mod incarnation;
mod read;
mod record;
#[cfg(test)]
mod tests;

pub(crate) use self::claim::{advance, load, newer_claims, read_saved, tombstone, CHECKPOINT_EVERY};
pub(crate) use self::incarnation::{incarnation_partition, newer_incarnation, register_incarnation};
pub(crate) use self::read::{reader, Limit, Reader};
pub(crate) use self::record::{encode, record_key};
