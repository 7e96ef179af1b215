//! A static member's incarnation records: registered under its instance
//! id, and the check for a newer incarnation since.

use std::collections::HashMap;
use std::time::Duration;

use rdkafka::consumer::Consumer;
use rdkafka::error::KafkaResult;
use rdkafka::producer::{FutureProducer, FutureRecord};

use super::read::{append_markers, read_range, Limit, Reader};
use super::record::incarnation_key;
use crate::names::Names;

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
