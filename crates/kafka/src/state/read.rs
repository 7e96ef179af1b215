//! Reading the state topic: a reader outside every group, the markers that
//! tell a read where to end, where a group's read starts (its pointer), and
//! the bounded read of a range.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::error::{KafkaError, KafkaResult};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Message as _, Offset, TopicPartitionList};

use super::record::MARKER_KEY;
use crate::config::{base_config, KafkaConfig};

/// A consumer outside any group that reads state records.
pub(crate) type Reader = BaseConsumer;

/// A reader of the state topic: a consumer outside every group (assigned,
/// never subscribed).
pub(crate) fn reader(cfg: &KafkaConfig) -> KafkaResult<Reader> {
    let mut r = base_config(cfg);
    r.set("group.id", "keyorder-state-reader")
        .set("enable.auto.commit", "false");
    r.create()
}

/// When a state read gives up before it is done: past `until`, or once
/// `stop` is set (the source closing: a close must not wait out a read).
#[derive(Clone, Copy)]
pub(crate) struct Limit<'a> {
    pub(crate) until: Option<Instant>,
    pub(crate) stop: &'a AtomicBool,
}

/// Never set: a read that only its own budget bounds.
static NEVER: AtomicBool = AtomicBool::new(false);

impl Limit<'static> {
    /// Bounded by the read's own timeouts and [`READ_BUDGET`] only.
    pub(crate) fn none() -> Self {
        Limit {
            until: None,
            stop: &NEVER,
        }
    }
}

impl Limit<'_> {
    /// `timeout`, cut to what is left; an error once stopped or past `until`.
    pub(super) fn left(&self, timeout: Duration) -> KafkaResult<Duration> {
        if self.stop.load(Ordering::SeqCst) {
            return Err(KafkaError::Canceled);
        }
        match self.until {
            None => Ok(timeout),
            Some(until) => match until.checked_duration_since(Instant::now()) {
                Some(left) if !left.is_zero() => Ok(timeout.min(left)),
                _ => Err(KafkaError::MessageConsumption(
                    rdkafka::types::RDKafkaErrorCode::OperationTimedOut,
                )),
            },
        }
    }
}

/// Appends a marker record to each of `parts` of the state topic and
/// returns where each landed: where a read of the partition ends. The high
/// watermark cannot say (the test broker, tansu 0.6, moves it by one per
/// batch, not per record), and owners of other groups keep appending.
pub(super) fn append_markers(
    producer: &FutureProducer,
    state_topic: &str,
    parts: &[i32],
    payload: impl Fn(i32) -> String,
    timeout: Duration,
    limit: Limit<'_>,
) -> KafkaResult<HashMap<i32, i64>> {
    let mut ends = HashMap::new();
    for p in parts {
        let timeout = limit.left(timeout)?;
        let body = payload(*p);
        let marker = FutureRecord::<[u8], [u8]>::to(state_topic)
            .partition(*p)
            .key(MARKER_KEY)
            .payload(body.as_bytes());
        let end = futures::executor::block_on(producer.send(marker, timeout))
            .map_err(|(e, _)| e)?
            .offset;
        ends.insert(*p, end);
    }
    Ok(ends)
}

/// Where `group_id`'s reads of `parts` start: its pointers, never below a
/// partition's low watermark. Read before the end markers are appended, so
/// the record a pointer names lies before the end.
pub(super) fn starts<C: ConsumerContext>(
    member: &BaseConsumer<C>,
    reader: &Reader,
    state_topic: &str,
    parts: &[i32],
    timeout: Duration,
    limit: Limit<'_>,
) -> KafkaResult<HashMap<i32, i64>> {
    let mut tpl = TopicPartitionList::new();
    for p in parts {
        tpl.add_partition(state_topic, *p);
    }
    let pointers = member.committed_offsets(tpl, limit.left(timeout)?)?;
    let mut out = HashMap::new();
    for e in pointers.elements() {
        let p = e.partition();
        let (low, _) = reader.fetch_watermarks(state_topic, p, limit.left(timeout)?)?;
        let from = match e.offset() {
            Offset::Offset(o) if o >= 0 => o.max(low),
            _ => low,
        };
        tracing::debug!(partition = p, pointer = ?e.offset(), low, "kafka: reading saved state");
        out.insert(p, from);
    }
    Ok(out)
}

/// The longest a read of the state topic may take in all, well inside the
/// topic's `min.compaction.lag.ms` ([`crate::STATE_MIN_COMPACTION_LAG_MS`],
/// an hour): records written since the read's start are never compacted
/// away under it.
const READ_BUDGET: Duration = Duration::from_secs(600);

/// Reads partitions of `state_topic` from `starts` up to and including
/// their `ends`, calling `visit(partition, offset, key, value)` in order.
/// Fails after `idle` without a record, after [`READ_BUDGET`] in all, or
/// as `limit` says.
pub(super) fn read_range(
    reader: &Reader,
    state_topic: &str,
    starts: &HashMap<i32, i64>,
    ends: &HashMap<i32, i64>,
    idle: Duration,
    limit: Limit<'_>,
    mut visit: impl FnMut(i32, i64, Option<&[u8]>, Option<&[u8]>),
) -> KafkaResult<()> {
    let mut left: HashMap<i32, i64> = ends
        .iter()
        .filter(|(p, _)| starts.contains_key(p))
        .map(|(p, e)| (*p, *e))
        .collect();
    if left.is_empty() {
        return Ok(());
    }
    let mut tpl = TopicPartitionList::new();
    for (p, from) in starts {
        if let Some(end) = left.get(p) {
            tpl.add_partition_offset(state_topic, *p, Offset::Offset((*from).min(*end)))?;
        }
    }
    reader.assign(&tpl)?;
    let mut deadline = std::time::Instant::now() + idle;
    let budget = std::time::Instant::now() + READ_BUDGET;
    while !left.is_empty() {
        if std::time::Instant::now() > deadline.min(budget) {
            let _ = reader.unassign();
            return Err(KafkaError::MessageConsumption(
                rdkafka::types::RDKafkaErrorCode::OperationTimedOut,
            ));
        }
        // Checked at every poll: a close or a rebalance callback's bound
        // must not wait out an idle timeout or the whole budget.
        if let Err(e) = limit.left(idle) {
            let _ = reader.unassign();
            return Err(e);
        }
        let Some(r) = reader.poll(Duration::from_millis(50)) else {
            continue;
        };
        let m = match r {
            Err(KafkaError::PartitionEOF(_)) => continue,
            Err(e) => {
                let _ = reader.unassign();
                return Err(e);
            }
            Ok(m) => m,
        };
        deadline = std::time::Instant::now() + idle;
        let p = m.partition();
        let Some(end) = left.get(&p).copied() else { continue };
        if m.offset() >= end {
            left.remove(&p);
        }
        if m.offset() <= end {
            visit(p, m.offset(), m.key(), m.payload());
        }
    }
    reader.unassign()?;
    Ok(())
}
