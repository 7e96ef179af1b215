//! The user's handler.

use std::fmt;
use std::future::Future;

use crate::message::Delivery;

type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Why a handler failed: retry with back-off, or apply the poison policy at once.
///
/// `?` on any error type gives a retryable error.
pub enum HandlerError {
    /// Retry with back-off, then the poison policy.
    Retryable(BoxError),
    /// The message can never succeed: the poison policy applies at once.
    Poison(BoxError),
}

impl HandlerError {
    /// A retryable error from any error or message.
    pub fn retry(err: impl Into<BoxError>) -> Self {
        HandlerError::Retryable(err.into())
    }
    /// A poison error from any error or message.
    pub fn poison(err: impl Into<BoxError>) -> Self {
        HandlerError::Poison(err.into())
    }
    /// Whether the poison policy applies at once.
    pub fn is_poison(&self) -> bool {
        matches!(self, HandlerError::Poison(_))
    }
}

impl<E: Into<BoxError>> From<E> for HandlerError {
    fn from(err: E) -> Self {
        HandlerError::Retryable(err.into())
    }
}

impl fmt::Debug for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HandlerError::Retryable(e) => write!(f, "Retryable({e})"),
            HandlerError::Poison(e) => write!(f, "Poison({e})"),
        }
    }
}

impl fmt::Display for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HandlerError::Retryable(e) => write!(f, "retryable: {e}"),
            HandlerError::Poison(e) => write!(f, "poison: {e}"),
        }
    }
}

/// What a handler returns.
pub type HandlerResult = Result<(), HandlerError>;

/// The user's handler: an async function of a delivery. `Ok(())` acks;
/// a [`HandlerError`] retries or applies the poison policy; a panic counts
/// as a poison error.
///
/// Any `Fn(Delivery) -> impl Future<Output = HandlerResult>` is a handler:
///
/// ```
/// use keyorder_core::{Delivery, Handler, HandlerResult};
/// fn assert_handler<H: Handler>(_: H) {}
/// assert_handler(|d: Delivery| async move {
///     println!("{} bytes at attempt {}", d.payload().len(), d.attempt());
///     HandlerResult::Ok(())
/// });
/// ```
///
/// The trait is object-safe: the dispatcher holds an `Arc<dyn Handler>`.
#[async_trait::async_trait]
pub trait Handler: Send + Sync + 'static {
    /// Handles one delivery.
    async fn handle(&self, delivery: Delivery) -> HandlerResult;
}

#[async_trait::async_trait]
impl<F, Fut> Handler for F
where
    F: Fn(Delivery) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = HandlerResult> + Send + 'static,
{
    async fn handle(&self, delivery: Delivery) -> HandlerResult {
        (self)(delivery).await
    }
}
