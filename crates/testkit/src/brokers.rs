//! The test brokers, as the adapter tests reach them: each broker's URL
//! (from the environment variable `scripts/services` prints, or the
//! loopback default) and a connect that fails the test with a message
//! naming the broker, the URL and `scripts/services`, the way the
//! conformance run reports an unreachable broker. A missing broker is a
//! failure, never a pass by skipping.
//!
//! ```no_run
//! # async fn f() {
//! use keyorder_testkit::brokers::Broker;
//! let url = Broker::Redis.url();
//! let conn = Broker::Redis
//!     .require(&url, async { std::net::TcpStream::connect("127.0.0.1:6379") })
//!     .await;
//! # drop(conn);
//! # }
//! ```

use std::fmt::Display;
use std::future::Future;
use std::time::Duration;

/// How long a connect may take before the broker counts as unreachable
/// (the conformance run's limit).
const CONNECT_LIMIT: Duration = Duration::from_secs(60);

/// A broker the tests run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Broker {
    /// PostgreSQL (`POSTGRES_URL`).
    Postgres,
    /// Redis (`REDIS_URL`).
    Redis,
    /// RabbitMQ (`AMQP_URL`).
    RabbitMq,
    /// Kafka (tansu; `KAFKA_BROKERS`, a `host:port` list, not a URL).
    Kafka,
}

impl Broker {
    /// The broker's name in messages.
    pub fn name(self) -> &'static str {
        match self {
            Broker::Postgres => "postgres",
            Broker::Redis => "redis",
            Broker::RabbitMq => "rabbitmq",
            Broker::Kafka => "kafka",
        }
    }

    /// The environment variable that points the tests at the broker.
    pub fn var(self) -> &'static str {
        match self {
            Broker::Postgres => "POSTGRES_URL",
            Broker::Redis => "REDIS_URL",
            Broker::RabbitMq => "AMQP_URL",
            Broker::Kafka => "KAFKA_BROKERS",
        }
    }

    /// Where `scripts/services` runs the broker.
    pub fn default_url(self) -> &'static str {
        match self {
            Broker::Postgres => "postgres://postgres@127.0.0.1:5432/test",
            Broker::Redis => "redis://127.0.0.1:6379",
            Broker::RabbitMq => "amqp://guest:guest@127.0.0.1:5672/%2f",
            Broker::Kafka => "127.0.0.1:9092",
        }
    }

    /// The broker's URL: [`Broker::var`] if set, else [`Broker::default_url`].
    pub fn url(self) -> String {
        std::env::var(self.var()).unwrap_or_else(|_| self.default_url().to_owned())
    }

    /// Awaits `connect` (a connect to this broker at `url`, migrations
    /// included where it runs them), for at most 60 s, and returns what it connected; panics with
    /// [`Broker::unreachable`]'s message if it failed or did not answer.
    pub async fn require<T, E: Display>(self, url: &str, connect: impl Future<Output = Result<T, E>>) -> T {
        match tokio::time::timeout(CONNECT_LIMIT, connect).await {
            Ok(Ok(connected)) => connected,
            Ok(Err(e)) => panic!("{}", self.unreachable(url, &e)),
            Err(_) => panic!(
                "{}",
                self.unreachable(url, &format!("no answer within {CONNECT_LIMIT:?}"))
            ),
        }
    }

    /// What a test says when connecting to the broker at `url` failed: the
    /// broker, the URL (its password and query values hidden), why, and the
    /// fix.
    pub fn unreachable(self, url: &str, why: &dyn Display) -> String {
        format!(
            "{} broker: connecting to {} failed: {why} (is it running? run scripts/services, or point {} at a running one)",
            self.name(),
            shown(url),
            self.var()
        )
    }
}

/// `url` as a message may show it: its password and every query value
/// hidden (`keyorder_core::redact::url`); a bare `host:port` list (Kafka's)
/// as it is.
fn shown(url: &str) -> String {
    if url.contains("://") {
        keyorder_core::redact::url(url)
    } else {
        url.to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_are_hidden() {
        assert_eq!(
            shown("amqp://guest:guest@127.0.0.1:5672/%2f"),
            "amqp://guest:***@127.0.0.1:5672/%2f"
        );
        assert_eq!(
            shown("postgres://postgres@127.0.0.1:5432/test?sslpassword=s3cret"),
            "postgres://postgres@127.0.0.1:5432/test?sslpassword=***"
        );
        assert_eq!(shown("127.0.0.1:9092"), "127.0.0.1:9092");
    }

    #[tokio::test]
    async fn a_failed_connect_names_the_broker_the_url_and_the_fix() {
        let panic = tokio::spawn(async {
            Broker::Redis
                .require("redis://u:secret@127.0.0.1:1", async {
                    Err::<(), _>("connection refused")
                })
                .await
        })
        .await
        .unwrap_err()
        .into_panic();
        let msg = panic.downcast_ref::<String>().unwrap();
        assert_eq!(
            msg,
            "redis broker: connecting to redis://u:***@127.0.0.1:1 failed: connection refused \
             (is it running? run scripts/services, or point REDIS_URL at a running one)"
        );
    }
}
