#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]

// The application's face: what a program that publishes, subscribes and
// operates uses. What an adapter author needs is under `raw`.
pub use keyorder_core::{
    async_trait, redact, Admin, BrokerError, Bytes, Capabilities, Client, DeadLetter, Delivery, Error, GlobalBackoff,
    GroupInfo, HaltedKey, Handler, HandlerError, HandlerResult, HeadAction, Health, HealthReport, HotKey, KeyError,
    KeyRule, KeyRules, KeySource, KeylessPolicy, LeaseConfig, MemoryTransport, Message, MessageType, OrderingKey,
    PoisonPolicy, PublishFence, Publisher, Resolved, Result, RetryPolicy, RunReport, ScopeInfo, Settled, SettledHook,
    Settlement, Stats, StatsSnapshot, Strategy, Subscription, SubscriptionBuilder, CONTENT_TYPE_HEADER, KEY_HEADER,
    MAX_KEY_BYTES, TRACEPARENT_HEADER, TRACESTATE_HEADER, TYPE_HEADER,
};

/// Typed payloads (feature `serde`): [`Message::json`], [`Delivery::json`]
/// and any `serde` format through [`codec::Codec`]; a payload that does
/// not decode is poison ([`keyorder_core::codec`]).
#[cfg(feature = "serde")]
pub use keyorder_core::codec;

/// For adapter authors: the transport traits, the keyed dispatcher, leases
/// and scope assignment ([`keyorder_core::raw`]). An application does not
/// need anything in here.
pub use keyorder_core::raw;

/// The URL schemes this build can connect to.
pub fn schemes() -> &'static [&'static str] {
    &[
        "memory",
        #[cfg(feature = "postgres")]
        "postgres",
        #[cfg(feature = "redis")]
        "redis",
        #[cfg(feature = "rabbitmq")]
        "amqp",
        #[cfg(feature = "kafka")]
        "kafka",
    ]
}

#[cfg(feature = "ops")]
pub mod ops;

#[cfg(feature = "postgres")]
pub use keyorder_postgres as postgres;

#[cfg(feature = "redis")]
pub use keyorder_redis as redis;

#[cfg(feature = "rabbitmq")]
pub use keyorder_rabbitmq as rabbitmq;

#[cfg(feature = "kafka")]
pub use keyorder_kafka as kafka;

/// How a demo or a bench runs the transport `url` names
/// ([`raw::BenchHints`]), as its adapter declares them, without connecting:
/// a tool asks here instead of reading the scheme. A URL no compiled-in
/// adapter serves gets the defaults (the URL as it is), and [`connect`]
/// then says what is wrong with it.
///
/// ```
/// let hints = keyorder::bench_hints("memory://");
/// assert!(!hints.connects_share_broker());
/// assert_eq!(hints.setup("memory://", "keyorder"), "memory://");
/// ```
pub fn bench_hints(url: &str) -> &'static dyn raw::BenchHints {
    let scheme = url::Url::parse(url).map(|u| u.scheme().to_owned()).unwrap_or_default();
    match scheme.as_str() {
        "memory" => &keyorder_core::memory::MemoryBenchHints,
        #[cfg(feature = "postgres")]
        "postgres" | "postgresql" => &keyorder_postgres::PgBenchHints,
        #[cfg(feature = "redis")]
        "redis" | "rediss" => &keyorder_redis::RedisBenchHints,
        #[cfg(feature = "rabbitmq")]
        "amqp" | "amqps" => &keyorder_rabbitmq::RabbitBenchHints,
        #[cfg(feature = "kafka")]
        "kafka" => &keyorder_kafka::KafkaBenchHints,
        _ => &raw::DefaultBenchHints,
    }
}

/// Connects to the transport a URL names; the rest of the URL (host, query
/// string) is the adapter's configuration, so a deployment swaps brokers by
/// changing one URL and no code.
///
/// | scheme | adapter | options |
/// |---|---|---|
/// | `memory://` | [`MemoryTransport`] (one process) | `partitions=N`, and on every adapter `lease_ttl_ms`, `lease_heartbeat_ms`, `lease_margin_ms` (the subscriptions' default lease) |
/// | `postgres://` | `keyorder_postgres::PgTransport` (feature `postgres`) | `schema`, `slots`, `pool`, `migrate`, `retention_batch`, `pooler`, `direct`, `layout`, the lease options |
/// | `redis://`, `rediss://` | `keyorder_redis::RedisTransport` (feature `redis`) | `layout`, `response_timeout_ms`, `reap_idle_ms`, `partition_warn`, the lease options |
/// | `amqp://`, `amqps://` | `keyorder_rabbitmq::RabbitTransport` (feature `rabbitmq`) | `topology`, `queues`, `queue_type`, `declare`, `prefetch`, the lease options |
/// | `kafka://` | `keyorder_kafka::KafkaTransport` (feature `kafka`) | `partitions`, `replication`, `assignor`, `fetch_wait_ms`, `max_unfinished`, `rdkafka.*`, the lease options |
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> keyorder::Result<()> {
/// let client = keyorder::connect("memory://?partitions=8").await?;
/// assert_eq!(client.transport_name(), "memory");
/// assert!(keyorder::connect("nats://127.0.0.1").await.is_err());
/// # Ok(()) }
/// ```
///
/// # Errors
/// [`Error::Url`] for a URL that does not parse, a scheme no compiled-in
/// adapter serves (the message lists the ones that are), or a bad option.
pub async fn connect(url: &str) -> Result<Client> {
    let parsed = url::Url::parse(url)
        .map_err(|e| Error::Url(format!("{e}: expected e.g. memory:// or redis://127.0.0.1:6379")))?;
    match parsed.scheme() {
        "memory" => Ok(Client::new(std::sync::Arc::new(MemoryTransport::from_url(&parsed)?))),
        #[cfg(feature = "postgres")]
        "postgres" | "postgresql" => Ok(Client::new(std::sync::Arc::new(
            keyorder_postgres::PgTransport::from_url(&parsed).await?,
        ))),
        #[cfg(feature = "redis")]
        "redis" | "rediss" => Ok(Client::new(std::sync::Arc::new(
            keyorder_redis::RedisTransport::from_url(&parsed).await?,
        ))),
        #[cfg(feature = "rabbitmq")]
        "amqp" | "amqps" => Ok(Client::new(std::sync::Arc::new(
            keyorder_rabbitmq::RabbitTransport::from_url(&parsed).await?,
        ))),
        #[cfg(feature = "kafka")]
        "kafka" => Ok(Client::new(std::sync::Arc::new(
            keyorder_kafka::KafkaTransport::from_url(&parsed).await?,
        ))),
        other => Err(Error::Url(format!(
            "no adapter for `{other}://` in this build (compiled in: {}); enable the adapter's feature of the \
             `keyorder` crate",
            schemes()
                .iter()
                .map(|s| format!("{s}://"))
                .collect::<Vec<_>>()
                .join(", ")
        ))),
    }
}
