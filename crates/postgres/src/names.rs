//! The names of keyorder's things in the database: the tables of its
//! schema (`?schema=`, default `keyorder`), a key's slot and a slot's scope
//! name (`queue/sN`), and the schema's notification channel with what its
//! payloads name (a queue's slot, a group's membership).

use std::sync::Arc;

use keyorder_core::OrderingKey;

/// Every table of keyorder's schema that holds rows of a queue, children
/// before the tables they refer to (`delete_queue` deletes in this order).
pub(crate) const TABLES: [&str; 12] = [
    "acked",
    "attempts",
    "halted",
    "dead",
    "read_marks",
    "members",
    "publish_fences",
    "slots",
    "groups",
    "events",
    "plain_events",
    "queues",
];

/// The tables that hold rows of one consumer group, in the order
/// `remove_group` deletes from them: the slot rows (which the fenced
/// statements lock) and the group's row first, then what hangs off them.
pub(crate) const GROUP_TABLES: [&str; 8] = [
    "slots",
    "groups",
    "acked",
    "attempts",
    "halted",
    "dead",
    "read_marks",
    "members",
];

/// The slot of a key: `stable_hash(key) % slots` (FNV-1a 64, see
/// [`keyorder_core::key::stable_hash`]); keyless messages by their id.
pub fn slot_of(key: Option<&OrderingKey>, message_id: &str, slots: u32) -> u32 {
    let h = match key {
        Some(k) => k.stable_hash(),
        None => keyorder_core::key::stable_hash(message_id.as_bytes()),
    };
    (h % u64::from(slots.max(1))) as u32
}

/// The scope name of a queue's slot: `queue/sN`.
pub(crate) fn scope_name(queue: &str, slot: u32) -> Arc<str> {
    Arc::from(format!("{queue}/s{slot}"))
}

/// The slot a scope name ([`scope_name`]) names.
pub(crate) fn parse_scope(scope: &str) -> Option<u32> {
    scope.rsplit_once("/s").and_then(|(_, n)| n.parse().ok())
}

/// The notification channel of `schema`: publishes and membership changes
/// of every queue in it.
pub(crate) fn channel(schema: &str) -> String {
    format!("keyorder_{schema}")
}

/// The notification payload that tells the members of group `grp` of
/// `queue` its membership or slot ownership changed (publishes notify with
/// the queue's name, which holds no newline).
pub(crate) fn members_payload(queue: &str, grp: &str) -> String {
    format!("members\n{queue}\n{grp}")
}

/// What a publish notification says about `queue`: `Some(Some(slot))` for
/// `queue\nslot`, `Some(None)` for a bare `queue` (a publisher of an earlier
/// version: any slot may have more), `None` for anything else.
pub(crate) fn published_to(payload: &str, queue: &str) -> Option<Option<u32>> {
    let rest = payload.strip_prefix(queue)?;
    if rest.is_empty() {
        return Some(None);
    }
    rest.strip_prefix('\n')?.parse().ok().map(Some)
}

#[cfg(test)]
mod tests {
    use super::published_to;

    #[test]
    fn a_publish_notification_names_its_slot() {
        assert_eq!(published_to("orders\n7", "orders"), Some(Some(7)));
        assert_eq!(published_to("orders", "orders"), Some(None));
        assert_eq!(published_to("orders-eu\n7", "orders"), None);
        assert_eq!(published_to("orders\nx", "orders"), None);
        assert_eq!(published_to("members\norders\ng", "orders"), None);
    }
}
