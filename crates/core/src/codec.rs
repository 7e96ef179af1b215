//! Typed payloads (feature `serde`): a message's payload as a Rust value,
//! encoded by a [`Codec`] ([`Json`] is the one keyorder ships).
//!
//! * [`Message::json`] / [`Message::encode`] build a message whose payload
//!   is a value encoded by the codec, with the codec's content type in the
//!   [`CONTENT_TYPE_HEADER`] header; key, id and headers are then set with
//!   the usual builder methods.
//! * [`Delivery::json`] / [`Delivery::decode`] decode a delivery's payload.
//!   A payload that does not decode gives a [`DecodeError`] that names the
//!   Rust type, the message (id, type, scope, the key's label, never its
//!   value) and the codec's error.
//!
//! A decode failure is poison: no retry can fix the bytes of a message. `?`
//! on a [`DecodeError`] in a handler gives [`HandlerError::Poison`], so the
//! subscription's [`PoisonPolicy`](crate::PoisonPolicy) applies at once:
//! `Halt` stops the key at the message (its later messages wait behind it
//! until an operator resolves it), `Park` dead-letters it with the error as
//! the reason. It is never dropped silently, and never retried forever.
//!
//! ```
//! use keyorder_core::{Delivery, HandlerResult, Message};
//!
//! #[derive(serde::Serialize, serde::Deserialize, Debug, PartialEq)]
//! struct Order {
//!     id: u64,
//!     total: u32,
//! }
//!
//! // Producer side: the builder shape of every message.
//! let msg = Message::json(&Order { id: 7, total: 3 })?.with_key("client-42")?;
//! assert_eq!(msg.header(keyorder_core::CONTENT_TYPE_HEADER), Some("application/json"));
//! assert_eq!(&msg.payload()[..], br#"{"id":7,"total":3}"#);
//!
//! // Consumer side: a payload that does not decode is poison.
//! async fn handle(d: Delivery) -> HandlerResult {
//!     let order: Order = d.json()?;
//!     println!("order {} total {}", order.id, order.total);
//!     Ok(())
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! [`HandlerError::Poison`]: crate::HandlerError::Poison
//! [`CONTENT_TYPE_HEADER`]: crate::CONTENT_TYPE_HEADER

use std::any::type_name;
use std::error::Error as StdError;
use std::fmt;

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::key::OrderingKey;
use crate::message::{Delivery, Message, CONTENT_TYPE_HEADER};
use crate::redact;

type BoxError = Box<dyn StdError + Send + Sync + 'static>;

/// A `serde` format for payloads: how a value becomes bytes and back.
///
/// Implement it for another format (MessagePack, CBOR...) on a unit type,
/// as [`Json`] does, and use it with [`Message::encode`] and
/// [`Delivery::decode`].
///
/// ```
/// use keyorder_core::codec::{Codec, Json};
/// let bytes = Json::encode(&[1, 2, 3]).unwrap();
/// assert_eq!(Json::decode::<Vec<u8>>(&bytes).unwrap(), vec![1, 2, 3]);
/// assert_eq!(Json::CONTENT_TYPE, "application/json");
/// ```
pub trait Codec {
    /// The media type written to [`CONTENT_TYPE_HEADER`] on encode.
    const CONTENT_TYPE: &'static str;
    /// The format's error.
    type Error: StdError + Send + Sync + 'static;
    /// Encodes `value`.
    fn encode<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, Self::Error>;
    /// Decodes a `T` from `bytes`.
    fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, Self::Error>;
}

/// JSON through `serde_json`, as `application/json`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Json;

impl Codec for Json {
    const CONTENT_TYPE: &'static str = "application/json";
    type Error = serde_json::Error;
    fn encode<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, Self::Error> {
        serde_json::to_vec(value)
    }
    fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, Self::Error> {
        serde_json::from_slice(bytes)
    }
}

impl Message {
    /// A keyless message whose payload is `value` as JSON, with
    /// `content-type` [`Json::CONTENT_TYPE`] in [`CONTENT_TYPE_HEADER`];
    /// set the key and the rest with the usual builder methods.
    ///
    /// ```
    /// use keyorder_core::Message;
    /// let msg = Message::json(&serde_json::json!({ "total": 3 }))?
    ///     .with_key("client-42")?
    ///     .with_type("order.created");
    /// assert_eq!(&msg.payload()[..], br#"{"total":3}"#);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    /// [`EncodeError`] where the value cannot be written as JSON (a map
    /// whose keys are not strings, a `Serialize` implementation that fails).
    pub fn json<T: Serialize + ?Sized>(value: &T) -> Result<Self, EncodeError> {
        Self::encode::<Json, T>(value)
    }

    /// A keyless message whose payload is `value` encoded by `C`, with
    /// [`Codec::CONTENT_TYPE`] in [`CONTENT_TYPE_HEADER`].
    ///
    /// ```
    /// use keyorder_core::{codec::Json, Message};
    /// let msg = Message::encode::<Json, _>(&vec!["a", "b"])?;
    /// assert_eq!(&msg.payload()[..], br#"["a","b"]"#);
    /// # Ok::<(), keyorder_core::codec::EncodeError>(())
    /// ```
    ///
    /// # Errors
    /// [`EncodeError`] where `C` cannot encode the value.
    pub fn encode<C: Codec, T: Serialize + ?Sized>(value: &T) -> Result<Self, EncodeError> {
        match C::encode(value) {
            Ok(bytes) => Ok(Message::new(bytes).with_header(CONTENT_TYPE_HEADER, C::CONTENT_TYPE)),
            Err(err) => Err(EncodeError {
                type_name: type_name::<T>(),
                content_type: C::CONTENT_TYPE,
                source: Box::new(err),
            }),
        }
    }
}

impl Delivery {
    /// The payload decoded from JSON as a `T`.
    ///
    /// In a handler, `let order: Order = delivery.json()?;` turns a payload
    /// that does not decode into a poison error (see the [module
    /// documentation](self)).
    ///
    /// # Errors
    /// [`DecodeError`] where the payload is no JSON form of `T`.
    pub fn json<T: DeserializeOwned>(&self) -> Result<T, DecodeError> {
        self.decode::<Json, T>()
    }

    /// The payload decoded by `C` as a `T` (whatever the message's
    /// [`CONTENT_TYPE_HEADER`] says: a message from a producer that sets
    /// none decodes too).
    ///
    /// # Errors
    /// [`DecodeError`] where `C` cannot decode the payload as a `T`.
    pub fn decode<C: Codec, T: DeserializeOwned>(&self) -> Result<T, DecodeError> {
        C::decode(self.payload()).map_err(|err| DecodeError::new::<T>(C::CONTENT_TYPE, self, Box::new(err)))
    }
}

/// A value the codec could not encode: names the Rust type and the codec.
#[derive(Debug)]
pub struct EncodeError {
    type_name: &'static str,
    content_type: &'static str,
    source: BoxError,
}

impl EncodeError {
    /// The Rust type of the value (`std::any::type_name`).
    pub fn type_name(&self) -> &'static str {
        self.type_name
    }
    /// The codec's content type.
    pub fn content_type(&self) -> &'static str {
        self.content_type
    }
}

impl fmt::Display for EncodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "cannot encode a `{}` as {}: {}",
            self.type_name, self.content_type, self.source
        )
    }
}

impl StdError for EncodeError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        Some(&*self.source)
    }
}

/// A payload that does not decode as the type a handler asked for.
///
/// Its text names the Rust type, the codec, the message (its id, its
/// [`TYPE_HEADER`](crate::TYPE_HEADER) type where it has one, its scope and
/// its key's label `k#...`, never the key's value) and what the codec
/// said, with the key's value, where the codec quoted it, replaced by the
/// label and control characters escaped ([`redact::text`]). The same text
/// is the reason a halt or a park records at the broker.
///
/// In a handler, `?` turns it into [`HandlerError::Poison`]: the poison
/// policy applies at once (see the [module documentation](self)).
///
/// ```
/// use keyorder_core::{HandlerError, codec::DecodeError};
/// fn assert_poison(e: DecodeError) {
///     assert!(HandlerError::from(e).is_poison());
/// }
/// ```
///
/// [`HandlerError::Poison`]: crate::HandlerError::Poison
pub struct DecodeError(Box<Decode>);

/// What a [`DecodeError`] holds (boxed: a `Result` carrying it stays small).
struct Decode {
    type_name: &'static str,
    content_type: &'static str,
    id: String,
    message_type: Option<String>,
    scope: String,
    key_label: Option<String>,
    attempt: u32,
    detail: String,
    source: BoxError,
}

impl DecodeError {
    fn new<T>(content_type: &'static str, d: &Delivery, source: BoxError) -> Self {
        DecodeError(Box::new(Decode {
            type_name: type_name::<T>(),
            content_type,
            id: d.id().to_owned(),
            message_type: d.message().message_type().map(str::to_owned),
            scope: d.scope().to_owned(),
            key_label: d.key().map(OrderingKey::label),
            attempt: d.attempt(),
            detail: scrub(&source.to_string(), d.key()),
            source,
        }))
    }
    /// The Rust type asked for (`std::any::type_name`).
    pub fn type_name(&self) -> &'static str {
        self.0.type_name
    }
    /// The codec's content type.
    pub fn content_type(&self) -> &'static str {
        self.0.content_type
    }
    /// The message id.
    pub fn message_id(&self) -> &str {
        &self.0.id
    }
    /// The key's label (`k#...`), `None` for a keyless message.
    pub fn key_label(&self) -> Option<&str> {
        self.0.key_label.as_deref()
    }
    /// What the codec said, with the key's value replaced by its label.
    pub fn detail(&self) -> &str {
        &self.0.detail
    }
    /// The codec's own error (`serde_json::Error` for [`Json`], to
    /// downcast for its line and column). Its text may quote the payload,
    /// the key's value included: log [`DecodeError`] itself, not this. It
    /// is therefore not the [`source`](StdError::source), which error
    /// reporters print.
    pub fn codec_error(&self) -> &(dyn StdError + Send + Sync + 'static) {
        &*self.0.source
    }
}

/// `text` with every occurrence of the key's value (as it is, and as
/// `Debug` escapes it inside a quoted string, as serde quotes a string)
/// replaced by its label, then escaped to one inert line. A trailing
/// position (` at line N column M`, as `serde_json` ends its errors) is
/// kept as it is: it is no payload text, and a short numeric key would
/// otherwise garble it.
fn scrub(text: &str, key: Option<&OrderingKey>) -> String {
    let (body, position) = split_position(text);
    let mut body = body.to_owned();
    if let Some(key) = key {
        let label = key.label();
        let raw = key.as_str();
        let escaped = format!("{raw:?}");
        let escaped = &escaped[1..escaped.len() - 1];
        body = replace_any(&body, &[raw, escaped], &label);
    }
    redact::text(&format!("{body}{position}"))
}

/// `text` with every occurrence of any of `needles` (the longest where
/// several start at one place) replaced by `with`, in one pass: a
/// replacement is never searched again (a label's hex digits may hold a
/// short key's value).
fn replace_any(text: &str, needles: &[&str], with: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while !rest.is_empty() {
        let longest = needles
            .iter()
            .filter(|n| !n.is_empty() && rest.starts_with(**n))
            .map(|n| n.len())
            .max();
        if let Some(len) = longest {
            out.push_str(with);
            rest = &rest[len..];
            continue;
        }
        let mut chars = rest.chars();
        if let Some(c) = chars.next() {
            out.push(c);
        }
        rest = chars.as_str();
    }
    out
}

/// `text` split before a trailing ` at line N column M`, if it has one.
fn split_position(text: &str) -> (&str, &str) {
    let Some(at) = text.rfind(" at line ") else {
        return (text, "");
    };
    let tail = &text[at + " at line ".len()..];
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    match tail.split_once(" column ") {
        Some((line, column)) if digits(line) && digits(column) => (&text[..at], &text[at..]),
        _ => (text, ""),
    }
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "cannot decode message {} (", redact::quoted(&self.0.id))?;
        if let Some(ty) = &self.0.message_type {
            write!(f, "type {}, ", redact::quoted(ty))?;
        }
        write!(
            f,
            "key {}, scope {}, attempt {}) as `{}` from {}: {}; a payload that does not decode is poison: \
             the poison policy applies at once (fix the producer or the type)",
            self.0.key_label.as_deref().unwrap_or("keyless"),
            redact::quoted(&self.0.scope),
            self.0.attempt,
            self.0.type_name,
            self.0.content_type,
            self.0.detail
        )
    }
}

impl fmt::Debug for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DecodeError")
            .field("type_name", &self.0.type_name)
            .field("content_type", &self.0.content_type)
            .field("id", &redact::text(&self.0.id))
            .field("key_label", &self.0.key_label)
            .field("scope", &redact::text(&self.0.scope))
            .field("attempt", &self.0.attempt)
            .field("detail", &self.0.detail)
            .finish()
    }
}

impl StdError for DecodeError {}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
    struct Order {
        client: String,
        total: u32,
    }

    fn delivery(msg: Message, key: &str) -> Delivery {
        Delivery {
            message: Arc::new(msg),
            key: Some(OrderingKey::new(key).unwrap()),
            attempt: 1,
            fencing_token: 3,
            scope: Arc::from("p-2"),
        }
    }

    #[test]
    fn json_round_trips_with_its_content_type() {
        let order = Order {
            client: "c-1".into(),
            total: 3,
        };
        let msg = Message::json(&order)
            .unwrap()
            .with_key("c-1")
            .unwrap()
            .with_type("order");
        assert_eq!(msg.header(CONTENT_TYPE_HEADER), Some("application/json"));
        assert_eq!(msg.message_type(), Some("order"));
        assert_eq!(msg.key().unwrap().as_str(), "c-1");
        assert_eq!(delivery(msg.clone(), "c-1").json::<Order>().unwrap(), order);
        assert_eq!(delivery(msg, "c-1").decode::<Json, Order>().unwrap(), order);
    }

    #[test]
    fn an_unencodable_value_names_its_type() {
        // JSON maps need string keys.
        let bad: std::collections::BTreeMap<(u8, u8), u8> = [((1, 2), 3)].into();
        let err = Message::json(&bad).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("BTreeMap<(u8, u8), u8>"), "{text}");
        assert!(text.contains("application/json"), "{text}");
        assert!(err.source().is_some());
    }

    #[test]
    fn a_decode_error_names_type_and_message_but_not_the_key() {
        let key = "customer-4711-secret";
        // The payload quotes the key where the type wants a number: the
        // codec's own text shows it.
        let msg = Message::new(format!(r#"{{"client":"c","total":"{key}"}}"#))
            .with_id("m-9")
            .with_type("order.created");
        let d = delivery(msg, key);
        let err = d.json::<Order>().unwrap_err();
        assert!(
            err.codec_error().to_string().contains(key),
            "the raw codec text quotes the key"
        );
        let text = err.to_string();
        let label = OrderingKey::new(key).unwrap().label();
        for want in [
            "keyorder_core::codec::tests::Order",
            "\"m-9\"",
            "\"order.created\"",
            "\"p-2\"",
            label.as_str(),
            "application/json",
            "invalid type",
            "poison",
        ] {
            assert!(text.contains(want), "{want:?} missing from {text}");
        }
        assert!(!text.contains(key), "the key's value leaked: {text}");
        assert!(!format!("{err:?}").contains(key));
        assert!(err.source().is_none(), "no source: its text would show the key");
        assert_eq!(err.type_name(), type_name::<Order>());
        assert_eq!(err.key_label(), Some(label.as_str()));
        assert_eq!(err.message_id(), "m-9");
    }

    #[test]
    fn the_key_escaped_by_the_codec_is_hidden_too() {
        let key = "tab\there \"quoted\"";
        let json = serde_json::to_string(key).unwrap();
        let msg = Message::new(format!(r#"{{"client":"c","total":{json}}}"#));
        let err = delivery(msg, key).json::<Order>().unwrap_err();
        let text = err.to_string();
        assert!(!text.contains("here"), "{text}");
        assert!(text.contains(&OrderingKey::new(key).unwrap().label()), "{text}");
    }

    #[test]
    fn a_forged_line_in_the_payload_stays_one_line() {
        let msg = Message::new("{\"client\":\"c\",\"total\":\"x\\n\\u001b[2J\"}".to_owned()).with_id("id\nforged");
        let text = delivery(msg, "k").json::<Order>().unwrap_err().to_string();
        assert!(!text.chars().any(char::is_control), "{text:?}");
    }

    #[test]
    fn every_occurrence_is_replaced_but_the_position() {
        let key = OrderingKey::new("1").unwrap();
        let label = key.label();
        assert_eq!(
            scrub("got 1 and x1x at line 1 column 12", Some(&key)),
            format!("got {label} and x{label}x at line 1 column 12")
        );
        assert_eq!(split_position("no position here"), ("no position here", ""));
        assert_eq!(split_position("a at line 2 column x"), ("a at line 2 column x", ""));
        assert_eq!(scrub("keyless text", None), "keyless text");
        assert_eq!(replace_any("a\\tb a\tb ab", &["a\tb", "a\\tb"], "K"), "K K ab");
        assert_eq!(replace_any("ключ-ключ", &["ключ"], "K"), "K-K");
        assert_eq!(replace_any("same", &[""], "K"), "same");
    }

    #[test]
    fn a_decode_error_is_poison_through_question_mark() {
        fn handler(d: &Delivery) -> crate::HandlerResult {
            let _order: Order = d.json()?;
            Ok(())
        }
        let err = handler(&delivery(Message::new("not json"), "k")).unwrap_err();
        assert!(err.is_poison(), "{err:?}");
        assert!(err.to_string().contains("Order"), "{err}");
        // Any other error stays retryable.
        fn other() -> crate::HandlerResult {
            Err(std::io::Error::other("down"))?
        }
        assert!(!other().unwrap_err().is_poison());
    }
}
