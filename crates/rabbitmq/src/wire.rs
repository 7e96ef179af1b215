//! How a [`Message`] becomes AMQP properties and a routing key, and how a
//! delivery's headers are read back.

use keyorder_core::{Error, Message, Result, KEY_HEADER};
use lapin::types::MAX_SHORT_STRING_LENGTH;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::BasicProperties;

/// The header versions before consumer groups stamped with the publisher's
/// queue count. Publishers no longer choose a queue (each group's own
/// exchange does, with the count its registry record fixes), so it is
/// neither stamped nor checked; consumers leave it out of a message's
/// headers.
pub const EPOCH_HEADER: &str = "keyorder-epoch";

fn long(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s))
}

/// `value` as an AMQP short string (at most 255 bytes); a longer one is
/// refused naming `what` and the limit (never the value: user data).
pub(crate) fn short(what: &str, value: &str) -> Result<ShortString> {
    ShortString::try_new(value).map_err(|_| {
        Error::Config(format!(
            "rabbitmq: the {what} is {} bytes; AMQP carries at most {MAX_SHORT_STRING_LENGTH} bytes there, so \
             the message was not published (nothing was stored): shorten it",
            value.len()
        ))
    })
}

/// The AMQP properties of a message: id, correlation id, persistent
/// delivery, headers (the key in [`KEY_HEADER`]). A message id,
/// correlation id or header name over 255 bytes is refused
/// (`Error::Config`), in the caller's `publish`.
pub(crate) fn properties(message: &Message) -> Result<BasicProperties> {
    let mut headers = FieldTable::default();
    for (k, v) in message.headers() {
        headers.insert(short("header name", k)?, long(v));
    }
    if let Some(k) = message.key() {
        headers.insert(KEY_HEADER.into(), long(k.as_str()));
    }
    let mut props = BasicProperties::default()
        .with_message_id(short("message id", message.id())?)
        .with_delivery_mode(2)
        .with_headers(headers);
    if let Some(c) = message.correlation_id() {
        props = props.with_correlation_id(short("correlation id", c)?);
    }
    Ok(props)
}

/// The routing key of a keyless message: a hash of its id (16 hex
/// digits), so every id fits and keyless messages spread over a ring.
pub(crate) fn keyless_routing_key(id: &str) -> String {
    // FNV-1a, 64 bits: stable across processes and versions.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in id.as_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("{h:016x}")
}

pub(crate) fn header_text(props: &BasicProperties, name: &str) -> Option<String> {
    let h = props.headers().as_ref()?;
    match h.inner().get(name)? {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
        _ => None,
    }
}

/// Whether `name` is a header the broker (dead-lettering, delivery counts,
/// shovels, stream offsets) or keyorder's dead-lettering set on a delivery,
/// not the producer.
pub(crate) fn is_delivery_header(name: &str) -> bool {
    const EXACT: [&str; 3] = ["x-death", "x-delivery-count", "x-received-from"];
    const PREFIXES: [&str; 6] = [
        "x-first-death-",
        "x-last-death-",
        "x-shovelled",
        "x-keyorder-",
        "x-opt-",
        "x-stream-",
    ];
    EXACT.contains(&name) || PREFIXES.iter().any(|p| name.starts_with(p))
}

pub(crate) fn header_int(props: &BasicProperties, name: &str) -> Option<i64> {
    let h = props.headers().as_ref()?;
    match h.inner().get(name)? {
        AMQPValue::LongLongInt(n) => Some(*n),
        AMQPValue::LongInt(n) => Some(i64::from(*n)),
        AMQPValue::LongUInt(n) => Some(i64::from(*n)),
        AMQPValue::ShortInt(n) => Some(i64::from(*n)),
        AMQPValue::ShortUInt(n) => Some(i64::from(*n)),
        _ => None,
    }
}
