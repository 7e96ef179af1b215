//! The message model: what a producer publishes and what a handler receives.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use bytes::Bytes;

use crate::key::{KeyError, KeyRules, OrderingKey};

/// The header a publisher stamps with the key it routed by, and that the
/// default [`KeySource`] reads back on the consumer side.
pub const KEY_HEADER: &str = "keyorder-key";

/// The header that names a message's type (see [`MessageType`]).
pub const TYPE_HEADER: &str = "keyorder-type";

/// The header that names a payload's encoding as a media type
/// (`application/json`): `Message::json` and `Message::encode` (feature
/// `serde`) set it from the codec.
pub const CONTENT_TYPE_HEADER: &str = "keyorder-content-type";

/// An outbound message: key, headers, payload bytes, message id and
/// correlation id.
///
/// ```
/// use keyorder_core::Message;
/// let msg = Message::new(&b"{\"total\":3}"[..])
///     .with_key("client-42")?
///     .with_correlation_id("order-7")
///     .with_header("source", "web");
/// assert_eq!(msg.key().unwrap().as_str(), "client-42");
/// # Ok::<(), keyorder_core::KeyError>(())
/// ```
#[derive(Clone)]
pub struct Message {
    id: Arc<str>,
    key: Option<OrderingKey>,
    correlation_id: Option<Arc<str>>,
    headers: BTreeMap<String, String>,
    payload: Bytes,
}

impl fmt::Debug for Message {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Message")
            .field("id", &self.id)
            .field("key", &self.key)
            .field("headers", &self.headers.len())
            .field("payload_bytes", &self.payload.len())
            .finish()
    }
}

impl Message {
    /// A keyless message with a fresh, time-ordered id (UUID v7).
    pub fn new(payload: impl Into<Bytes>) -> Self {
        Message {
            id: Arc::from(uuid::Uuid::now_v7().to_string()),
            key: None,
            correlation_id: None,
            headers: BTreeMap::new(),
            payload: payload.into(),
        }
    }

    /// Sets the ordering key, validating it with the default rules in this
    /// call: a bad key never becomes a stored record.
    pub fn with_key(self, key: impl AsRef<str>) -> Result<Self, KeyError> {
        Ok(self.with_ordering_key(OrderingKey::new(key)?))
    }

    /// Sets the ordering key, validating it with `rules`.
    pub fn with_key_rules(self, key: impl AsRef<str>, rules: &KeyRules) -> Result<Self, KeyError> {
        Ok(self.with_ordering_key(OrderingKey::with_rules(key, rules)?))
    }

    /// Sets an already validated key.
    pub fn with_ordering_key(mut self, key: OrderingKey) -> Self {
        self.key = Some(key);
        self
    }

    /// Replaces the message id (for example with an outbox record's id).
    pub fn with_id(mut self, id: impl Into<String>) -> Self {
        self.id = Arc::from(id.into());
        self
    }

    /// Sets the correlation id.
    pub fn with_correlation_id(mut self, id: impl Into<String>) -> Self {
        self.correlation_id = Some(Arc::from(id.into()));
        self
    }

    /// Sets the message type (the [`TYPE_HEADER`] header).
    pub fn with_type(self, name: impl Into<String>) -> Self {
        self.with_header(TYPE_HEADER, name)
    }

    /// Sets a header.
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.insert(name.into(), value.into());
        self
    }

    /// Replaces whatever trace context headers the message has (any case)
    /// with `context` (see [`crate::trace`]).
    pub(crate) fn set_trace_context(&mut self, context: Vec<(&'static str, String)>) {
        crate::trace::replace_context(&mut self.headers, context);
    }

    /// The message id.
    pub fn id(&self) -> &str {
        &self.id
    }
    /// The ordering key the producer set (the routing key), if any.
    pub fn key(&self) -> Option<&OrderingKey> {
        self.key.as_ref()
    }
    /// The correlation id, if any.
    pub fn correlation_id(&self) -> Option<&str> {
        self.correlation_id.as_deref()
    }
    /// One header's value.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(String::as_str)
    }
    /// Every header.
    pub fn headers(&self) -> &BTreeMap<String, String> {
        &self.headers
    }
    /// The message type, from [`TYPE_HEADER`].
    pub fn message_type(&self) -> Option<&str> {
        self.header(TYPE_HEADER)
    }
    /// The payload bytes.
    pub fn payload(&self) -> &Bytes {
        &self.payload
    }
}

/// What a handler receives: the message, the key it is ordered by, the
/// attempt number and the owner's fencing token.
#[derive(Debug, Clone)]
pub struct Delivery {
    pub(crate) message: Arc<Message>,
    pub(crate) key: Option<OrderingKey>,
    pub(crate) attempt: u32,
    pub(crate) fencing_token: u64,
    pub(crate) scope: Arc<str>,
}

impl Delivery {
    /// The message as published.
    pub fn message(&self) -> &Message {
        &self.message
    }
    /// The key this delivery is ordered by (`None` for keyless messages).
    pub fn key(&self) -> Option<&OrderingKey> {
        self.key.as_ref()
    }
    /// The attempt number, counted durably and starting at 1.
    pub fn attempt(&self) -> u32 {
        self.attempt
    }
    /// The owner's generation: a handler's own store can reject a completion
    /// whose token is lower than one it has already seen for the key.
    pub fn fencing_token(&self) -> u64 {
        self.fencing_token
    }
    /// The transport scope (partition, slot, queue) the delivery came from.
    pub fn scope(&self) -> &str {
        &self.scope
    }
    /// Shorthand for `message().payload()`.
    pub fn payload(&self) -> &Bytes {
        self.message.payload()
    }
    /// Shorthand for `message().id()`.
    pub fn id(&self) -> &str {
        self.message.id()
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum KeyStep {
    Header(String),
    Field(String),
    CorrelationId,
}

/// Where a subscription finds a delivery's key: a chain of steps tried in
/// order (header, typed field of the decoded message, correlation id); the
/// first that yields a value wins, and a message none yields is keyless.
///
/// ```
/// use keyorder_core::KeySource;
/// let source = KeySource::header("ordering-key").or_field("client_id").or_correlation_id();
/// assert_eq!(source.to_string(), "header(ordering-key) > field(client_id) > correlation-id");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct KeySource {
    pub(crate) steps: Vec<KeyStep>,
}

impl Default for KeySource {
    /// The key the producer routed by ([`KEY_HEADER`]).
    fn default() -> Self {
        KeySource::header(KEY_HEADER)
    }
}

impl KeySource {
    /// The key the producer routed by (the [`KEY_HEADER`] header).
    pub fn routing_key() -> Self {
        Self::default()
    }
    /// Starts the chain with a header.
    pub fn header(name: impl Into<String>) -> Self {
        KeySource {
            steps: vec![KeyStep::Header(name.into())],
        }
    }
    /// Starts the chain with a typed selector: a top-level field of the JSON
    /// payload (a string or a number).
    pub fn field(name: impl Into<String>) -> Self {
        KeySource {
            steps: vec![KeyStep::Field(name.into())],
        }
    }
    /// Starts the chain with the correlation id.
    pub fn correlation_id() -> Self {
        KeySource {
            steps: vec![KeyStep::CorrelationId],
        }
    }
    /// Adds a header step.
    pub fn or_header(mut self, name: impl Into<String>) -> Self {
        self.steps.push(KeyStep::Header(name.into()));
        self
    }
    /// Adds a typed field step.
    pub fn or_field(mut self, name: impl Into<String>) -> Self {
        self.steps.push(KeyStep::Field(name.into()));
        self
    }
    /// Adds the correlation id step.
    pub fn or_correlation_id(mut self) -> Self {
        self.steps.push(KeyStep::CorrelationId);
        self
    }

    /// Runs the chain over a message. `Ok(None)`: keyless; `Err`: a value was
    /// found but is not a valid key.
    pub fn select(&self, message: &Message, rules: &KeyRules) -> Result<Option<OrderingKey>, KeyError> {
        let mut decoded: Option<Option<serde_json::Value>> = None;
        for step in &self.steps {
            let found: Option<String> = match step {
                KeyStep::Header(name) => message.header(name).map(str::to_owned),
                KeyStep::CorrelationId => message.correlation_id().map(str::to_owned),
                KeyStep::Field(name) => {
                    let value = decoded.get_or_insert_with(|| serde_json::from_slice(message.payload()).ok());
                    value.as_ref().and_then(|v| match v.get(name)? {
                        serde_json::Value::String(s) => Some(s.clone()),
                        serde_json::Value::Number(n) => Some(n.to_string()),
                        _ => None,
                    })
                }
            };
            if let Some(found) = found {
                return OrderingKey::with_rules(found, rules).map(Some);
            }
        }
        Ok(None)
    }

    /// Whether a message of `ty` can yield a key through this chain: a header
    /// or correlation step always can; a field step only if `ty` declares it.
    pub fn can_yield(&self, ty: &MessageType) -> bool {
        self.steps.iter().any(|step| match step {
            KeyStep::Field(name) => ty.fields.iter().any(|f| f == name),
            KeyStep::Header(_) | KeyStep::CorrelationId => true,
        })
    }
}

impl fmt::Display for KeySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, step) in self.steps.iter().enumerate() {
            if i > 0 {
                f.write_str(" > ")?;
            }
            match step {
                KeyStep::Header(h) => write!(f, "header({h})")?,
                KeyStep::Field(n) => write!(f, "field({n})")?,
                KeyStep::CorrelationId => f.write_str("correlation-id")?,
            }
        }
        Ok(())
    }
}

/// A message type a subscription handles, with the key fields it carries.
/// Declaring types lets registration refuse a key source the types cannot
/// yield (C8) before any message flows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MessageType {
    pub(crate) name: String,
    pub(crate) fields: Vec<String>,
}

impl MessageType {
    /// A type by name (the [`TYPE_HEADER`] value).
    pub fn new(name: impl Into<String>) -> Self {
        MessageType {
            name: name.into(),
            fields: Vec::new(),
        }
    }
    /// Declares the top-level payload fields the type carries.
    pub fn with_fields<I, S>(mut self, fields: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.fields.extend(fields.into_iter().map(Into::into));
        self
    }
    /// The type's name.
    pub fn name(&self) -> &str {
        &self.name
    }
}

/// What an ordered subscription does with a message that has no key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KeylessPolicy {
    /// Process it in parallel, unordered, and count it (the default).
    #[default]
    Parallel,
    /// Reject it: dead-letter it with a reason and count it.
    Reject,
}
