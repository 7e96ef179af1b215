//! The `postgres://` URL's options, parsed into [`PgConfig`]: keyorder's own
//! (`schema`, `slots`, `pool`, `retention_batch`, `pooler`, `direct`,
//! `layout`, `migrate`, and the lease's `lease_ttl_ms`,
//! `lease_heartbeat_ms`, `lease_margin_ms`) and the driver's, on an allow-list; a refusal names
//! the fix.

use keyorder_core::lease::{LeaseOptions, LEASE_URL_OPTIONS};
use keyorder_core::{Error, LeaseConfig, Result};

use crate::shared;

/// Default slot count of a queue.
pub const DEFAULT_SLOTS: u32 = 16;

/// Parses a URL option that must lie in `range`.
fn in_range(name: &str, value: &str, range: std::ops::RangeInclusive<u32>) -> Result<u32> {
    value
        .parse()
        .ok()
        .filter(|n| range.contains(n))
        .ok_or_else(|| Error::Url(format!("{name}={value}: expected {}..={}", range.start(), range.end())))
}

/// How a queue is laid out (`?layout=`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Layout {
    /// Hash slots with fenced single owners: per-key order (the default).
    #[default]
    Slots,
    /// One table read by plain `FOR UPDATE SKIP LOCKED` competing consumers:
    /// no per-key order, no halt (the benchmark baseline; ordered
    /// subscriptions are refused).
    Plain,
}

/// Configuration of the PostgreSQL transport.
#[derive(Clone)]
pub struct PgConfig {
    /// The connection URL (without keyorder's own query options).
    pub url: String,
    /// The schema keyorder's tables live in.
    pub schema: String,
    /// Slots per queue (fixed once a queue exists).
    pub slots: u32,
    /// Connections in the pool (`?pool=`, default 8). Settlements use up to
    /// [`SETTLEMENT_CONNECTIONS`](crate::SETTLEMENT_CONNECTIONS) more of their own, and each ordered
    /// subscription one more for its lease renewals.
    pub max_connections: u32,
    /// Run [`PgTransport::migrate`](crate::PgTransport::migrate) when connecting (`?migrate=true`).
    pub migrate: bool,
    /// Events deleted per owned slot and heartbeat once every group of the
    /// queue passed them (`?retention_batch=`, 0 keeps everything).
    pub retention_batch: u32,
    /// `url` is a transaction-mode connection pooler such as PgBouncer
    /// (`?pooler=transaction`; default `none`): every statement runs in its
    /// own transaction as an unnamed statement, and nothing keeps session
    /// state on the pooled connections.
    pub pooled: bool,
    /// A direct connection to the server (`?direct=<url-encoded URL>`), for
    /// what a transaction pooler cannot carry: `LISTEN` and
    /// [`PgTransport::migrate`](crate::PgTransport::migrate). Required with `pooler=transaction`;
    /// defaults to `url` otherwise.
    pub direct: Option<String>,
    /// The queue layout (`?layout=slots|plain`, default `slots`).
    pub layout: Layout,
    /// The subscriptions' default lease (`?lease_ttl_ms=` 1000..=86400000,
    /// optionally `lease_heartbeat_ms=` and `lease_margin_ms=`, derived
    /// from the TTL by [`LeaseConfig::from_ttl`] when not given): a slot
    /// lease row expires this long after its owner's last renewal. A lease
    /// set on the builder wins. `None`: [`LeaseConfig::default`].
    pub lease: Option<LeaseConfig>,
}

/// Shows the URLs without their passwords or option values.
impl std::fmt::Debug for PgConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgConfig")
            .field("url", &keyorder_core::redact::url(&self.url))
            .field("schema", &self.schema)
            .field("slots", &self.slots)
            .field("max_connections", &self.max_connections)
            .field("migrate", &self.migrate)
            .field("retention_batch", &self.retention_batch)
            .field("pooled", &self.pooled)
            .field("direct", &self.direct.as_deref().map(keyorder_core::redact::url))
            .field("layout", &self.layout)
            .field("lease", &self.lease)
            .finish()
    }
}

impl PgConfig {
    /// Parses `postgres://user@host:port/db?schema=keyorder&slots=16&pool=8&migrate=true`
    /// (and `pooler=transaction&direct=...` behind PgBouncer); the other
    /// query parameters go to the driver.
    pub fn from_url(url: &url::Url) -> Result<Self> {
        let mut cfg = PgConfig {
            url: String::new(),
            schema: "keyorder".into(),
            slots: DEFAULT_SLOTS,
            max_connections: 8,
            migrate: false,
            retention_batch: 1000,
            pooled: false,
            direct: None,
            layout: Layout::Slots,
            lease: None,
        };
        let mut lease = LeaseOptions::default();
        let mut rest = url.clone();
        rest.set_query(None);
        let mut driver = Vec::new();
        for (k, v) in url.query_pairs() {
            if lease.accept("postgres", &k, &v)? {
                continue;
            }
            match &*k {
                "schema" => cfg.schema = v.into_owned(),
                "slots" => cfg.slots = in_range("slots", &v, 1..=4096)?,
                "pool" => cfg.max_connections = in_range("pool", &v, 1..=256)?,
                "retention_batch" => {
                    cfg.retention_batch = v
                        .parse()
                        .map_err(|_| Error::Url(format!("retention_batch={v}: expected a count")))?
                }
                "pooler" => {
                    cfg.pooled = match &*v {
                        "transaction" => true,
                        "none" => false,
                        _ => return Err(Error::Url(format!("pooler={v}: expected transaction or none"))),
                    }
                }
                "direct" => {
                    let direct = url::Url::parse(&v).map_err(|e| {
                        Error::Url(format!(
                            "direct=: expected a url-encoded postgres:// URL of the server ({e})"
                        ))
                    })?;
                    if !matches!(direct.scheme(), "postgres" | "postgresql") {
                        return Err(Error::Url("direct=: expected a postgres:// URL".into()));
                    }
                    // Handed to the driver as it is: its options too.
                    shared::check_driver_url(&direct).map_err(|e| Error::Url(format!("direct=: {e}")))?;
                    cfg.direct = Some(v.into_owned());
                }
                "layout" => {
                    cfg.layout = match &*v {
                        "slots" => Layout::Slots,
                        "plain" => Layout::Plain,
                        _ => return Err(Error::Url(format!("layout={v}: expected slots or plain"))),
                    }
                }
                "migrate" => {
                    cfg.migrate = v
                        .parse()
                        .map_err(|_| Error::Url(format!("migrate={v}: expected true or false")))?
                }
                // The driver's own options, on an allow-list: any other
                // is refused, never forwarded (the driver logs an option it
                // does not know at WARN, value and all).
                k if shared::is_driver_option(k) => {
                    shared::check_ssl_mode(k, &v)?;
                    driver.push((k.to_owned(), v.into_owned()))
                }
                k => {
                    return Err(Error::Url(format!(
                        "postgres: unknown URL option `{}` (keyorder's: schema, slots, pool, retention_batch, \
                         pooler, direct, layout, migrate, {LEASE_URL_OPTIONS}; the driver's: {})",
                        keyorder_core::redact::text(k),
                        shared::DRIVER_OPTIONS.join(", ")
                    )))
                }
            }
        }
        if !driver.is_empty() {
            rest.query_pairs_mut().extend_pairs(driver);
        }
        cfg.lease = lease.lease("postgres")?;
        shared::check_schema(&cfg.schema)?;
        if cfg.pooled && cfg.direct.is_none() {
            return Err(Error::Url(
                "pooler=transaction needs a direct connection for LISTEN and migrations: add \
                 direct=<url-encoded postgres:// URL of the server itself>"
                    .into(),
            ));
        }
        cfg.url = rest.to_string();
        Ok(cfg)
    }
}

#[cfg(test)]
mod tests {
    use super::PgConfig;

    /// URL options are on an allow-list, and no password or option value
    /// reaches `Debug` or an error (issue 37: `sslpassword=`, unknown to the
    /// driver, was forwarded and logged at WARN with its value).
    #[test]
    fn secrets_stay_out_of_debug_and_errors() {
        let url = |s: &str| url::Url::parse(s).unwrap();
        let cfg = PgConfig::from_url(&url("postgres://app:s3cret-a@db:5432/test?sslmode=require")).unwrap();
        assert!(!format!("{cfg:?}").contains("s3cret"), "{cfg:?}");
        let err = PgConfig::from_url(&url("postgres://app@db:5432/test?sslpassword=s3cret-b"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("`sslpassword`") && !err.contains("s3cret"), "{err}");
        let direct = "postgres%3A%2F%2Fapp%3As3cret-c%40db%3A5432%2Ftest";
        let cfg = PgConfig::from_url(&url(&format!(
            "postgres://app:s3cret-c@db:6432/test?pooler=transaction&direct={direct}"
        )))
        .unwrap();
        assert!(!format!("{cfg:?}").contains("s3cret"), "{cfg:?}");
        // The direct URL goes to the driver too: its options are checked.
        let direct = "postgres%3A%2F%2Fapp%40db%2Ftest%3Fsslpassword%3Ds3cret-d";
        let err = PgConfig::from_url(&url(&format!(
            "postgres://app@db:6432/test?pooler=transaction&direct={direct}"
        )))
        .unwrap_err()
        .to_string();
        assert!(err.contains("`sslpassword`") && !err.contains("s3cret"), "{err}");
        // The driver's other spellings and server settings pass.
        PgConfig::from_url(&url(
            "postgres://app@db/test?ssl-mode=require&options[statement_timeout]=5s",
        ))
        .unwrap();
    }

    /// The lease options parse to the subscriptions' default lease, and
    /// never reach the driver; a bad one is named; the unknown-option list
    /// names them.
    #[test]
    fn lease_options() {
        use keyorder_core::LeaseConfig;
        use std::time::Duration;
        let parse = |q: &str| PgConfig::from_url(&url::Url::parse(&format!("postgres://app@db/test?{q}")).unwrap());
        assert_eq!(parse("migrate=true").unwrap().lease, None);
        let cfg = parse("lease_ttl_ms=5000&lease_heartbeat_ms=500").unwrap();
        assert_eq!(
            cfg.lease,
            Some(LeaseConfig {
                heartbeat: Duration::from_millis(500),
                ..LeaseConfig::from_ttl(Duration::from_secs(5))
            })
        );
        assert!(!cfg.url.contains("lease"), "{}", cfg.url);
        let err = parse("lease_margin_ms=-1").unwrap_err().to_string();
        assert!(
            err.contains("postgres: lease_margin_ms=-1: expected a whole number of milliseconds"),
            "{err}"
        );
        let err = parse("lease=5").unwrap_err().to_string();
        assert!(
            err.contains("lease_ttl_ms, lease_heartbeat_ms, lease_margin_ms"),
            "{err}"
        );
    }

    /// `sslmode=verify-ca` is refused wherever a URL reaches the driver
    /// (issue 37: the driver trusts the public roots beside `sslrootcert=`
    /// and checks no host name in that mode).
    #[test]
    fn verify_ca_is_refused() {
        for raw in [
            "postgres://u@h/db?sslmode=verify-ca",
            "postgres://u@h/db?ssl-mode=VERIFY-CA&sslrootcert=/ca.pem",
        ] {
            let url = url::Url::parse(raw).unwrap();
            let err = crate::shared::check_driver_url(&url).unwrap_err().to_string();
            assert!(err.contains("verify-full"), "{err}");
            let err = PgConfig::from_url(&url).unwrap_err().to_string();
            assert!(err.contains("verify-full"), "{err}");
        }
        let ok = url::Url::parse("postgres://u@h/db?sslmode=verify-full&sslrootcert=/ca.pem").unwrap();
        assert!(crate::shared::check_driver_url(&ok).is_ok() && PgConfig::from_url(&ok).is_ok());
    }
}
