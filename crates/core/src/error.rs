//! The one error type of keyorder.

use crate::key::KeyError;

/// Every error keyorder returns. Adapters map their driver's errors into it
/// in one conversion function each (`error::broker` in the adapter crate;
/// the orphan rule rules out a `From` implementation there).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An ordering key broke a rule of the contract; the message names the rule.
    #[error(transparent)]
    Key(#[from] KeyError),
    /// The subscription or transport is configured in a way that cannot keep
    /// the promise; the message names the fix.
    #[error("configuration: {0}")]
    Config(String),
    /// Registration failed before any message flowed (C8, C10).
    #[error("registration: {0}")]
    Registration(String),
    /// The transport lacks a capability the subscription's options need.
    #[error("transport `{transport}` lacks capability `{capability}`: {fix}")]
    Unsupported {
        /// The transport's name.
        transport: String,
        /// The missing capability's name, as in [`crate::Capabilities`].
        capability: &'static str,
        /// What to do about it.
        fix: String,
    },
    /// A broker operation was rejected because this owner no longer holds the
    /// scope at this generation (the fence).
    #[error("fenced: scope `{scope}` is no longer owned at generation {generation}")]
    Fenced {
        /// The scope that was lost.
        scope: String,
        /// The stale generation.
        generation: u64,
    },
    /// The URL could not be understood or names no compiled-in adapter.
    #[error("url: {0}")]
    Url(String),
    /// The broker failed. [`BrokerError::is_temporary`] says whether
    /// retrying can help; [`std::error::Error::source`] gives the driver's
    /// error where the adapter had one (sqlx, redis, lapin, rdkafka).
    #[error(transparent)]
    Broker(BrokerError),
    /// The subscription or transport was shut down.
    #[error("shut down")]
    Shutdown,
    /// An operator action named something that does not exist.
    #[error("not found: {0}")]
    NotFound(String),
    /// A value the codec could not encode as a payload (feature `serde`:
    /// `Message::json`, `Message::encode`); the text names its type.
    #[cfg(feature = "serde")]
    #[error(transparent)]
    Encode(#[from] crate::codec::EncodeError),
}

impl Error {
    /// A broker failure described by `message`, taken to be temporary
    /// (retrying may help), with no driver error behind it. Adapters convert
    /// their driver's errors with [`BrokerError::caused_by`] and
    /// [`BrokerError::with_temporary`] instead.
    pub fn broker(message: impl Into<String>) -> Self {
        Error::Broker(BrokerError::new(message))
    }

    /// Whether retrying the operation may succeed: a temporary broker
    /// failure (a dropped connection, a timeout, a failover). Everything
    /// else (a configuration, a key, a fence, a shutdown, a permanent broker
    /// refusal) fails again the same way.
    pub fn is_temporary(&self) -> bool {
        matches!(self, Error::Broker(b) if b.is_temporary())
    }
}

/// A broker's failure: what failed (the text keyorder shows, never a
/// secret), whether retrying can help, and the driver's error as the
/// [`source`](std::error::Error::source) where there was one.
///
/// ```
/// use keyorder_core::{BrokerError, Error};
/// use std::error::Error as _;
///
/// let io = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset by peer");
/// let e = Error::Broker(BrokerError::new(format!("publish: {io}")).caused_by(io).with_temporary(true));
/// assert_eq!(e.to_string(), "broker: publish: reset by peer");
/// assert!(e.is_temporary());
/// assert_eq!(e.source().unwrap().to_string(), "reset by peer");
/// ```
#[derive(Debug)]
pub struct BrokerError {
    message: String,
    temporary: bool,
    source: Option<Box<dyn std::error::Error + Send + Sync + 'static>>,
}

impl BrokerError {
    /// A temporary failure with no driver error behind it.
    pub fn new(message: impl Into<String>) -> Self {
        BrokerError {
            message: message.into(),
            temporary: true,
            source: None,
        }
    }

    /// The same failure with the driver's error `source` kept as its
    /// [`source`](std::error::Error::source). An adapter passes only errors
    /// whose text and `Debug` carry no secret and no ordering key.
    pub fn caused_by(mut self, source: impl std::error::Error + Send + Sync + 'static) -> Self {
        self.source = Some(Box::new(source));
        self
    }

    /// The same failure, marked temporary (retrying may help) or not.
    pub fn with_temporary(mut self, temporary: bool) -> Self {
        self.temporary = temporary;
        self
    }

    /// What failed, as keyorder shows it (after `broker: `).
    pub fn message(&self) -> &str {
        &self.message
    }

    /// Whether retrying may succeed.
    pub fn is_temporary(&self) -> bool {
        self.temporary
    }
}

impl std::fmt::Display for BrokerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "broker: {}", self.message)
    }
}

impl std::error::Error for BrokerError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source.as_deref().map(|e| e as &(dyn std::error::Error + 'static))
    }
}

/// `Result` with keyorder's [`Error`] as the default error.
pub type Result<T, E = Error> = std::result::Result<T, E>;
