//! Helpers the outbox's integration tests share: a fresh outbox in a schema
//! of its own on the real PostgreSQL server, the workspace's poll helper, a
//! running relay, and an ordered consumer behind the `SequenceGuard`.
#![allow(dead_code)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use keyorder_core::{Client, Delivery, HandlerResult, KeySource, LeaseConfig, Result, RunReport};
use keyorder_outbox::sqlx::{self, PgPool};
use keyorder_outbox::{GuardStats, Outbox, OutboxConfig, Relay, RelayStats, SequenceGuard};
pub(crate) use keyorder_testkit::brokers::Broker;
pub(crate) use keyorder_testkit::until;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

pub(crate) fn pg_url() -> String {
    Broker::Postgres.url()
}

pub(crate) fn unique(prefix: &str) -> String {
    format!("{prefix}{}", &uuid::Uuid::new_v4().simple().to_string()[..12])
}

/// A fresh, migrated outbox in a schema of its own, named from `prefix`.
pub(crate) async fn outbox_in(prefix: &str) -> (Outbox, String) {
    let schema = unique(prefix);
    let cfg = OutboxConfig {
        schema: schema.clone(),
        ..OutboxConfig::default()
    };
    let url = pg_url();
    let outbox = Broker::Postgres.require(&url, Outbox::connect(&url, 8, cfg)).await;
    outbox.migrate().await.unwrap();
    (outbox, schema)
}

pub(crate) async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
        .fetch_one(pool)
        .await
        .unwrap()
}

/// A running relay and its stop signal.
pub(crate) struct Running {
    pub(crate) stop: oneshot::Sender<()>,
    pub(crate) task: JoinHandle<Result<keyorder_outbox::RelayStatsSnapshot>>,
    pub(crate) stats: Arc<RelayStats>,
}

pub(crate) fn spawn_relay(relay: Relay) -> Running {
    let (stop, stopped) = oneshot::channel::<()>();
    let stats = relay.stats();
    let task = tokio::spawn(relay.run(async move {
        let _ = stopped.await;
    }));
    Running { stop, task, stats }
}

impl Running {
    pub(crate) async fn stop(self) {
        let _ = self.stop.send(());
        self.task.await.unwrap().unwrap();
    }
}

/// What the handler applied, after the guard: (key, seq, message id).
pub(crate) type Log = Arc<Mutex<Vec<(String, u64, String)>>>;

pub(crate) struct Consumer {
    pub(crate) log: Log,
    pub(crate) guard: Arc<GuardStats>,
    pub(crate) stop: oneshot::Sender<()>,
    pub(crate) task: JoinHandle<Result<RunReport>>,
}

/// An ordered consumer of `category` (lease `lease`) behind an in-memory
/// `SequenceGuard`.
pub(crate) async fn consume(client: &Client, category: &str, lease: LeaseConfig) -> Consumer {
    let subscription = client
        .subscribe(category, "consumer")
        .ordered_by(KeySource::routing_key())
        .lease(lease)
        .build()
        .await
        .unwrap();
    let log: Log = Arc::default();
    let seen = log.clone();
    let handler = move |d: Delivery| {
        let seen = seen.clone();
        async move {
            let seq = keyorder_outbox::sequence_of(d.message()).expect("every outbox message has a sequence");
            seen.lock()
                .unwrap()
                .push((d.key().unwrap().as_str().to_owned(), seq, d.id().to_owned()));
            HandlerResult::Ok(())
        }
    };
    let guard = SequenceGuard::in_memory(handler, 10_000);
    let stats = guard.stats();
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(subscription.run(guard, async move {
        let _ = stopped.await;
    }));
    Consumer {
        log,
        guard: stats,
        stop,
        task,
    }
}

impl Consumer {
    pub(crate) fn seen(&self) -> Vec<(String, u64, String)> {
        self.log.lock().unwrap().clone()
    }
    pub(crate) fn ids_of(&self, key: &str) -> Vec<String> {
        self.log
            .lock()
            .unwrap()
            .iter()
            .filter(|(k, _, _)| k == key)
            .map(|(_, _, id)| id.clone())
            .collect()
    }
    pub(crate) fn len(&self) -> usize {
        self.log.lock().unwrap().len()
    }
    pub(crate) async fn wait_for(&self, n: usize) {
        until(&format!("{n} deliveries applied"), Duration::from_secs(60), || async {
            self.len() >= n
        })
        .await;
    }
    pub(crate) async fn stop(self) -> Vec<(String, u64, String)> {
        let _ = self.stop.send(());
        self.task.await.unwrap().unwrap();
        self.log.lock().unwrap().clone()
    }
}
