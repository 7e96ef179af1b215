//! Relays under test: a process (re-executing the runner) or a task.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use keyorder_core::{Error, Result};
use keyorder_outbox::{Outbox, OutboxConfig, RelayStatsSnapshot};
use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use super::common::*;
use super::hold::*;
use keyorder_check::worker::{run_from_env, Connector, WorkerProcess};

// ------------------------------------------------------- relay processes

/// What a relay process runs.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RelayWorkerConfig {
    /// The adapter URL the relay publishes to.
    pub url: String,
    /// The outbox's PostgreSQL URL.
    pub outbox_url: String,
    /// The outbox's schema.
    pub schema: String,
    /// The relay's instance id.
    pub instance: String,
    /// Slot lease TTL, heartbeat and margin in ms.
    pub lease_ms: (u64, u64, u64),
    /// Where to hold a publish (released by `SIGUSR1`).
    pub hold: Option<HoldRule>,
}

/// If this process was spawned as an outbox relay, runs it and exits.
/// [`crate::worker::run_if_worker`] calls it first.
pub fn run_if_relay(connect: Connector) {
    run_from_env(RELAY_ENV, "relay", |cfg: RelayWorkerConfig| async move {
        relay_main(cfg, connect).await.map(|s| relay_stats_json(&s))
    });
}

pub(super) async fn relay_main(cfg: RelayWorkerConfig, connect: Connector) -> Result<RelayStatsSnapshot> {
    use tokio::signal::unix::{signal, SignalKind};
    let client = connect(cfg.url.clone()).await?;
    let state = HoldState::new(cfg.hold, true);
    let client = holding_client(&client, state.clone());
    let outbox = Outbox::connect(
        &cfg.outbox_url,
        4,
        OutboxConfig {
            schema: cfg.schema.clone(),
            slots: SLOTS,
            key_rules: client.key_rules().clone(),
        },
    )
    .await?;
    let relay = outbox.relay(client, relay_config(&cfg.instance, cfg.lease_ms));
    let sig = |kind: SignalKind, name: &str| signal(kind).map_err(|e| Error::Config(format!("{name} handler: {e}")));
    let mut term = sig(SignalKind::terminate(), "SIGTERM")?;
    let mut usr1 = sig(SignalKind::user_defined1(), "SIGUSR1")?;
    tokio::spawn(async move {
        while usr1.recv().await.is_some() {
            state.release.add_permits(1);
        }
    });
    println!("KEYORDER_WORKER_READY");
    relay
        .run(async move {
            term.recv().await;
        })
        .await
}

/// A relay in this process (the in-memory transport's trials): a task that
/// drives [`keyorder_outbox::Relay::step`] unless paused.
#[derive(Debug)]
pub(super) struct TaskRelay {
    pub(super) pause: Arc<AtomicBool>,
    pub(super) state: Arc<HoldState>,
    pub(super) stop: Option<oneshot::Sender<()>>,
    pub(super) join: JoinHandle<Result<RelayStatsSnapshot>>,
}

/// A relay under test: a process or a task.
#[derive(Debug)]
pub(super) enum RelayUnderTest {
    Process(Box<WorkerProcess>),
    Task(TaskRelay),
}

impl RelayUnderTest {
    /// The id of the message it holds, once it holds one.
    pub(super) fn held(&self) -> Option<String> {
        match self {
            RelayUnderTest::Process(p) => p.held(),
            RelayUnderTest::Task(t) => t.state.held.lock().unwrap().clone(),
        }
    }

    /// How its held publish ended once let go (`ok`, `fenced`, `error: ...`).
    pub(super) fn released(&self) -> Option<String> {
        match self {
            RelayUnderTest::Process(p) => p.released(),
            RelayUnderTest::Task(t) => t.state.released.lock().unwrap().clone(),
        }
    }

    /// `kill -9` (a process) or an abort with every in-flight publish (a task).
    pub(super) async fn crash(self) -> Outcome {
        match self {
            RelayUnderTest::Process(p) => (*p).kill9().await,
            RelayUnderTest::Task(t) => {
                t.join.abort();
                match t.join.await {
                    Err(e) if e.is_cancelled() => Ok(()),
                    other => Err(format!("the relay task ended before the crash: {other:?}")),
                }
            }
        }
    }

    /// `SIGSTOP` (a process) or no more driving (a task).
    pub(super) fn stall(&self) -> Outcome {
        match self {
            RelayUnderTest::Process(p) => p.stop(),
            RelayUnderTest::Task(t) => {
                t.pause.store(true, Ordering::SeqCst);
                Ok(())
            }
        }
    }

    /// Lets the held publish go on and the relay run again.
    pub(super) fn resume(&self) -> Outcome {
        match self {
            RelayUnderTest::Process(p) => {
                p.release()?;
                p.cont()
            }
            RelayUnderTest::Task(t) => {
                t.state.release.add_permits(1);
                t.pause.store(false, Ordering::SeqCst);
                Ok(())
            }
        }
    }

    /// Graceful stop (the relay drains); its final counters.
    pub(super) async fn stop(self) -> std::result::Result<serde_json::Value, String> {
        match self {
            RelayUnderTest::Process(p) => (*p).terminate().await,
            RelayUnderTest::Task(mut t) => {
                if let Some(stop) = t.stop.take() {
                    let _ = stop.send(());
                }
                let stats = tokio::time::timeout(Duration::from_secs(60), t.join)
                    .await
                    .map_err(|_| "the relay task did not drain within 60 s".to_owned())?
                    .map_err(err)?
                    .map_err(err)?;
                Ok(relay_stats_json(&stats))
            }
        }
    }
}
