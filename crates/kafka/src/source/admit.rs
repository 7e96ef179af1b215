//! A fetched record as an `Inbound`: the message (its key, headers and
//! id) and its settle.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use keyorder_core::{Inbound, OrderingKey};
use rdkafka::message::OwnedMessage;
use rdkafka::Message as _;

use crate::owned::{Part, Shared};
use crate::settle::KafkaSettle;
use crate::track::Admit;
use crate::wire::{message_of, partition_for};

/// `m`, a fetched record of `part` (owned, not being handed over), as the
/// dispatcher takes it; `None` when it was finished under an earlier owner.
pub(super) fn inbound(shared: &Arc<Shared>, part: &Arc<Part>, m: OwnedMessage) -> Option<Inbound> {
    let partition = m.partition();
    let offset = m.offset();
    let (attempts, halted) = match part.track().admit(offset) {
        Admit::Skip => return None,
        Admit::Deliver { attempts, halted } => (attempts, halted),
    };
    let payload = keyorder_core::Bytes::copy_from_slice(m.payload().unwrap_or_default());
    let mut msg = message_of(payload.clone(), m.headers(), shared.names.topic(), partition, offset);
    let key_bytes = m.key().map(<[u8]>::to_vec);
    // A key on another partition than Java's default partitioner gives
    // it (a producer on librdkafka's `consistent_random`, say): its
    // records and keyorder's, or another producer's, of one key land
    // on different partitions, which order nothing between them.
    // Counted, and said once with the fix.
    if let Some(raw) = key_bytes.as_deref().filter(|k| !k.is_empty()) {
        if partition_for(raw, shared.partitions) != partition {
            metrics::counter!("keyorder_kafka_misplaced_keys_total").increment(1);
            if !shared.misplaced_key_reported.swap(true, Ordering::SeqCst) {
                tracing::warn!(
                    topic = %shared.names.topic(),
                    partition,
                    offset,
                    "kafka: a record's key is on another partition than Java's default partitioner (murmur2) \
                     puts it, where keyorder publishes it: a key's records from such a producer and from others \
                     land on different partitions and are not ordered with each other. Set the producer's \
                     partitioner to murmur2 (librdkafka clients: partitioner=murmur2_random) (reported once; \
                     counted in keyorder_kafka_misplaced_keys_total)"
                );
            }
        }
    }
    // The record key is the routing key; it reaches key selection as
    // the routing-key header.
    // Any key bytes order their messages (the partitioner placed them
    // by those bytes): bytes that are no key as they are (not UTF-8,
    // over 255 bytes) get their stable text form. Only an empty key is
    // none: the keyless policy handles it, counted and reported once.
    match key_bytes.as_deref().map(OrderingKey::from_bytes) {
        Some(Ok(k)) => {
            msg = msg.with_header(keyorder_core::KEY_HEADER, k.as_str());
            msg = msg.with_ordering_key(k);
        }
        Some(Err(e)) => {
            metrics::counter!("keyorder_kafka_unusable_keys_total").increment(1);
            if !shared.unusable_key_reported.swap(true, Ordering::SeqCst) {
                tracing::warn!(
                    topic = %shared.names.topic(),
                    partition,
                    offset,
                    error = %e,
                    "kafka: a record's key is no ordering key ({}); it runs under the keyless policy. \
                     Give its producer a non-empty key (reported once; counted in keyorder_kafka_unusable_keys_total)",
                    e.rule().name()
                );
            }
        }
        None => {}
    }
    if halted.is_some() {
        tracing::info!(scope = %part.lease.scope(), offset, "kafka: a key halted here under an earlier owner");
    }
    let settle = KafkaSettle {
        shared: shared.clone(),
        part: part.clone(),
        offset,
        key: key_bytes,
        payload,
        headers: m.headers().cloned(),
        message_id: msg.id().to_owned(),
        earlier: attempts,
    };
    Some(Inbound {
        message: msg,
        lease: part.lease.clone(),
        settle: Box::new(settle),
    })
}
