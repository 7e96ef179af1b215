#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]

mod admin;
mod attempts;
mod claims;
mod config;
pub mod control;
mod plan;
mod presence;
mod probe;
mod settle;
mod source;
mod topology;

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use keyorder_core::{
    Admin, Capabilities, Error, Message, Result, SourceEvent, SourceSpec, Transport, TransportPublisher,
    TransportSource, KEY_HEADER,
};
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::MAX_SHORT_STRING_LENGTH;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::Confirmation;
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};

pub use crate::config::{ConsumerTimeout, QueueType, RabbitConfig, Topology, QUORUM_MAX_PREFETCH};
pub use crate::topology::{GroupNames, Names, MAX_CATEGORY_AND_GROUP};
pub use lapin;

use crate::topology::amqp;

/// The header versions before consumer groups stamped with the publisher's
/// queue count. Publishers no longer choose a queue (each group's own
/// exchange does, with the count its registry record fixes), so it is
/// neither stamped nor checked; consumers leave it out of a message's
/// headers.
pub const EPOCH_HEADER: &str = "keyorder-epoch";

/// What the RabbitMQ transport can do with an affinity topology (`hash`, `sac`).
pub const CAPABILITIES: Capabilities = Capabilities {
    cross_instance_affinity: true,
    fencing: true,
    self_fencing: true,
    crash_reclaim: true,
    halt_on_poison: true,
    park_and_release: true,
    correlated_ownership: false,
    dynamic_partitions: false,
    remap_window: false,
    multi_process: true,
    persistent: false,
};

/// What it can do with the `plain` topology (competing consumers).
pub const PLAIN_CAPABILITIES: Capabilities = Capabilities {
    cross_instance_affinity: false,
    fencing: false,
    self_fencing: false,
    crash_reclaim: true,
    halt_on_poison: false,
    park_and_release: true,
    correlated_ownership: false,
    dynamic_partitions: false,
    remap_window: false,
    multi_process: true,
    persistent: false,
};

/// A halted head held in this process (its delivery stays unacknowledged).
pub(crate) struct Halted {
    pub(crate) scope: String,
    pub(crate) head_id: String,
    pub(crate) attempts: u32,
    pub(crate) reason: String,
    pub(crate) settle: Arc<settle::Held>,
}

/// State the sources of this transport share with its admin view. A
/// (category, group) pair is named by its base name `{category}:{group}`
/// ([`GroupNames::base`]).
pub(crate) struct Shared {
    /// (group base, key) -> halted head.
    pub(crate) halted: Mutex<HashMap<(String, String), Halted>>,
    /// group base -> operator actions for the owner.
    pub(crate) resolved: Mutex<HashMap<String, Vec<SourceEvent>>>,
    /// Answers other processes' operator requests about these halts.
    pub(crate) responder: control::Responder,
    /// group base -> key -> deliveries this process holds (delivered by the
    /// broker, not yet settled: in a source's buffer, waiting in the
    /// dispatcher or running), for `hot_keys`. Entries go at zero, so it
    /// is bounded by the consumers' prefetch.
    pub(crate) held_keys: Mutex<HashMap<String, HashMap<String, u64>>>,
    /// This transport's id in operator answers (an answer from itself is
    /// not counted twice).
    pub(crate) id: String,
}

impl Shared {
    fn new() -> Shared {
        Shared {
            halted: Mutex::default(),
            resolved: Mutex::default(),
            responder: control::Responder::default(),
            held_keys: Mutex::default(),
            id: uuid::Uuid::new_v4().simple().to_string(),
        }
    }

    /// One more delivery of `key` held here.
    pub(crate) fn hold(&self, category: &str, key: &str) {
        let mut map = self.held_keys.lock().unwrap_or_else(|e| e.into_inner());
        let keys = match map.get_mut(category) {
            Some(keys) => keys,
            None => map.entry(category.to_owned()).or_default(),
        };
        match keys.get_mut(key) {
            Some(n) => *n += 1,
            None => {
                keys.insert(key.to_owned(), 1);
            }
        }
    }

    /// A delivery of `key` settled or dropped.
    pub(crate) fn unhold(&self, category: &str, key: &str) {
        let mut map = self.held_keys.lock().unwrap_or_else(|e| e.into_inner());
        let Some(keys) = map.get_mut(category) else { return };
        if let Some(n) = keys.get_mut(key) {
            *n -= 1;
            if *n == 0 {
                keys.remove(key);
            }
        }
        if keys.is_empty() {
            map.remove(category);
        }
    }
}

/// The RabbitMQ transport (`amqp://`).
#[derive(Clone)]
pub struct RabbitTransport {
    pub(crate) cfg: Arc<RabbitConfig>,
    conn: Arc<tokio::sync::Mutex<Arc<Connection>>>,
    pub(crate) shared: Arc<Shared>,
    declared: Arc<Mutex<HashSet<String>>>,
    /// What ordered consumers do about `consumer_timeout`, decided once.
    timeout_arg: Arc<tokio::sync::OnceCell<Option<i64>>>,
}

impl fmt::Debug for RabbitTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitTransport")
            .field("topology", &self.cfg.topology)
            .finish_non_exhaustive()
    }
}

/// Connects to `uri` (`cfg`'s, or a variant of it); with TLS, the CA
/// certificates of `cacertfile=` (or the system's roots) verify the server.
pub(crate) async fn connect_uri(uri: &str, cfg: &RabbitConfig) -> Result<Connection> {
    let display = &cfg.display;
    let tls = match &cfg.ca_file {
        Some(path) => {
            let pem = std::fs::read_to_string(path)
                .map_err(|e| Error::Config(format!("rabbitmq: cannot read cacertfile {}: {e}", path.display())))?;
            // The TLS library skips what it cannot parse: a file without a
            // certificate would leave the system's roots alone in charge.
            if !pem.contains("-----BEGIN CERTIFICATE-----") {
                return Err(Error::Config(format!(
                    "rabbitmq: cacertfile {} holds no PEM certificate (-----BEGIN CERTIFICATE-----)",
                    path.display()
                )));
            }
            lapin::tcp::OwnedTLSConfig {
                identity: None,
                cert_chain: Some(pem),
            }
        }
        None => lapin::tcp::OwnedTLSConfig::default(),
    };
    let runtime = lapin::runtime::default_runtime()
        .map_err(|e| Error::Broker(format!("rabbitmq: no runtime to connect with: {e}")))?;
    tokio::time::timeout(
        std::time::Duration::from_secs(10),
        Connection::connect_with_config(uri, ConnectionProperties::default(), tls, runtime),
    )
    .await
    .map_err(|_| Error::Broker(format!("rabbitmq: no answer from {display} ({})", hint(uri))))?
    .map_err(|e| {
        let e = e.to_string();
        let hint = if e.contains("ACCESS_REFUSED") {
            "check the user name and password, and that the user may use this virtual host"
        } else {
            hint(uri)
        };
        Error::Broker(format!("rabbitmq: cannot connect to {display}: {e} ({hint})"))
    })
}

/// What to check when a connection fails.
fn hint(uri: &str) -> &'static str {
    if uri.starts_with("amqps:") {
        "is it running, does that port serve TLS (a plaintext port answers a TLS handshake with a corrupt message), \
         and did the CA of cacertfile= (or a system root) sign its certificate?"
    } else {
        "is it running?"
    }
}

impl RabbitTransport {
    /// Connects with `cfg`.
    pub async fn connect(cfg: RabbitConfig) -> Result<Self> {
        let conn = connect_uri(&cfg.uri, &cfg).await?;
        Ok(RabbitTransport {
            cfg: Arc::new(cfg),
            conn: Arc::new(tokio::sync::Mutex::new(Arc::new(conn))),
            shared: Arc::new(Shared::new()),
            declared: Arc::default(),
            timeout_arg: Arc::default(),
        })
    }

    /// Connects to the broker an `amqp://` URL names (options in its query
    /// string; see [`RabbitConfig`]).
    pub async fn from_url(url: &url::Url) -> Result<Self> {
        Self::connect(RabbitConfig::from_url(url)?).await
    }

    /// The configuration in use.
    pub fn config(&self) -> &RabbitConfig {
        &self.cfg
    }

    /// The shared connection (publishing, declarations, admin), reconnected
    /// when the broker closed it (a restart).
    pub(crate) async fn connection(&self) -> Result<Arc<Connection>> {
        let mut conn = self.conn.lock().await;
        if !conn.status().connected() {
            tracing::info!(broker = %self.cfg.display, "rabbitmq: reconnecting");
            *conn = Arc::new(connect_uri(&self.cfg.uri, &self.cfg).await?);
        }
        Ok(conn.clone())
    }

    fn was_declared(&self, name: &str) -> bool {
        self.declared.lock().unwrap_or_else(|e| e.into_inner()).contains(name)
    }

    fn declared_now(&self, name: &str) {
        self.declared
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(name.to_owned());
    }

    /// Forgets that `name` (a category or a group's base name) was
    /// declared: the next use declares it again.
    pub(crate) fn forget(&self, name: &str) {
        self.declared.lock().unwrap_or_else(|e| e.into_inner()).remove(name);
    }

    /// Deletes `category` with everything kept for it on the broker, for
    /// every group: each recorded group's queues (backlogs and dead letters
    /// with them) and exchanges, the entry exchange, the group registry,
    /// and the queues and exchanges of the layout before consumer groups
    /// (`{c}.hash`, `{c}.hash.N`, `{c}.sac`, `{c}.plain`, `{c}.dlq`).
    /// Returns the queues deleted. Stop the category's subscriptions first:
    /// a running one loses its queues.
    pub async fn delete_category(&self, category: &str) -> Result<Vec<String>> {
        let n = Names::new(category)?;
        let conn = self.connection().await?;
        // Everything is deleted while the registry's lock is held, the
        // lock queue last: a group declared meanwhile by another process
        // waits, then finds no registry and declares the category anew.
        let registry = topology::Registry::lock(&conn, &n, true).await?;
        let res = async {
            let mut gone = Vec::new();
            for (group, recorded) in registry.records() {
                let g = n.group(&group)?;
                gone.extend(topology::delete_group(&conn, &g, topology::parse_topology(&recorded)).await?);
                self.forget(g.base());
            }
            gone.extend(self.delete_category_names(&conn, &n).await?);
            Ok::<_, Error>(gone)
        }
        .await;
        match res {
            Ok(mut gone) => {
                registry.delete(&n.registry_lock()).await?;
                gone.push(n.registry_lock());
                self.forget(category);
                Ok(gone)
            }
            Err(e) => {
                let _ = registry.release().await;
                Err(e)
            }
        }
    }

    /// Deletes the category-level names (registry, entry exchange, the
    /// layout before consumer groups) that exist; returns the queues.
    async fn delete_category_names(&self, conn: &Connection, n: &Names) -> Result<Vec<String>> {
        use lapin::options::{ExchangeDeleteOptions, QueueDeleteOptions};
        let mut gone = Vec::new();
        let mut queues = vec![n.registry()];
        queues.extend(n.legacy_queues());
        for i in 1..1024 {
            if topology::queue_state(conn, &n.legacy_hash_queue(i)).await?.is_none() {
                break;
            }
            queues.push(n.legacy_hash_queue(i));
        }
        let ch = conn.create_channel().await.map_err(amqp)?;
        for q in queues {
            if topology::queue_state(conn, &q).await?.is_some() {
                ch.queue_delete(q.as_str().into(), QueueDeleteOptions::default())
                    .await
                    .map_err(amqp)?;
                gone.push(q);
            }
        }
        for x in [
            n.entry(),
            n.legacy_hash_exchange(),
            format!("{}.presence", n.category()),
        ] {
            ch.exchange_delete(x.as_str().into(), ExchangeDeleteOptions::default())
                .await
                .map_err(amqp)?;
        }
        let _ = ch.close(200, "deleted".into()).await;
        Ok(gone)
    }

    /// Refuses a category with queues of the layout before consumer groups,
    /// and declares (or verifies) its entry exchange; once per transport.
    pub(crate) async fn ensure_category(&self, names: &Names) -> Result<()> {
        if self.was_declared(names.category()) {
            return Ok(());
        }
        topology::ensure_category(&*self.connection().await?, &self.cfg, names).await?;
        self.declared_now(names.category());
        Ok(())
    }

    /// Declares (or verifies) one group's topology behind the category's
    /// entry exchange and records the group; once per transport.
    /// With `recheck` (a subscription's build), a group declared here
    /// before is checked to be still there (two passive declarations; not
    /// on every publisher's creation).
    pub(crate) async fn ensure_group(&self, names: &Names, group: &GroupNames, recheck: bool) -> Result<()> {
        self.ensure_category(names).await?;
        let conn = self.connection().await?;
        if self.was_declared(group.base()) {
            if !recheck {
                return Ok(());
            }
            // Declared here before: still there, unless another process
            // removed the group (or deleted the category) since.
            let mut there = true;
            for q in [&group.queues(self.cfg.topology)[0], &group.members()] {
                there = there && topology::queue_state(&conn, q).await?.is_some();
            }
            if there {
                return Ok(());
            }
            tracing::info!(group = %group.base(), "rabbitmq: the group was removed since this process declared it; declaring it again");
            self.forget(group.base());
            self.forget(names.category());
            self.ensure_category(names).await?;
        }
        topology::ensure_group(&conn, &self.cfg, names, group).await?;
        self.declared_now(group.base());
        Ok(())
    }

    /// The broker's version from its `connection.start` (plain `amqp://`
    /// only; `None` over TLS or when it does not answer in 5 s).
    pub async fn broker_version(&self) -> Option<String> {
        let (host, port) = self.cfg.probe.as_ref()?;
        probe::server_version(host, *port).await
    }

    /// What an ordered consumer does about RabbitMQ's `consumer_timeout`,
    /// which would redeliver a halted head (it stays unacknowledged):
    /// `Some(ms)` to set on each consumer (`x-consumer-timeout`, RabbitMQ
    /// 3.11.15 and later), `None` when the broker cannot take it but the URL
    /// states its setting; otherwise an error that names the fix.
    pub(crate) async fn consumer_timeout_arg(&self) -> Result<Option<i64>> {
        self.timeout_arg
            .get_or_try_init(|| async {
                let version = self.broker_version().await;
                if let Some(v) = version.as_deref().filter(|v| probe::per_consumer_timeout(v)) {
                    let t = self.cfg.consumer_timeout.unwrap_or(ConsumerTimeout::Off);
                    tracing::debug!(broker = %self.cfg.display, version = v, timeout = %t,
                        "rabbitmq: ordered consumers set x-consumer-timeout");
                    return Ok(Some(t.consumer_arg_ms()));
                }
                let runs = match &version {
                    Some(v) => format!("runs RabbitMQ {v}, which"),
                    None => {
                        "did not tell its version (TLS, or no answer to a plain handshake); before 3.11.15 RabbitMQ"
                            .to_owned()
                    }
                };
                match self.cfg.consumer_timeout {
                    Some(t) => {
                        tracing::info!(broker = %self.cfg.display, timeout = %t,
                            "rabbitmq: the broker's consumer_timeout as stated in the URL: a head halted longer \
                             is redelivered (and halts again on its next consumer)");
                        Ok(None)
                    }
                    None => Err(Error::Config(format!(
                        "rabbitmq: {} {runs} closes the channel of a delivery left unacknowledged past its \
                         `consumer_timeout` (30 min by default) and redelivers it, and lets no client set or read \
                         that timeout: a halted head (kept unacknowledged) would be redelivered. Set \
                         `consumer_timeout = <ms>` in rabbitmq.conf above the longest halt you tolerate (or disable \
                         it: `{{rabbit, [{{consumer_timeout, undefined}}]}}` in advanced.config) and state it in the \
                         URL with `consumer_timeout_ms=<ms>` (or `consumer_timeout_ms=off`), or upgrade to RabbitMQ \
                         3.11.15 or later, where each ordered consumer sets its own",
                        self.cfg.display
                    ))),
                }
            })
            .await
            .copied()
    }
}

#[async_trait]
impl Transport for RabbitTransport {
    fn name(&self) -> &str {
        "rabbitmq"
    }

    fn capabilities(&self) -> Capabilities {
        match self.cfg.topology {
            Topology::Plain => PLAIN_CAPABILITIES,
            _ => CAPABILITIES,
        }
    }

    fn affinity_fix(&self) -> String {
        "declare an affinity topology in the amqp:// URL: `?topology=hash&queues=8` (a consistent-hash exchange \
         over 8 single-active-consumer queues, spread over the instances) or `?topology=sac` (one \
         single-active-consumer queue)"
            .into()
    }

    async fn publisher(&self, category: &str) -> Result<Arc<dyn TransportPublisher>> {
        let names = Names::new(category)?;
        self.ensure_category(&names).await?;
        // The groups the URL names keep what is published from now on.
        for g in &self.cfg.groups {
            self.ensure_group(&names, &names.group(g)?, false).await?;
        }
        Ok(Arc::new(RabbitPublisher {
            t: self.clone(),
            names,
            channel: tokio::sync::Mutex::new(None),
        }))
    }

    async fn open(&self, spec: &SourceSpec) -> Result<Box<dyn TransportSource>> {
        if spec.ordered && self.cfg.topology == Topology::Plain {
            return Err(Error::Config(format!(
                "an ordered subscription needs cross-instance affinity: {}",
                self.affinity_fix()
            )));
        }
        let timeout_arg = if spec.ordered {
            self.consumer_timeout_arg().await?
        } else {
            None
        };
        let names = Names::new(&spec.category)?;
        let group = names.group(&spec.group)?;
        self.ensure_group(&names, &group, true).await?;
        // Operators in other processes ask the consumers themselves for
        // their hot keys and halted heads (see `control`).
        self.answer_for(group.base());
        Ok(Box::new(
            source::Source::open(timeout_arg, self.clone(), spec.clone(), group).await?,
        ))
    }

    fn admin(&self) -> Arc<dyn Admin> {
        Arc::new(admin::RabbitAdmin { t: self.clone() })
    }
}

/// A confirm-mode channel.
pub(crate) async fn confirm_channel(conn: &Connection) -> Result<Channel> {
    let ch = conn.create_channel().await.map_err(amqp)?;
    ch.confirm_select(ConfirmSelectOptions::default()).await.map_err(amqp)?;
    Ok(ch)
}

/// Publishes with `mandatory` and waits for the broker's confirm; an
/// unroutable or refused message is an error, never a silent drop.
pub(crate) async fn publish_confirmed(
    ch: &Channel,
    exchange: &str,
    routing_key: &str,
    payload: &[u8],
    props: BasicProperties,
) -> Result<()> {
    let confirm = ch
        .basic_publish(
            exchange.into(),
            routing_key.into(),
            BasicPublishOptions {
                mandatory: true,
                ..Default::default()
            },
            payload,
            props,
        )
        .await
        .map_err(amqp)?
        .await
        .map_err(amqp)?;
    match confirm {
        Confirmation::Ack(None) => Ok(()),
        Confirmation::Ack(Some(_)) => Err(Error::NotFound(format!(
            "rabbitmq: message unroutable through exchange `{exchange}` (no queue bound: declare the topology)"
        ))),
        Confirmation::Nack(_) => Err(Error::Broker("rabbitmq: the broker refused the message (nack)".into())),
        Confirmation::NotRequested => Err(Error::Broker("rabbitmq: publisher confirms are off".into())),
    }
}

fn long(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s))
}

/// `value` as an AMQP short string (at most 255 bytes); a longer one is
/// refused naming `what` and the limit (never the value: user data).
pub(crate) fn short(what: &str, value: &str) -> Result<ShortString> {
    ShortString::try_new(value).map_err(|_| {
        Error::Config(format!(
            "rabbitmq: the {what} is {} bytes; AMQP carries at most {MAX_SHORT_STRING_LENGTH} bytes there, so \
             the message was not published (nothing was stored): shorten it",
            value.len()
        ))
    })
}

/// The AMQP properties of a message: id, correlation id, persistent
/// delivery, headers (the key in [`KEY_HEADER`]). A message id,
/// correlation id or header name over 255 bytes is refused
/// (`Error::Config`), in the caller's `publish`.
pub(crate) fn properties(message: &Message) -> Result<BasicProperties> {
    let mut headers = FieldTable::default();
    for (k, v) in message.headers() {
        headers.insert(short("header name", k)?, long(v));
    }
    if let Some(k) = message.key() {
        headers.insert(KEY_HEADER.into(), long(k.as_str()));
    }
    let mut props = BasicProperties::default()
        .with_message_id(short("message id", message.id())?)
        .with_delivery_mode(2)
        .with_headers(headers);
    if let Some(c) = message.correlation_id() {
        props = props.with_correlation_id(short("correlation id", c)?);
    }
    Ok(props)
}

/// The routing key of a keyless message: a hash of its id (16 hex
/// digits), so every id fits and keyless messages spread over a ring.
pub(crate) fn keyless_routing_key(id: &str) -> String {
    // FNV-1a, 64 bits: stable across processes and versions.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in id.as_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("{h:016x}")
}

struct RabbitPublisher {
    t: RabbitTransport,
    names: Names,
    channel: tokio::sync::Mutex<Option<Channel>>,
}

impl fmt::Debug for RabbitPublisher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitPublisher")
            .field("category", &self.names.category())
            .finish()
    }
}

#[async_trait]
impl TransportPublisher for RabbitPublisher {
    async fn publish(&self, message: Message) -> Result<()> {
        // Refused before anything is sent.
        let props = properties(&message)?;
        let mut slot = self.channel.lock().await;
        let ch = match slot.as_ref() {
            Some(ch) if ch.status().connected() => ch.clone(),
            _ => {
                let ch = confirm_channel(&*self.t.connection().await?).await?;
                *slot = Some(ch.clone());
                ch
            }
        };
        drop(slot);
        // Keyless messages spread by a hash of their id (an id may be
        // longer than a routing key can be).
        let key = message
            .key()
            .map_or_else(|| keyless_routing_key(message.id()), |k| k.as_str().to_owned());
        let entry = self.names.entry();
        match publish_confirmed(&ch, &entry, &key, message.payload(), props).await {
            Err(Error::NotFound(_)) => Err(Error::Config(format!(
                "rabbitmq: no consumer group of category `{c}` has its queues declared, so the message was not \
                 stored (nothing was published): each group's queues are declared when its first subscription is \
                 built, and a message published before that does not reach it. Name the groups that must receive \
                 it in the publisher's URL, `groups=<group>,...` (with the groups' topology: it declares them \
                 when the publisher is created), or build each group's subscription once before publishing",
                c = self.names.category()
            ))),
            other => other,
        }
    }
}
