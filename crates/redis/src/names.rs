//! The key layout of one category. `{c}` is the category, `{k}` the ordering
//! key, `{g}` the consumer group.
//!
//! | Redis key | Type | What |
//! |---|---|---|
//! | `{c}:{k}` | stream | the partition of key `{k}` |
//! | `{c}:{k}:{lane}` | stream | a lane of the key (reserved suffix) |
//! | `{c}:{k}:dlq` | stream | the key's dead letters |
//! | `{c}:__partitions__` | sorted set | the index: every live partition, scored by its last publish (server clock, ms) |
//! | `{c}:{k}:__lease__:{g}` | string | the lease, `{owner}:{generation}`, with a PX expiry |
//! | `{c}:__generation__` | string | the category's generation counter (never expires) |
//! | `{c}:__fence__:{scope}` | string | a publish fence: the highest token a fenced publish for `{scope}` carried (never expires) |
//! | `{c}:__members__:{g}` | sorted set | live members, scored by their last heartbeat |
//! | `{c}:__groups__` | hash | the group registry: every group that subscribed and was not removed, with its lease TTL (ms); trimming and reaping keep what any of them still needs |
//! | `{c}:__halted__:{g}` | hash | halted keys and their heads |
//! | `{c}:__resolved__:{g}` | hash | operator actions waiting for the owner |
//! | `{c}:__dlq__` | set | keys with dead letters |
//! | `{c}:__keyless__` | stream | keyless messages (no order) |
//! | `{c}` | stream | every message, with `layout=single` |
//! | `{c}:__wake__` | pub/sub channel | wake-ups: the key of each publish |
//!
//! `{k}` above is the key's *segment* ([`Names::segment`]), never the raw
//! key; the key field inside a stream entry stays the raw key. Index
//! members, halted and resolved fields, dead-letter index members and
//! wake-up payloads are segments too, and are decoded
//! ([`Names::key_of`]) wherever a key is read back.
//!
//! A key is *plain* when it holds no `:`, `{`, `}` or control character
//! and is not of the `__name__` form (more than 4 bytes, starting and
//! ending with `__`): its segment is the key itself. Every other key is
//! *encoded*: `}` followed by the key with `%`, `:`, `{`, `}` and every
//! control character written as `%XX` (its UTF-8 bytes, upper-case hex).
//! So no segment holds a `:`; a plain one holds no brace and is no
//! `__name__` token; an encoded one starts with `}` and holds no other.
//!
//! Why no two names meet: read a name of the category after `{c}:` and
//! split it at `:`. Its first part is a plain segment (the name is a key's),
//! an encoded segment (starting with `}`), or a `__name__` token (an
//! internal name: `__partitions__`, `__keyless__`, `__fence__`...). These
//! never overlap, so a key's names never meet an internal name (the key
//! `__keyless__` is encoded as `}__keyless__`, so `{c}:}__keyless__:dlq` is
//! not the keyless stream's dead letters `{c}:__keyless__:dlq`). Within a
//! key's names the segment ends at the first `:`, and what follows tells
//! the names apart: nothing (the stream), `:{lane}`, `:dlq`,
//! `:__lease__:{g}`, `:__attempts__:{g}`. Distinct keys have distinct
//! segments (plain ones are the keys, encoded ones start with `}` and
//! percent-escape `%` itself), so the key `a:dlq` has the stream
//! `{c}:}a%3Adlq`, not key `a`'s dead letters `{c}:a:dlq`. A key equal to a
//! lane token (`dlq`, `backfill`) is plain: `{c}:dlq` has a single `:`
//! after the category, and every lane or dead-letter name has two, so it
//! needs no encoding and the rule does not depend on the lanes a
//! deployment configures. The marker is `}` because no category name holds
//! a brace: with `:` instead, category `x` would have met category `x:`
//! (`x::…`).
//!
//! Upgrade: every key wave 1 accepted (no `:`, `{`, `}`, control character,
//! lane token or `__name__` form) is plain, so its streams, leases, index
//! members and halted records keep their names. Only keys wave 1 refused
//! are encoded. The argument holds within one category: a category name
//! may hold `:`, so do not name a category after another category and `:`
//! (see the README).
//!
//! Attempt counts are in `{c}:{k}:__attempts__:{group}` (entry id to
//! attempts made, for entries delivered more than once; see `scripts`):
//! durable, kept across owner changes.

use std::borrow::Cow;
use std::fmt::Write as _;

use keyorder_core::{Error, Result};

/// The Redis key names of one category.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Names {
    c: String,
}

impl Names {
    /// The names of `category` (not empty, at most 200 bytes, no braces or
    /// control characters).
    pub fn new(category: &str) -> Result<Self> {
        if category.is_empty()
            || category.len() > 200
            || category.contains(['{', '}'])
            || category.chars().any(char::is_control)
        {
            return Err(Error::Config(format!(
                "redis: category `{}` is not usable: it must be 1 to 200 bytes without braces or control characters",
                category.escape_debug()
            )));
        }
        Ok(Names { c: category.to_owned() })
    }

    /// The category.
    pub fn category(&self) -> &str {
        &self.c
    }
    /// The name segment of `key`, what stands for the key in every name,
    /// index member, halted and resolved field, dead-letter index member and
    /// wake-up. A *plain* key (no `:`, `{`, `}` or control character, and
    /// not of the `__name__` form: more than 4 bytes, starting and ending
    /// with `__`) is its own segment, so every key that was valid before
    /// keys could hold these keeps its names. Any other key's segment is `}`
    /// and the key with `%`, `:`, `{`, `}` and control characters written
    /// as `%XX` (UTF-8 bytes, upper-case hex). No segment holds a `:`; a
    /// plain one holds no brace and is no `__name__` token (every internal
    /// name's is); an encoded one starts with `}` (which no category name
    /// holds) and holds no other: so no key's names meet another key's, a
    /// lane, dead letters, a lease, an internal name, or a name of the
    /// category `{c}:`.
    ///
    /// ```
    /// use keyorder_redis::Names;
    /// assert_eq!(Names::segment("customer-42"), "customer-42");
    /// assert_eq!(Names::segment("dlq"), "dlq");
    /// assert_eq!(Names::segment("a:dlq"), "}a%3Adlq");
    /// assert_eq!(Names::segment("__keyless__"), "}__keyless__");
    /// assert_eq!(Names::key_of("}a%3Adlq").as_deref(), Some("a:dlq"));
    /// ```
    pub fn segment(key: &str) -> Cow<'_, str> {
        if is_plain(key) {
            return Cow::Borrowed(key);
        }
        let mut out = String::with_capacity(key.len() + 8);
        out.push(ENCODED);
        for c in key.chars() {
            if needs_escape(c) {
                let mut buf = [0u8; 4];
                for b in c.encode_utf8(&mut buf).bytes() {
                    let _ = write!(out, "%{b:02X}");
                }
            } else {
                out.push(c);
            }
        }
        Cow::Owned(out)
    }

    /// The key whose [`Names::segment`] is `segment`; `None` when no key
    /// has that segment (an internal token such as `__keyless__`, or a form
    /// keyorder never writes).
    pub fn key_of(segment: &str) -> Option<Cow<'_, str>> {
        let Some(body) = segment.strip_prefix(ENCODED) else {
            return (!segment.is_empty() && is_plain(segment)).then_some(Cow::Borrowed(segment));
        };
        let bytes = body.as_bytes();
        let mut out = Vec::with_capacity(bytes.len());
        let mut i = 0;
        while i < bytes.len() {
            if bytes[i] == b'%' {
                let hex = body.get(i + 1..i + 3)?;
                if !hex.bytes().all(|b| b.is_ascii_digit() || (b'A'..=b'F').contains(&b)) {
                    return None;
                }
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 3;
            } else {
                out.push(bytes[i]);
                i += 1;
            }
        }
        let key = String::from_utf8(out).ok()?;
        // Only the canonical form: the one segment of that key.
        (!key.is_empty() && Self::segment(&key) == segment).then_some(Cow::Owned(key))
    }

    /// The partition stream of `key`.
    pub fn stream(&self, key: &str) -> String {
        format!("{}:{}", self.c, Self::segment(key))
    }
    /// A lane of `key`.
    pub fn lane(&self, key: &str, lane: &str) -> String {
        format!("{}:{}:{lane}", self.c, Self::segment(key))
    }
    /// The dead-letter stream of `key`.
    pub fn dlq(&self, key: &str) -> String {
        self.lane(key, keyorder_core::key::DLQ_LANE)
    }
    /// The partition index.
    pub fn index(&self) -> String {
        format!("{}:__partitions__", self.c)
    }
    /// The lease of `key`'s partition for `group`.
    pub fn lease(&self, key: &str, group: &str) -> String {
        format!("{}:{}:__lease__:{group}", self.c, Self::segment(key))
    }
    /// The publish fence of `scope` (the highest token a fenced publish
    /// for it carried; never expires).
    pub fn fence(&self, scope: &str) -> String {
        format!("{}:__fence__:{scope}", self.c)
    }
    /// The generation counter.
    pub fn generation(&self) -> String {
        format!("{}:__generation__", self.c)
    }
    /// The group registry.
    pub fn groups(&self) -> String {
        format!("{}:__groups__", self.c)
    }
    /// Live members of `group`.
    pub fn members(&self, group: &str) -> String {
        format!("{}:__members__:{group}", self.c)
    }
    /// Halted keys of `group`.
    pub fn halted(&self, group: &str) -> String {
        format!("{}:__halted__:{group}", self.c)
    }
    /// Operator actions waiting for the owner in `group`.
    pub fn resolved(&self, group: &str) -> String {
        format!("{}:__resolved__:{group}", self.c)
    }
    /// Keys with dead letters.
    pub fn dlq_index(&self) -> String {
        format!("{}:__dlq__", self.c)
    }
    /// The keyless stream.
    pub fn keyless(&self) -> String {
        format!("{}:__keyless__", self.c)
    }
    /// The keyless stream's dead letters.
    pub fn keyless_dlq(&self) -> String {
        format!("{}:__keyless__:dlq", self.c)
    }
    /// The single-layout stream.
    pub fn single(&self) -> String {
        self.c.clone()
    }
    /// The wake-up channel.
    pub fn wake(&self) -> String {
        format!("{}:__wake__", self.c)
    }
}

/// What starts an encoded segment (no category name holds it).
const ENCODED: char = '}';

/// Whether `key` is its own segment: no `:`, `{`, `}` or control
/// character, and not of the `__name__` form.
fn is_plain(key: &str) -> bool {
    let sentinel = key.len() > 4 && key.starts_with("__") && key.ends_with("__");
    !sentinel && !key.contains([':', '{', '}']) && !key.chars().any(char::is_control)
}

/// Whether an encoded segment writes `c` as `%XX`.
fn needs_escape(c: char) -> bool {
    matches!(c, '%' | ':' | '{' | '}') || c.is_control()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn keys_wave_1_accepted_keep_their_names() {
        let n = Names::new("orders").unwrap();
        for key in [
            "a",
            "customer-42",
            "%3A",
            "%",
            "ключ",
            "___",
            "____",
            "_x__",
            "\u{fffd}ff",
        ] {
            assert_eq!(Names::segment(key), key);
            assert_eq!(Names::key_of(key).as_deref(), Some(key));
        }
        assert_eq!(n.stream("customer-42"), "orders:customer-42");
        assert_eq!(n.dlq("customer-42"), "orders:customer-42:dlq");
        assert_eq!(n.lane("customer-42", "backfill"), "orders:customer-42:backfill");
        assert_eq!(n.lease("customer-42", "g"), "orders:customer-42:__lease__:g");
    }

    #[test]
    fn keys_that_look_like_names_are_encoded() {
        let n = Names::new("c").unwrap();
        let cases = [
            ("a:dlq", "}a%3Adlq"),
            ("__partitions__", "}__partitions__"),
            ("__keyless__", "}__keyless__"),
            ("a:__lease__:g", "}a%3A__lease__%3Ag"),
            (":", "}%3A"),
            ("{x}", "}%7Bx%7D"),
            ("%:", "}%25%3A"),
            ("\0", "}%00"),
            ("a\u{1}b", "}a%01b"),
            ("\u{85}", "}%C2%85"),
        ];
        for (key, segment) in cases {
            assert_eq!(Names::segment(key), segment, "{key:?}");
            assert_eq!(Names::key_of(segment).as_deref(), Some(key), "{key:?}");
        }
        // Lane tokens need no encoding: their stream has one `:` after the
        // category, every lane name two.
        assert_eq!(n.stream("dlq"), "c:dlq");
        assert_eq!(n.stream("backfill"), "c:backfill");
        assert_ne!(n.dlq("a"), n.stream("a:dlq"));
        assert_ne!(n.lease("a", "g"), n.stream("a:__lease__:g"));
        assert_ne!(n.keyless(), n.stream("__keyless__"));
        assert_ne!(n.keyless_dlq(), n.dlq("__keyless__"));
        assert_ne!(n.index(), n.stream("__partitions__"));
        // Nor a name of the category `c:` (helper-30's finding: with `:` as
        // the marker, `c::%3A` was both key `:` of `c` and key `%3A` of `c:`).
        let colon = Names::new("c:").unwrap();
        assert_ne!(n.stream(":"), colon.stream("%3A"));
        assert_ne!(n.stream("__partitions__"), colon.index());
        assert_ne!(n.stream("a:b"), colon.stream("a%3Ab"));
    }

    #[test]
    fn only_canonical_segments_decode() {
        for bad in [
            "",
            "}",
            "__keyless__",
            "a:b",
            "}a",
            ":a",
            "}%3a",
            "}%3",
            "}%ZZ",
            "}%FF",
            "}%25",
            "a{",
        ] {
            // `}a` is not canonical (the key `a` is plain); `}%25` neither (`%` is plain).
            assert_eq!(Names::key_of(bad), None, "{bad:?}");
        }
    }

    /// Every internal name of the category, for a group `g`.
    fn internal(n: &Names) -> Vec<String> {
        vec![
            n.index(),
            n.generation(),
            n.groups(),
            n.members("g"),
            n.halted("g"),
            n.resolved("g"),
            n.dlq_index(),
            n.keyless(),
            n.keyless_dlq(),
            format!("{}:__attempts__:g", n.keyless()),
            n.single(),
            n.wake(),
            n.fence("g"),
        ]
    }

    fn key_names(n: &Names, key: &str) -> Vec<String> {
        vec![
            n.stream(key),
            n.dlq(key),
            n.lane(key, "backfill"),
            n.lease(key, "g"),
            format!("{}:__attempts__:g", n.stream(key)),
            format!("{}:__attempts__:g", n.dlq(key)),
        ]
    }

    fn any_key() -> impl Strategy<Value = String> {
        prop_oneof![
            "[a-z:%{}_]{1,12}",
            "(__)?[a-z:%]{0,6}(__)?",
            any::<String>(),
            prop::sample::select(vec![
                "dlq".to_owned(),
                "backfill".to_owned(),
                "__keyless__".to_owned(),
                "__partitions__".to_owned(),
                "a:dlq".to_owned(),
                "a".to_owned(),
                "\0".to_owned(),
            ]),
        ]
        .prop_filter("a key", |k| !k.is_empty() && k.len() <= 255)
    }

    proptest! {
        #[test]
        fn segments_round_trip_and_hold_at_most_one_leading_colon(key in any_key()) {
            let seg = Names::segment(&key);
            let back = Names::key_of(&seg);
            prop_assert_eq!(back.as_deref(), Some(key.as_str()));
            prop_assert!(!seg.contains(':'), "a `:` in a segment");
            match seg.strip_prefix(ENCODED) {
                Some(rest) => {
                    prop_assert!(!rest.contains(['{', '}']), "a brace after the marker");
                    prop_assert!(!is_plain(&key));
                }
                None => {
                    prop_assert!(!seg.contains(['{', '}']), "a brace in a plain segment");
                    prop_assert_eq!(seg.as_ref(), key.as_str());
                }
            }
            prop_assert!(!seg.contains('{') && !seg.chars().any(char::is_control), "a brace or control character in a segment");
        }

        #[test]
        fn distinct_keys_have_distinct_segments_and_names(a in any_key(), b in any_key()) {
            let n = Names::new("c").unwrap();
            if a != b {
                prop_assert_ne!(Names::segment(&a), Names::segment(&b));
            }
            let internal = internal(&n);
            let (na, nb) = (key_names(&n, &a), key_names(&n, &b));
            for x in &na {
                prop_assert!(!internal.contains(x), "{:?} names an internal name", a);
                if a != b {
                    prop_assert!(!nb.contains(x), "{:?} and {:?} share a name", a, b);
                }
            }
            // Within one key, its names are distinct too.
            let set: std::collections::HashSet<&String> = na.iter().collect();
            prop_assert_eq!(set.len(), na.len());
        }
    }
}
