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
//! [`CHECKPOINT_EVERY`](crate::source) and at a hand-over the owner appends
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

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext};
use rdkafka::error::{KafkaError, KafkaResult};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Message as _, Offset, TopicPartitionList};

use crate::config::{base_config, KafkaConfig};
use crate::names::Names;

/// The key of the marker records a state read appends to find the end.
const MARKER_KEY: &[u8] = b"keyorder-marker";

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
    fn left(&self, timeout: Duration) -> KafkaResult<Duration> {
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

/// The key of a state record written by `group_id`'s owner of generation
/// `generation`: one key per generation, so that compaction (which keeps the
/// newest record of each key) never lets a stale owner's late record replace
/// a newer owner's.
pub(crate) fn record_key(group_id: &str, generation: u64) -> String {
    format!("{group_id}#{generation}")
}

/// The value of a state record.
pub(crate) fn encode(generation: u64, committed: i64, meta: &str) -> String {
    format!("{generation}|{committed}|{meta}")
}

fn decode(value: &[u8]) -> Option<(u64, i64, String)> {
    let text = std::str::from_utf8(value).ok()?;
    let mut it = text.splitn(3, '|');
    let generation: u64 = it.next()?.parse().ok()?;
    let committed: i64 = it.next()?.parse().ok()?;
    let meta = it.next()?.to_owned();
    // A generation or offset no owner could have written (a record forged
    // or damaged in the state topic) is skipped, counted and said once:
    // restoring it would overflow the next generation or position.
    if generation >= STATE_LIMIT as u64 || !(0..STATE_LIMIT).contains(&committed) {
        metrics::counter!("keyorder_kafka_bad_state_records_total").increment(1);
        static REPORTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        if !REPORTED.swap(true, std::sync::atomic::Ordering::SeqCst) {
            tracing::warn!(
                "kafka: skipped a state record with a generation or offset out of range (not written by keyorder); \
                 counted in keyorder_kafka_bad_state_records_total, reported once"
            );
        }
        return None;
    }
    Some((generation, committed, meta))
}

/// Above any generation or offset a state record can hold (2^62).
const STATE_LIMIT: i64 = 1 << 62;

/// A state record of one group, as read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Record {
    pub(crate) offset: i64,
    pub(crate) generation: u64,
    pub(crate) committed: i64,
    pub(crate) meta: String,
}

/// `(key, value)` read as a state record of `group_id`: keyed by
/// [`record_key`] (or by the group alone, as wave-1 owners wrote them), its
/// value's generation the key's.
pub(crate) fn record_of(group_id: &str, offset: i64, key: Option<&[u8]>, value: Option<&[u8]>) -> Option<Record> {
    let key = key?;
    let (generation, committed, meta) = decode(value?)?;
    let ours = if key == group_id.as_bytes() {
        true
    } else {
        key.strip_prefix(group_id.as_bytes())
            .and_then(|rest| rest.strip_prefix(b"#"))
            .and_then(|g| std::str::from_utf8(g).ok())
            .and_then(|g| g.parse::<u64>().ok())
            == Some(generation)
    };
    ours.then_some(Record {
        offset,
        generation,
        committed,
        meta,
    })
}

/// Whether `r` is restored rather than `best`: the highest generation, and
/// of that the newest record.
pub(crate) fn ranks_above(r: &Record, best: Option<&Record>) -> bool {
    best.is_none_or(|b| (r.generation, r.offset) > (b.generation, b.offset))
}

/// Appends a marker record to each of `parts` of the state topic and
/// returns where each landed: where a read of the partition ends. The high
/// watermark cannot say (the test broker, tansu 0.6, moves it by one per
/// batch, not per record), and owners of other groups keep appending.
fn append_markers(
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
fn starts<C: ConsumerContext>(
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
fn read_range(
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

/// The value of the marker a claim of `partition` by `group_id` appends:
/// `<group_id>/<partition>#<a token of this claim>` (earlier versions
/// appended `<group_id>/<partition>` alone, also for reads that own nothing).
fn claim_marker(group_id: &str, partition: i32) -> String {
    format!("{group_id}/{partition}#{}", uuid::Uuid::new_v4().simple())
}

/// Whether `value` is a claim marker of `partition` by `group_id`. The
/// bare form earlier versions appended is not: they appended it for reads
/// that own nothing too (an operator's view, the check at open), so it
/// cannot tell a claim (run every process of a deployment on one version).
fn is_claim_marker(value: &[u8], group_id: &str, partition: i32) -> bool {
    let prefix = format!("{group_id}/{partition}#");
    value.starts_with(prefix.as_bytes())
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

/// The key of a static member's incarnation record: one per group and
/// instance id, so compaction keeps the newest incarnation's.
fn incarnation_key(group_id: &str, instance: &str) -> String {
    format!("keyorder-incarnation/{group_id}/{instance}")
}

/// The state partition that holds the incarnation records of `instance`
/// (of `partitions`).
pub(crate) fn incarnation_partition(instance: &str, partitions: i32) -> i32 {
    (keyorder_core::key::stable_hash(instance.as_bytes()) % partitions.max(1) as u64) as i32
}

/// Registers a static member's incarnation (`token`) under its instance
/// id: a record in its state partition. Returns where it landed, where its
/// checks ([`newer_incarnation`]) start.
pub(crate) fn register_incarnation(
    producer: &FutureProducer,
    names: &Names,
    group_id: &str,
    instance: &str,
    partition: i32,
    token: &str,
    timeout: Duration,
) -> KafkaResult<i64> {
    let key = incarnation_key(group_id, instance);
    let topic = names.state();
    let record = FutureRecord::<[u8], [u8]>::to(&topic)
        .partition(partition)
        .key(key.as_bytes())
        .payload(token.as_bytes());
    Ok(futures::executor::block_on(producer.send(record, timeout))
        .map_err(|(e, _)| e)?
        .offset)
}

/// Whether another incarnation registered `instance` after this one:
/// `from` is where this one's record landed (`first`: no check ran yet) or
/// where its last check ended;
/// a marker is appended to the partition and everything from `from` up to
/// it is read. Returns the answer and where the read ended (the next
/// check's start: what lies before it was checked). Compaction keeps the
/// newest record of each key, so a newer incarnation's record is never
/// compacted away while an older one's stays.
#[allow(clippy::too_many_arguments)]
pub(crate) fn newer_incarnation(
    reader: &Reader,
    producer: &FutureProducer,
    names: &Names,
    group_id: &str,
    instance: &str,
    partition: i32,
    token: &str,
    from: i64,
    first: bool,
    timeout: Duration,
    limit: Limit<'_>,
) -> KafkaResult<(bool, i64)> {
    let state_topic = names.state();
    let (low, _) = reader.fetch_watermarks(&state_topic, partition, limit.left(timeout)?)?;
    let ends = append_markers(
        producer,
        &state_topic,
        &[partition],
        |p| format!("{group_id}/{p}/check"),
        timeout,
        limit,
    )?;
    let starts = HashMap::from([(partition, from.max(low))]);
    let key = incarnation_key(group_id, instance);
    // The first check starts at this incarnation's own record (where its
    // send said it landed): a record of the same key before it is an
    // older incarnation's. Later checks start after it.
    let (mut own_seen, mut before, mut newer) = (!first, false, false);
    read_range(reader, &state_topic, &starts, &ends, timeout, limit, |_, _, k, v| {
        if k != Some(key.as_bytes()) {
            return;
        }
        if v == Some(token.as_bytes()) {
            own_seen = true;
        } else if own_seen {
            newer = true;
        } else {
            before = true;
        }
    })?;
    // Its own record gone: compaction kept a newer one of the key.
    if !own_seen && before {
        newer = true;
    }
    Ok((newer, ends.get(&partition).copied().unwrap_or(from)))
}

#[cfg(test)]
mod tests {

    /// A record no owner could have written is skipped (issue 37): its
    /// generation + 1 or offset + 1 would overflow.
    #[test]
    fn out_of_range_records_are_skipped() {
        assert_eq!(decode(b"3|5|meta"), Some((3, 5, "meta".to_owned())));
        assert_eq!(decode(format!("{}|5|", u64::MAX).as_bytes()), None);
        assert_eq!(decode(format!("3|{}|", i64::MAX).as_bytes()), None);
        assert_eq!(decode(b"3|-7|"), None);
    }
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

/// The state protocol on the test broker (`KAFKA_BROKERS`), one owner step
/// at a time, as the source takes them.
#[cfg(test)]
mod broker_tests {
    use super::*;
    use crate::broker::KafkaTransport;

    struct Bench {
        t: KafkaTransport,
        names: Names,
        group_id: String,
        member: BaseConsumer,
        reader: Reader,
    }

    impl Bench {
        async fn new(what: &str) -> Bench {
            let brokers = std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into());
            let cfg = KafkaConfig {
                brokers,
                partitions: 1,
                ..KafkaConfig::default()
            };
            let t = KafkaTransport::connect(cfg).await.expect("the test broker answers");
            let nonce = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos();
            let names = Names::new(&format!("ko-state-{what}-{nonce}")).unwrap();
            t.ensure(&names).await.unwrap();
            let group_id = names.group_id("g");
            let mut c = base_config(&t.cfg);
            c.set("group.id", &group_id).set("enable.auto.commit", "false");
            let member: BaseConsumer = c.create().unwrap();
            let reader = reader(&t.cfg).unwrap();
            Bench {
                t,
                names,
                group_id,
                member,
                reader,
            }
        }

        /// Registers an incarnation of `instance` and returns its token and
        /// where its checks start.
        fn register(&self, instance: &str) -> (String, i64) {
            let token = uuid::Uuid::new_v4().simple().to_string();
            let at = register_incarnation(
                &self.t.state_producer,
                &self.names,
                &self.group_id,
                instance,
                0,
                &token,
                Duration::from_secs(10),
            )
            .unwrap();
            (token, at)
        }

        /// Checks `instance`'s incarnation `token` from `from`.
        fn newer(&self, instance: &str, token: &str, from: i64, first: bool) -> (bool, i64) {
            newer_incarnation(
                &self.reader,
                &self.t.state_producer,
                &self.names,
                &self.group_id,
                instance,
                0,
                token,
                from,
                first,
                Duration::from_secs(10),
                Limit::none(),
            )
            .unwrap()
        }

        /// An owner's claim: its saved state and its generation.
        fn claim(&self) -> (Saved, u64) {
            let s = load(
                &self.member,
                &self.reader,
                &self.t.state_producer,
                &self.names,
                &self.group_id,
                &[0],
                Duration::from_secs(10),
                Limit::none(),
            )
            .unwrap()
            .remove(0);
            let generation = s.generation + 1;
            (s, generation)
        }

        /// An owner's state round: one record, then its pointer.
        async fn round(&self, generation: u64, committed: i64) -> Vec<i32> {
            let key = record_key(&self.group_id, generation);
            let value = encode(generation, committed, "");
            let (_, at) = self
                .t
                .produce_state(&self.names.state(), 0, key.as_bytes(), value.as_bytes())
                .await
                .unwrap();
            advance(
                &self.member,
                &self.member,
                &self.reader,
                &self.t.state_producer,
                &self.names,
                &self.group_id,
                &[(0, generation, at)],
                &HashMap::new(),
                Duration::from_secs(10),
                CommitMode::Sync,
                Limit::none(),
            )
            .unwrap()
        }
    }

    /// Finding 1 of issue 35: a stalled owner's last round lands after the
    /// next owner's; the owner after them must still restore the newest
    /// owner's state and take a generation above every earlier one.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stale_round_never_rolls_the_next_owner_back() {
        let b = Bench::new("stale").await;
        let (_, a) = b.claim();
        b.round(a, 10).await;
        let (saved, g2) = b.claim();
        assert_eq!(saved.committed, 10, "the second owner restores the first's state");
        assert!(g2 > a, "generations go up: {a} then {g2}");
        b.round(g2, 20).await;
        // The first owner, stalled with a round in flight, comes back.
        b.round(a, 15).await;
        let (saved, g3) = b.claim();
        assert_eq!(
            saved.committed, 20,
            "the third owner restores the second owner's state, not the stale first's"
        );
        assert!(g3 > g2, "generations never repeat: {a}, {g2}, then {g3}");
    }

    /// After the next owner's record is durable and its pointer checked,
    /// it deletes the earlier owner's record key: compacted (a tombstone
    /// removes its key), the partition keeps no key of that generation, and
    /// a claim still restores the newest owner's state with a generation
    /// above every earlier one, even after a stale owner's late record.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn tombstones_delete_earlier_generations_only() {
        let b = Bench::new("tombstone").await;
        let (_, a) = b.claim();
        b.round(a, 10).await;
        let (saved, g2) = b.claim();
        assert_eq!(saved.older, vec![a], "the claim found the first owner's records");
        assert!(b.round(g2, 20).await.is_empty(), "the pointer check passes");
        tombstone(&b.t.state_producer, &b.names, &b.group_id, 0, &saved.older)
            .await
            .unwrap();
        // The first owner, stalled, lands a late record after the tombstone.
        b.round(a, 15).await;
        let topic = b.names.state();
        let ends = append_markers(
            &b.t.state_producer,
            &topic,
            &[0],
            |_| "end".into(),
            Duration::from_secs(10),
            Limit::none(),
        )
        .unwrap();
        type Entry = (i64, Option<Vec<u8>>, Option<Vec<u8>>);
        let mut log: Vec<Entry> = Vec::new();
        read_range(
            &b.reader,
            &topic,
            &HashMap::from([(0, 0)]),
            &ends,
            Duration::from_secs(10),
            Limit::none(),
            |_, offset, key, value| log.push((offset, key.map(<[u8]>::to_vec), value.map(<[u8]>::to_vec))),
        )
        .unwrap();
        let first = record_key(&b.group_id, a).into_bytes();
        let tombstoned = log
            .iter()
            .position(|(_, k, v)| k.as_deref() == Some(&first[..]) && v.is_none())
            .expect("a tombstone for the first owner's key");
        assert!(
            !log.iter()
                .any(|(_, k, v)| k.as_deref() == Some(record_key(&b.group_id, g2).as_bytes()) && v.is_none()),
            "the newest owner's key is never deleted"
        );
        // Compaction: the newest entry of each key; a tombstone removes it.
        let mut newest: HashMap<Option<Vec<u8>>, i64> = HashMap::new();
        for (offset, key, _) in &log {
            newest.insert(key.clone(), *offset);
        }
        let kept: Vec<&Entry> = log
            .iter()
            .filter(|(o, k, v)| newest.get(k) == Some(o) && v.is_some())
            .collect();
        let mut best: Option<Record> = None;
        for (offset, key, value) in &kept {
            if let Some(r) = record_of(&b.group_id, *offset, key.as_deref(), value.as_deref()) {
                if ranks_above(&r, best.as_ref()) {
                    best = Some(r);
                }
            }
        }
        let best = best.expect("the newest owner's record survives");
        assert_eq!((best.generation, best.committed), (g2, 20));
        assert!(
            kept.iter()
                .all(|(o, k, _)| k.as_deref() != Some(&first[..]) || *o > log[tombstoned].0),
            "only the first owner's late record (after the tombstone) keeps its key"
        );
        let (saved, g3) = b.claim();
        assert_eq!(saved.committed, 20, "a claim restores the newest owner's state");
        assert!(g3 > g2, "generations still go up: {g2} then {g3}");
    }

    /// A read waiting for records that do not come gives up as its limit
    /// says: at once when stopped (a close), at its deadline (an
    /// assignment's bound), not after its idle timeout or its budget.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_read_stops_when_told_and_at_its_deadline() {
        let b = Bench::new("stop").await;
        let topic = b.names.state();
        let end = append_markers(
            &b.t.state_producer,
            &topic,
            &[0],
            |_| "end".into(),
            Duration::from_secs(10),
            Limit::none(),
        )
        .unwrap()[&0];
        // Past the marker nothing comes: the read waits for an end it
        // never reaches.
        let starts = HashMap::from([(0, end + 1)]);
        let ends = HashMap::from([(0, end + 1_000)]);
        let idle = Duration::from_secs(30);
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let setter = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            flag.store(true, Ordering::SeqCst);
        });
        let started = Instant::now();
        let stopped = read_range(
            &b.reader,
            &topic,
            &starts,
            &ends,
            idle,
            Limit {
                until: None,
                stop: &stop,
            },
            |_, _, _, _| {},
        );
        setter.await.unwrap();
        assert!(stopped.is_err(), "a stopped read fails");
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "stopped after {:?}",
            started.elapsed()
        );

        let never = AtomicBool::new(false);
        let started = Instant::now();
        let late = read_range(
            &b.reader,
            &topic,
            &starts,
            &ends,
            idle,
            Limit {
                until: Some(started + Duration::from_millis(500)),
                stop: &never,
            },
            |_, _, _, _| {},
        );
        assert!(late.is_err(), "a read past its deadline fails");
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "gave up after {:?}",
            started.elapsed()
        );
    }

    /// Finding 2 of issue 35: the state topic is compacted (the newest
    /// record of each key survives). After a stale owner's late record, the
    /// partition as compaction leaves it must still rank the newest owner's
    /// state first.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn compaction_keeps_the_newest_owners_state() {
        let b = Bench::new("compact").await;
        let (_, a) = b.claim();
        b.round(a, 10).await;
        let (_, g2) = b.claim();
        b.round(g2, 20).await;
        b.round(a, 15).await;
        // Everything the partition holds, up to a marker of our own.
        let topic = b.names.state();
        let ends = append_markers(
            &b.t.state_producer,
            &topic,
            &[0],
            |_| "end".into(),
            Duration::from_secs(10),
            Limit::none(),
        )
        .unwrap();
        type Entry = (i64, Option<Vec<u8>>, Option<Vec<u8>>);
        let mut log: Vec<Entry> = Vec::new();
        read_range(
            &b.reader,
            &topic,
            &HashMap::from([(0, 0)]),
            &ends,
            Duration::from_secs(10),
            Limit::none(),
            |_, offset, key, value| log.push((offset, key.map(<[u8]>::to_vec), value.map(<[u8]>::to_vec))),
        )
        .unwrap();
        // Compaction: the newest record of each key.
        let mut newest: HashMap<Option<Vec<u8>>, i64> = HashMap::new();
        for (offset, key, _) in &log {
            newest.insert(key.clone(), *offset);
        }
        let mut best: Option<Record> = None;
        for (offset, key, value) in &log {
            if newest.get(key) != Some(offset) {
                continue;
            }
            if let Some(r) = record_of(&b.group_id, *offset, key.as_deref(), value.as_deref()) {
                if ranks_above(&r, best.as_ref()) {
                    best = Some(r);
                }
            }
        }
        let best = best.expect("a record survives compaction");
        assert_eq!(
            (best.generation, best.committed),
            (g2, 20),
            "after compaction the second owner's state still ranks first"
        );
    }

    /// A static member's incarnation check: a newer registration of its
    /// instance id is found (from its own record, and from where its last
    /// check ended), an older one or another instance's is not.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_newer_incarnation_is_found_and_an_older_one_is_not() {
        let b = Bench::new("incarnation").await;
        let (old, old_from) = b.register("member-a");
        let (_, _) = b.register("member-b");
        let (alone, end) = b.newer("member-a", &old, old_from, true);
        assert!(!alone, "another instance's registration is not a newer incarnation");
        let (new, new_from) = b.register("member-a");
        let (found, _) = b.newer("member-a", &old, end, false);
        assert!(found, "the newer incarnation is found from where the last check ended");
        let (found_first, _) = b.newer("member-a", &old, old_from, true);
        assert!(found_first, "and from the older one's own record");
        let (newest, _) = b.newer("member-a", &new, new_from, true);
        assert!(!newest, "the older incarnation's record is not a newer one");
    }
}
