//! Holding a relay's publish (a transport whose publisher waits), and the
//! relays' configuration.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use keyorder_core::{Client, Error, LeaseConfig, Message, PublishFence, Result, RetryPolicy, TransportPublisher};
use keyorder_outbox::{RelayConfig, RelayStatsSnapshot};
use serde::{Deserialize, Serialize};
use tokio::sync::Semaphore;

use keyorder_check::worker::{HOLDING_LINE, RELEASED_LINE};

use crate::wrap::{send, Hooks, Wrapped};

// ------------------------------------------------------------------ holds

/// Where a relay holds one publish: the first record with a per-key
/// sequence of at least `from_seq`, before or after the broker confirmed it.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct HoldRule {
    /// The first record whose sequence is at least this one is held.
    pub from_seq: u64,
    /// `true`: hold after the broker confirmed it (published, not yet
    /// marked); `false`: hold before it reaches the broker.
    pub after_publish: bool,
}

#[derive(Debug)]
pub(super) struct HoldState {
    pub(super) rule: Option<HoldRule>,
    pub(super) taken: AtomicBool,
    pub(super) held: Mutex<Option<String>>,
    pub(super) release: Semaphore,
    pub(super) announce: bool,
    /// How the held publish ended once let go (`ok`, `fenced`, `error: ...`).
    pub(super) released: Mutex<Option<String>>,
}

impl HoldState {
    pub(super) fn new(rule: Option<HoldRule>, announce: bool) -> Arc<HoldState> {
        Arc::new(HoldState {
            rule,
            taken: AtomicBool::new(false),
            held: Mutex::new(None),
            release: Semaphore::new(0),
            announce,
            released: Mutex::new(None),
        })
    }

    pub(super) async fn hold(&self, id: &str) {
        *self.held.lock().unwrap() = Some(id.to_owned());
        if self.announce {
            println!("{HOLDING_LINE}{id}");
        }
        if let Ok(permit) = self.release.acquire().await {
            permit.forget();
        }
    }

    pub(super) fn released(&self, res: &Result<()>) {
        let outcome = match res {
            Ok(()) => "ok".to_owned(),
            Err(Error::Fenced { .. }) => "fenced".to_owned(),
            Err(e) => format!("error: {e}"),
        };
        if self.announce {
            println!("{RELEASED_LINE}{outcome}");
        }
        *self.released.lock().unwrap() = Some(outcome);
    }
}

/// The hooks ([`crate::wrap`]) of a transport whose publisher holds one
/// publish by a [`HoldRule`].
#[derive(Debug)]
pub(super) struct Holding(pub(super) Arc<HoldState>);

#[async_trait]
impl Hooks for Holding {
    async fn publish(
        &self,
        inner: &dyn TransportPublisher,
        message: Message,
        fence: Option<&PublishFence>,
    ) -> Result<()> {
        let state = &self.0;
        let rule = state
            .rule
            .filter(|r| keyorder_outbox::sequence_of(&message).is_some_and(|s| s >= r.from_seq))
            .filter(|_| !state.taken.swap(true, Ordering::SeqCst));
        let Some(rule) = rule else {
            return send(inner, message, fence).await;
        };
        let id = message.id().to_owned();
        if rule.after_publish {
            if let Err(e) = send(inner, message, fence).await {
                state.taken.store(false, Ordering::SeqCst);
                return Err(e);
            }
            state.hold(&id).await;
            Ok(())
        } else {
            state.hold(&id).await;
            let res = send(inner, message, fence).await;
            state.released(&res);
            res
        }
    }
}

pub(super) fn holding_client(client: &Client, state: Arc<HoldState>) -> Client {
    Client::new(Arc::new(Wrapped::new(client.transport().clone(), Holding(state))))
        .with_key_rules(client.key_rules().clone())
}

pub(super) fn relay_config(instance: &str, lease_ms: (u64, u64, u64)) -> RelayConfig {
    RelayConfig {
        instance: Some(instance.to_owned()),
        lease: LeaseConfig {
            ttl: Duration::from_millis(lease_ms.0),
            heartbeat: Duration::from_millis(lease_ms.1),
            margin: Duration::from_millis(lease_ms.2),
        },
        poll: Duration::from_millis(20),
        retry: RetryPolicy {
            max_attempts: 20,
            initial_backoff: Duration::from_millis(50),
            max_backoff: Duration::from_secs(1),
        },
        // The trials read the published rows afterwards: keep them.
        retention_batch: 0,
        ..RelayConfig::default()
    }
}

pub(super) fn relay_stats_json(s: &RelayStatsSnapshot) -> serde_json::Value {
    serde_json::json!({
        "published": s.published,
        "fenced": s.fenced,
        "abandoned": s.abandoned,
        "slots_lost": s.slots_lost,
        "retries": s.retries,
    })
}
