//! Names, declaration and verification of a category's topology: one entry
//! exchange per category that publishers publish to, and behind it one set
//! of queues per consumer group, so every group receives every message.
//!
//! Category `{c}` (what publishers use):
//!
//! | Name | Kind | What |
//! |---|---|---|
//! | `{c}:entry` | fanout exchange | publishers publish here, routing key = the key (a keyless message: a hash of its id); every group's topology is bound to it. A foreign producer's routing key is its message's key (a valid one; else the message runs under the keyless policy, counted); a `keyorder-key` header that differs from the routing key gets the message parked |
//! | `{c}:groups` | classic queue (whatever `queue_type`: not replicated), never `x-expires`, one persistent message per group (`{"group": g, "topology": "hash:8"}`) | the group registry: `Admin::groups`, the topology each group was declared with (a different one is refused), what `remove_group` and `keyorder delete-queue` delete; a message that is no valid record is skipped |
//! | `{c}:groups-lock` | classic queue, never `x-expires`, never holds a message | the registry's lock: whoever reads or changes the registry holds an exclusive consumer on it, for a few round trips (a group's queues are declared after it is released) |
//!
//! Group `{g}` of category `{c}` (its base name `{c}:{g}`): its queues are of the configured
//! `queue_type`; quorum ones carry `x-delivery-limit` = `i32::MAX`
//! ([`DELIVERY_LIMIT`](declare::DELIVERY_LIMIT): never reached, where RabbitMQ 4.x's default of 20
//! would drop a halted head):
//!
//! | Name | Kind | What |
//! |---|---|---|
//! | `{c}:{g}.hash` | `x-consistent-hash` exchange, arguments `x-keyorder-queues: N`, `x-keyorder-weight: W`, bound to `{c}:entry` (an exchange-to-exchange binding keeps the routing key) | the group's ring (`hash` topology) |
//! | `{c}:{g}.hash.{i}` | queue, single active consumer, bound to `{c}:{g}.hash` with weight W (`RING_WEIGHT`) | one of the group's N queues |
//! | `{c}:{g}.sac` | queue, single active consumer, bound to `{c}:entry` | the `sac` topology |
//! | `{c}:{g}.plain` | queue, bound to `{c}:entry` | the `plain` topology |
//! | `{c}:{g}.dlq` | queue, never `x-expires` | the group's dead letters (published with a confirm, then the head is acknowledged) |
//! | `{c}:{g}.members` | classic queue, never holds a message | every running source of the group consumes it: its consumer count is the group's live members |
//! | `{c}:{g}.presence` | fanout exchange (transient) | the group's instances announce themselves every heartbeat (`hash`) |
//! | `keyorder.live.{hash}` | exclusive queue (gone with its connection), never holds a message | held by each running source of a `hash` group, named after its join claim and instance id; an announcement is believed only while its queue exists and is locked to another connection ([`GroupNames::live`](crate::names::GroupNames::live)) |
//!
//! Virtual host (shared by every category and group):
//!
//! | Name | Kind | What |
//! |---|---|---|
//! | `keyorder.claims` | stream queue (`x-queue-type: stream`, durable, `x-max-length-bytes` 16 MB in 1 MB segments, `x-max-age` 1D, never `x-expires`, never deleted by keyorder) | fencing tokens: a consumer's claim at its activation, and each source's join claim; a claim's offset is the token (see the `claims` module). One per virtual host, not per group: a stream holds files open on the broker for as long as it exists, and a group's queues may expire, a stream cannot |
//! | `keyorder.attempts` | stream queue (durable, `x-max-length-bytes` 16 MB in 1 MB segments, `x-max-age` 7D, never deleted by keyorder) | attempts counted per started attempt: a record is written and read back before an attempt that is not a first delivery's first starts (see the `attempts` module) |
//!
//! **No two (category, group) pairs share a name.** Categories and groups
//! are 1 to 200 bytes of `[A-Za-z0-9._-]` (the names keyorder's client
//! accepts; anything else is refused naming this rule), so neither holds a
//! `:`: the first `:` of a name ends the category. A category-level name
//! has no `.` after it; a group's name always ends in `.{kind}` with a kind
//! from the fixed set above, none of which ends another at a `.` (`hash.N`
//! ends in digits), so the group and the kind are recovered from the rest.
//! Category and group together are at most 244 bytes, so the longest name
//! (`{c}:{g}.hash.1023`) fits AMQP's 255; a longer pair is refused naming
//! that rule. Names of the layout before consumer groups (`{c}.hash`,
//! `{c}.hash.N`, `{c}.sac`, `{c}.plain`, `{c}.dlq`) hold no `:` either: a
//! category that still has such queues is refused at subscribe and at
//! publish until they are drained and deleted ([`legacy_queues`](inspect::legacy_queues)).
//!
//! The drift checks hold per group: a group is recorded in the registry with
//! its topology (and N), and declaring it with another one (another N, `sac`
//! for a `hash` group, ...) is refused with the fix, with `declare=false`
//! too; the group's existing queues are checked as well (a hash queue
//! beyond N or a queue of another kind is refused; without a record, so is
//! a ring of fewer queues), since RabbitMQ does not compare a custom
//! exchange's arguments (`x-keyorder-queues` enforces nothing by itself).
//! The queue type and the single-active-consumer argument are checked by
//! the broker on every declaration (406).
//!
//! The code is kept by what it does: [`inspect`] looks (passive checks,
//! drift), [`declare`] declares one thing at a time, [`registry`] keeps the
//! groups and their topologies, and [`group`] declares, verifies and
//! deletes a category's and a group's topology as a whole.

mod declare;
mod delete;
mod group;
mod inspect;
mod registry;

pub(crate) use declare::private_queue;
pub(crate) use delete::delete_category;
pub(crate) use group::{delete_group, ensure_category, ensure_group, group_queues};
pub(crate) use inspect::{exchange_exists, parse_topology, queue_state};
pub(crate) use registry::Registry;
