//! Configuration from an `amqp://` URL, decided without a broker round trip.

use keyorder_core::{Error, Result};

/// How a category's queues are laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Topology {
    /// One queue per category, plain competing consumers: no per-key order
    /// across consumers (the default, and the benchmark baseline).
    Plain,
    /// One queue with `x-single-active-consumer`: one instance consumes at a
    /// time; inside it the dispatcher still runs keys in parallel.
    SingleActiveConsumer,
    /// An `x-consistent-hash` exchange bound to `queues` queues, each with
    /// single active consumer, spread over the instances.
    ConsistentHash {
        /// The number of queues (fixed for the category's life: a change
        /// moves keys and is refused).
        queues: u16,
    },
}

/// Queue durability type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueType {
    /// Quorum queues (replicated, `x-delivery-count` kept across redeliveries).
    Quorum,
    /// Classic queues.
    Classic,
}

impl QueueType {
    pub(crate) fn name(self) -> &'static str {
        match self {
            QueueType::Quorum => "quorum",
            QueueType::Classic => "classic",
        }
    }
}

/// The largest prefetch allowed on quorum queues: with more unacknowledged
/// messages per consumer, RabbitMQ 3.10 quorum queues were seen returning
/// them out of order when the consumer's channel closed (a per-key reorder
/// after a hand-over in one bench run of four at prefetch 256; none in six
/// at 32).
pub const QUORUM_MAX_PREFETCH: u16 = 32;

/// Configuration of the RabbitMQ transport.
///
/// URL options (query string):
///
/// | Option | Default | Meaning |
/// |---|---|---|
/// | `topology` | `plain` | `plain`, `sac` (single active consumer) or `hash` (consistent hash) |
/// | `queues` | `8` | queues of the `hash` topology (1..=1024) |
/// | `queue_type` | `quorum` | `quorum` or `classic` |
/// | `declare` | `true` | create the topology; `false` only verifies it (manual topology) |
/// | `prefetch` | `32` | unacknowledged deliveries per queue and consumer (at most 32 on quorum queues) |
/// | `expires_ms` | none | delete a queue unused (no consumer) this long (`x-expires`; for tests and short-lived categories) |
///
/// ```
/// use keyorder_rabbitmq::{RabbitConfig, Topology};
/// let url = url::Url::parse("amqp://guest:guest@127.0.0.1:5672/%2f?topology=hash&queues=4").unwrap();
/// let cfg = RabbitConfig::from_url(&url).unwrap();
/// assert_eq!(cfg.topology, Topology::ConsistentHash { queues: 4 });
/// // Quorum queues refuse a prefetch above 32 (see QUORUM_MAX_PREFETCH).
/// let big = url::Url::parse("amqp://127.0.0.1/%2f?topology=hash&prefetch=256").unwrap();
/// assert!(RabbitConfig::from_url(&big).unwrap_err().to_string().contains("at most 32"));
/// ```
#[derive(Debug, Clone)]
pub struct RabbitConfig {
    /// The broker URI without keyorder's options.
    pub uri: String,
    /// `host:port` for messages (no credentials).
    pub display: String,
    /// The topology.
    pub topology: Topology,
    /// The queue type.
    pub queue_type: QueueType,
    /// Create the topology (`true`) or only verify it.
    pub declare: bool,
    /// Unacknowledged deliveries per queue and consumer.
    pub prefetch: u16,
    /// `x-expires` of every queue, if set.
    pub expires_ms: Option<u32>,
}

impl RabbitConfig {
    /// Reads the configuration; an unknown option or bad value is an error
    /// that names the accepted ones.
    pub fn from_url(url: &url::Url) -> Result<Self> {
        let mut topology = "plain".to_owned();
        let mut queues: u16 = 8;
        let mut cfg = RabbitConfig {
            uri: String::new(),
            display: format!(
                "{}:{}",
                url.host_str().unwrap_or("127.0.0.1"),
                url.port().unwrap_or(5672)
            ),
            topology: Topology::Plain,
            queue_type: QueueType::Quorum,
            declare: true,
            prefetch: QUORUM_MAX_PREFETCH,
            expires_ms: None,
        };
        let mut rest = Vec::new();
        for (k, v) in url.query_pairs() {
            let bad = |expected: &str| Error::Url(format!("amqp: {k}={v}: expected {expected}"));
            match k.as_ref() {
                "topology" => topology = v.into_owned(),
                "queues" => {
                    queues = v
                        .parse()
                        .ok()
                        .filter(|n| (1..=1024).contains(n))
                        .ok_or_else(|| bad("1..=1024"))?
                }
                "queue_type" => {
                    cfg.queue_type = match v.as_ref() {
                        "quorum" => QueueType::Quorum,
                        "classic" => QueueType::Classic,
                        _ => return Err(bad("`quorum` or `classic`")),
                    }
                }
                "declare" => cfg.declare = v.parse().map_err(|_| bad("`true` or `false`"))?,
                "prefetch" => {
                    cfg.prefetch = v
                        .parse()
                        .ok()
                        .filter(|n| *n >= 1)
                        .ok_or_else(|| bad("1..=65535"))?
                }
                "expires_ms" => {
                    cfg.expires_ms = Some(
                        v.parse()
                            .ok()
                            .filter(|n| *n >= 1000)
                            .ok_or_else(|| bad("a whole number of ms >= 1000"))?,
                    )
                }
                "heartbeat" | "frame_max" | "channel_max" | "connection_timeout" => {
                    rest.push((k.into_owned(), v.into_owned()))
                }
                other => {
                    return Err(Error::Url(format!(
                        "amqp: unknown option `{other}` (known: topology, queues, queue_type, declare, prefetch, expires_ms)"
                    )))
                }
            }
        }
        cfg.topology = match topology.as_str() {
            "plain" => Topology::Plain,
            "sac" => Topology::SingleActiveConsumer,
            "hash" => Topology::ConsistentHash { queues },
            other => {
                return Err(Error::Url(format!(
                    "amqp: topology={other}: expected `plain`, `sac` or `hash`"
                )))
            }
        };
        if cfg.queue_type == QueueType::Quorum && cfg.prefetch > QUORUM_MAX_PREFETCH {
            return Err(Error::Url(format!(
                "amqp: prefetch={} on quorum queues: at most {QUORUM_MAX_PREFETCH}. When a consumer's channel \
                 closes (a hand-over, a crash), RabbitMQ 3.10 quorum queues were seen returning more than 32 \
                 unacknowledged messages out of order, which reorders a key; use prefetch<=32 or queue_type=classic",
                cfg.prefetch
            )));
        }
        let mut uri = url.clone();
        uri.set_query(None);
        if !rest.is_empty() {
            uri.query_pairs_mut().extend_pairs(rest);
        }
        cfg.uri = uri.to_string();
        Ok(cfg)
    }

    /// The URI with an AMQP heartbeat of `secs` (the stall fence: a stalled
    /// consumer's connection is closed by the broker after about two missed
    /// heartbeats).
    pub(crate) fn uri_with_heartbeat(&self, secs: u64) -> String {
        let mut u = url::Url::parse(&self.uri).expect("parsed before");
        let keep: Vec<(String, String)> = u
            .query_pairs()
            .filter(|(k, _)| k != "heartbeat")
            .map(|(k, v)| (k.into_owned(), v.into_owned()))
            .collect();
        u.set_query(None);
        u.query_pairs_mut()
            .extend_pairs(keep)
            .append_pair("heartbeat", &secs.max(1).to_string());
        u.to_string()
    }
}
