//! Configuration from a `redis://` URL.

use std::time::Duration;

use keyorder_core::lease::{LeaseOptions, LEASE_URL_OPTIONS};
use keyorder_core::{Error, LeaseConfig, Result};

/// How a category is laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// A stream per key, owned through a fenced lease (ordered; the default).
    Partitioned,
    /// One stream per category read by a plain competing-consumer group: no
    /// per-key order across instances (the benchmark baseline).
    Single,
}

/// Configuration of the Redis transport.
///
/// URL options (query string), all optional:
///
/// | Option | Default | Meaning |
/// |---|---|---|
/// | `layout` | `partitioned` | `partitioned` or `single` (see [`Layout`]) |
/// | `response_timeout_ms` | `2000` | per-command response timeout |
/// | `reap_idle_ms` | `3600000` | remove a drained partition idle this long (0: never) |
/// | `partition_warn` | `2000` | warn when a category has more live partitions |
/// | `ca_file` | the system's roots | `rediss://` only: a PEM file of the CA certificates to trust |
/// | `lease_ttl_ms` | `10000` | the subscriptions' lease TTL (1000..=86400000): a partition's lease key expires this long after its owner's last renewal; the heartbeat and margin are derived from it ([`LeaseConfig::from_ttl`]) unless given |
/// | `lease_heartbeat_ms` | a fifth of the TTL, at most 5000 | how often the owner renews its leases |
/// | `lease_margin_ms` | 3/10 of the TTL | the self-fence pauses work once the last renewal is older than `ttl - margin` |
///
/// The lease options set the default of every subscription on this
/// transport; a lease set on the builder
/// ([`SubscriptionBuilder::lease`](keyorder_core::SubscriptionBuilder::lease)) wins.
///
/// `rediss://` connects with TLS and verifies the server's certificate and
/// name; it needs the `tls` feature (part of keyorder's `all-adapters`) and
/// is refused without it, never downgraded to plaintext.
///
/// ```
/// let url = url::Url::parse("redis://127.0.0.1:6379/?reap_idle_ms=60000").unwrap();
/// let cfg = keyorder_redis::RedisConfig::from_url(&url).unwrap();
/// assert_eq!(cfg.reap_idle, std::time::Duration::from_secs(60));
/// ```
#[derive(Clone)]
pub struct RedisConfig {
    /// The server URL without keyorder's options.
    pub server: String,
    /// The server for messages (no password).
    pub display: String,
    /// The layout.
    pub layout: Layout,
    /// Per-command response timeout.
    pub response_timeout: Duration,
    /// Idle time after which a drained partition is removed (zero: never).
    pub reap_idle: Duration,
    /// Live partitions per category above which a warning fires.
    pub partition_warn: usize,
    /// CA certificates to trust (`ca_file=`, `rediss://` only); `None`: the
    /// system's roots.
    pub ca_file: Option<std::path::PathBuf>,
    /// The subscriptions' default lease (`lease_ttl_ms=`...), if the URL
    /// states one.
    pub lease: Option<LeaseConfig>,
}

impl RedisConfig {
    /// What to check when a connection fails.
    pub(crate) fn hint(&self) -> &'static str {
        if self.server.starts_with("rediss:") {
            "is it running, does that port serve TLS (a plaintext port never answers the TLS handshake), and did \
             the CA of ca_file= (or a system root) sign its certificate?"
        } else {
            "is it running?"
        }
    }
}

/// Refuses `rediss://` in a build without TLS, and `ca_file=` without
/// `rediss://`: never a plaintext connection where TLS was asked for.
fn check_tls(scheme: &str, ca_file: bool, tls_built: bool) -> Result<()> {
    match scheme {
        "rediss" if !tls_built => Err(Error::Config(
            "redis: rediss:// needs TLS, and this build has none: enable keyorder-redis's `tls` feature (keyorder's \
             `tls`, part of `all-adapters`); refusing to connect in plaintext"
                .into(),
        )),
        "redis" if ca_file => Err(Error::Url(
            "redis: ca_file= is for TLS: use rediss:// (redis:// is plaintext)".into(),
        )),
        _ => Ok(()),
    }
}

impl RedisConfig {
    /// Reads the configuration from a `redis://` URL; unknown options are an
    /// error that lists the known ones.
    pub fn from_url(url: &url::Url) -> Result<Self> {
        let mut cfg = RedisConfig {
            server: String::new(),
            display: format!(
                "{}:{}",
                url.host_str().unwrap_or("127.0.0.1"),
                url.port().unwrap_or(6379)
            ),
            layout: Layout::Partitioned,
            response_timeout: Duration::from_secs(2),
            reap_idle: Duration::from_secs(3600),
            partition_warn: 2000,
            ca_file: None,
            lease: None,
        };
        let mut lease = LeaseOptions::default();
        let num = |k: &str, v: &str| -> Result<u64> {
            v.parse()
                .map_err(|_| Error::Url(format!("redis: {k}={v}: expected a whole number")))
        };
        let mut rest = Vec::new();
        for (k, v) in url.query_pairs() {
            if lease.accept("redis", &k, &v)? {
                continue;
            }
            match k.as_ref() {
                "layout" => {
                    cfg.layout = match v.as_ref() {
                        "partitioned" => Layout::Partitioned,
                        "single" => Layout::Single,
                        other => {
                            return Err(Error::Url(format!(
                                "redis: layout={other}: expected `partitioned` or `single`"
                            )))
                        }
                    }
                }
                "response_timeout_ms" => {
                    cfg.response_timeout = Duration::from_millis(num(&k, &v)?.max(50));
                }
                "reap_idle_ms" => cfg.reap_idle = Duration::from_millis(num(&k, &v)?),
                "partition_warn" => cfg.partition_warn = num(&k, &v)? as usize,
                "ca_file" => cfg.ca_file = Some(std::path::PathBuf::from(v.as_ref())),
                "protocol" | "db" => rest.push((k.into_owned(), v.into_owned())),
                other => {
                    return Err(Error::Url(format!(
                        "redis: unknown option `{}` (known: layout, response_timeout_ms, reap_idle_ms, \
                         partition_warn, ca_file, {LEASE_URL_OPTIONS}, protocol, db)",
                        keyorder_core::redact::text(other)
                    )))
                }
            }
        }
        cfg.lease = lease.lease("redis")?;
        check_tls(url.scheme(), cfg.ca_file.is_some(), cfg!(feature = "tls"))?;
        // redis-rs reads `#insecure` as "skip certificate verification" when
        // any crate of the build enables its insecure feature: refused.
        if url.fragment().is_some() {
            return Err(Error::Url(
                "redis: a URL fragment (`#...`) is refused: `#insecure` would turn certificate verification off".into(),
            ));
        }
        let mut server = url.clone();
        server.set_query(None);
        if !rest.is_empty() {
            server.query_pairs_mut().extend_pairs(rest);
        }
        cfg.server = server.to_string();
        Ok(cfg)
    }
}

/// Shows the server URL without its password or option values.
impl std::fmt::Debug for RedisConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisConfig")
            .field("server", &keyorder_core::redact::url(&self.server))
            .field("display", &self.display)
            .field("layout", &self.layout)
            .field("response_timeout", &self.response_timeout)
            .field("reap_idle", &self.reap_idle)
            .field("partition_warn", &self.partition_warn)
            .field("ca_file", &self.ca_file)
            .field("lease", &self.lease)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The password stays out of `Debug` (issue 37).
    #[test]
    fn debug_hides_the_password() {
        let cfg = RedisConfig::from_url(&url::Url::parse("redis://:s3cret@127.0.0.1:6379/0").unwrap()).unwrap();
        assert!(!format!("{cfg:?}").contains("s3cret"), "{cfg:?}");
    }

    /// TLS asked for is never downgraded (issue 37).
    #[test]
    fn tls_is_refused_without_a_backend_and_ca_file_needs_rediss() {
        let err = check_tls("rediss", false, false).unwrap_err().to_string();
        assert!(err.contains("`tls` feature") && err.contains("refusing"), "{err}");
        assert!(check_tls("rediss", true, true).is_ok() && check_tls("redis", false, false).is_ok());
        let url = url::Url::parse("redis://127.0.0.1:6379/?ca_file=/tmp/ca.pem").unwrap();
        let err = RedisConfig::from_url(&url).unwrap_err().to_string();
        assert!(err.contains("use rediss://"), "{err}");
    }

    /// The lease options parse to the subscriptions' default lease; a bad
    /// one is named; the unknown-option list names them.
    #[test]
    fn lease_options() {
        let parse = |q: &str| RedisConfig::from_url(&url::Url::parse(&format!("redis://127.0.0.1:6379/?{q}")).unwrap());
        assert_eq!(parse("").unwrap().lease, None);
        assert_eq!(
            parse("lease_ttl_ms=3000").unwrap().lease,
            Some(LeaseConfig::from_ttl(Duration::from_secs(3)))
        );
        let err = parse("lease_ttl_ms=3s").unwrap_err().to_string();
        assert!(
            err.contains("redis: lease_ttl_ms=3s: expected a whole number of milliseconds"),
            "{err}"
        );
        let err = parse("lease_ttl=3000").unwrap_err().to_string();
        assert!(
            err.contains("lease_ttl_ms, lease_heartbeat_ms, lease_margin_ms"),
            "{err}"
        );
    }

    /// `#insecure` (or any fragment) never reaches the client.
    #[test]
    fn a_fragment_is_refused() {
        let url = url::Url::parse("rediss://127.0.0.1:6390/#insecure").unwrap();
        let err = RedisConfig::from_url(&url).unwrap_err().to_string();
        assert!(err.contains("#insecure"), "{err}");
    }
}
