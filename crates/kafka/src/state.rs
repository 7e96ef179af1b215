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
//! After its records the owner commits two offsets, without waiting, at
//! most every 250 ms and at every hand-over: the topic partition's
//! committed offset (for lag and other tools), and the group's offset on
//! the state partition, pointing at its newest record. A
//! new owner reads the state partition from that pointer to its end and
//! takes the record with the highest generation (the latest of those): a
//! failed commit loses nothing, and a stale owner's late record (a lower
//! generation) is ignored. The new owner's generation is one more than
//! the highest claimed before its marker (see below).
//!
//! Each read appends a *marker* record (the group and partition) and reads
//! up to it. A marker is also a claim: the owner that appended it took the
//! generation one above everything before it, whether or not it saved a
//! record afterwards. So a reader counts every earlier marker of its group
//! and partition as a generation of its own: an owner that lost a
//! partition before saving anything still had a generation, and a late
//! record of it (a stalled owner's, landing after the next owner's
//! marker) ranks below the next owner's records instead of tying with
//! them.
//!
//! Kafka's own commit metadata could carry the same text, but not every
//! Kafka-protocol broker keeps it (the test broker, tansu 0.6, drops it), and
//! a commit is refused while the group rebalances, which is exactly when a
//! hand-over needs its state.

use std::collections::HashMap;
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::error::{KafkaError, KafkaResult};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Message as _, Offset, TopicPartitionList};

use crate::Names;

/// The key of the marker records a state read appends to find the end.
const MARKER_KEY: &[u8] = b"keyorder-marker";

/// A consumer outside any group that reads state records.
pub(crate) type Reader = BaseConsumer;

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
}

/// The value of a state record.
pub(crate) fn encode(generation: u64, committed: i64, meta: &str) -> String {
    format!("{generation}|{committed}|{meta}")
}

fn decode(value: &[u8]) -> Option<(u64, i64, String)> {
    let text = std::str::from_utf8(value).ok()?;
    let mut it = text.splitn(3, '|');
    let generation = it.next()?.parse().ok()?;
    let committed = it.next()?.parse().ok()?;
    Some((generation, committed, it.next()?.to_owned()))
}

/// Reads the saved progress of `parts` for `group_id`: the group's pointers
/// into the state partitions, then every record from there to the end
/// (read with `reader`, a consumer outside the group), up to a marker
/// record it appends with `producer`.
pub(crate) fn load<C: ConsumerContext>(
    member: &BaseConsumer<C>,
    reader: &Reader,
    producer: &FutureProducer,
    names: &Names,
    group_id: &str,
    parts: &[i32],
    timeout: Duration,
) -> KafkaResult<Vec<Saved>> {
    let state_topic = names.state();
    let mut tpl = TopicPartitionList::new();
    for p in parts {
        tpl.add_partition(&state_topic, *p);
    }
    let pointers = member.committed_offsets(tpl, timeout)?;
    let mut saved: HashMap<i32, Saved> = parts
        .iter()
        .map(|p| {
            (
                *p,
                Saved {
                    partition: *p,
                    committed: 0,
                    known: false,
                    generation: 0,
                    meta: String::new(),
                },
            )
        })
        .collect();
    // Where a partition ends is where a marker this read appends lands: the
    // high watermark cannot say (the test broker, tansu 0.6, moves it by one
    // per batch, not per record), and owners of other groups keep appending.
    let mut read = TopicPartitionList::new();
    let mut ends: HashMap<i32, i64> = HashMap::new();
    for e in pointers.elements() {
        let p = e.partition();
        let nonce = format!("{group_id}/{p}");
        let marker = FutureRecord::<[u8], [u8]>::to(&state_topic)
            .partition(p)
            .key(MARKER_KEY)
            .payload(nonce.as_bytes());
        let end = futures::executor::block_on(producer.send(marker, timeout))
            .map_err(|(e, _)| e)?
            .offset;
        let (low, _) = reader.fetch_watermarks(&state_topic, p, timeout)?;
        let from = match e.offset() {
            Offset::Offset(o) if o >= 0 => o.max(low),
            _ => low,
        };
        tracing::debug!(partition = p, pointer = ?e.offset(), low, end, "kafka: reading saved state");
        read.add_partition_offset(&state_topic, p, Offset::Offset(from.min(end)))?;
        ends.insert(p, end);
    }
    if ends.is_empty() {
        let mut out: Vec<Saved> = saved.into_values().collect();
        out.sort_by_key(|s| s.partition);
        return Ok(out);
    }
    reader.assign(&read)?;
    let deadline = std::time::Instant::now() + timeout;
    let mut best: HashMap<i32, (u64, i64)> = HashMap::new();
    // The highest generation claimed so far per partition: saved records'
    // generations, and one more for each earlier marker of this group.
    let mut claimed: HashMap<i32, u64> = HashMap::new();
    while !ends.is_empty() {
        if std::time::Instant::now() > deadline {
            let _ = reader.unassign();
            return Err(KafkaError::MessageConsumption(
                rdkafka::types::RDKafkaErrorCode::OperationTimedOut,
            ));
        }
        let Some(r) = reader.poll(Duration::from_millis(50)) else {
            continue;
        };
        let m = match r {
            Err(KafkaError::PartitionEOF(_)) => continue,
            other => other?,
        };
        let p = m.partition();
        let Some(end) = ends.get(&p).copied() else { continue };
        if m.offset() >= end {
            ends.remove(&p);
        }
        if m.key() == Some(MARKER_KEY) {
            if m.offset() < end && m.payload() == Some(format!("{group_id}/{p}").as_bytes()) {
                let c = claimed.entry(p).or_default();
                *c += 1;
            }
            continue;
        }
        if m.key() != Some(group_id.as_bytes()) {
            continue;
        }
        let Some((generation, committed, meta)) = m.payload().and_then(decode) else {
            continue;
        };
        let c = claimed.entry(p).or_default();
        *c = (*c).max(generation);
        let rank = (generation, m.offset());
        if best.get(&p).is_some_and(|b| *b > rank) {
            continue;
        }
        best.insert(p, rank);
        tracing::trace!(
            partition = p,
            offset = m.offset(),
            generation,
            committed,
            "kafka: saved state record"
        );
        if let Some(s) = saved.get_mut(&p) {
            s.committed = committed;
            s.known = true;
            s.generation = generation;
            s.meta = meta;
        }
    }
    reader.unassign()?;
    for (p, c) in claimed {
        if let Some(s) = saved.get_mut(&p) {
            s.generation = s.generation.max(c);
        }
    }
    let mut out: Vec<Saved> = saved.into_values().collect();
    out.sort_by_key(|s| s.partition);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_values_round_trip() {
        assert_eq!(
            decode(encode(3, 42, "ko1;n=8|x").as_bytes()),
            Some((3, 42, "ko1;n=8|x".into()))
        );
        assert_eq!(decode(b"junk"), None);
        assert_eq!(decode(&[0xff, b'|']), None);
    }
}
