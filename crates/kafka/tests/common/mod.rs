//! What the Kafka tests share: the test broker's address and the lease its
//! consumer groups are timed by.

use std::time::Duration;

use keyorder_core::LeaseConfig;

/// The test broker (`KAFKA_BROKERS`, started by `scripts/services`).
pub(crate) fn brokers() -> String {
    std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into())
}

/// The lease TTL is the group's session timeout; the test broker assigns
/// partitions after about half of it.
pub(crate) fn lease() -> LeaseConfig {
    LeaseConfig {
        ttl: Duration::from_secs(6),
        heartbeat: Duration::from_millis(500),
        margin: Duration::from_secs(2),
    }
}
