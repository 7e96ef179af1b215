//! Ordering keys: one validated rule set for every transport.
//!
//! An [`OrderingKey`] can only be built through validation, so a value of the
//! type always obeys every rule of the contract. A key is refused only when
//! no adapter could carry it:
//!
//! * empty;
//! * longer than [`MAX_KEY_BYTES`] bytes (fits an AMQP routing key).
//!
//! Everything else is carried, the keys real systems use included:
//! `customer:42`, `{tag}`, control characters, NUL, a lane token such as
//! `dlq`, the `__name__` form. An adapter whose broker names things by key
//! (Redis) encodes the key so that it collides with no other key, lane or
//! internal name; a store whose text cannot hold NUL (PostgreSQL) keeps the
//! [`stored_text`] form. A foreign message whose key is not UTF-8 (a Kafka
//! record's key bytes) gets a key from [`OrderingKey::from_bytes`].
//!
//! Errors never carry the full key: keys are user data. [`KeyError`] shows a
//! truncated, escaped preview and the rule that was broken.
//!
//! ```
//! use keyorder_core::{KeyRule, OrderingKey};
//!
//! let key = OrderingKey::new("customer:42")?;
//! assert_eq!(key.as_str(), "customer:42");
//!
//! let err = OrderingKey::new("").unwrap_err();
//! assert_eq!(err.rule(), KeyRule::Empty);
//! let err = OrderingKey::new("x".repeat(256)).unwrap_err();
//! assert_eq!(err.rule(), KeyRule::TooLong);
//!
//! // An 8-byte big-endian integer key, as a Java producer writes it.
//! let raw = 42u64.to_be_bytes();
//! assert_eq!(OrderingKey::from_bytes(&raw)?.as_str().as_bytes(), &raw[..]);
//! # Ok::<(), keyorder_core::KeyError>(())
//! ```

use std::fmt;
use std::sync::Arc;

/// The longest key accepted, in bytes.
pub const MAX_KEY_BYTES: usize = 255;

/// The lane token every transport reserves for dead letters.
pub const DLQ_LANE: &str = "dlq";

/// The rule a rejected key broke.
///
/// Wave 1 also refused `:`, `{`, `}`, control characters, lane tokens and
/// the `__name__` form; those keys are now carried (adapters encode them
/// where their broker needs it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum KeyRule {
    /// The key is empty.
    Empty,
    /// The key is longer than [`MAX_KEY_BYTES`] bytes.
    TooLong,
}

impl KeyRule {
    /// A short, stable name of the rule (used in errors and metrics).
    pub fn name(self) -> &'static str {
        match self {
            KeyRule::Empty => "empty",
            KeyRule::TooLong => "longer than 255 bytes",
        }
    }
}

/// A rejected key: the rule it broke and a redacted preview of it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid ordering key {preview}: {}", rule.name())]
pub struct KeyError {
    rule: KeyRule,
    preview: String,
}

impl KeyError {
    /// The rule the key broke.
    pub fn rule(&self) -> KeyRule {
        self.rule
    }
    /// The redacted preview shown in the message (never the full key).
    pub fn preview(&self) -> &str {
        &self.preview
    }
}

/// A short, escaped, truncated form of a key, safe to log: at most half of
/// its characters and never more than 8, escaped (control characters,
/// quotes and non-ASCII as `\u{..}`, so nothing in it can act on a log or
/// a terminal), then `…` and its byte length. It never shows a whole key,
/// however short: `"ab"` shows as `"a…" (2 bytes)`.
pub fn redact(value: &str) -> String {
    let chars = value.chars().count();
    let shown: String = value
        .chars()
        .take((chars / 2).min(8))
        .flat_map(char::escape_default)
        .collect();
    format!("\"{shown}…\" ({} bytes)", value.len())
}

/// The deployment's lanes (`dlq` and suffixes such as `backfill`).
///
/// Lanes no longer reserve keys: a key equal to a lane token is carried, and
/// an adapter that names things by key (Redis) encodes it so that it never
/// collides with a lane. The value is kept so that adapters and
/// subscriptions share one list of lanes; one `KeyRules` value should be
/// shared by every producer and consumer of a deployment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyRules {
    lanes: Arc<[String]>,
}

impl Default for KeyRules {
    fn default() -> Self {
        KeyRules {
            lanes: Arc::from(vec![DLQ_LANE.to_owned()]),
        }
    }
}

impl KeyRules {
    /// Adds one more lane suffix.
    pub fn with_lane(mut self, lane: impl Into<String>) -> Self {
        let mut lanes: Vec<String> = self.lanes.iter().cloned().collect();
        let lane = lane.into();
        if !lanes.contains(&lane) {
            lanes.push(lane);
        }
        self.lanes = Arc::from(lanes);
        self
    }

    /// The reserved lane tokens, `dlq` first.
    pub fn lanes(&self) -> &[String] {
        &self.lanes
    }

    /// Checks `value` against every rule, returning the first broken one.
    pub fn check(&self, value: &str) -> Result<(), KeyError> {
        let fail = |rule| {
            Err(KeyError {
                rule,
                preview: redact(value),
            })
        };
        if value.is_empty() {
            return fail(KeyRule::Empty);
        }
        if value.len() > MAX_KEY_BYTES {
            return fail(KeyRule::TooLong);
        }
        Ok(())
    }
}

/// A validated ordering key. See the [module docs](self) for the rules.
///
/// `Display` and `Debug` print a redacted form; use [`OrderingKey::as_str`]
/// where the real value is needed (never in logs).
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OrderingKey(Arc<str>);

impl OrderingKey {
    /// Validates `value`: not empty, at most [`MAX_KEY_BYTES`] bytes.
    pub fn new(value: impl AsRef<str>) -> Result<Self, KeyError> {
        Self::with_rules(value, &KeyRules::default())
    }

    /// Validates `value` with `rules`.
    pub fn with_rules(value: impl AsRef<str>, rules: &KeyRules) -> Result<Self, KeyError> {
        let value = value.as_ref();
        rules.check(value)?;
        Ok(OrderingKey(Arc::from(value)))
    }

    /// The key of a foreign message's key bytes (a Kafka record's key).
    ///
    /// UTF-8 bytes of at most [`MAX_KEY_BYTES`] are the key itself. Other
    /// bytes, which a key (a string) cannot hold, get a stable text form:
    /// `U+FFFD` followed by the bytes in lower-case hex; when that would
    /// pass [`MAX_KEY_BYTES`] (a binary key over 126 bytes, a UTF-8 key
    /// over 255), the hex of the first 100 bytes, `~`, and the
    /// [`stable_hash`] of all of them. The same bytes always give the same
    /// key, so their messages keep their order; two different byte strings
    /// share a key only if their forms are equal (a UTF-8 key spelled like
    /// a form, or two long keys with a common 100-byte prefix and equal
    /// hash), which only orders them together. One consequence: a foreign
    /// UTF-8 key spelled exactly like the form of other bytes (`U+FFFD`
    /// `ff`) is that key, and keyorder's Kafka publisher sends it as those
    /// bytes ([`OrderingKey::to_bytes`]), so a republished record of it
    /// lands on those bytes' partition. Fails only for no bytes.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, KeyError> {
        match std::str::from_utf8(bytes) {
            Ok(text) if text.len() <= MAX_KEY_BYTES => Self::new(text),
            _ if bytes.is_empty() => Self::new(""),
            _ => {
                use std::fmt::Write as _;
                let mut form = String::from(BINARY_KEY_MARK);
                if form.len() + 2 * bytes.len() <= MAX_KEY_BYTES {
                    for b in bytes {
                        let _ = write!(form, "{b:02x}");
                    }
                } else {
                    for b in &bytes[..100] {
                        let _ = write!(form, "{b:02x}");
                    }
                    let _ = write!(form, "~{:016x}", stable_hash(bytes));
                }
                Self::new(form)
            }
        }
    }

    /// Whether this key has the text form [`OrderingKey::from_bytes`] gives
    /// key bytes that are no key as they are.
    pub fn is_binary_form(&self) -> bool {
        self.0.starts_with(BINARY_KEY_MARK)
    }

    /// The key bytes a broker that keys records by bytes (Kafka) carries:
    /// the original bytes of a short form of non-UTF-8 bytes (so a record
    /// consumed under such a key and published again keeps its key bytes
    /// and partition), else the key's UTF-8. Reverses
    /// [`OrderingKey::from_bytes`] wherever that can be told:
    /// `from_bytes(key.to_bytes()) == key` for every key.
    pub fn to_bytes(&self) -> std::borrow::Cow<'_, [u8]> {
        let text = self.as_str();
        let raw = text.strip_prefix(BINARY_KEY_MARK).and_then(|hex| {
            if hex.len() % 2 != 0 || !hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
                return None;
            }
            let bytes: Vec<u8> = (0..hex.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&hex[i..i + 2], 16))
                .collect::<Result<_, _>>()
                .ok()?;
            // Only bytes that are no UTF-8: others were never a form.
            (!bytes.is_empty() && std::str::from_utf8(&bytes).is_err()).then_some(bytes)
        });
        match raw {
            Some(bytes) => std::borrow::Cow::Owned(bytes),
            None => std::borrow::Cow::Borrowed(text.as_bytes()),
        }
    }

    /// The key's value. Keys are user data: do not log it.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// A stable 64-bit hash of the key (FNV-1a over its bytes), the same in
    /// every process and version: adapters use it for slot and partition
    /// assignment and logs use it to name a key without showing it.
    pub fn stable_hash(&self) -> u64 {
        stable_hash(self.as_str().as_bytes())
    }

    /// A log-safe label: `k#` and the stable hash in hex.
    pub fn label(&self) -> String {
        label(self.as_str())
    }
}

/// What starts the text form of non-UTF-8 key bytes (U+FFFD, the
/// replacement character; see [`OrderingKey::from_bytes`]).
pub const BINARY_KEY_MARK: &str = "\u{fffd}";

/// The escape character of [`stored_text`] (U+0001).
const STORED_ESCAPE: char = '\u{1}';

/// A key's form for a store whose text cannot hold NUL (PostgreSQL's
/// `text`): a key without NUL that does not start with U+0001 is itself
/// (so every key stored before NUL was allowed keeps its form); any other
/// is U+0001 followed by the key with U+0001 written as U+0001 `1` and NUL
/// as U+0001 `0`. [`from_stored_text`] reverses it; distinct keys never
/// share a form.
pub fn stored_text(key: &str) -> std::borrow::Cow<'_, str> {
    if !key.contains('\0') && !key.starts_with(STORED_ESCAPE) {
        return std::borrow::Cow::Borrowed(key);
    }
    let mut out = String::with_capacity(key.len() + 2);
    out.push(STORED_ESCAPE);
    for c in key.chars() {
        match c {
            '\0' => {
                out.push(STORED_ESCAPE);
                out.push('0');
            }
            STORED_ESCAPE => {
                out.push(STORED_ESCAPE);
                out.push('1');
            }
            c => out.push(c),
        }
    }
    std::borrow::Cow::Owned(out)
}

/// The key whose [`stored_text`] form is `stored` (a value that is no
/// such form, which no keyorder wrote, is returned as it is).
pub fn from_stored_text(stored: &str) -> std::borrow::Cow<'_, str> {
    let Some(rest) = stored.strip_prefix(STORED_ESCAPE) else {
        return std::borrow::Cow::Borrowed(stored);
    };
    let mut out = String::with_capacity(rest.len());
    let mut chars = rest.chars();
    while let Some(c) = chars.next() {
        if c == STORED_ESCAPE {
            match chars.next() {
                Some('0') => out.push('\0'),
                Some('1') => out.push(STORED_ESCAPE),
                _ => return std::borrow::Cow::Borrowed(stored),
            }
        } else {
            out.push(c);
        }
    }
    std::borrow::Cow::Owned(out)
}

/// The log-safe label of a key value: `k#` and its [`stable_hash`] in hex.
/// Operators name halted keys by it; it never shows the value.
pub fn label(key: &str) -> String {
    format!("k#{:016x}", stable_hash(key.as_bytes()))
}

/// FNV-1a, 64 bits: the documented, stable hash keyorder uses wherever a key
/// must map to a slot or partition the same way in every process.
pub fn stable_hash(bytes: &[u8]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        hash ^= u64::from(*b);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash
}

impl fmt::Debug for OrderingKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "OrderingKey({})", redact(&self.0))
    }
}

impl fmt::Display for OrderingKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&redact(&self.0))
    }
}

impl TryFrom<&str> for OrderingKey {
    type Error = KeyError;
    fn try_from(value: &str) -> Result<Self, Self::Error> {
        OrderingKey::new(value)
    }
}

impl TryFrom<String> for OrderingKey {
    type Error = KeyError;
    fn try_from(value: String) -> Result<Self, Self::Error> {
        OrderingKey::new(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn rule_of(value: &str, rules: &KeyRules) -> Option<KeyRule> {
        rules.check(value).err().map(|e| e.rule())
    }

    #[test]
    fn every_rule_is_named() {
        let rules = KeyRules::default().with_lane("backfill");
        assert_eq!(rule_of("", &rules), Some(KeyRule::Empty));
        assert_eq!(rule_of(&"x".repeat(256), &rules), Some(KeyRule::TooLong));
        assert_eq!(rule_of(&"x".repeat(255), &rules), None);
        // The keys real systems use, and what wave 1 refused, are carried.
        for carried in [
            "customer:42",
            "a{b",
            "a}b",
            "a\nb",
            "a\u{7f}",
            "\0",
            "dlq",
            "backfill",
            "__partitions__",
            "client-42",
            "ключ",
        ] {
            assert_eq!(rule_of(carried, &rules), None, "{carried:?}");
        }
    }

    #[test]
    fn binary_keys_get_a_stable_distinct_text_form() {
        let int = 42u64.to_be_bytes();
        assert_eq!(OrderingKey::from_bytes(&int).unwrap().as_str().as_bytes(), &int[..]);
        let raw = [0xff_u8, 0x00, 0x41];
        let k = OrderingKey::from_bytes(&raw).unwrap();
        assert_eq!(k.as_str(), "\u{fffd}ff0041");
        assert!(k.is_binary_form());
        assert_eq!(k, OrderingKey::from_bytes(&raw).unwrap());
        assert_eq!(&*k.to_bytes(), &raw[..], "the form gives its bytes back");
        let spelled = OrderingKey::new("\u{fffd}41").unwrap();
        assert_eq!(
            &*spelled.to_bytes(),
            spelled.as_str().as_bytes(),
            "a form of UTF-8 bytes is text"
        );
        assert_ne!(k, OrderingKey::from_bytes(&[0xff, 0x00, 0x42]).unwrap());
        let long: Vec<u8> = (0..=255u8).collect();
        let mut other = long.clone();
        other[200] = 0;
        let (a, b) = (
            OrderingKey::from_bytes(&long).unwrap(),
            OrderingKey::from_bytes(&other).unwrap(),
        );
        assert!(a.as_str().len() <= MAX_KEY_BYTES && a.is_binary_form());
        assert_ne!(a, b, "long keys differing past the prefix differ by their hash");
        assert_eq!(OrderingKey::from_bytes(b"").unwrap_err().rule(), KeyRule::Empty);
        let text = "x".repeat(300);
        let k = OrderingKey::from_bytes(text.as_bytes()).unwrap();
        assert!(
            k.is_binary_form() && k.as_str().len() <= MAX_KEY_BYTES,
            "an over-long UTF-8 key gets the form"
        );
    }

    #[test]
    fn stored_text_holds_no_nul_and_keeps_old_keys() {
        for key in ["plain", "customer:42", "\u{2}x"] {
            assert_eq!(stored_text(key), key, "a key without NUL or a leading U+0001 is itself");
        }
        for key in ["\0", "a\0b", "\u{1}", "\u{1}0", "\u{1}\0\u{1}1"] {
            let stored = stored_text(key);
            assert!(!stored.contains('\0'), "{key:?}");
            assert_eq!(from_stored_text(&stored), key);
        }
    }

    #[test]
    fn a_preview_never_shows_a_whole_key() {
        for len in 1..=12 {
            let key: String = "abcdefghijkl".chars().take(len).collect();
            let shown = redact(&key);
            assert!(!shown.contains(&format!("\"{key}")), "{key}: {shown}");
            assert!(shown.ends_with(&format!("({len} bytes)")), "{shown}");
        }
        assert_eq!(redact("ab"), "\"a…\" (2 bytes)");
        assert_eq!(redact("\u{1b}[31mred"), "\"\\u{1b}[31…\" (8 bytes)");
    }

    #[test]
    fn errors_never_show_the_full_key() {
        let secret = format!("secret-customer-{}:x", "9".repeat(300));
        let err = OrderingKey::new(&secret).unwrap_err();
        let shown = err.to_string();
        assert!(!shown.contains(&secret));
        assert!(!shown.contains("customer"), "{shown}");
        let ok = OrderingKey::new("customer-0000001").unwrap();
        assert!(!format!("{ok:?} {ok}").contains("customer-0000001"));
    }

    fn obeys_every_rule(value: &str) -> bool {
        !value.is_empty() && value.len() <= MAX_KEY_BYTES
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: std::env::var("KEYORDER_PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(2048),
            ..ProptestConfig::default()
        })]

        /// No input panics; every accepted key obeys every rule; every
        /// rejection names a rule the value really breaks, and hides the value.
        #[test]
        fn no_input_panics_and_accepted_keys_obey_rules(value in any::<String>(), lane in "[a-z]{1,8}") {
            let rules = KeyRules::default().with_lane(lane);
            match OrderingKey::with_rules(&value, &rules) {
                Ok(key) => {
                    prop_assert!(obeys_every_rule(key.as_str()));
                    prop_assert_eq!(key.as_str(), value.as_str());
                }
                Err(err) => {
                    prop_assert!(!obeys_every_rule(&value));
                    if value.chars().count() > 8 {
                        prop_assert!(!err.to_string().contains(&value));
                    }
                }
            }
        }

        #[test]
        fn near_valid_keys(value in "[a-z0-9_:{}\\-\u{0}-\u{1f}]{0,300}") {
            let rules = KeyRules::default();
            let accepted = OrderingKey::with_rules(&value, &rules).is_ok();
            prop_assert_eq!(accepted, obeys_every_rule(&value));
        }

        /// The stored text form never holds NUL and always reads back.
        #[test]
        fn stored_text_round_trips(value in any::<String>()) {
            let stored = stored_text(&value);
            prop_assert!(!stored.contains('\0'));
            prop_assert_eq!(from_stored_text(&stored), value.as_str());
        }

        /// Every key's bytes give the key back.
        #[test]
        fn key_bytes_round_trip(value in "(\u{fffd})?[0-9a-f\u{0}-\u{7f}]{1,20}") {
            let k = OrderingKey::new(&value).unwrap();
            prop_assert_eq!(OrderingKey::from_bytes(&k.to_bytes()).unwrap(), k);
        }

        /// Any key bytes give a valid key; equal bytes the same, and bytes
        /// that fit the hex form distinct keys; short bytes come back.
        #[test]
        fn any_key_bytes_give_a_key(bytes in proptest::collection::vec(any::<u8>(), 1..300), other in proptest::collection::vec(any::<u8>(), 1..120)) {
            match OrderingKey::from_bytes(&bytes) {
                Ok(k) => {
                    prop_assert_eq!(&k, &OrderingKey::from_bytes(&bytes).unwrap());
                    prop_assert_eq!(&OrderingKey::from_bytes(&k.to_bytes()).unwrap(), &k);
                    if 3 + 2 * bytes.len() <= MAX_KEY_BYTES && !std::str::from_utf8(&bytes).is_ok_and(|t| t.starts_with(BINARY_KEY_MARK)) {
                        prop_assert_eq!(&*k.to_bytes(), &bytes[..]);
                    }
                }
                Err(e) => prop_assert!(false, "{e}"),
            }
            if bytes != other && bytes.len() < 120 {
                if let (Ok(a), Ok(b)) = (OrderingKey::from_bytes(&bytes), OrderingKey::from_bytes(&other)) {
                    let utf8 = std::str::from_utf8(&bytes).is_ok() || std::str::from_utf8(&other).is_ok();
                    prop_assert!(utf8 || a != b);
                }
            }
        }
    }
}
