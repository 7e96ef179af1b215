//! How a [`Message`] becomes a stream entry's fields and back, and how the
//! server's replies (entries, stored texts) are read.

use std::collections::BTreeMap;

use keyorder_core::{Error, Message, OrderingKey, Result};
use redis::Value;

/// The stream fields of a message (the key is the partition, or the `k`
/// field in the single layout).
pub(crate) fn fields(message: &Message, with_key: bool) -> Result<Vec<Vec<u8>>> {
    let headers = serde_json::to_string(message.headers()).map_err(|e| Error::broker(e.to_string()))?;
    let mut out: Vec<Vec<u8>> = vec![
        b"id".to_vec(),
        message.id().as_bytes().to_vec(),
        b"h".to_vec(),
        headers.into_bytes(),
        b"p".to_vec(),
        message.payload().to_vec(),
    ];
    if let Some(c) = message.correlation_id() {
        out.push(b"c".to_vec());
        out.push(c.as_bytes().to_vec());
    }
    if with_key {
        if let Some(k) = message.key() {
            out.push(b"k".to_vec());
            out.push(k.as_str().as_bytes().to_vec());
        }
    }
    Ok(out)
}

/// One stream entry: its id and fields (`None` when the entry was deleted
/// while pending).
pub(crate) type Entry = (String, Option<BTreeMap<String, Vec<u8>>>);

pub(crate) fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        Value::Int(i) => Some(i.to_string()),
        _ => None,
    }
}

fn bytes(v: &Value) -> Option<Vec<u8>> {
    match v {
        Value::BulkString(b) => Some(b.clone()),
        Value::SimpleString(s) => Some(s.as_bytes().to_vec()),
        Value::Int(i) => Some(i.to_string().into_bytes()),
        _ => None,
    }
}

/// Parses `[[id, [field, value, ...]], ...]`.
pub(crate) fn entries(v: &Value) -> Vec<Entry> {
    let Value::Array(items) = v else { return Vec::new() };
    items
        .iter()
        .filter_map(|item| {
            let Value::Array(pair) = item else { return None };
            let id = text(pair.first()?)?;
            let fields = match pair.get(1) {
                Some(Value::Array(kv)) => Some(
                    kv.chunks(2)
                        .filter_map(|c| Some((text(c.first()?)?, bytes(c.get(1)?)?)))
                        .collect(),
                ),
                _ => None,
            };
            Some((id, fields))
        })
        .collect()
}

/// Rebuilds a message from its stream fields.
pub(crate) fn message(fields: &BTreeMap<String, Vec<u8>>, key: Option<OrderingKey>) -> Message {
    let payload = fields.get("p").cloned().unwrap_or_default();
    let mut msg = Message::new(payload);
    if let Some(id) = fields.get("id") {
        msg = msg.with_id(String::from_utf8_lossy(id).into_owned());
    }
    if let Some(h) = fields.get("h") {
        if let Ok(h) = serde_json::from_slice::<BTreeMap<String, String>>(h) {
            for (k, v) in h {
                msg = msg.with_header(k, v);
            }
        }
    }
    if let Some(c) = fields.get("c") {
        msg = msg.with_correlation_id(String::from_utf8_lossy(c).into_owned());
    }
    if let Some(k) = key {
        msg = msg.with_ordering_key(k);
    }
    msg
}

/// Stored entries (index members, hash fields, set members) that are text,
/// in order; any other (written by hand or by a foreign client: no keyorder
/// writes one) is skipped, counted in `keyorder_redis_unreadable_entries_total`
/// and reported once per process, so one bad entry never stops discovery,
/// upkeep or an operator's command.
pub(crate) fn texts(raw: Vec<Vec<u8>>, what: &str) -> Vec<String> {
    raw.into_iter().filter_map(|b| text_of(b, what)).collect()
}

/// The pairs of a hash read with `HGETALL` whose field and value are text
/// (see [`texts`]).
pub(crate) fn text_pairs(raw: Vec<(Vec<u8>, Vec<u8>)>, what: &str) -> Vec<(String, String)> {
    raw.into_iter()
        .filter_map(|(k, v)| Some((text_of(k, what)?, text_of(v, what)?)))
        .collect()
}

fn text_of(b: Vec<u8>, what: &str) -> Option<String> {
    static REPORTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    match String::from_utf8(b) {
        Ok(t) => Some(t),
        Err(_) => {
            metrics::counter!("keyorder_redis_unreadable_entries_total").increment(1);
            if !REPORTED.swap(true, std::sync::atomic::Ordering::SeqCst) {
                tracing::warn!(what, "redis: skipped a stored entry that is not text (not written by keyorder); counted in keyorder_redis_unreadable_entries_total, reported once");
            }
            None
        }
    }
}
