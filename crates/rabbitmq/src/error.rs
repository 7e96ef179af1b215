//! The one conversion of a lapin (AMQP) error into
//! [`keyorder_core::Error`] ([`broker`]), and how the broker's refusals
//! read: a declaration refused for other arguments or a missing name
//! ([`explain`]), a name that does not exist ([`not_found`]).

use keyorder_core::Error;

pub(crate) fn broker(e: lapin::Error) -> Error {
    Error::Broker(format!("rabbitmq: {e}"))
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
