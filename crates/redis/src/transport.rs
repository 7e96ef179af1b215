//! [`RedisTransport`]: connecting (`from_url`), what it can do with each
//! layout, and `impl Transport`, which opens publishers, sources and the
//! operator's admin over one shared [`Conn`].

use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;
use keyorder_core::{Admin, Capabilities, Error, Result, SourceSpec, Transport, TransportPublisher, TransportSource};
use redis::aio::ConnectionManager;

use crate::admin::RedisAdmin;
use crate::batch;
use crate::config::{Layout, RedisConfig};
use crate::conn::{manager, Conn};
use crate::names::Names;
use crate::plain::PlainSource;
use crate::publisher::RedisPublisher;
use crate::source::Source;

/// What the Redis transport can do with the partitioned layout (the default).
pub const CAPABILITIES: Capabilities = Capabilities {
    cross_instance_affinity: true,
    fencing: true,
    self_fencing: true,
    crash_reclaim: true,
    halt_on_poison: true,
    park_and_release: true,
    correlated_ownership: true,
    dynamic_partitions: true,
    remap_window: false,
    publish_fencing: true,
    multi_process: true,
    persistent: false,
};

/// What the Redis transport can do with `layout=single`: one stream per
/// category read by a plain competing-consumer group (the benchmark baseline).
pub const SINGLE_CAPABILITIES: Capabilities = Capabilities {
    cross_instance_affinity: false,
    fencing: false,
    self_fencing: false,
    crash_reclaim: false,
    halt_on_poison: false,
    park_and_release: true,
    correlated_ownership: false,
    dynamic_partitions: false,
    remap_window: false,
    publish_fencing: true,
    multi_process: true,
    persistent: false,
};

/// The Redis Streams transport (`redis://`).
#[derive(Clone)]
pub struct RedisTransport {
    c: Conn,
}

impl fmt::Debug for RedisTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisTransport")
            .field("layout", &self.c.cfg.layout)
            .finish_non_exhaustive()
    }
}

impl RedisTransport {
    /// Connects with `cfg`; fails when the server does not answer.
    pub async fn connect(cfg: RedisConfig) -> Result<Self> {
        let client = Self::client(&cfg)?;
        let conn = manager(&client, &cfg, Some(cfg.response_timeout)).await?;
        Self::check_eviction(&mut conn.clone(), &cfg).await?;
        Ok(RedisTransport {
            c: Conn {
                cfg: Arc::new(cfg),
                client,
                batcher: batch::Batcher::start(conn.clone()),
                conn,
            },
        })
    }

    /// The client for `cfg`: with TLS, the CA certificates of `ca_file=` (or
    /// the system's roots) verify the server.
    fn client(cfg: &RedisConfig) -> Result<redis::Client> {
        let bad = |e: redis::RedisError| Error::Url(format!("redis: {}", keyorder_core::redact::text(&e.to_string())));
        #[cfg(feature = "tls")]
        if cfg.server.starts_with("rediss:") {
            // redis-rs builds its TLS configuration from the process's
            // rustls provider: install ring's unless the application chose one.
            let _ = rustls::crypto::ring::default_provider().install_default();
            if let Some(path) = &cfg.ca_file {
                let pem = std::fs::read(path)
                    .map_err(|e| Error::Config(format!("redis: cannot read ca_file {}: {e}", path.display())))?;
                let certs = redis::TlsCertificates {
                    client_tls: None,
                    root_cert: Some(pem),
                };
                return redis::Client::build_with_tls(cfg.server.as_str(), certs).map_err(bad);
            }
        }
        redis::Client::open(cfg.server.as_str()).map_err(bad)
    }

    /// Connects to the server a `redis://` URL names (options in its query
    /// string; see [`RedisConfig::from_url`]).
    pub async fn from_url(url: &url::Url) -> Result<Self> {
        Self::connect(RedisConfig::from_url(url)?).await
    }

    /// Refuses a server that may evict keys: an evicted lease or generation
    /// counter would break the fence (the contract's durability rule). A
    /// server that does not answer `CONFIG GET` (some managed services) is
    /// trusted, with a warning.
    async fn check_eviction(conn: &mut ConnectionManager, cfg: &RedisConfig) -> Result<()> {
        let policy: redis::RedisResult<Vec<String>> = redis::cmd("CONFIG")
            .arg("GET")
            .arg("maxmemory-policy")
            .query_async(conn)
            .await;
        match policy {
            Ok(v) => match v.get(1).map(String::as_str) {
                Some("noeviction") | None => Ok(()),
                Some(other) => Err(Error::Config(format!(
                    "redis at {}: maxmemory-policy is `{other}`, which can evict leases and generation counters and \
                     break the fence; set `maxmemory-policy noeviction` (CONFIG SET maxmemory-policy noeviction, \
                     and in redis.conf)",
                    cfg.display
                ))),
            },
            Err(e) => {
                tracing::warn!(error = %e, "redis: cannot read maxmemory-policy; assuming noeviction");
                Ok(())
            }
        }
    }

    /// The configuration in use.
    pub fn config(&self) -> &RedisConfig {
        &self.c.cfg
    }
}

#[async_trait]
impl Transport for RedisTransport {
    fn name(&self) -> &str {
        "redis"
    }

    fn capabilities(&self) -> Capabilities {
        match self.c.cfg.layout {
            Layout::Partitioned => CAPABILITIES,
            Layout::Single => SINGLE_CAPABILITIES,
        }
    }

    fn affinity_fix(&self) -> String {
        "use the partitioned layout (the default; remove `layout=single` from the redis:// URL), which gives each \
         key its own stream owned by one instance"
            .into()
    }

    async fn publisher(&self, category: &str) -> Result<Arc<dyn TransportPublisher>> {
        Ok(Arc::new(RedisPublisher {
            t: self.c.clone(),
            names: Names::new(category)?,
        }))
    }

    async fn open(&self, spec: &SourceSpec) -> Result<Box<dyn TransportSource>> {
        if spec.ordered && self.c.cfg.layout == Layout::Single {
            return Err(Error::Config(format!(
                "an ordered subscription needs cross-instance affinity: {}",
                self.affinity_fix()
            )));
        }
        if spec.ordered {
            Ok(Box::new(Source::open(self.c.clone(), spec.clone()).await?))
        } else {
            Ok(Box::new(PlainSource::open(self.c.clone(), spec.clone()).await?))
        }
    }

    fn admin(&self) -> Arc<dyn Admin> {
        Arc::new(RedisAdmin { t: self.c.clone() })
    }

    fn default_lease(&self) -> Option<keyorder_core::LeaseConfig> {
        self.c.cfg.lease
    }
}
