//! librdkafka's errors as `keyorder_core::Error`, and the adapter's named
//! errors (a fenced settlement, a topic whose partition count changed).

use std::fmt;

use keyorder_core::{Error, ScopeLease};

use crate::names::Names;

/// A broker (or client) error: `Error::Broker`, which is retried.
pub(crate) fn kafka_err(e: impl fmt::Display) -> Error {
    Error::Broker(format!("kafka: {e}"))
}

/// A client's creation failed: librdkafka's configuration error names the
/// value it refused (a password, say), so only the setting is shown.
pub(crate) fn create_err(e: rdkafka::error::KafkaError) -> Error {
    match e {
        rdkafka::error::KafkaError::ClientConfig(_, _, key, _) => Error::Config(format!(
            "kafka: librdkafka refused the setting `{}` (the value is not shown)",
            keyorder_core::redact::text(&key)
        )),
        other => kafka_err(other),
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
