//! Configuration from an `amqp://` URL, decided without a broker round trip.

use keyorder_core::lease::{LeaseOptions, LEASE_URL_OPTIONS};
use keyorder_core::{Error, LeaseConfig, Result};

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

/// The largest prefetch allowed on quorum queues: a quorum queue's channel
/// keeps at most 32 commands (acknowledgements among them) pending at the
/// queue and buffers the rest, and a channel closed while it buffers
/// acknowledgements drops them (rabbitmq-server issue #10327), so after a
/// hand-over the next consumer would run already applied messages again.
/// With at most 32 deliveries unacknowledged per channel nothing is
/// buffered (see the README's RabbitMQ section).
pub const QUORUM_MAX_PREFETCH: u16 = 32;

/// How long a delivery may stay unacknowledged before RabbitMQ closes its
/// channel and redelivers it (`consumer_timeout`): a halted head stays
/// unacknowledged for as long as the halt lasts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConsumerTimeout {
    /// No timeout.
    Off,
    /// A timeout in milliseconds.
    Ms(u32),
}

impl ConsumerTimeout {
    /// The per-consumer `x-consumer-timeout` value (RabbitMQ 3.11.15 and
    /// later): `Off` asks for the largest one the broker takes (2^31 - 1 ms,
    /// about 24.8 days).
    pub fn consumer_arg_ms(self) -> i64 {
        match self {
            ConsumerTimeout::Off => i64::from(i32::MAX),
            ConsumerTimeout::Ms(ms) => i64::from(ms.min(i32::MAX as u32)),
        }
    }
}

impl std::fmt::Display for ConsumerTimeout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConsumerTimeout::Off => f.write_str("off"),
            ConsumerTimeout::Ms(ms) => write!(f, "{ms} ms"),
        }
    }
}

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
/// | `prefetch` | `32` | unacknowledged deliveries per queue and consumer (at most 32 on quorum queues with `hash` or `sac`) |
/// | `expires_ms` | none | delete a group's queue unused (no consumer) this long (`x-expires`; for tests and short-lived categories; never the registry, its lock or a dead-letter queue). Publishing is not use: a queue that expires while a backlog is published to it is deleted with its messages |
/// | `consumer_timeout_ms` | see below | how long a halted head may stay unacknowledged: a whole number of ms, or `off` |
/// | `groups` | none | consumer groups (comma-separated) whose topology a publisher declares before its first publish, so they keep what is published before their first consumer starts |
/// | `cacertfile` | the system's roots | `amqps://` only: a PEM file of the CA certificates to trust (with the `tls` feature; `amqps://` without it is refused, never connected in plaintext) |
/// | `lease_ttl_ms` | `10000` | the subscriptions' lease TTL (1000..=86400000); the AMQP heartbeat is `ceil((ttl - margin) / 2)` s, so the broker closes a stalled owner's connection after 2 to 3 of them; the heartbeat and margin are derived from it ([`LeaseConfig::from_ttl`](keyorder_core::LeaseConfig::from_ttl)) unless given |
/// | `lease_heartbeat_ms` | a fifth of the TTL, at most 5000 | how often the owner confirms its leases (a round trip on each owned queue's channel) |
/// | `lease_margin_ms` | 3/10 of the TTL | the self-fence pauses work once the last confirmation is older than `ttl - margin` |
///
/// The lease options set the default of every subscription on this
/// transport; a lease set on the builder
/// ([`SubscriptionBuilder::lease`](keyorder_core::SubscriptionBuilder::lease)) wins.
///
/// `groups`: each consumer group has queues of its own behind the
/// category's entry exchange, created when the group's first subscription
/// is built; a message published before that does not reach the group, and
/// one that reaches no group at all is refused in the `publish` call. A
/// publisher whose URL names groups (`groups=billing,shipping`) declares
/// them (with this URL's `topology`, `queues` and `queue_type`, which must
/// be the groups' own) when it is created, as a deployment declares its
/// topology, so they keep everything published from then on.
///
/// `consumer_timeout_ms`: RabbitMQ closes the channel of a delivery left
/// unacknowledged past its `consumer_timeout` (30 min by default) and
/// redelivers it, and a halted head stays unacknowledged while it is
/// halted. From RabbitMQ 3.11.15 on, every ordered consumer sets its own
/// timeout (`x-consumer-timeout`) to this value, `off` by default (the
/// largest the broker takes, about 24.8 days). Older brokers let a client
/// neither set nor read it: there an ordered subscription refuses to start
/// until this option states what the broker's `rabbitmq.conf` says (see the
/// README's RabbitMQ section).
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
#[derive(Clone)]
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
    /// `x-expires` of each group's queues, if set (never the registry, its
    /// lock or a dead-letter queue).
    pub expires_ms: Option<u32>,
    /// The `consumer_timeout` stated in the URL, if any.
    pub consumer_timeout: Option<ConsumerTimeout>,
    /// Groups a publisher declares before its first publish (`groups=`).
    pub groups: Vec<String>,
    /// `host:port` to read the broker's version from (plain `amqp://` only;
    /// `None` for TLS).
    pub(crate) probe: Option<(String, u16)>,
    /// CA certificates to trust (`cacertfile=`, the name RabbitMQ's URI
    /// spec uses; `amqps://` only); `None`: the system's roots.
    pub ca_file: Option<std::path::PathBuf>,
    /// The subscriptions' default lease (`lease_ttl_ms=`...), if the URL
    /// states one.
    pub lease: Option<LeaseConfig>,
}

/// Without a TLS backend lapin would connect an `amqps://` URL in
/// plaintext, credentials and all: refused, never downgraded.
fn check_tls(scheme: &str, tls_built: bool) -> Result<()> {
    if scheme == "amqps" && !tls_built {
        return Err(Error::Config(
            "rabbitmq: amqps:// needs TLS, and this build has none: enable keyorder-rabbitmq's `tls` feature \
             (keyorder's `rabbitmq-tls`, part of `all-adapters`); refusing to connect in plaintext"
                .into(),
        ));
    }
    Ok(())
}

impl RabbitConfig {
    /// Reads the configuration; an unknown option or bad value is an error
    /// that names the accepted ones.
    pub fn from_url(url: &url::Url) -> Result<Self> {
        check_tls(url.scheme(), cfg!(feature = "tls"))?;
        let mut topology = "plain".to_owned();
        let mut queues: u16 = 8;
        let mut cfg = RabbitConfig {
            uri: String::new(),
            display: format!(
                "{}:{}",
                url.host_str().unwrap_or("127.0.0.1"),
                url.port().unwrap_or(if url.scheme() == "amqps" { 5671 } else { 5672 })
            ),
            topology: Topology::Plain,
            queue_type: QueueType::Quorum,
            declare: true,
            prefetch: QUORUM_MAX_PREFETCH,
            expires_ms: None,
            consumer_timeout: None,
            groups: Vec::new(),
            ca_file: None,
            lease: None,
            probe: (url.scheme() == "amqp").then(|| {
                (
                    url.host_str().unwrap_or("127.0.0.1").to_owned(),
                    url.port().unwrap_or(5672),
                )
            }),
        };
        let mut rest = Vec::new();
        let mut lease = LeaseOptions::default();
        for (k, v) in url.query_pairs() {
            if lease.accept("amqp", &k, &v)? {
                continue;
            }
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
                "prefetch" => cfg.prefetch = v.parse().ok().filter(|n| *n >= 1).ok_or_else(|| bad("1..=65535"))?,
                "expires_ms" => {
                    cfg.expires_ms = Some(
                        v.parse()
                            .ok()
                            .filter(|n| *n >= 1000)
                            .ok_or_else(|| bad("a whole number of ms >= 1000"))?,
                    )
                }
                "consumer_timeout_ms" => {
                    cfg.consumer_timeout = Some(if v == "off" {
                        ConsumerTimeout::Off
                    } else {
                        ConsumerTimeout::Ms(
                            v.parse()
                                .ok()
                                .filter(|n| (1000..=i32::MAX as u32).contains(n))
                                .ok_or_else(|| bad("`off` or a whole number of ms in 1000..=2147483647"))?,
                        )
                    })
                }
                "groups" => {
                    for g in v.split(',') {
                        let g = g.trim();
                        if g.is_empty()
                            || g.len() > 200
                            || !g
                                .chars()
                                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
                        {
                            return Err(bad(
                                "a comma-separated list of group names, each 1 to 200 characters of [A-Za-z0-9._-]",
                            ));
                        }
                        if !cfg.groups.iter().any(|x| x == g) {
                            cfg.groups.push(g.to_owned());
                        }
                    }
                }
                "cacertfile" => {
                    if url.scheme() != "amqps" {
                        return Err(Error::Url(
                            "amqp: cacertfile= is for TLS: use amqps:// (amqp:// is plaintext)".into(),
                        ));
                    }
                    cfg.ca_file = Some(std::path::PathBuf::from(v.as_ref()))
                }
                "heartbeat" | "frame_max" | "channel_max" | "connection_timeout" => {
                    rest.push((k.into_owned(), v.into_owned()))
                }
                other => {
                    return Err(Error::Url(format!(
                    "amqp: unknown option `{}` (known: topology, queues, queue_type, declare, prefetch, expires_ms, \
                         consumer_timeout_ms, groups, cacertfile, {LEASE_URL_OPTIONS}, heartbeat, frame_max, \
                         channel_max, connection_timeout)",
                    keyorder_core::redact::text(other)
                )))
                }
            }
        }
        cfg.lease = lease.lease("amqp")?;
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
        // Plain competing consumers keep no order to lose.
        if cfg.queue_type == QueueType::Quorum && cfg.topology != Topology::Plain && cfg.prefetch > QUORUM_MAX_PREFETCH
        {
            return Err(Error::Url(format!(
                "amqp: prefetch={} on quorum queues: at most {QUORUM_MAX_PREFETCH}. A quorum queue's channel \
                 buffers acknowledgements beyond 32 pending ones and drops them when it closes (a hand-over; \
                 rabbitmq-server issue #10327), so the next consumer would run applied messages again; use \
                 prefetch<=32 or queue_type=classic",
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

/// Shows the URI without its password or option values.
impl std::fmt::Debug for RabbitConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RabbitConfig")
            .field("uri", &keyorder_core::redact::url(&self.uri))
            .field("display", &self.display)
            .field("topology", &self.topology)
            .field("queue_type", &self.queue_type)
            .field("declare", &self.declare)
            .field("prefetch", &self.prefetch)
            .field("expires_ms", &self.expires_ms)
            .field("consumer_timeout", &self.consumer_timeout)
            .field("groups", &self.groups)
            .field("ca_file", &self.ca_file)
            .field("lease", &self.lease)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A TLS scheme is never downgraded to plaintext (issue 37: without
    /// a TLS backend lapin connected `amqps://` in the clear).
    #[test]
    fn amqps_without_tls_is_refused() {
        let err = check_tls("amqps", false).unwrap_err().to_string();
        assert!(err.contains("`tls` feature"), "{err}");
        assert!(check_tls("amqps", true).is_ok() && check_tls("amqp", false).is_ok());
        // This build's own answer.
        let url = url::Url::parse("amqps://app:s3cret@127.0.0.1:5671/%2f").unwrap();
        let built = cfg!(feature = "tls");
        match RabbitConfig::from_url(&url) {
            Ok(_) => assert!(built, "amqps accepted without TLS"),
            Err(e) => assert!(!built && !e.to_string().contains("s3cret"), "{e}"),
        }
    }

    /// The lease options parse to the subscriptions' default lease; a bad
    /// one is named; the unknown-option list names them.
    #[test]
    fn lease_options() {
        use std::time::Duration;
        let parse = |q: &str| {
            RabbitConfig::from_url(&url::Url::parse(&format!("amqp://127.0.0.1/%2f?topology=hash&{q}")).unwrap())
        };
        assert_eq!(parse("queues=2").unwrap().lease, None);
        let cfg = parse("lease_ttl_ms=6000").unwrap();
        assert_eq!(cfg.lease, Some(LeaseConfig::from_ttl(Duration::from_secs(6))));
        assert!(!cfg.uri.contains("lease"), "{}", cfg.uri);
        let err = parse("lease_ttl_ms=6000&lease_margin_ms=5500").unwrap_err().to_string();
        assert!(err.contains("amqp: lease options: heartbeat 1200 ms must be"), "{err}");
        let err = parse("lease_ttl_s=6").unwrap_err().to_string();
        assert!(
            err.contains("lease_ttl_ms, lease_heartbeat_ms, lease_margin_ms"),
            "{err}"
        );
    }

    /// The password stays out of `Debug` (issue 37).
    #[test]
    fn debug_hides_the_password() {
        let cfg =
            RabbitConfig::from_url(&url::Url::parse("amqp://app:s3cret@127.0.0.1:5672/%2f?topology=hash").unwrap())
                .unwrap();
        assert!(!format!("{cfg:?}").contains("s3cret"), "{cfg:?}");
    }
}
