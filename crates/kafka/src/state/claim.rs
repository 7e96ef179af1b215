//! Claims and pointer checks: a new owner's claim (its saved state and
//! generation), a read that owns nothing, the check that moves a group's
//! pointers, and the tombstones of earlier owners' record keys.

use std::collections::HashMap;
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext};
use rdkafka::error::KafkaResult;
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Offset, TopicPartitionList};

use super::read::{append_markers, read_range, starts, Limit, Reader};
use super::record::{claim_marker, is_claim_marker, ranks_above, record_key, record_of, Record, MARKER_KEY};
use crate::names::Names;

/// A partition's saved progress.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Saved {
    pub(crate) partition: i32,
    /// The committed offset (0 when nothing was saved: from the start).
    pub(crate) committed: i64,
    /// Whether anything was saved.
    pub(crate) known: bool,
    /// The highest generation claimed before this read: the saved
    /// record's, or one per owner that appended a marker since (0: none).
    pub(crate) generation: u64,
    pub(crate) meta: String,
    /// The marker this claim appended (what tells its own claim from a
    /// newer owner's in later checks).
    pub(crate) claim: String,
    /// The generations of this group's records (keyed by
    /// [`record_key`]) the read found: the claim's owner deletes their keys
    /// once a record of its own is durable ([`tombstone`]).
    pub(crate) older: Vec<u64>,
}

/// Reads the saved progress of `parts` for `group_id`, claiming them: a
/// marker record is appended to each state partition (with `producer`),
/// then every record from the group's pointer up to that marker is read
/// (with `reader`, a consumer outside the group). The newest record of the
/// highest generation is the saved state. The claim's generation is above
/// the marker's offset and every generation read, so claims made later
/// (their markers land later) always rank higher, whatever was read.
/// Each step waits at most `timeout`, and the whole read as `limit` says.
#[allow(clippy::too_many_arguments)]
pub(crate) fn load<C: ConsumerContext>(
    member: &BaseConsumer<C>,
    reader: &Reader,
    producer: &FutureProducer,
    names: &Names,
    group_id: &str,
    parts: &[i32],
    timeout: Duration,
    limit: Limit<'_>,
) -> KafkaResult<Vec<Saved>> {
    load_as(member, reader, producer, names, group_id, parts, timeout, limit, true)
}

/// As [`load`], for a reader that owns nothing (an operator's view, a
/// subscription's check at open): its markers are not claims, so the
/// owners' claim checks do not take them for a newer owner's.
#[allow(clippy::too_many_arguments)]
pub(crate) fn read_saved<C: ConsumerContext>(
    member: &BaseConsumer<C>,
    reader: &Reader,
    producer: &FutureProducer,
    names: &Names,
    group_id: &str,
    parts: &[i32],
    timeout: Duration,
    limit: Limit<'_>,
) -> KafkaResult<Vec<Saved>> {
    load_as(member, reader, producer, names, group_id, parts, timeout, limit, false)
}

#[allow(clippy::too_many_arguments)]
fn load_as<C: ConsumerContext>(
    member: &BaseConsumer<C>,
    reader: &Reader,
    producer: &FutureProducer,
    names: &Names,
    group_id: &str,
    parts: &[i32],
    timeout: Duration,
    limit: Limit<'_>,
    claiming: bool,
) -> KafkaResult<Vec<Saved>> {
    let state_topic = names.state();
    let from = starts(member, reader, &state_topic, parts, timeout, limit)?;
    let claims: HashMap<i32, String> = parts
        .iter()
        .map(|p| {
            let marker = if claiming {
                claim_marker(group_id, *p)
            } else {
                format!("{group_id}/{p}/read")
            };
            (*p, marker)
        })
        .collect();
    let ends = append_markers(
        producer,
        &state_topic,
        parts,
        |p| claims.get(&p).cloned().unwrap_or_default(),
        timeout,
        limit,
    )?;
    let mut best: HashMap<i32, Record> = HashMap::new();
    let mut older: HashMap<i32, Vec<u64>> = HashMap::new();
    read_range(
        reader,
        &state_topic,
        &from,
        &ends,
        timeout,
        limit,
        |p, offset, key, value| {
            if let Some(r) = record_of(group_id, offset, key, value) {
                // Keyed by generation (not wave 1's group alone): deletable.
                if key != Some(group_id.as_bytes()) {
                    let seen = older.entry(p).or_default();
                    if !seen.contains(&r.generation) {
                        seen.push(r.generation);
                    }
                }
                tracing::trace!(
                    partition = p,
                    offset,
                    generation = r.generation,
                    committed = r.committed,
                    "kafka: saved state record"
                );
                if ranks_above(&r, best.get(&p)) {
                    best.insert(p, r);
                }
            }
        },
    )?;
    let mut out: Vec<Saved> = parts
        .iter()
        .map(|p| {
            let end = ends.get(p).copied().unwrap_or(0).max(0) as u64;
            let older = older.remove(p).unwrap_or_default();
            let claim = claims.get(p).cloned().unwrap_or_default();
            match best.remove(p) {
                Some(r) => Saved {
                    partition: *p,
                    committed: r.committed,
                    known: true,
                    generation: r.generation.max(end),
                    meta: r.meta,
                    claim,
                    older,
                },
                None => Saved {
                    partition: *p,
                    committed: 0,
                    known: false,
                    generation: end,
                    meta: String::new(),
                    claim,
                    older,
                },
            }
        })
        .collect();
    out.sort_by_key(|s| s.partition);
    Ok(out)
}

/// Deletes the keys of `group_id`'s records of `generations` on state
/// partition `partition`: a tombstone (a null value) each, so compaction
/// removes them and the topic does not keep one key per generation for
/// good. Called by the owner of a higher generation once a record of its
/// own is durable and its pointer check passed. No claim needs them then:
/// a read starts at the pointer, at or before that record, and ranks it
/// above every record tombstoned (all of lower generations); a claim's
/// generation rests on its marker's offset and on the records it reads,
/// and the newest record of the highest generation is never deleted. A
/// stale owner's record landing after the tombstone survives it, as it
/// would have without it, and ranks below.
pub(crate) async fn tombstone(
    producer: &FutureProducer,
    names: &Names,
    group_id: &str,
    partition: i32,
    generations: &[u64],
) -> KafkaResult<()> {
    let state_topic = names.state();
    for g in generations {
        let key = record_key(group_id, *g);
        let record = FutureRecord::<[u8], [u8]>::to(&state_topic)
            .partition(partition)
            .key(key.as_bytes());
        producer
            .send(record, Duration::from_secs(10))
            .await
            .map_err(|(e, _)| e)?;
    }
    Ok(())
}

/// The state partitions' pointers are moved, with a check ([`advance`]; see
/// the module doc), at most this often and at every hand-over. A new owner
/// reads the state partition from the pointer to its end, so a late pointer
/// only lengthens that read; an acknowledgement waits for its state record,
/// never for a pointer.
pub(crate) const CHECKPOINT_EVERY: Duration = Duration::from_secs(2);

/// Moves `group_id`'s pointers into the state partitions: `list` holds
/// `(partition, the writer's generation, offset of its newest record)`.
/// First it checks, as [`load`] reads, that no newer owner wrote: a marker
/// is appended and everything from the current pointer up to it is read;
/// a partition holding a record of a higher generation is returned (the
/// caller lost it) and its pointer is left alone. A pointer is so only
/// ever moved to a record that ranked highest when it was moved, and a
/// later owner's records all land after it: a stalled owner's late commit
/// cannot hide a newer owner's state from the next reader.
///
/// The pointers are read through `pointers`, a consumer of the group's id
/// that never joins (the member's own connection serves nothing else while
/// its join is pending, for as long as a rebalance takes); the commit goes
/// through `member`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn advance<C: ConsumerContext>(
    member: &BaseConsumer<C>,
    pointers: &BaseConsumer,
    reader: &Reader,
    producer: &FutureProducer,
    names: &Names,
    group_id: &str,
    list: &[(i32, u64, i64)],
    claims: &HashMap<i32, String>,
    timeout: Duration,
    mode: CommitMode,
    limit: Limit<'_>,
) -> KafkaResult<Vec<i32>> {
    let own: Vec<(i32, u64)> = list.iter().map(|(p, g, _)| (*p, *g)).collect();
    let stale = newer_claims(
        pointers, reader, producer, names, group_id, &own, claims, timeout, limit,
    )?;
    let mut tpl = TopicPartitionList::new();
    for (p, _, at) in list {
        if !stale.contains(p) {
            tpl.add_partition_offset(&names.state(), *p, Offset::Offset(*at))?;
        }
    }
    if tpl.count() > 0 {
        member.commit(&tpl, mode)?;
    }
    Ok(stale)
}

/// The partitions of `own` (`(partition, the owner's generation)`) that a
/// newer owner claimed or wrote: a marker is appended to each state
/// partition and everything from the current pointer up to it is read. A
/// record of a higher generation is a newer owner's; so is another claim
/// marker read after the owner's own (`claims`: the marker its claim
/// appended), or read at all when its own lies before the pointer (then
/// everything read came after it). A claim made before the check's marker
/// is seen; one made after it took its generation after this call began.
#[allow(clippy::too_many_arguments)]
pub(crate) fn newer_claims<C: ConsumerContext>(
    member: &BaseConsumer<C>,
    reader: &Reader,
    producer: &FutureProducer,
    names: &Names,
    group_id: &str,
    own: &[(i32, u64)],
    claims: &HashMap<i32, String>,
    timeout: Duration,
    limit: Limit<'_>,
) -> KafkaResult<Vec<i32>> {
    let state_topic = names.state();
    let parts: Vec<i32> = own.iter().map(|(p, _)| *p).collect();
    let from = starts(member, reader, &state_topic, &parts, timeout, limit)?;
    let ends = append_markers(
        producer,
        &state_topic,
        &parts,
        |p| format!("{group_id}/{p}/check"),
        timeout,
        limit,
    )?;
    let own: HashMap<i32, u64> = own.iter().copied().collect();
    let mut stale: Vec<i32> = Vec::new();
    // Per partition: its own claim marker was read; another's after it.
    let mut own_seen: HashMap<i32, bool> = HashMap::new();
    let mut foreign_after: HashMap<i32, bool> = HashMap::new();
    read_range(
        reader,
        &state_topic,
        &from,
        &ends,
        timeout,
        limit,
        |p, offset, key, value| {
            let Some(g) = own.get(&p) else { return };
            if stale.contains(&p) {
                return;
            }
            if let Some(r) = record_of(group_id, offset, key, value) {
                if r.generation > *g {
                    tracing::debug!(
                        partition = p,
                        offset,
                        generation = r.generation,
                        "kafka: a newer owner wrote this partition's state"
                    );
                    stale.push(p);
                }
            } else if let (Some(MARKER_KEY), Some(value), Some(mine)) = (key, value, claims.get(&p)) {
                if !is_claim_marker(value, group_id, p) {
                    return;
                }
                if value == mine.as_bytes() {
                    own_seen.insert(p, true);
                    foreign_after.insert(p, false);
                } else {
                    // A newer owner's claim, which may not have written
                    // anything yet, if it lies after this owner's.
                    foreign_after.insert(p, true);
                }
            }
        },
    )?;
    for (p, after) in foreign_after {
        if after && !stale.contains(&p) {
            tracing::debug!(
                partition = p,
                own_claim_read = own_seen.get(&p).copied().unwrap_or(false),
                "kafka: a newer owner claimed this partition"
            );
            stale.push(p);
        }
    }
    Ok(stale)
}
