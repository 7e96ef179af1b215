//! [`RabbitTransport`]: connecting (`from_url`), declaring a category and
//! a group's topology once per transport, deleting a category, what it can
//! do with each topology, and `impl Transport`, which opens publishers,
//! sources and the operator's admin over one shared [`Conn`].

use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;
use keyorder_core::{Admin, Capabilities, Error, Result, SourceSpec, Transport, TransportPublisher, TransportSource};

use crate::admin::RabbitAdmin;
use crate::config::{ConsumerTimeout, RabbitConfig, Topology};
use crate::conn::{connect_uri, Conn};
use crate::names::{GroupNames, Names};
use crate::probe;
use crate::publisher::RabbitPublisher;
use crate::shared::Shared;
use crate::source::Source;
use crate::topology::{self, queue_state};

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
    publish_fencing: false,
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
    publish_fencing: false,
    multi_process: true,
    persistent: false,
};

/// The RabbitMQ transport (`amqp://`).
#[derive(Clone)]
pub struct RabbitTransport {
    c: Conn,
    /// What ordered consumers do about `consumer_timeout`, decided once.
    timeout_arg: Arc<tokio::sync::OnceCell<Option<i64>>>,
}

impl fmt::Debug for RabbitTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitTransport")
            .field("topology", &self.c.cfg.topology)
            .finish_non_exhaustive()
    }
}

impl RabbitTransport {
    /// Connects with `cfg`.
    pub async fn connect(cfg: RabbitConfig) -> Result<Self> {
        let conn = connect_uri(&cfg.uri, &cfg).await?;
        Ok(RabbitTransport {
            c: Conn {
                cfg: Arc::new(cfg),
                conn: Arc::new(tokio::sync::Mutex::new(Arc::new(conn))),
                shared: Arc::new(Shared::new()),
                declared: Arc::default(),
            },
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
        &self.c.cfg
    }

    /// Deletes `category` with everything kept for it on the broker, for
    /// every group: each recorded group's queues (backlogs and dead letters
    /// with them) and exchanges, the entry exchange, the group registry,
    /// and the queues and exchanges of the layout before consumer groups
    /// (`{c}.hash`, `{c}.hash.N`, `{c}.sac`, `{c}.plain`, `{c}.dlq`).
    /// Returns the queues deleted. Stop the category's subscriptions first:
    /// a running one loses its queues.
    pub async fn delete_category(&self, category: &str) -> Result<Vec<String>> {
        topology::delete_category(&self.c, category).await
    }

    /// Refuses a category with queues of the layout before consumer groups,
    /// and declares (or verifies) its entry exchange; once per transport.
    pub(crate) async fn ensure_category(&self, names: &Names) -> Result<()> {
        if self.c.was_declared(names.category()) {
            return Ok(());
        }
        topology::ensure_category(&*self.c.connection().await?, &self.c.cfg, names).await?;
        self.c.declared_now(names.category());
        Ok(())
    }

    /// Declares (or verifies) one group's topology behind the category's
    /// entry exchange and records the group; once per transport.
    /// With `recheck` (a subscription's build), a group declared here
    /// before is checked to be still there (two passive declarations; not
    /// on every publisher's creation).
    pub(crate) async fn ensure_group(&self, names: &Names, group: &GroupNames, recheck: bool) -> Result<()> {
        self.ensure_category(names).await?;
        let conn = self.c.connection().await?;
        if self.c.was_declared(group.base()) {
            if !recheck {
                return Ok(());
            }
            // Declared here before: still there, unless another process
            // removed the group (or deleted the category) since.
            let mut there = true;
            for q in [&group.queues(self.c.cfg.topology)[0], &group.members()] {
                there = there && queue_state(&conn, q).await?.is_some();
            }
            if there {
                return Ok(());
            }
            tracing::info!(group = %group.base(), "rabbitmq: the group was removed since this process declared it; declaring it again");
            self.c.forget(group.base());
            self.c.forget(names.category());
            self.ensure_category(names).await?;
        }
        topology::ensure_group(&conn, &self.c.cfg, names, group).await?;
        self.c.declared_now(group.base());
        Ok(())
    }

    /// The broker's version from its `connection.start` (plain `amqp://`
    /// only; `None` over TLS or when it does not answer in 5 s).
    pub async fn broker_version(&self) -> Option<String> {
        let (host, port) = self.c.cfg.probe.as_ref()?;
        probe::server_version(host, *port).await
    }

    /// What an ordered consumer does about RabbitMQ's `consumer_timeout`,
    /// which redelivers a delivery left unacknowledged past it (a halted
    /// head stays unacknowledged): `Some(ms)` to set on each consumer
    /// (`x-consumer-timeout`, RabbitMQ 3.11.15 and later); `None` on an
    /// older broker (or one that does not tell its version), which lets no
    /// client set or read it: there the broker's own setting applies (30
    /// min by default). That keeps the order: the broker closes the
    /// channel, and the halted head comes back first of its key (the queue
    /// returns a closed channel's deliveries in order, as after a crash)
    /// and halts again on its next consumer without running, its attempts
    /// counted on the attempts stream; the channel's other unsettled
    /// deliveries are fenced and delivered again. The URL's
    /// `consumer_timeout_ms` states the broker's setting for the log.
    pub(crate) async fn consumer_timeout_arg(&self) -> Result<Option<i64>> {
        self.timeout_arg
            .get_or_try_init(|| async {
                let version = self.broker_version().await;
                if let Some(v) = version.as_deref().filter(|v| probe::per_consumer_timeout(v)) {
                    let t = self.c.cfg.consumer_timeout.unwrap_or(ConsumerTimeout::Off);
                    tracing::debug!(broker = %self.c.cfg.display, version = v, timeout = %t,
                        "rabbitmq: ordered consumers set x-consumer-timeout");
                    return Ok(Some(t.consumer_arg_ms()));
                }
                let version = version.unwrap_or_else(|| "unknown (TLS, or no answer to a plain handshake)".into());
                match self.c.cfg.consumer_timeout {
                    Some(t) => tracing::info!(broker = %self.c.cfg.display, version = %version, timeout = %t,
                        "rabbitmq: the broker's consumer_timeout as stated in the URL: a head halted longer is \
                         redelivered in order and halts again on its next consumer"),
                    None => tracing::warn!(broker = %self.c.cfg.display, version = %version,
                        "rabbitmq: this broker lets no client set or read its consumer_timeout (30 min by \
                         default; per consumer from RabbitMQ 3.11.15): a head halted longer is redelivered in \
                         order and halts again on its next consumer, and its queue's other unsettled deliveries \
                         run again. To hold halts longer, raise `consumer_timeout` in rabbitmq.conf \
                         (scripts/services sets 3600000) and state it with consumer_timeout_ms=<ms> (or off)"),
                }
                Ok(None)
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
        match self.c.cfg.topology {
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
        for g in &self.c.cfg.groups {
            self.ensure_group(&names, &names.group(g)?, false).await?;
        }
        Ok(Arc::new(RabbitPublisher {
            t: self.c.clone(),
            names,
            channel: tokio::sync::Mutex::new(None),
        }))
    }

    async fn open(&self, spec: &SourceSpec) -> Result<Box<dyn TransportSource>> {
        if spec.ordered && self.c.cfg.topology == Topology::Plain {
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
        self.c.answer_for(group.base());
        Ok(Box::new(
            Source::open(timeout_arg, self.c.clone(), spec.clone(), group).await?,
        ))
    }

    fn default_lease(&self) -> Option<keyorder_core::LeaseConfig> {
        self.c.cfg.lease
    }

    fn admin(&self) -> Arc<dyn Admin> {
        Arc::new(RabbitAdmin { t: self.c.clone() })
    }
}
