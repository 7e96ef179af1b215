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
//! Keys cannot contain `:`, `{` or `}` nor be a reserved lane or a `__x__`
//! sentinel, so no key's names collide with another's or with these.
//!
//! Attempt counts are in `{c}:{key}:__attempts__:{group}` (entry id to
//! attempts made, for entries delivered more than once; see `scripts`):
//! durable, kept across owner changes.

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
    /// The partition stream of `key`.
    pub fn stream(&self, key: &str) -> String {
        format!("{}:{key}", self.c)
    }
    /// A lane of `key`.
    pub fn lane(&self, key: &str, lane: &str) -> String {
        format!("{}:{key}:{lane}", self.c)
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
        format!("{}:{key}:__lease__:{group}", self.c)
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
