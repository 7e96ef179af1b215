//! The user's handler.

use std::fmt;
use std::future::Future;

use crate::message::Delivery;

type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Why a handler failed: retry with back-off, apply the poison policy at
/// once, or the handler's own store refused this delivery's fencing token.
///
/// `?` on any error type gives a retryable error, except a payload that
/// does not decode (`keyorder_core::codec::DecodeError`, feature `serde`),
/// which gives [`HandlerError::Poison`]: retrying cannot change a
/// message's bytes. (It is recognised as it is converted; wrapped in
/// another error type first, it is that type's error: call
/// [`HandlerError::poison`] then.)
pub enum HandlerError {
    /// Retry with back-off, then the poison policy.
    Retryable(BoxError),
    /// The message can never succeed: the poison policy applies at once.
    Poison(BoxError),
    /// The handler's own store refused [`Delivery::fencing_token`] as stale
    /// (it has seen a newer owner's): nothing is acknowledged, nothing is
    /// recorded as applied, it is counted in `Stats::handler_fenced`, and
    /// the same attempt runs again after a back-off for as long as the
    /// broker still gives this instance the scope (a stale owner loses it
    /// at its next heartbeat, and the delivery goes to the new owner). It
    /// never counts toward the poison policy.
    Fenced(BoxError),
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
    /// The handler's store refused the delivery's fencing token (see
    /// [`HandlerError::Fenced`]).
    ///
    /// ```
    /// use keyorder_core::{Delivery, HandlerError, HandlerResult};
    /// // A store that keeps the highest token it accepted per scope.
    /// fn apply(d: &Delivery, highest_seen: u64) -> HandlerResult {
    ///     if d.fencing_token() < highest_seen {
    ///         return Err(HandlerError::fenced("store saw a newer owner's token"));
    ///     }
    ///     Ok(())
    /// }
    /// ```
    pub fn fenced(err: impl Into<BoxError>) -> Self {
        HandlerError::Fenced(err.into())
    }
    /// Whether the poison policy applies at once.
    pub fn is_poison(&self) -> bool {
        matches!(self, HandlerError::Poison(_))
    }
    /// Whether the handler's store refused the fencing token.
    pub fn is_fenced(&self) -> bool {
        matches!(self, HandlerError::Fenced(_))
    }
}

/// How a delivery ended in this process, as
/// [`crate::SubscriptionBuilder::on_settled`] reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Settlement {
    /// Applied: the handler returned `Ok` and the broker acknowledged it.
    Acknowledged,
    /// Dead-lettered by the poison policy, durably confirmed.
    Parked,
    /// Its key halted at it (it stays as the key's head).
    Halted,
    /// Rejected by a fence: the broker's (this owner lost the scope) or the
    /// handler's own store ([`HandlerError::Fenced`]). Not acknowledged: the
    /// scope's next owner delivers it.
    Fenced,
    /// Discarded before it ran: its scope was lost (self-fence). Not
    /// acknowledged: the scope's next owner delivers it.
    Discarded,
}

/// One delivery's settlement (see [`Settlement`]).
#[derive(Debug, Clone)]
pub struct Settled {
    /// The message id.
    pub id: String,
    /// The key's label (`k#...`), `None` for a keyless message.
    pub key_label: Option<String>,
    /// The fencing token the delivery carried.
    pub fencing_token: u64,
    /// How it ended.
    pub settlement: Settlement,
}

/// A callback told of every delivery's settlement.
#[derive(Clone)]
pub struct SettledHook(std::sync::Arc<dyn Fn(&Settled) + Send + Sync>);

impl SettledHook {
    /// Wraps `f`.
    pub fn new(f: impl Fn(&Settled) + Send + Sync + 'static) -> Self {
        SettledHook(std::sync::Arc::new(f))
    }
    /// Calls it.
    pub fn call(&self, settled: &Settled) {
        (self.0)(settled);
    }
}

impl fmt::Debug for SettledHook {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SettledHook")
    }
}

impl<E: Into<BoxError>> From<E> for HandlerError {
    /// [`HandlerError::Retryable`], or [`HandlerError::Poison`] for a
    /// `codec::DecodeError` (a blanket implementation cannot be
    /// specialised, so the decode error is recognised here).
    fn from(err: E) -> Self {
        let err = err.into();
        #[cfg(feature = "serde")]
        if err.is::<crate::codec::DecodeError>() {
            return HandlerError::Poison(err);
        }
        HandlerError::Retryable(err)
    }
}

impl fmt::Debug for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HandlerError::Retryable(e) => write!(f, "Retryable({e})"),
            HandlerError::Poison(e) => write!(f, "Poison({e})"),
            HandlerError::Fenced(e) => write!(f, "Fenced({e})"),
        }
    }
}

impl fmt::Display for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HandlerError::Retryable(e) => write!(f, "retryable: {e}"),
            HandlerError::Poison(e) => write!(f, "poison: {e}"),
            HandlerError::Fenced(e) => write!(f, "fenced by the handler's store: {e}"),
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
