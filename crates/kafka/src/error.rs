//! librdkafka's errors as `keyorder_core::Error` ([`broker`], keeping the
//! error as the source and saying whether retrying can help), and the adapter's named
//! errors (a fenced settlement, a topic whose partition count changed).

use keyorder_core::{BrokerError, Error, ScopeLease};
use rdkafka::error::KafkaError;

use crate::names::Names;

/// The one conversion of a client error (librdkafka's, or a blocking task's
/// that ran it) into `Error::Broker`: the error is kept as the source, and
/// whether retrying can help is [`is_temporary`]'s answer for librdkafka's
/// errors (a task that failed to run is temporary). The orphan rule rules
/// out a `From` impl here, both types being foreign.
pub(crate) fn broker<E: std::error::Error + Send + Sync + 'static>(e: E) -> Error {
    let temporary = (&e as &dyn std::any::Any)
        .downcast_ref::<KafkaError>()
        .is_none_or(is_temporary);
    Error::Broker(
        BrokerError::new(format!("kafka: {e}"))
            .with_temporary(temporary)
            .caused_by(e),
    )
}

/// Whether retrying may succeed: the broker could not be reached or timed
/// out, a partition's leader or the group's coordinator is moving, a
/// rebalance is under way, too few replicas are in sync for now, or the
/// local queue is full. A refused configuration, a missing topic, an
/// authorization failure or a bad message fail again.
pub(crate) fn is_temporary(e: &KafkaError) -> bool {
    e.rdkafka_error_code().is_some_and(code_is_temporary)
}

/// `message` (what keyorder says), with librdkafka's error `e` as the
/// source and its answer to whether retrying can help.
pub(crate) fn broker_as(message: String, e: KafkaError) -> Error {
    let temporary = is_temporary(&e);
    Error::Broker(BrokerError::new(message).with_temporary(temporary).caused_by(e))
}

/// [`is_temporary`] for a bare error code (an admin operation's result).
pub(crate) fn code_is_temporary(code: rdkafka::types::RDKafkaErrorCode) -> bool {
    use rdkafka::types::RDKafkaErrorCode as C;
    matches!(
        code,
        C::BrokerTransportFailure
            | C::AllBrokersDown
            | C::OperationTimedOut
            | C::MessageTimedOut
            | C::QueueFull
            | C::Resolve
            | C::LeaderNotAvailable
            | C::NotLeaderForPartition
            | C::RequestTimedOut
            | C::BrokerNotAvailable
            | C::NetworkException
            | C::CoordinatorLoadInProgress
            | C::CoordinatorNotAvailable
            | C::NotCoordinator
            | C::NotEnoughReplicas
            | C::NotEnoughReplicasAfterAppend
            | C::RebalanceInProgress
            | C::KafkaStorageError
            | C::PreferredLeaderNotAvailable
    )
}

/// A client's creation failed: librdkafka's configuration error names the
/// value it refused (a password, say), so only the setting is shown.
pub(crate) fn create_err(e: KafkaError) -> Error {
    match e {
        KafkaError::ClientConfig(_, _, key, _) => Error::Config(format!(
            "kafka: librdkafka refused the setting `{}` (the value is not shown)",
            keyorder_core::redact::text(&key)
        )),
        other => broker(other),
    }
}

/// A settlement refused because `lease`'s partition was lost (the fence).
pub(crate) fn fenced(lease: &ScopeLease) -> Error {
    Error::Fenced {
        scope: lease.scope().to_string(),
        generation: lease.generation(),
    }
}

/// The error of a topic whose partition count is no longer its layout's.
pub(crate) fn layout_changed(names: &Names, layout: i32, now: i32) -> Error {
    Error::Config(format!(
        "kafka: topic `{}` has {now} partitions, but keyorder's layout for it has {layout} (the count it was \
         created with, kept by `{}`): partitions were added while it was in use, which moves keys between \
         partitions and breaks their order, so keyorder stops publishing to it and consuming it. Fix: Kafka \
         cannot remove partitions; stop the publishers, let every group drain the topic, then move to a new \
         category (or delete and recreate the topic and its `.keyorder-state` and `.dlq` topics with the new \
         count once drained)",
        names.topic(),
        names.state()
    ))
}

#[cfg(test)]
mod tests {
    use std::error::Error as _;

    use rdkafka::error::KafkaError;
    use rdkafka::types::RDKafkaErrorCode as C;

    #[test]
    fn a_broker_error_keeps_the_client_error_and_says_if_retrying_helps() {
        let down = super::broker(KafkaError::MetadataFetch(C::AllBrokersDown));
        assert!(down.is_temporary(), "{down}");
        let source = down.source().expect("the client's error is the source");
        assert!(source.downcast_ref::<KafkaError>().is_some(), "{source:?}");
        assert!(down.to_string().starts_with("broker: kafka: "), "{down}");
        let denied = super::broker(KafkaError::MetadataFetch(C::TopicAuthorizationFailed));
        assert!(!denied.is_temporary(), "{denied}");
        let moving = super::broker(KafkaError::MessageProduction(C::NotLeaderForPartition));
        assert!(moving.is_temporary(), "{moving}");
        let too_big = super::broker(KafkaError::MessageProduction(C::MessageSizeTooLarge));
        assert!(!too_big.is_temporary(), "{too_big}");
    }
}
