//! The user-facing entry points: [`Client`], [`Publisher`], and the
//! subscription builder.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};

use crate::capability::Capabilities;
use crate::error::{Error, Result};
use crate::key::KeyRules;
use crate::message::{Message, KEY_HEADER};
use crate::transport::{Admin, PublishFence, Transport, TransportPublisher};

/// A handle on one transport: publishers, subscriptions, the admin view.
/// Cheap to clone; clones share the registration table.
///
/// ```
/// # async fn demo() -> keyorder_core::Result<()> {
/// use keyorder_core::{Client, Message};
/// let client = Client::memory();
/// let orders = client.publisher("orders").await?;
/// orders.publish(Message::new("created").with_key("client-42")?).await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Client {
    pub(crate) transport: Arc<dyn Transport>,
    pub(crate) rules: KeyRules,
    pub(crate) registry: Arc<Mutex<HashMap<String, crate::message::KeySource>>>,
}

impl fmt::Debug for Client {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Client")
            .field("transport", &self.transport.name())
            .finish()
    }
}

impl Client {
    /// A client over any transport.
    pub fn new(transport: Arc<dyn Transport>) -> Self {
        Client {
            transport,
            rules: KeyRules::default(),
            registry: Arc::default(),
        }
    }

    /// A client over a fresh in-memory transport (one process).
    pub fn memory() -> Self {
        Client::new(Arc::new(crate::memory::MemoryTransport::new()))
    }

    /// Uses `rules` (the deployment's lanes) for every publish and subscription.
    pub fn with_key_rules(mut self, rules: KeyRules) -> Self {
        self.rules = rules;
        self
    }

    /// The key rules in force.
    pub fn key_rules(&self) -> &KeyRules {
        &self.rules
    }

    /// The transport's name.
    pub fn transport_name(&self) -> &str {
        self.transport.name()
    }

    /// The transport's capabilities with its declared configuration.
    pub fn capabilities(&self) -> Capabilities {
        self.transport.capabilities()
    }

    /// The transport.
    pub fn transport(&self) -> &Arc<dyn Transport> {
        &self.transport
    }

    /// The operator's admin view.
    pub fn admin(&self) -> Arc<dyn Admin> {
        self.transport.admin()
    }

    /// A publisher for `category`.
    pub async fn publisher(&self, category: &str) -> Result<Publisher> {
        check_name("category", category)?;
        Ok(Publisher {
            inner: self.transport.publisher(category).await?,
            rules: self.rules.clone(),
            fences: self.transport.capabilities().publish_fencing,
        })
    }
}

/// Checks a category or group name: non-empty, at most 200 bytes, and no
/// character a transport uses in its own names.
pub(crate) fn check_name(what: &str, name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 200
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if ok {
        Ok(())
    } else {
        Err(Error::Config(format!(
            "{what} name {:?} must be 1-200 characters of [A-Za-z0-9._-]",
            crate::key::redact(name)
        )))
    }
}

/// Publishes to one category. The key is validated in the caller's call and
/// stamped in the [`KEY_HEADER`] header, so the consumer orders by exactly
/// the key the producer routed by.
#[derive(Clone)]
pub struct Publisher {
    inner: Arc<dyn TransportPublisher>,
    rules: KeyRules,
    /// The transport's [`crate::Capabilities::publish_fencing`].
    fences: bool,
}

impl fmt::Debug for Publisher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Publisher").field("inner", &self.inner).finish()
    }
}

impl Publisher {
    /// Publishes one message and returns once the broker acknowledged it.
    /// Awaiting each publish before the next keeps a key's publish order.
    /// With the feature `otel`, the message carries the current span's
    /// trace context unless it has a valid [`crate::TRACEPARENT_HEADER`] already
    /// ([`crate::trace`]).
    ///
    /// # Errors
    /// [`Error::Key`] when the key breaks a rule of this client's
    /// [`KeyRules`] (nothing is stored); [`Error::Broker`] when the broker failed.
    pub async fn publish(&self, message: Message) -> Result<()> {
        let message = self.checked(message)?;
        self.inner.publish(message).await
    }

    /// Whether this transport's broker checks [`Publisher::publish_fenced`]:
    /// its [`crate::Capabilities::publish_fencing`] (memory, Redis and
    /// PostgreSQL do; RabbitMQ and Kafka publish unfenced).
    pub fn fences_publishes(&self) -> bool {
        self.fences
    }

    /// Publishes one message unless the broker has already seen a higher
    /// token for `fence.scope` in this category (a newer owner of the
    /// scope), and records the token; one atomic step on the broker. On a
    /// transport that cannot fence a publish ([`Publisher::fences_publishes`]
    /// is `false`) it publishes unfenced.
    ///
    /// # Errors
    /// As [`Publisher::publish`]; [`Error::Fenced`] when the broker refused
    /// it (nothing stored); [`Error::Config`] for a badly spelled scope.
    pub async fn publish_fenced(&self, message: Message, fence: &PublishFence) -> Result<()> {
        fence.check()?;
        let message = self.checked(message)?;
        if self.fences {
            self.inner.publish_fenced(message, fence).await
        } else {
            self.inner.publish(message).await
        }
    }

    fn checked(&self, message: Message) -> Result<Message> {
        let mut message = match message.key() {
            Some(key) => {
                self.rules.check(key.as_str())?;
                let key = key.as_str().to_owned();
                message.with_header(KEY_HEADER, key)
            }
            None => message,
        };
        // Feature `otel`: the current span's trace context, unless the
        // message carries a valid one already (the outbox's, from its
        // staging); an invalid one is replaced.
        if !crate::trace::carries_context(message.headers()) {
            message.set_trace_context(crate::trace::current_context());
        }
        Ok(message)
    }
}
