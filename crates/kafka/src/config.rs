//! Configuration from a `kafka://` URL, decided without a broker round trip,
//! and the librdkafka client configuration every client starts from.

use std::collections::BTreeMap;

use keyorder_core::lease::{LeaseOptions, LEASE_URL_OPTIONS};
use keyorder_core::{Error, LeaseConfig, Result};

/// How the group's partitions are assigned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Assignor {
    /// `cooperative-sticky`: only moved partitions are revoked (the default).
    CooperativeSticky,
    /// `range` (eager): every rebalance revokes every partition first.
    Range,
}

impl Assignor {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Assignor::CooperativeSticky => "cooperative-sticky",
            Assignor::Range => "range",
        }
    }
}

/// Where a partition without saved progress (never consumed by this
/// keyorder group) starts.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum StartAt {
    /// Its first retained message (the default): nothing is skipped, a
    /// topic adopted with history replays all of it.
    #[default]
    Earliest,
    /// The end at the partition's first assignment: messages published
    /// before it are never delivered to this group (skipped, not lost to
    /// other groups); per-key order holds from there.
    Latest,
    /// Where another consumer group (one that consumed the topic before
    /// keyorder) committed, read when a subscription opens while some
    /// partition has no saved progress (refused when that group has no
    /// offsets then; once every partition has saved progress the option no
    /// longer matters); a partition it never committed starts at its
    /// earliest message. What
    /// that group had delivered but not committed runs again (at least
    /// once), in partition order, so per-key order holds; stop that group's
    /// consumers first, or both groups process the topic.
    Group(String),
}

/// Configuration of the Kafka transport.
///
/// URL options (query string):
///
/// | Option | Default | Meaning |
/// |---|---|---|
/// | `brokers` | the URL's host | more bootstrap brokers, comma-separated `host:port` |
/// | `partitions` | `8` | partitions of a topic this transport creates |
/// | `replication` | `1` | replication factor of a topic it creates (use 3 in production) |
/// | `create` | `true` | create missing topics; `false` requires them to exist |
/// | `assignor` | `cooperative-sticky` | `cooperative-sticky` or `range` (eager) |
/// | `fetch_wait_ms` | `10` | librdkafka `fetch.wait.max.ms`: the broker may hold every fetch this long |
/// | `max_unfinished` | `512` | unfinished messages per partition before it is paused (bounds memory and the state record, which lists every unfinished offset) |
/// | `start` | `earliest` | where a partition this group never consumed starts: `earliest`, `latest`, or `group:<group id>` (another group's committed offsets); see [`StartAt`] |
/// | `reset_layout` | `false` | when the category's `.keyorder-state` topic holds no records and its partition count is not the topic's (left by an earlier attempt), delete it and create it again with the topic's count; never when it holds records. Use it once: partitions added to a topic that holds messages of the same keys break their order (drain first) |
/// | `static_membership` | `false` | join as a static member (`group.instance.id` = the subscription's instance id): a restart does not move the other members' partitions (see below) |
/// | `lease_ttl_ms` | `10000` | the subscriptions' lease TTL (1000..=86400000): the group session timeout (`session.timeout.ms`, which the broker bounds by its `group.min.session.timeout.ms` and `group.max.session.timeout.ms`); the heartbeat and margin are derived from it ([`LeaseConfig::from_ttl`](keyorder_core::LeaseConfig::from_ttl)) unless given |
/// | `lease_heartbeat_ms` | a fifth of the TTL, at most 5000 | `heartbeat.interval.ms`, and how often owned partitions are confirmed |
/// | `lease_margin_ms` | 3/10 of the TTL | the self-fence pauses work once the last confirmation is older than `ttl - margin` |
/// | `rdkafka.<name>` | | any librdkafka setting, passed through (e.g. `rdkafka.security.protocol=ssl`); `partition.assignment.strategy` is `assignor`'s, `max.poll.interval.ms` is raised to at least the session timeout plus a second, and `group.instance.id` is refused (use `static_membership`) |
///
/// **Static membership** (KIP-345). Each subscription joins with
/// `group.instance.id` set to its [instance id](keyorder_core::SubscriptionBuilder::instance_id),
/// which must then be a name that survives a restart (a pod's name) and is
/// unique per group: ASCII letters, digits, `.`, `_` and `-`, at most 200
/// bytes. A static member does not leave the group when it closes or
/// crashes; its partitions stay with it, unread, until it comes back or its
/// session times out (the lease TTL), and the other members' partitions
/// never move meanwhile. A restarted member gets its partitions back without
/// a rebalance, but the broker gives them to it without asking the previous
/// incarnation, which may be stalled rather than dead, and not every broker
/// fences it: so a static member confirms its leases through a claim check
/// against the state topic at every heartbeat, and starts an assigned
/// partition's work only `ttl − margin + heartbeat` after its claim, when
/// every lease the previous incarnation confirmed before that claim has
/// ended. This wait applies to every assignment of a static member (with
/// the eager `range` assignor, every rebalance re-assigns every partition).
/// Each incarnation registers itself in the state topic when it first
/// joins; one that finds a newer registration under its instance id (at a
/// heartbeat, in every assignment before anything starts, or before
/// rejoining after a stall past the session timeout) fails for good,
/// naming the fix, instead of taking the partitions back. One that cannot
/// read the state topic starts nothing newly assigned, and fails for good
/// after 5 minutes without a check.
/// A member replaced by another with its instance id (librdkafka's fatal
/// `FENCED_INSTANCE_ID`) loses every partition and its subscription fails,
/// naming the fix. See BENCHMARKS.md for what this does to fail-over.
///
/// ```
/// use keyorder_kafka::{Assignor, KafkaConfig, StartAt};
/// let url = url::Url::parse("kafka://127.0.0.1:9092?partitions=4&assignor=range").unwrap();
/// let cfg = KafkaConfig::from_url(&url).unwrap();
/// assert_eq!(cfg.partitions, 4);
/// assert_eq!(cfg.assignor, Assignor::Range);
/// let url = url::Url::parse("kafka://127.0.0.1:9092?start=group:legacy-billing").unwrap();
/// assert_eq!(KafkaConfig::from_url(&url).unwrap().start, StartAt::Group("legacy-billing".into()));
/// assert!(KafkaConfig::from_url(&url::Url::parse("kafka://127.0.0.1?partitions=0").unwrap()).is_err());
/// ```
#[derive(Clone)]
pub struct KafkaConfig {
    /// `bootstrap.servers`.
    pub brokers: String,
    /// Partitions of topics this transport creates.
    pub partitions: i32,
    /// Replication factor of topics this transport creates.
    pub replication: i32,
    /// Create missing topics.
    pub create: bool,
    /// The partition assignor.
    pub assignor: Assignor,
    /// `fetch.wait.max.ms`.
    pub fetch_wait_ms: u32,
    /// Unfinished messages per partition before the partition is paused.
    pub max_unfinished: usize,
    /// Join as a static member (`group.instance.id`).
    pub static_membership: bool,
    /// Where a partition without saved progress starts.
    pub start: StartAt,
    /// Recreate empty state and dead-letter topics whose count is not the
    /// topic's.
    pub reset_layout: bool,
    /// librdkafka settings passed through.
    pub extra: BTreeMap<String, String>,
    /// The subscriptions' default lease (`lease_ttl_ms=`...), if the URL
    /// states one; a lease set on the builder wins.
    pub lease: Option<LeaseConfig>,
}

impl Default for KafkaConfig {
    fn default() -> Self {
        KafkaConfig {
            brokers: "127.0.0.1:9092".into(),
            partitions: 8,
            replication: 1,
            create: true,
            assignor: Assignor::CooperativeSticky,
            fetch_wait_ms: 10,
            max_unfinished: 512,
            static_membership: false,
            start: StartAt::Earliest,
            reset_layout: false,
            extra: BTreeMap::new(),
            lease: None,
        }
    }
}

fn bad(option: &str, value: &str, want: &str) -> Error {
    Error::Url(format!("kafka:// option `{option}={value}`: expected {want}"))
}

impl KafkaConfig {
    /// Reads a `kafka://host:port?options` URL.
    pub fn from_url(url: &url::Url) -> Result<Self> {
        let mut cfg = KafkaConfig::default();
        let host = url.host_str().unwrap_or("127.0.0.1");
        let mut brokers = vec![format!("{host}:{}", url.port().unwrap_or(9092))];
        let mut lease = LeaseOptions::default();
        for (k, v) in url.query_pairs() {
            let (k, v) = (k.as_ref(), v.as_ref());
            if lease.accept("kafka://", k, v)? {
                continue;
            }
            match k {
                "brokers" => brokers.extend(v.split(',').filter(|s| !s.is_empty()).map(str::to_owned)),
                "partitions" => {
                    cfg.partitions = v
                        .parse()
                        .ok()
                        .filter(|n| (1..=10_000).contains(n))
                        .ok_or_else(|| bad(k, v, "1..=10000"))?;
                }
                "replication" => {
                    cfg.replication = v
                        .parse()
                        .ok()
                        .filter(|n| (1..=32).contains(n))
                        .ok_or_else(|| bad(k, v, "1..=32"))?;
                }
                "create" => cfg.create = v.parse().map_err(|_| bad(k, v, "true or false"))?,
                "assignor" => {
                    cfg.assignor = match v {
                        "cooperative-sticky" => Assignor::CooperativeSticky,
                        "range" => Assignor::Range,
                        _ => return Err(bad(k, v, "cooperative-sticky or range")),
                    }
                }
                "fetch_wait_ms" => {
                    cfg.fetch_wait_ms = v
                        .parse()
                        .ok()
                        .filter(|n| *n <= 10_000)
                        .ok_or_else(|| bad(k, v, "0..=10000"))?;
                }
                "max_unfinished" => {
                    cfg.max_unfinished = v.parse().ok().filter(|n| (1..=4_096).contains(n)).ok_or_else(|| {
                        bad(
                            k,
                            v,
                            "1..=4096 (the partition's state record lists every unfinished offset)",
                        )
                    })?;
                }
                "static_membership" => {
                    cfg.static_membership = v.parse().map_err(|_| bad(k, v, "true or false"))?;
                }
                "reset_layout" => {
                    cfg.reset_layout = v.parse().map_err(|_| bad(k, v, "true or false"))?;
                }
                "start" => {
                    cfg.start = match v {
                        "earliest" => StartAt::Earliest,
                        "latest" => StartAt::Latest,
                        _ => match v.strip_prefix("group:") {
                            Some(g) if !g.is_empty() && g.len() <= 249 && !g.chars().any(char::is_control) => {
                                StartAt::Group(g.to_owned())
                            }
                            _ => return Err(bad(k, v, "earliest, latest or group:<group id>")),
                        },
                    }
                }
                other => match other.strip_prefix("rdkafka.") {
                    Some("group.instance.id") => {
                        return Err(Error::Url(
                            "kafka:// option `rdkafka.group.instance.id`: use `static_membership=true` instead \
                             (each subscription then joins with its own instance id; one id for every \
                             subscription of a process would fence its own members)"
                                .into(),
                        ))
                    }
                    Some(name) if !name.is_empty() => {
                        cfg.extra.insert(name.to_owned(), v.to_owned());
                    }
                    _ => {
                        return Err(Error::Url(format!(
                            "kafka:// has no option `{}` (options: brokers, partitions, replication, create, \
                             assignor, fetch_wait_ms, max_unfinished, static_membership, start, reset_layout, \
                             {LEASE_URL_OPTIONS}, rdkafka.<librdkafka setting>)",
                            keyorder_core::redact::text(other)
                        )))
                    }
                },
            }
        }
        cfg.lease = lease.lease("kafka://")?;
        cfg.brokers = brokers.join(",");
        check_extra(&cfg.extra)?;
        Ok(cfg)
    }
}

/// Shows no pass-through value (`rdkafka.sasl.password`, ...): only names.
impl std::fmt::Debug for KafkaConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let extra: Vec<String> = self.extra.keys().map(|k| format!("{k}=***")).collect();
        f.debug_struct("KafkaConfig")
            .field("brokers", &self.brokers)
            .field("partitions", &self.partitions)
            .field("replication", &self.replication)
            .field("create", &self.create)
            .field("assignor", &self.assignor)
            .field("fetch_wait_ms", &self.fetch_wait_ms)
            .field("max_unfinished", &self.max_unfinished)
            .field("static_membership", &self.static_membership)
            .field("start", &self.start)
            .field("reset_layout", &self.reset_layout)
            .field("extra", &extra)
            .field("lease", &self.lease)
            .finish()
    }
}

/// Checks every pass-through setting with librdkafka now, so that a bad
/// one fails here, naming the setting and what is wrong with it, never its
/// value or librdkafka's text (which quotes the value, or a part of it).
pub(crate) fn check_extra(extra: &BTreeMap<String, String>) -> Result<()> {
    for (k, v) in extra {
        let mut probe = rdkafka::ClientConfig::new();
        probe.set(k, v);
        if let Err(e) = probe.create_native_config() {
            let why = match e {
                rdkafka::error::KafkaError::ClientConfig(rdkafka::types::RDKafkaConfRes::RD_KAFKA_CONF_UNKNOWN, ..) => {
                    "librdkafka has no such setting"
                }
                rdkafka::error::KafkaError::ClientConfig(rdkafka::types::RDKafkaConfRes::RD_KAFKA_CONF_INVALID, ..) => {
                    "librdkafka refused its value"
                }
                _ => "librdkafka refused it",
            };
            return Err(Error::Url(format!(
                "kafka:// option `rdkafka.{}`: {why} (the value is not shown)",
                keyorder_core::redact::text(k)
            )));
        }
    }
    Ok(())
}

/// The librdkafka configuration every client of `cfg` starts from: the
/// brokers, quiet logs, no topic auto-creation, and the pass-through
/// settings.
pub(crate) fn base_config(cfg: &KafkaConfig) -> rdkafka::ClientConfig {
    let mut c = rdkafka::ClientConfig::new();
    // Topics are created only where keyorder means to (`ensure`, with
    // `create=true`): a producer's metadata request for a named topic
    // would otherwise let the broker create it, so that an operator's
    // read-only command created a category's topics (issue 37).
    c.set("bootstrap.servers", &cfg.brokers)
        .set("log_level", "3")
        .set("allow.auto.create.topics", "false");
    apply_extra(&mut c, cfg);
    c
}

/// Sets `cfg`'s pass-through settings on `c` (again, over settings made
/// since [`base_config`]).
pub(crate) fn apply_extra(c: &mut rdkafka::ClientConfig, cfg: &KafkaConfig) {
    for (k, v) in &cfg.extra {
        c.set(k, v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The lease options parse to the subscriptions' default lease and never
    /// reach librdkafka; a bad one is named; the unknown-option list names
    /// them.
    #[test]
    fn lease_options() {
        use std::time::Duration;
        let parse = |q: &str| KafkaConfig::from_url(&url::Url::parse(&format!("kafka://127.0.0.1:9092?{q}")).unwrap());
        assert_eq!(parse("partitions=2").unwrap().lease, None);
        let cfg = parse("lease_ttl_ms=12000&lease_margin_ms=2000").unwrap();
        assert_eq!(
            cfg.lease,
            Some(LeaseConfig {
                margin: Duration::from_secs(2),
                ..LeaseConfig::from_ttl(Duration::from_secs(12))
            })
        );
        assert!(cfg.extra.is_empty(), "{:?}", cfg.extra);
        let err = parse("lease_heartbeat_ms=soon").unwrap_err().to_string();
        assert!(
            err.contains("kafka://: lease_heartbeat_ms=soon: expected a whole number of milliseconds"),
            "{err}"
        );
        let err = parse("lease_ttl=1").unwrap_err().to_string();
        assert!(
            err.contains("lease_ttl_ms, lease_heartbeat_ms, lease_margin_ms"),
            "{err}"
        );
    }

    /// No pass-through value reaches `Debug` or an error (issue 37), not
    /// even the part of it librdkafka would quote.
    #[test]
    fn pass_through_values_stay_hidden() {
        let url = url::Url::parse("kafka://127.0.0.1:9092?rdkafka.sasl.password=s3cret-a").unwrap();
        let cfg = KafkaConfig::from_url(&url).unwrap();
        assert!(!format!("{cfg:?}").contains("s3cret"), "{cfg:?}");
        for bad in [
            "kafka://127.0.0.1:9092?rdkafka.sasl.passwrd=s3cret-b",
            "kafka://127.0.0.1:9092?rdkafka.session.timeout.ms=s3cret-c",
            // librdkafka quotes only the bad item of a list, or trims.
            "kafka://127.0.0.1:9092?rdkafka.debug=broker,s3cretTok",
            "kafka://127.0.0.1:9092?rdkafka.security.protocol=%20s3cretLead",
        ] {
            let err = KafkaConfig::from_url(&url::Url::parse(bad).unwrap())
                .unwrap_err()
                .to_string();
            assert!(!err.contains("s3cret"), "{err}");
            assert!(err.contains("`rdkafka."), "{err}");
        }
    }
}
