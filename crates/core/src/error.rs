//! The one error type of keyorder.

use crate::key::KeyError;

/// Every error keyorder returns. Adapters map their driver's errors into it
/// in exactly one `From` implementation each.
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
    /// The broker failed; the operation may be retried.
    #[error("broker: {0}")]
    Broker(String),
    /// The subscription or transport was shut down.
    #[error("shut down")]
    Shutdown,
    /// An operator action named something that does not exist.
    #[error("not found: {0}")]
    NotFound(String),
}

/// `Result` with keyorder's [`Error`] as the default error.
pub type Result<T, E = Error> = std::result::Result<T, E>;
