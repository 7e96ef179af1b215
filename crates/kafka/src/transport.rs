//! Connecting a `KafkaTransport` (`kafka://`) and its `impl Transport`:
//! publishers, sources and the operator's admin of a category.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use keyorder_core::{Admin, Capabilities, Result, SourceSpec, Transport, TransportPublisher, TransportSource};
use rdkafka::producer::{FutureProducer, Producer};

use crate::admin::KafkaAdmin;
use crate::broker::KafkaTransport;
use crate::config::{apply_extra, base_config, check_extra, KafkaConfig};
use crate::error::{broker, create_err};
use crate::names::Names;
use crate::publisher::KafkaPublisher;
use crate::source::Source;

/// What the Kafka transport can do.
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

impl KafkaTransport {
    /// Connects with `cfg` (creates the producer; checks the brokers answer).
    pub async fn connect(cfg: KafkaConfig) -> Result<Self> {
        // A configuration built in code is checked as a URL's is: a bad
        // pass-through setting is named, its value never shown.
        check_extra(&cfg.extra)?;
        let mut pc = base_config(&cfg);
        pc.set("enable.idempotence", "true")
            .set("acks", "all")
            .set("partitioner", "murmur2_random")
            .set("linger.ms", "1")
            .set("message.timeout.ms", "30000");
        apply_extra(&mut pc, &cfg);
        let producer: FutureProducer = pc.create().map_err(create_err)?;
        pc.set("linger.ms", "0");
        apply_extra(&mut pc, &cfg);
        let state_producer: FutureProducer = pc.create().map_err(create_err)?;
        let probe = producer.clone();
        let brokers = cfg.brokers.clone();
        let tls = match cfg.extra.get("security.protocol").map(|v| v.to_ascii_lowercase()) {
            Some(p) if p.contains("ssl") => {
                "is it running, does that port serve TLS (a plaintext port fails the handshake), and did the CA of \
                 ssl.ca.location (or a system root) sign its certificate? librdkafka's log line says which"
            }
            _ => "is it running?",
        };
        tokio::task::spawn_blocking(move || probe.client().fetch_metadata(None, Duration::from_secs(10)))
            .await
            .map_err(broker)?
            .map_err(|e| crate::error::broker_as(format!("kafka: no answer from {brokers}: {e} ({tls})"), e))?;
        Ok(KafkaTransport::with_producers(cfg, producer, state_producer))
    }

    /// Connects to the brokers a `kafka://` URL names (options in its query
    /// string; see [`KafkaConfig`]).
    pub async fn from_url(url: &url::Url) -> Result<Self> {
        Self::connect(KafkaConfig::from_url(url)?).await
    }

    /// The configuration in use.
    pub fn config(&self) -> &KafkaConfig {
        &self.cfg
    }
}

#[async_trait]
impl Transport for KafkaTransport {
    fn name(&self) -> &str {
        "kafka"
    }

    fn capabilities(&self) -> Capabilities {
        CAPABILITIES
    }

    fn affinity_fix(&self) -> String {
        "Kafka pins every key to a partition and every partition to one group member; nothing to configure".into()
    }

    async fn publisher(&self, category: &str) -> Result<Arc<dyn TransportPublisher>> {
        let names = Names::new(category)?;
        self.ensure(&names).await?;
        self.check_layout(&names).await?;
        Ok(Arc::new(KafkaPublisher::new(self.clone(), names)))
    }

    async fn open(&self, spec: &SourceSpec) -> Result<Box<dyn TransportSource>> {
        let names = Names::new(&spec.category)?;
        self.ensure(&names).await?;
        let partitions = self.check_layout(&names).await?;
        Ok(Box::new(
            Source::open(self.clone(), spec.clone(), names, partitions).await?,
        ))
    }

    fn admin(&self) -> Arc<dyn Admin> {
        Arc::new(KafkaAdmin { t: self.clone() })
    }

    fn default_lease(&self) -> Option<keyorder_core::LeaseConfig> {
        self.cfg.lease
    }
}
