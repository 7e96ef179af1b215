//! The one conversion of a lapin (AMQP) error into
//! [`keyorder_core::Error`] ([`broker`]: the lapin error kept as the
//! source, temporary or not by [`is_temporary`]; the orphan rule rules out
//! a `From` impl here, both types being foreign), and how the broker's refusals
//! read: a declaration refused for other arguments or a missing name
//! ([`explain`]), a name that does not exist ([`not_found`]).

use keyorder_core::{BrokerError, Error};

pub(crate) fn broker(e: lapin::Error) -> Error {
    broker_as(format!("rabbitmq: {e}"), e)
}

/// `message` (what keyorder says), with lapin's error `e` as the source
/// and its answer to whether retrying can help.
pub(crate) fn broker_as(message: String, e: lapin::Error) -> Error {
    let temporary = is_temporary(&e);
    Error::Broker(BrokerError::new(message).with_temporary(temporary).caused_by(e))
}

/// Whether retrying may succeed: the connection or channel failed (I/O, a
/// missed heartbeat, a closed channel or connection, no channel left; not
/// a TLS certificate refused or a URI refused), or
/// the broker refused for now (`CONNECTION_FORCED` while it shuts down,
/// `RESOURCE_LOCKED`, `RESOURCE_ERROR`, `INTERNAL_ERROR`, a queue whose home
/// node is down). A declaration refused for other arguments, a name that
/// does not exist, refused access and protocol errors fail again.
pub(crate) fn is_temporary(e: &lapin::Error) -> bool {
    use lapin::protocol::{AMQPErrorKind, AMQPHardError, AMQPSoftError};
    match e.kind() {
        // A network failure; not a TLS verification failure or a refused
        // URI (lapin wraps both as I/O errors), which fail again.
        lapin::ErrorKind::IOError(io) => {
            use std::io::ErrorKind as K;
            matches!(
                io.kind(),
                K::ConnectionRefused
                    | K::ConnectionReset
                    | K::ConnectionAborted
                    | K::NotConnected
                    | K::BrokenPipe
                    | K::TimedOut
                    | K::UnexpectedEof
                    | K::Interrupted
                    | K::AddrNotAvailable
                    | K::NetworkUnreachable
                    | K::HostUnreachable
                    | K::NetworkDown
            )
        }
        lapin::ErrorKind::MissingHeartbeatError
        | lapin::ErrorKind::InvalidConnectionState(_)
        | lapin::ErrorKind::InvalidChannelState(..)
        | lapin::ErrorKind::ChannelsLimitReached => true,
        lapin::ErrorKind::ProtocolError(amqp) => match amqp.kind() {
            AMQPErrorKind::Soft(AMQPSoftError::RESOURCELOCKED) => true,
            AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND) => amqp.get_message().as_str().contains("is down"),
            AMQPErrorKind::Hard(
                AMQPHardError::CONNECTIONFORCED | AMQPHardError::RESOURCEERROR | AMQPHardError::INTERNALERROR,
            ) => true,
            _ => false,
        },
        _ => false,
    }
}

pub(crate) fn explain(e: lapin::Error, what: &str, fix: &str) -> Error {
    let text = e.to_string();
    if text.contains("PRECONDITION_FAILED") || text.contains("406") {
        Error::Config(format!("rabbitmq: {what} exists with other arguments ({text}); {fix}"))
    } else if text.contains("NOT_FOUND") || text.contains("404") {
        Error::Config(format!("rabbitmq: {what} is missing ({text}); {fix}"))
    } else {
        broker(e)
    }
}

pub(crate) fn not_found(e: &lapin::Error) -> bool {
    let text = e.to_string();
    text.contains("NOT_FOUND") || text.contains("404")
}
