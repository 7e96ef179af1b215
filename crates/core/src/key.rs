//! Ordering keys: one validated rule set for every transport.
//!
//! An [`OrderingKey`] can only be built through validation, so a value of the
//! type always obeys every rule of the contract:
//!
//! * not empty and at most [`MAX_KEY_BYTES`] bytes (fits an AMQP routing key);
//! * no `:`, `{`, `}` (Redis key layout and cluster hash tags) and no control
//!   character;
//! * not a reserved lane token (`dlq`, and each configured lane suffix);
//! * not of the sentinel form `__name__` (reserved for internal names).
//!
//! Errors never carry the full key: keys are user data. [`KeyError`] shows a
//! truncated, escaped preview and the rule that was broken.
//!
//! ```
//! use keyorder_core::{KeyRules, OrderingKey};
//!
//! let key = OrderingKey::new("client-42")?;
//! assert_eq!(key.as_str(), "client-42");
//!
//! let err = OrderingKey::new("a:b").unwrap_err();
//! assert_eq!(err.rule(), keyorder_core::KeyRule::ForbiddenCharacter);
//!
//! let rules = KeyRules::default().with_lane("backfill");
//! assert!(OrderingKey::with_rules("backfill", &rules).is_err());
//! # Ok::<(), keyorder_core::KeyError>(())
//! ```

use std::fmt;
use std::sync::Arc;

/// The longest key accepted, in bytes.
pub const MAX_KEY_BYTES: usize = 255;

/// The lane token every transport reserves for dead letters.
pub const DLQ_LANE: &str = "dlq";

/// The rule a rejected key broke.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum KeyRule {
    /// The key is empty.
    Empty,
    /// The key is longer than [`MAX_KEY_BYTES`] bytes.
    TooLong,
    /// The key contains `:`, `{` or `}`.
    ForbiddenCharacter,
    /// The key contains a control character.
    ControlCharacter,
    /// The key equals a reserved lane token (`dlq` or a configured lane).
    ReservedLane,
    /// The key has the sentinel form `__name__`.
    Sentinel,
}

impl KeyRule {
    /// A short, stable name of the rule (used in errors and metrics).
    pub fn name(self) -> &'static str {
        match self {
            KeyRule::Empty => "empty",
            KeyRule::TooLong => "longer than 255 bytes",
            KeyRule::ForbiddenCharacter => "contains ':', '{' or '}'",
            KeyRule::ControlCharacter => "contains a control character",
            KeyRule::ReservedLane => "reserved lane token",
            KeyRule::Sentinel => "reserved sentinel form __name__",
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

/// A short, escaped, truncated form of a key, safe to log: at most 8
/// characters of the value, escaped, followed by its byte length.
pub fn redact(value: &str) -> String {
    let mut shown: String = value.chars().take(8).flat_map(char::escape_default).collect();
    if shown.len() > 32 {
        shown.truncate(32);
    }
    if value.chars().count() > 8 {
        format!("\"{shown}…\" ({} bytes)", value.len())
    } else {
        format!("\"{shown}\" ({} bytes)", value.len())
    }
}

/// The configurable part of the rule set: reserved lane suffixes.
///
/// `dlq` is always reserved; adapters and subscriptions add lanes such as
/// `backfill`. One `KeyRules` value should be shared by every producer and
/// consumer of a deployment.
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
    /// Reserves one more lane suffix (keys equal to it are rejected).
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
        if value.contains([':', '{', '}']) {
            return fail(KeyRule::ForbiddenCharacter);
        }
        if value.chars().any(char::is_control) {
            return fail(KeyRule::ControlCharacter);
        }
        if self.lanes.iter().any(|lane| lane == value) {
            return fail(KeyRule::ReservedLane);
        }
        if value.len() > 4 && value.starts_with("__") && value.ends_with("__") {
            return fail(KeyRule::Sentinel);
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
    /// Validates `value` with the default rules (`dlq` reserved).
    pub fn new(value: impl AsRef<str>) -> Result<Self, KeyError> {
        Self::with_rules(value, &KeyRules::default())
    }

    /// Validates `value` with `rules`.
    pub fn with_rules(value: impl AsRef<str>, rules: &KeyRules) -> Result<Self, KeyError> {
        let value = value.as_ref();
        rules.check(value)?;
        Ok(OrderingKey(Arc::from(value)))
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
        assert_eq!(rule_of("a:b", &rules), Some(KeyRule::ForbiddenCharacter));
        assert_eq!(rule_of("a{b", &rules), Some(KeyRule::ForbiddenCharacter));
        assert_eq!(rule_of("a}b", &rules), Some(KeyRule::ForbiddenCharacter));
        assert_eq!(rule_of("a\nb", &rules), Some(KeyRule::ControlCharacter));
        assert_eq!(rule_of("a\u{7f}", &rules), Some(KeyRule::ControlCharacter));
        assert_eq!(rule_of("dlq", &rules), Some(KeyRule::ReservedLane));
        assert_eq!(rule_of("backfill", &rules), Some(KeyRule::ReservedLane));
        assert_eq!(rule_of("__partitions__", &rules), Some(KeyRule::Sentinel));
        assert_eq!(rule_of("____", &rules), None, "too short to be a sentinel name");
        assert_eq!(rule_of("__x", &rules), None);
        assert_eq!(rule_of("client-42", &rules), None);
        assert_eq!(rule_of("ключ", &rules), None);
    }

    #[test]
    fn errors_never_show_the_full_key() {
        let secret = format!("secret-customer-{}:x", "9".repeat(40));
        let err = OrderingKey::new(&secret).unwrap_err();
        let shown = err.to_string();
        assert!(!shown.contains(&secret));
        assert!(!shown.contains("customer"), "{shown}");
        let ok = OrderingKey::new("customer-0000001").unwrap();
        assert!(!format!("{ok:?} {ok}").contains("customer-0000001"));
    }

    fn obeys_every_rule(value: &str, rules: &KeyRules) -> bool {
        !value.is_empty()
            && value.len() <= MAX_KEY_BYTES
            && !value.contains([':', '{', '}'])
            && !value.chars().any(char::is_control)
            && !rules.lanes().iter().any(|l| l == value)
            && !(value.len() > 4 && value.starts_with("__") && value.ends_with("__"))
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
                Ok(key) => prop_assert!(obeys_every_rule(key.as_str(), &rules)),
                Err(err) => {
                    prop_assert!(!obeys_every_rule(&value, &rules));
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
            prop_assert_eq!(accepted, obeys_every_rule(&value, &rules));
        }
    }
}
