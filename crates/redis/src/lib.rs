#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]

mod admin;
mod batch;
mod config;
mod names;
mod plain;
mod scripts;
mod settle;
mod source;
mod wake;

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use keyorder_core::{
    Admin, Capabilities, Error, Message, OrderingKey, PublishFence, Result, SourceSpec, Transport, TransportPublisher,
    TransportSource,
};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::Value;

pub use crate::config::{Layout, RedisConfig};
pub use crate::names::Names;
pub use redis;

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
    multi_process: true,
    persistent: false,
};

/// Stored entries (index members, hash fields, set members) that are text,
/// in order; any other (written by hand or by a foreign client: no keyorder
/// writes one) is skipped, counted in `keyorder_redis_unreadable_entries_total`
/// and reported once per process, so one bad entry never stops discovery,
/// upkeep or an operator's command.
pub(crate) fn texts(raw: Vec<Vec<u8>>, what: &str) -> Vec<String> {
    raw.into_iter().filter_map(|b| text_of(b, what)).collect()
}

/// The pairs of a hash read with `HGETALL` whose field and value are text
/// (see [`texts`]).
pub(crate) fn text_pairs(raw: Vec<(Vec<u8>, Vec<u8>)>, what: &str) -> Vec<(String, String)> {
    raw.into_iter()
        .filter_map(|(k, v)| Some((text_of(k, what)?, text_of(v, what)?)))
        .collect()
}

fn text_of(b: Vec<u8>, what: &str) -> Option<String> {
    static REPORTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    match String::from_utf8(b) {
        Ok(t) => Some(t),
        Err(_) => {
            metrics::counter!("keyorder_redis_unreadable_entries_total").increment(1);
            if !REPORTED.swap(true, std::sync::atomic::Ordering::SeqCst) {
                tracing::warn!(what, "redis: skipped a stored entry that is not text (not written by keyorder); counted in keyorder_redis_unreadable_entries_total, reported once");
            }
            None
        }
    }
}

pub(crate) fn broker(e: redis::RedisError) -> Error {
    let text = e.to_string();
    if text.contains(scripts::GROUP_REMOVED) {
        return Error::Config(
            "redis: this member's consumer group was removed by an operator (`keyorder groups remove`) while it ran; \
             it stops: subscribe again to start the group afresh"
                .into(),
        );
    }
    Error::Broker(format!("redis: {}", scrub(&text)))
}

/// Redis names keys in its error texts in single quotes (`No such key
/// '{c}:{k}'`); a key name carries an ordering key, which is user data and
/// may itself hold quotes, so everything from the first quote to the last
/// is replaced by one label before the text reaches a log or an [`Error`].
pub(crate) fn scrub(text: &str) -> String {
    let Some(first) = text.find('\'') else {
        return text.to_owned();
    };
    let last = text.rfind('\'').filter(|&l| l > first).unwrap_or(text.len());
    let inner = &text[first + 1..last];
    let rest = text.get(last + 1..).unwrap_or("");
    format!("{}'{}'{rest}", &text[..first], keyorder_core::key::label(inner))
}

/// Records `group` in the category's group registry, before the group
/// reads anything, with this member's first heartbeat in the same step
/// (see [`scripts::REGISTER`]): trimming and reaping keep what a registered
/// group has not passed. The entry names the sorted set the group's
/// members heartbeat in. Idempotent.
pub(crate) async fn register_group(
    t: &RedisTransport,
    names: &Names,
    group: &str,
    members: &str,
    owner: &str,
    ttl: Duration,
) -> Result<()> {
    let _: i64 = scripts::REGISTER
        .key(names.groups())
        .key(members)
        .key(names.keyless())
        .arg(names.category())
        .arg(group)
        .arg(owner)
        .arg(ttl.as_millis() as u64)
        .invoke_async(&mut t.conn.clone())
        .await
        .map_err(broker)?;
    Ok(())
}

/// The Redis Streams transport (`redis://`).
#[derive(Clone)]
pub struct RedisTransport {
    pub(crate) cfg: Arc<RedisConfig>,
    pub(crate) client: redis::Client,
    pub(crate) conn: ConnectionManager,
    pub(crate) batcher: batch::Batcher,
}

impl fmt::Debug for RedisTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisTransport")
            .field("layout", &self.cfg.layout)
            .finish_non_exhaustive()
    }
}

impl RedisTransport {
    /// Connects with `cfg`; fails when the server does not answer.
    pub async fn connect(cfg: RedisConfig) -> Result<Self> {
        let client = Self::client(&cfg)?;
        let conn = Self::manager(&client, &cfg, Some(cfg.response_timeout)).await?;
        Self::check_eviction(&mut conn.clone(), &cfg).await?;
        Ok(RedisTransport {
            cfg: Arc::new(cfg),
            client,
            batcher: batch::Batcher::start(conn.clone()),
            conn,
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

    /// A reconnecting connection with `timeout` per response.
    pub(crate) async fn manager(
        client: &redis::Client,
        cfg: &RedisConfig,
        timeout: Option<std::time::Duration>,
    ) -> Result<ConnectionManager> {
        let config = ConnectionManagerConfig::new()
            .set_response_timeout(timeout)
            .set_connection_timeout(Some(cfg.response_timeout))
            .set_number_of_retries(2)
            .set_max_delay(std::time::Duration::from_secs(1));
        tokio::time::timeout(
            cfg.response_timeout * 4,
            ConnectionManager::new_with_config(client.clone(), config),
        )
        .await
        .map_err(|_| Error::Broker(format!("redis: no answer from {} ({})", cfg.display, cfg.hint())))?
        .map_err(|e| {
            let hint = match e.kind() {
                redis::ErrorKind::AuthenticationFailed => "check the password (and the user name)",
                _ => cfg.hint(),
            };
            Error::Broker(format!("redis: cannot connect to {}: {e} ({hint})", cfg.display))
        })
    }

    /// The configuration in use.
    pub fn config(&self) -> &RedisConfig {
        &self.cfg
    }
}

#[async_trait]
impl Transport for RedisTransport {
    fn name(&self) -> &str {
        "redis"
    }

    fn capabilities(&self) -> Capabilities {
        match self.cfg.layout {
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
            t: self.clone(),
            names: Names::new(category)?,
        }))
    }

    async fn open(&self, spec: &SourceSpec) -> Result<Box<dyn TransportSource>> {
        if spec.ordered && self.cfg.layout == Layout::Single {
            return Err(Error::Config(format!(
                "an ordered subscription needs cross-instance affinity: {}",
                self.affinity_fix()
            )));
        }
        if spec.ordered {
            Ok(Box::new(source::Source::open(self.clone(), spec.clone()).await?))
        } else {
            Ok(Box::new(plain::PlainSource::open(self.clone(), spec.clone()).await?))
        }
    }

    fn admin(&self) -> Arc<dyn Admin> {
        Arc::new(admin::RedisAdmin { t: self.clone() })
    }
}

/// The stream fields of a message (the key is the partition, or the `k`
/// field in the single layout).
pub(crate) fn fields(message: &Message, with_key: bool) -> Result<Vec<Vec<u8>>> {
    let headers = serde_json::to_string(message.headers()).map_err(|e| Error::Broker(e.to_string()))?;
    let mut out: Vec<Vec<u8>> = vec![
        b"id".to_vec(),
        message.id().as_bytes().to_vec(),
        b"h".to_vec(),
        headers.into_bytes(),
        b"p".to_vec(),
        message.payload().to_vec(),
    ];
    if let Some(c) = message.correlation_id() {
        out.push(b"c".to_vec());
        out.push(c.as_bytes().to_vec());
    }
    if with_key {
        if let Some(k) = message.key() {
            out.push(b"k".to_vec());
            out.push(k.as_str().as_bytes().to_vec());
        }
    }
    Ok(out)
}

/// One stream entry: its id and fields (`None` when the entry was deleted
/// while pending).
pub(crate) type Entry = (String, Option<BTreeMap<String, Vec<u8>>>);

fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        Value::Int(i) => Some(i.to_string()),
        _ => None,
    }
}

fn bytes(v: &Value) -> Option<Vec<u8>> {
    match v {
        Value::BulkString(b) => Some(b.clone()),
        Value::SimpleString(s) => Some(s.as_bytes().to_vec()),
        Value::Int(i) => Some(i.to_string().into_bytes()),
        _ => None,
    }
}

/// Parses `[[id, [field, value, ...]], ...]`.
pub(crate) fn entries(v: &Value) -> Vec<Entry> {
    let Value::Array(items) = v else { return Vec::new() };
    items
        .iter()
        .filter_map(|item| {
            let Value::Array(pair) = item else { return None };
            let id = text(pair.first()?)?;
            let fields = match pair.get(1) {
                Some(Value::Array(kv)) => Some(
                    kv.chunks(2)
                        .filter_map(|c| Some((text(c.first()?)?, bytes(c.get(1)?)?)))
                        .collect(),
                ),
                _ => None,
            };
            Some((id, fields))
        })
        .collect()
}

/// Rebuilds a message from its stream fields.
pub(crate) fn message(fields: &BTreeMap<String, Vec<u8>>, key: Option<OrderingKey>) -> Message {
    let payload = fields.get("p").cloned().unwrap_or_default();
    let mut msg = Message::new(payload);
    if let Some(id) = fields.get("id") {
        msg = msg.with_id(String::from_utf8_lossy(id).into_owned());
    }
    if let Some(h) = fields.get("h") {
        if let Ok(h) = serde_json::from_slice::<BTreeMap<String, String>>(h) {
            for (k, v) in h {
                msg = msg.with_header(k, v);
            }
        }
    }
    if let Some(c) = fields.get("c") {
        msg = msg.with_correlation_id(String::from_utf8_lossy(c).into_owned());
    }
    if let Some(k) = key {
        msg = msg.with_ordering_key(k);
    }
    msg
}

struct RedisPublisher {
    t: RedisTransport,
    names: Names,
}

impl fmt::Debug for RedisPublisher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisPublisher")
            .field("category", &self.names.category())
            .finish()
    }
}

#[async_trait]
impl TransportPublisher for RedisPublisher {
    async fn publish(&self, message: Message) -> Result<()> {
        self.append(message, None).await.map(|_| ())
    }

    fn fences_publishes(&self) -> bool {
        true
    }

    /// One script checks and records the fence and appends, as
    /// [`TransportPublisher::publish`] would (the fence key is
    /// `{category}:__fence__:{scope}`).
    async fn publish_fenced(&self, message: Message, fence: &PublishFence) -> Result<()> {
        if self.append(message, Some(fence)).await? {
            Ok(())
        } else {
            Err(Error::Fenced {
                scope: fence.scope.clone(),
                generation: fence.token,
            })
        }
    }
}

impl RedisPublisher {
    /// Appends with one script: to the key's partition stream (recorded in
    /// the index), or to the single or keyless stream; behind `fence` when
    /// given. Returns whether it was stored (`false`: fenced).
    async fn append(&self, message: Message, fence: Option<&PublishFence>) -> Result<bool> {
        let mut conn = self.t.conn.clone();
        let n = &self.names;
        let single = self.t.cfg.layout == Layout::Single;
        let keyed = message.key().filter(|_| !single);
        let mut inv = match (keyed.is_some(), fence.is_some()) {
            (true, false) => scripts::PUBLISH.prepare_invoke(),
            (true, true) => scripts::PUBLISH_FENCED.prepare_invoke(),
            (false, false) => scripts::APPEND.prepare_invoke(),
            (false, true) => scripts::APPEND_FENCED.prepare_invoke(),
        };
        match keyed {
            Some(key) => inv.key(n.stream(key.as_str())).key(n.index()),
            None => inv.key(if single { n.single() } else { n.keyless() }),
        };
        if let Some(f) = fence {
            inv.key(n.fence(&f.scope));
        }
        match keyed {
            // The index member and the wake-up carry the key's segment.
            Some(key) => inv.arg(&*Names::segment(key.as_str())).arg(n.wake()),
            None => inv.arg(n.wake()).arg(""),
        };
        if let Some(f) = fence {
            inv.arg(f.token);
        }
        for f in fields(&message, single)? {
            inv.arg(f);
        }
        let reply: Value = inv.invoke_async(&mut conn).await.map_err(broker)?;
        Ok(fence.is_none() || reply == Value::Int(1))
    }
}

#[cfg(test)]
mod scrub_tests {
    #[test]
    fn quoted_names_in_redis_errors_become_labels() {
        let text = "NOGROUP No such key 'orders:customer-42' or consumer group 'g' in XREADGROUP";
        let out = super::scrub(text);
        assert!(!out.contains("customer-42"), "{out}");
        assert!(
            out.starts_with("NOGROUP No such key 'k#") && out.ends_with("' in XREADGROUP"),
            "{out}"
        );
        assert_eq!(super::scrub("no quotes"), "no quotes");
        // A key holding quotes leaks nothing either.
        let out = super::scrub("No such key 'c:x'SECRET-4711' or consumer group 'g' in XREADGROUP");
        assert!(!out.contains("SECRET"), "{out}");
        let out = super::scrub("one 'SECRET quote");
        assert!(!out.contains("SECRET"), "{out}");
    }
}
