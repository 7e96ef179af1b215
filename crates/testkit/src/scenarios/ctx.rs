//! What every scenario shares: the context (harness, namespace, event log),
//! the outcome type and the small checks every scenario uses.

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use keyorder_core::{Client, KeySource, RetryPolicy, SubscriptionBuilder};

use super::Scenario;
use crate::checker::{check, Expectation, Published};
use crate::eventlog::{EventLog, MemoryEventLog};
use crate::instance::{wait_until, Instance, Switches};
use crate::Harness;
use keyorder_check::worker::WorkerConfig;

pub(crate) type Outcome = std::result::Result<(), String>;

pub(crate) fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// What every scenario shares: the harness, a fresh namespace, the event log.
pub(crate) struct Ctx<'a> {
    pub(crate) h: &'a dyn Harness,
    pub(crate) ns: String,
    pub(crate) log: Arc<dyn EventLog>,
    pub(crate) switches: Arc<Switches>,
}

impl<'a> Ctx<'a> {
    pub(super) fn new(h: &'a dyn Harness, s: Scenario) -> Self {
        let tag = uuid::Uuid::new_v4().simple().to_string();
        Ctx {
            h,
            ns: format!("{}-{}", s.slug().split('_').next().unwrap_or("c"), &tag[..10]),
            log: Arc::new(MemoryEventLog::default()),
            switches: Arc::new(Switches::default()),
        }
    }

    pub(crate) fn category(&self, suffix: &str) -> String {
        format!("{}-{suffix}", self.ns)
    }

    pub(crate) async fn client(&self) -> std::result::Result<Client, String> {
        self.h.client().await.map_err(err)
    }

    /// The scenarios' default ordered subscription.
    pub(crate) fn ordered(&self, client: &Client, category: &str, group: &str) -> SubscriptionBuilder {
        client
            .subscribe(category, group)
            .ordered_by(KeySource::routing_key())
            .lease(self.h.lease())
            .retry(RetryPolicy {
                max_attempts: 3,
                initial_backoff: Duration::from_millis(20),
                max_backoff: Duration::from_millis(200),
            })
    }

    pub(crate) async fn start(&self, builder: SubscriptionBuilder, id: &str) -> std::result::Result<Instance, String> {
        Instance::start(builder, id, self.log.clone(), self.switches.clone())
            .await
            .map_err(err)
    }

    /// Waits until every published id not in `excused` was applied.
    pub(crate) async fn wait_applied(&self, published: &[Published], excused: &HashSet<String>) -> Outcome {
        let want: HashSet<&str> = published
            .iter()
            .map(|p| p.id.as_str())
            .filter(|id| !excused.contains(*id))
            .collect();
        let log = self.log.clone();
        let missing = std::sync::atomic::AtomicUsize::new(want.len());
        let res = wait_until("every published message to be applied", self.h.deadline(), || {
            let log = log.clone();
            let want = &want;
            let missing = &missing;
            async move {
                let events = log.events().await.unwrap_or_default();
                let done: HashSet<&str> = events.iter().filter(|e| e.ok).map(|e| e.message_id.as_str()).collect();
                let n = want.iter().filter(|id| !done.contains(**id)).count();
                missing.store(n, Ordering::Relaxed);
                n == 0
            }
        })
        .await;
        res.map_err(|e| {
            format!(
                "{e} ({} of {} still missing)",
                missing.load(Ordering::Relaxed),
                want.len()
            )
        })
    }

    pub(super) async fn applied_count(&self, pred: impl Fn(&crate::Event) -> bool) -> usize {
        self.log
            .events()
            .await
            .unwrap_or_default()
            .iter()
            .filter(|e| e.ok && pred(e))
            .count()
    }

    pub(crate) async fn verdict(&self, expect: &Expectation) -> std::result::Result<crate::Verdict, String> {
        let events = self.log.events().await.map_err(err)?;
        Ok(check(&events, expect))
    }
}

impl Ctx<'_> {
    pub(crate) fn worker_config(
        &self,
        category: &str,
        instance: &str,
        hold_from_seq: Option<u64>,
        hold: Duration,
        concurrency: usize,
    ) -> Result<WorkerConfig, String> {
        let url = self
            .h
            .worker_url()
            .ok_or_else(|| format!("harness `{}` gives no worker URL", self.h.name()))?;
        let lease = self.h.lease();
        Ok(WorkerConfig {
            url,
            category: category.to_owned(),
            group: "g".into(),
            instance: instance.to_owned(),
            log_url: self.h.event_log_url(),
            run: self.ns.clone(),
            hold_from_seq,
            hold_ms: hold.as_millis() as u64,
            concurrency,
            lease_ms: (
                lease.ttl.as_millis() as u64,
                lease.heartbeat.as_millis() as u64,
                lease.margin.as_millis() as u64,
            ),
            crash_on_poison: false,
            park_after: None,
            max_attempts: None,
        })
    }

    /// Waits until `instance` is inside a handler (started, not ended) of a
    /// message with sequence >= `seq`; returns that message's key.
    pub(crate) async fn wait_held(&self, instance: &str, seq: u64) -> Result<String, String> {
        let log = self.log.clone();
        let found = Arc::new(std::sync::Mutex::new(None));
        let f = found.clone();
        wait_until(
            &format!("{instance} to be held inside a handler"),
            self.h.deadline(),
            || {
                let (log, f) = (log.clone(), f.clone());
                async move {
                    let events = log.events().await.unwrap_or_default();
                    let held = events
                        .iter()
                        .find(|e| e.instance == instance && e.seq >= seq && e.end.is_none());
                    *f.lock().unwrap() = held.map(|e| e.key.clone());
                    held.is_some()
                }
            },
        )
        .await?;
        let key = found.lock().unwrap().clone();
        key.ok_or_else(|| "held key vanished".into())
    }
}

pub(super) async fn stop_all(instances: Vec<Instance>) -> Outcome {
    for i in instances {
        i.stop().await?;
    }
    Ok(())
}

pub(crate) fn ensure(cond: bool, what: impl FnOnce() -> String) -> Outcome {
    if cond {
        Ok(())
    } else {
        Err(what())
    }
}
