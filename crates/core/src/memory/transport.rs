//! `MemoryTransport`: the broker handle, `memory://` options and `impl Transport`.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::capability::Capabilities;
use crate::error::{Error, Result};
use crate::lease::LeaseConfig;
use crate::transport::{Admin, SourceSpec, Transport, TransportPublisher, TransportSource};

use super::admin::MemoryAdmin;
use super::broker::{Broker, BrokerState, Group, GroupPart, Member};
use super::publisher::MemoryPublisher;
use super::source::MemorySource;

/// Default partition count of a memory category.
pub const DEFAULT_PARTITIONS: u32 = 16;

/// The in-memory transport. Clones share one broker.
#[derive(Clone)]
pub struct MemoryTransport {
    pub(super) broker: Arc<Broker>,
    /// The subscriptions' default lease (`lease_ttl_ms=`...), if the URL set one.
    pub(super) lease: Option<LeaseConfig>,
}

impl fmt::Debug for MemoryTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryTransport")
            .field("partitions", &self.broker.partitions)
            .field("lease", &self.lease)
            .finish()
    }
}

impl Default for MemoryTransport {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryTransport {
    /// A fresh broker with [`DEFAULT_PARTITIONS`] partitions per category.
    pub fn new() -> Self {
        Self::with_partitions(DEFAULT_PARTITIONS)
    }

    /// A fresh broker with `partitions` partitions per category (at least 1).
    pub fn with_partitions(partitions: u32) -> Self {
        MemoryTransport {
            broker: Arc::new(Broker {
                partitions: partitions.max(1),
                state: Mutex::new(BrokerState::default()),
                notify: Notify::new(),
            }),
            lease: None,
        }
    }

    /// The same broker, with `lease` as its subscriptions' default lease
    /// (what `lease_ttl_ms=` sets; a builder's own lease wins).
    pub fn with_default_lease(mut self, lease: LeaseConfig) -> Self {
        self.lease = Some(lease);
        self
    }

    /// Parses `memory://[?partitions=N][&lease_ttl_ms=MS...]` (the lease
    /// options are [`crate::lease::LeaseOptions`]').
    pub fn from_url(url: &url::Url) -> Result<Self> {
        let mut partitions = DEFAULT_PARTITIONS;
        let mut lease = crate::lease::LeaseOptions::default();
        for (k, v) in url.query_pairs() {
            if lease.accept("memory://", &k, &v)? {
                continue;
            }
            match &*k {
                "partitions" => {
                    partitions = v
                        .parse()
                        .ok()
                        .filter(|n| (1..=4096).contains(n))
                        .ok_or_else(|| Error::Url(format!("memory://?partitions={v}: expected 1..=4096")))?;
                }
                other => {
                    return Err(Error::Url(format!(
                        "memory:// has no option `{}` (known: partitions, {})",
                        crate::redact::text(other),
                        crate::lease::LEASE_URL_OPTIONS
                    )))
                }
            }
        }
        let mut t = Self::with_partitions(partitions);
        t.lease = lease.lease("memory://")?;
        Ok(t)
    }
}

#[async_trait]
impl Transport for MemoryTransport {
    fn name(&self) -> &str {
        "memory"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            cross_instance_affinity: true,
            fencing: true,
            self_fencing: true,
            crash_reclaim: true,
            halt_on_poison: true,
            park_and_release: true,
            publish_fencing: true,
            ..Capabilities::default()
        }
    }

    fn affinity_fix(&self) -> String {
        "the in-memory transport always has it".into()
    }

    async fn publisher(&self, category: &str) -> Result<Arc<dyn TransportPublisher>> {
        Ok(Arc::new(MemoryPublisher {
            broker: self.broker.clone(),
            category: category.to_owned(),
        }))
    }

    async fn open(&self, spec: &SourceSpec) -> Result<Box<dyn TransportSource>> {
        let mut st = self.broker.lock();
        let partitions = self.broker.partitions;
        let cat = self.broker.category(&mut st, &spec.category);
        let logs: Vec<u64> = cat.logs.iter().map(|l| l.base).collect();
        let group = cat.groups.entry(spec.group.clone()).or_insert_with(|| Group {
            ordered: spec.ordered,
            members: BTreeMap::new(),
            // A new group starts at the oldest retained entry: nothing
            // published before it existed is skipped.
            parts: logs
                .iter()
                .map(|&base| GroupPart {
                    acked_upto: base,
                    next: base,
                    ..GroupPart::default()
                })
                .collect(),
            attempts: HashMap::new(),
            halted: Vec::new(),
            dead: Vec::new(),
            inflight: HashMap::new(),
            redeliver: BTreeSet::new(),
        });
        if group.ordered != spec.ordered {
            return Err(Error::Config(format!(
                "group `{}` of `{}` is {} here; an ordered and an unordered subscription cannot share a group",
                spec.group,
                spec.category,
                if group.ordered { "ordered" } else { "unordered" }
            )));
        }
        if group.members.contains_key(&spec.instance) {
            return Err(Error::Config(format!(
                "instance id `{}` is already a member of the group",
                spec.instance
            )));
        }
        group.members.insert(
            spec.instance.clone(),
            Member {
                last_seen: Instant::now(),
                ttl: spec.lease.ttl,
                events: Vec::new(),
            },
        );
        group.rebalance(Instant::now(), partitions, &spec.category);
        drop(st);
        self.broker.notify.notify_waiters();
        let lease_cfg = if spec.ordered {
            spec.lease
        } else {
            LeaseConfig {
                ttl: Duration::from_secs(365 * 24 * 3600),
                heartbeat: spec.lease.heartbeat,
                margin: Duration::ZERO,
            }
        };
        Ok(Box::new(MemorySource {
            broker: self.broker.clone(),
            category: spec.category.clone(),
            group: spec.group.clone(),
            member: spec.instance.clone(),
            ordered: spec.ordered,
            lease_cfg,
            leases: HashMap::new(),
            events: Vec::new(),
            cursor: 0,
            closed: false,
        }))
    }

    fn admin(&self) -> Arc<dyn Admin> {
        Arc::new(MemoryAdmin {
            broker: self.broker.clone(),
        })
    }

    fn default_lease(&self) -> Option<LeaseConfig> {
        self.lease
    }
}
