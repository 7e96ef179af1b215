//! How a message becomes an event row and back: a key in its stored form
//! (PostgreSQL `text` and `jsonb` hold no NUL), the headers as the JSON of
//! the `headers` column, and a row's columns read back into a [`Message`].

use std::collections::BTreeMap;

use keyorder_core::key::{from_stored_text, stored_text};
use keyorder_core::{Error, Message, OrderingKey, Result};
use sqlx::Row;

/// A key's form in the key columns (PostgreSQL `text` cannot hold NUL):
/// [`keyorder_core::key::stored_text`], which is the key itself unless it
/// holds NUL or starts with U+0001. Every statement binds this form and
/// every key read back goes through
/// [`keyorder_core::key::from_stored_text`]; slots and labels are computed
/// from the key itself.
pub(crate) fn stored_key(key: &OrderingKey) -> std::borrow::Cow<'_, str> {
    keyorder_core::key::stored_text(key.as_str())
}

/// The message's headers as the JSON the `headers` column holds. The key
/// header ([`KEY_HEADER`], the key a [`keyorder_core::Publisher`] routed by)
/// is a key: it takes the key's stored form too (`jsonb` cannot hold NUL
/// either), and [`row_message`] decodes it.
pub(crate) fn headers_of(message: &Message) -> Result<String> {
    let headers = message.headers();
    // `jsonb` holds no NUL: every value in its stored form (itself unless
    // it holds NUL or starts with U+0001), a key taken from a header and
    // the `keyorder-key` header alike.
    let stored: BTreeMap<&String, std::borrow::Cow<'_, str>> =
        headers.iter().map(|(k, v)| (k, stored_text(v))).collect();
    serde_json::to_string(&stored).map_err(|e| Error::broker(e.to_string()))
}

/// The message of a log row whose columns from `at` on are key, message id,
/// correlation id, headers (JSON text) and payload; its key, if it passes
/// the deployment's key rules. The key and the key header are decoded from
/// their stored form.
pub(crate) fn row_message(
    r: &sqlx::postgres::PgRow,
    at: usize,
    rules: &keyorder_core::KeyRules,
) -> (Message, Option<OrderingKey>) {
    let key: Option<String> = r.get(at);
    let mut msg = Message::new(r.get::<Vec<u8>, _>(at + 4)).with_id(r.get::<String, _>(at + 1));
    if let Ok(h) = serde_json::from_str::<BTreeMap<String, String>>(&r.get::<String, _>(at + 3)) {
        for (k, v) in h {
            let v = from_stored_text(&v).into_owned();
            msg = msg.with_header(k, v);
        }
    }
    if let Some(c) = r.get::<Option<String>, _>(at + 2) {
        msg = msg.with_correlation_id(from_stored_text(&c));
    }
    let key = key.and_then(|k| OrderingKey::with_rules(from_stored_text(&k), rules).ok());
    if let Some(k) = &key {
        msg = msg.with_ordering_key(k.clone());
    }
    (msg, key)
}
