//! Where a partition's progress is kept durably.
//!
//! Every durable step (an attempt begun, a halt, an acknowledgement) is one
//! *state record* in the category's state topic (`<topic>.keyorder-state`,
//! compacted, same partition count; partition `p` holds the state of the
//! topic's partition `p`, keyed by the consumer group), followed by one
//! offset commit that moves two offsets at once: the topic partition's
//! committed offset (never past an unfinished message), and the group's
//! offset on the state partition, which points at the newest state record.
//! A new owner reads the record the pointer names.
//!
//! Kafka's own commit metadata could carry the same text, but not every
//! Kafka-protocol broker keeps it (the test broker, tansu 0.6, drops it), so
//! the state lives in a topic every broker keeps.

use std::collections::HashMap;
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::error::{KafkaError, KafkaResult};
use rdkafka::{Message as _, Offset, TopicPartitionList};

use crate::Names;

/// A partition's saved progress: the committed offset and the metadata
/// (see `track`) that goes with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Saved {
    pub(crate) partition: i32,
    /// The committed offset (0 when the group never committed: from the start).
    pub(crate) committed: i64,
    /// Whether the group ever committed here.
    pub(crate) known: bool,
    pub(crate) meta: String,
}

/// The value of a state record.
pub(crate) fn encode(committed: i64, meta: &str) -> String {
    format!("{committed}|{meta}")
}

fn decode(value: &[u8]) -> Option<(i64, String)> {
    let text = std::str::from_utf8(value).ok()?;
    let (c, meta) = text.split_once('|')?;
    Some((c.parse().ok()?, meta.to_owned()))
}

/// Reads the saved progress of `parts` for `group_id`: the committed
/// offsets, then the state records their pointers name (read with `reader`,
/// a consumer outside the group).
pub(crate) fn load<C: ConsumerContext>(
    member: &BaseConsumer<C>,
    reader: &BaseConsumer,
    names: &Names,
    group_id: &str,
    parts: &[i32],
    timeout: Duration,
) -> KafkaResult<Vec<Saved>> {
    let state_topic = names.state();
    let mut tpl = TopicPartitionList::new();
    for p in parts {
        tpl.add_partition(names.topic(), *p);
        tpl.add_partition(&state_topic, *p);
    }
    let committed = member.committed_offsets(tpl, timeout)?;
    let mut saved: HashMap<i32, Saved> = HashMap::new();
    let mut pointers = TopicPartitionList::new();
    let mut wanted: HashMap<i32, i64> = HashMap::new();
    for e in committed.elements() {
        let off = match e.offset() {
            Offset::Offset(o) if o >= 0 => Some(o),
            _ => None,
        };
        if e.topic() == names.topic() {
            let s = saved.entry(e.partition()).or_insert(Saved {
                partition: e.partition(),
                committed: 0,
                known: false,
                meta: String::new(),
            });
            if let Some(o) = off {
                if !s.known {
                    s.committed = o;
                    s.known = true;
                }
            }
        } else if let Some(o) = off {
            pointers.add_partition_offset(&state_topic, e.partition(), Offset::Offset(o))?;
            wanted.insert(e.partition(), o);
        }
    }
    if !wanted.is_empty() {
        reader.assign(&pointers)?;
        let deadline = std::time::Instant::now() + timeout;
        while !wanted.is_empty() {
            if std::time::Instant::now() > deadline {
                return Err(KafkaError::MessageConsumption(
                    rdkafka::types::RDKafkaErrorCode::OperationTimedOut,
                ));
            }
            let Some(r) = reader.poll(Duration::from_millis(100)) else {
                continue;
            };
            let m = r?;
            if wanted.get(&m.partition()) != Some(&m.offset()) {
                continue;
            }
            wanted.remove(&m.partition());
            if m.key() != Some(group_id.as_bytes()) {
                continue;
            }
            if let Some((c, meta)) = m.payload().and_then(decode) {
                let s = saved.entry(m.partition()).or_insert(Saved {
                    partition: m.partition(),
                    committed: c,
                    known: true,
                    meta: String::new(),
                });
                // The record is written before the commit that points at it:
                // it is never behind the committed offset.
                s.committed = c;
                s.known = true;
                s.meta = meta;
            }
        }
        reader.unassign()?;
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
        assert_eq!(decode(encode(42, "ko1;n=8").as_bytes()), Some((42, "ko1;n=8".into())));
        assert_eq!(decode(b"junk"), None);
        assert_eq!(decode(&[0xff, b'|']), None);
    }
}
