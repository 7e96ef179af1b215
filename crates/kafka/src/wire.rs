//! How a `Message` becomes a Kafka record and back: its headers (id,
//! correlation id, the user's; a dead letter's reason, origin and group),
//! its key's text, and the partition a key goes to (the Java client's
//! murmur2 partitioner).

use keyorder_core::{Bytes, Message};
use rdkafka::message::{Header, Headers, OwnedHeaders};

/// The header carrying a message's id.
pub const ID_HEADER: &str = "keyorder-id";
/// The header carrying a message's correlation id.
pub const CORRELATION_HEADER: &str = "keyorder-correlation";
/// The header a dead letter carries its reason in.
pub const REASON_HEADER: &str = "keyorder-reason";
/// The header a dead letter carries its origin (`topic/partition@offset`) in.
pub const ORIGIN_HEADER: &str = "keyorder-origin";
/// The header a dead letter carries its consumer group in.
pub const GROUP_HEADER: &str = "keyorder-group";

/// Kafka's default partitioner for keyed records (Java client,
/// `Utils.murmur2`): the 32-bit murmur2 hash with seed `0x9747b28c`.
///
/// ```
/// // Vectors from Apache Kafka's own UtilsTest.
/// assert_eq!(keyorder_kafka::murmur2(b"21"), -973932308);
/// assert_eq!(keyorder_kafka::murmur2(b"foobar"), -790332482);
/// ```
pub fn murmur2(data: &[u8]) -> i32 {
    const SEED: u32 = 0x9747_b28c;
    const M: u32 = 0x5bd1_e995;
    const R: u32 = 24;
    let len = data.len() as u32;
    let mut h = SEED ^ len;
    let mut chunks = data.chunks_exact(4);
    for c in &mut chunks {
        let mut k = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        k = k.wrapping_mul(M);
        k ^= k >> R;
        k = k.wrapping_mul(M);
        h = h.wrapping_mul(M);
        h ^= k;
    }
    let rest = chunks.remainder();
    if rest.len() >= 3 {
        h ^= u32::from(rest[2]) << 16;
    }
    if rest.len() >= 2 {
        h ^= u32::from(rest[1]) << 8;
    }
    if !rest.is_empty() {
        h ^= u32::from(rest[0]);
        h = h.wrapping_mul(M);
    }
    h ^= h >> 13;
    h = h.wrapping_mul(M);
    h ^= h >> 15;
    h as i32
}

/// A record key's bytes as keyorder names the key (its text, or the text
/// form [`keyorder_core::OrderingKey::from_bytes`] gives bytes that are no
/// UTF-8 or over 255 bytes): what the dispatcher, operators' labels and a
/// resolve all use. Empty bytes give an empty text (no key).
pub(crate) fn key_text(raw: &[u8]) -> String {
    keyorder_core::OrderingKey::from_bytes(raw)
        .map(|k| k.as_str().to_owned())
        .unwrap_or_default()
}

/// The partition the Java client (and this transport) puts a keyed record
/// in: `toPositive(murmur2(key)) % partitions`.
///
/// ```
/// let p = keyorder_kafka::partition_for(b"order-42", 8);
/// assert!((0..8).contains(&p));
/// ```
pub fn partition_for(key: &[u8], partitions: i32) -> i32 {
    ((murmur2(key) & 0x7fff_ffff) as i64 % i64::from(partitions.max(1))) as i32
}

/// The record headers of a message: id, correlation id, user headers.
pub(crate) fn headers_of(message: &Message) -> OwnedHeaders {
    let mut h = OwnedHeaders::new_with_capacity(message.headers().len() + 2).insert(Header {
        key: ID_HEADER,
        value: Some(message.id()),
    });
    if let Some(c) = message.correlation_id() {
        h = h.insert(Header {
            key: CORRELATION_HEADER,
            value: Some(c),
        });
    }
    for (k, v) in message.headers() {
        h = h.insert(Header {
            key: k.as_str(),
            value: Some(v.as_str()),
        });
    }
    h
}

/// The message a record carries, but for its key: its payload, its id (or
/// `<topic>-<partition>-<offset>` when it has none), its correlation id and
/// every other header. The routing key comes from the record key; a dead
/// letter's bookkeeping headers stay with the dead letter.
pub(crate) fn message_of(
    payload: Bytes,
    headers: Option<&OwnedHeaders>,
    topic: &str,
    partition: i32,
    offset: i64,
) -> Message {
    let mut msg = Message::new(payload);
    let mut id = None;
    if let Some(h) = headers {
        for hd in h.iter() {
            let Some(v) = hd.value.and_then(|v| std::str::from_utf8(v).ok()) else {
                continue;
            };
            match hd.key {
                ID_HEADER => id = Some(v.to_owned()),
                CORRELATION_HEADER => msg = msg.with_correlation_id(v),
                // The routing key comes from the record key (the source
                // sets it); a dead letter's bookkeeping stays with the
                // dead letter.
                // Every other header (the message type, an outbox
                // record's sequence, the user's) reaches the handler.
                keyorder_core::KEY_HEADER | REASON_HEADER | ORIGIN_HEADER | GROUP_HEADER => {}
                k => msg = msg.with_header(k, v),
            }
        }
    }
    msg.with_id(id.unwrap_or_else(|| format!("{topic}-{partition}-{offset}")))
}

/// A dead letter's headers: the original record's, then `reason`, its
/// `origin` (`topic/partition@offset`) and its consumer `group`.
pub(crate) fn dead_letter_headers(
    headers: Option<&OwnedHeaders>,
    reason: &str,
    origin: &str,
    group: &str,
) -> OwnedHeaders {
    let mut h = OwnedHeaders::new();
    if let Some(orig) = headers {
        for hd in orig.iter() {
            h = h.insert(Header {
                key: hd.key,
                value: hd.value,
            });
        }
    }
    h.insert(Header {
        key: REASON_HEADER,
        value: Some(reason),
    })
    .insert(Header {
        key: ORIGIN_HEADER,
        value: Some(origin),
    })
    .insert(Header {
        key: GROUP_HEADER,
        value: Some(group),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn murmur2_matches_the_java_client() {
        // Apache Kafka, clients/src/test/java/org/apache/kafka/common/utils/UtilsTest.java.
        let cases: [(&[u8], i32); 6] = [
            (b"21", -973_932_308),
            (b"foobar", -790_332_482),
            (b"a-little-bit-long-string", -985_981_536),
            (b"a-little-bit-longer-string", -1_486_304_829),
            (b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8", -58_897_971),
            (b"abc", 479_470_107),
        ];
        for (data, want) in cases {
            assert_eq!(murmur2(data), want, "{}", String::from_utf8_lossy(data));
        }
        // Partitions as Java's default partitioner (and kafka-python's)
        // gives them: `foobar` of 50 is 16; the empty key hashes too.
        assert_eq!(partition_for(b"foobar", 50), 16);
        assert_eq!(murmur2(b""), 275_646_681);
        assert_eq!(partition_for(b"", 8), 1);
    }
}
