//! The keys and values of the state topic's records: a state record (keyed
//! by group and generation, its value the generation, committed offset and
//! the partition's progress text), the markers a read appends, and a static
//! member's incarnation record.

/// The key of the marker records a state read appends to find the end.
pub(super) const MARKER_KEY: &[u8] = b"keyorder-marker";

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

/// The value of the marker a claim of `partition` by `group_id` appends:
/// `<group_id>/<partition>#<a token of this claim>` (earlier versions
/// appended `<group_id>/<partition>` alone, also for reads that own nothing).
pub(super) fn claim_marker(group_id: &str, partition: i32) -> String {
    format!("{group_id}/{partition}#{}", uuid::Uuid::new_v4().simple())
}

/// Whether `value` is a claim marker of `partition` by `group_id`. The
/// bare form earlier versions appended is not: they appended it for reads
/// that own nothing too (an operator's view, the check at open), so it
/// cannot tell a claim (run every process of a deployment on one version).
pub(super) fn is_claim_marker(value: &[u8], group_id: &str, partition: i32) -> bool {
    let prefix = format!("{group_id}/{partition}#");
    value.starts_with(prefix.as_bytes())
}

/// The key of a static member's incarnation record: one per group and
/// instance id, so compaction keeps the newest incarnation's.
pub(super) fn incarnation_key(group_id: &str, instance: &str) -> String {
    format!("keyorder-incarnation/{group_id}/{instance}")
}

#[cfg(test)]
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
