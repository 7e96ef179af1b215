//! The keyorder conformance suite: scenarios C1-C23 of
//! `shared/design/CONFORMANCE.md`, written once as functions over a
//! [`Harness`] that each adapter implements, and the one [`checker`] that
//! judges their event logs.
//!
//! A runner (see the workspace's `tests/conformance.rs`) turns
//! [`Scenario::ALL`] × harnesses into named trials; a scenario whose
//! [`Scenario::not_applicable`] gives a reason stays visible as an ignored
//! trial, so the output is the capability matrix.

use std::time::Duration;

use async_trait::async_trait;
use keyorder_core::{Capabilities, Client, LeaseConfig, Result};

pub mod broken;
pub mod brokers;
pub use keyorder_check::{checker, eventlog, instance, pglog};
pub mod logs;
pub mod outbox;
pub mod proxy;
pub mod scenarios;
pub mod worker;
pub mod wrap;

pub use checker::{check, Expectation, Published, Verdict};
pub use eventlog::{Event, EventLog, EventStart, MemoryEventLog};
pub use instance::Ready;
pub use scenarios::Scenario;

/// What a consumer group receives when it subscribes for the first time
/// (C17 checks the transport's answer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NewGroupStart {
    /// Everything ever published to the category (nothing was removed yet
    /// on the test broker).
    Beginning,
    /// What the broker still retains: entries that no registered group has
    /// released yet, and everything published after the subscription.
    Retained,
    /// What is published after the group's first subscription was built.
    Subscribed,
}

/// How a worker process's broker connections go through a fault proxy
/// (C19).
#[derive(Debug, Clone)]
pub struct FaultRoute {
    /// The broker's address: what the proxy forwards to.
    pub upstream: std::net::SocketAddr,
    /// The port the proxy must listen on (0: any). A broker that advertises
    /// a listener (Kafka) is reached at that port under `hosts`.
    pub port: u16,
    /// The worker's URL, with `{proxy}` standing for the proxy's
    /// `host:port`.
    pub url: String,
    /// Host names the worker alone must resolve to the proxy's address (a
    /// broker's advertised listener).
    pub hosts: Vec<String>,
}

impl FaultRoute {
    /// The worker URL through a proxy at `proxy`.
    pub fn url_via(&self, proxy: std::net::SocketAddr) -> String {
        self.url.replace("{proxy}", &proxy.to_string())
    }
}

/// What a transport gives the suite.
#[async_trait]
pub trait Harness: Send + Sync {
    /// The trial prefix (`memory`, `redis`, `rabbitmq-hash`, ...).
    fn name(&self) -> &str;

    /// The transport's capabilities in this test set-up.
    fn capabilities(&self) -> Capabilities;

    /// A new instance: a client with its own connections.
    async fn client(&self) -> Result<Client>;

    /// A reason the test broker rules a scenario out, beyond capabilities.
    fn not_applicable(&self, scenario: Scenario) -> Option<String> {
        let _ = scenario;
        None
    }

    /// A client whose configuration lacks cross-instance affinity, where the
    /// transport can be configured so (C9).
    async fn client_without_affinity(&self) -> Option<Result<Client>> {
        None
    }

    /// Lease timing for the scenarios (seconds, so a loaded machine keeps it).
    fn lease(&self) -> LeaseConfig {
        LeaseConfig::default()
    }

    /// How long a scenario may wait for a condition.
    fn deadline(&self) -> Duration {
        Duration::from_secs(90)
    }

    /// Whether ownership spreads over concurrent instances. `false` for a
    /// single-scope topology (RabbitMQ single active consumer: one instance
    /// consumes at a time by design), where C2 checks everything but spread.
    fn spreads(&self) -> bool {
        true
    }

    /// Whether a scenario that hands scopes over must let a member that
    /// just joined (or rejoined) receive work before another member leaves.
    /// `true` on the Kafka test broker: tansu 0.6 keeps a member that left
    /// during a pending rebalance as the new generation's leader, the
    /// remaining members' `SyncGroup` fails with "rebalance in progress"
    /// again and again, and the group stalls (seen in C21; Apache Kafka
    /// elects another leader).
    fn settle_joins(&self) -> bool {
        false
    }

    /// The URL a worker process connects with (process scenarios C6, C7).
    fn worker_url(&self) -> Option<String> {
        None
    }

    /// The PostgreSQL URL of the event log shared by processes.
    fn event_log_url(&self) -> String {
        std::env::var("POSTGRES_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
    }

    /// A client whose housekeeping (trimming, reaping of idle partitions,
    /// retention) runs as soon as it may, for C17 (idle thresholds of a
    /// second instead of an hour). The default is [`Harness::client`].
    async fn housekeeping_client(&self) -> Result<Client> {
        self.client().await
    }

    /// Whether this transport removes idle, drained partitions (Redis reaps
    /// a key's stream): C17 then waits until the reaped keys left
    /// [`keyorder_core::Admin::scopes`] before publishing to them again.
    fn reaps_partitions(&self) -> bool {
        false
    }

    /// A client whose category has a single scope (one slot, partition or
    /// queue), so that C18's poison key shares its scope with the healthy
    /// keys. The default is [`Harness::client`] (a transport whose scope is
    /// already shared, or is the key itself).
    async fn one_scope_client(&self) -> Result<Client> {
        self.client().await
    }

    /// How a worker process reaches the broker through a fault proxy
    /// (C19), where the harness knows.
    fn fault_route(&self) -> Option<FaultRoute> {
        None
    }

    /// What a consumer group that subscribes for the first time receives.
    fn new_group_start(&self) -> NewGroupStart {
        NewGroupStart::Retained
    }

    /// C23: why this transport's scope count cannot change while it runs
    /// (the reason C23 does not apply), or `None` when it can; then
    /// [`Harness::change_scope_count`] changes it.
    fn scope_count_fixed(&self) -> Option<String> {
        Some(format!("{}: the scope count cannot change while running", self.name()))
    }

    /// C23: changes `category`'s scope count behind keyorder's back, as an
    /// operator would; returns what changed (`4 -> 8 partitions`).
    async fn change_scope_count(&self, category: &str) -> Option<std::result::Result<String, String>> {
        let _ = category;
        None
    }

    /// C23: the longest publishers and consumers may take to notice a
    /// changed scope count (the transport's stated bound).
    fn scope_count_detect(&self) -> Duration {
        Duration::from_secs(30)
    }

    /// C24: why this harness's broker has no node to lose (one node), or
    /// `None` when it is a cluster whose nodes [`Harness::stop_node`] stops.
    fn single_node(&self) -> Option<String> {
        Some(format!(
            "{}: one broker node (the cluster trials run on a cluster of their own)",
            self.name()
        ))
    }

    /// C24: a client connected through the node [`Harness::stop_node`]
    /// will stop (the other clients connect through another node).
    async fn client_on_lost_node(&self) -> Result<Client> {
        Err(keyorder_core::Error::Config(format!("{}: one node", self.name())))
    }

    /// C24: stops the broker node that [`Harness::client_on_lost_node`]
    /// connects through, after making it lead one of the queues (or
    /// partitions) of `category`'s group `group`, as a node lost
    /// mid-stream; returns the node and the queue it led.
    async fn stop_node(&self, category: &str, group: &str) -> Result<LostNode> {
        let _ = (category, group);
        Err(keyorder_core::Error::Config(format!(
            "{}: no node to stop",
            self.name()
        )))
    }

    /// C24: the node leading `queue` now.
    async fn queue_leader(&self, queue: &str) -> Result<String> {
        let _ = queue;
        Err(keyorder_core::Error::Config(format!(
            "{}: no queue leaders",
            self.name()
        )))
    }

    /// C24: starts the node [`Harness::stop_node`] stopped again.
    async fn start_node(&self, node: &str) -> Result<()> {
        let _ = node;
        Err(keyorder_core::Error::Config(format!(
            "{}: no node to start",
            self.name()
        )))
    }

    /// Restarts the broker (C14), keeping what it persisted.
    async fn restart_broker(&self) -> Result<()> {
        Err(keyorder_core::Error::Config(format!(
            "{}: no broker restart hook",
            self.name()
        )))
    }
}

/// A broker node C24 stopped ([`Harness::stop_node`]).
#[derive(Debug, Clone)]
pub struct LostNode {
    /// The node's name on the broker (`keyorder-c2@localhost`).
    pub node: String,
    /// The queue (or partition) of the group it led when it was stopped.
    pub queue: String,
}

/// Runs every read-only operator command of `admin` on `category` (group
/// `g`), their answers ignored: the tests that check these commands create
/// nothing on the broker call it, then look at the broker.
pub async fn run_read_only_commands(admin: &dyn keyorder_core::Admin, category: &str) {
    let _ = admin.scopes(category, "g").await;
    let _ = admin.halted(category, "g").await;
    let _ = admin.hot_keys(category, "g", 10).await;
    let _ = admin.dead_letters(category, "g").await;
    let _ = admin.groups(category).await;
}

/// The one poll helper of the workspace's tests: polls `cond` every 20 ms
/// until it holds, and panics naming `what` once `deadline` passed (a
/// test's failure). The condition may be a plain or an `async` closure and
/// answers a `bool`, an `Option<T>` (the wait returns the `T`) or a
/// `Result<T, String>` whose last `Err` says in the timeout's message how
/// far it got (see [`Ready`]). Scenarios use [`instance::wait_until`], the
/// same poll returning the timeout as an `Err` instead.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let ready = std::sync::atomic::AtomicBool::new(true);
/// keyorder_testkit::until("ready", std::time::Duration::from_secs(5), async || {
///     ready.load(std::sync::atomic::Ordering::SeqCst)
/// })
/// .await;
/// let n = keyorder_testkit::until("a number", std::time::Duration::from_secs(5), async || Some(7)).await;
/// assert_eq!(n, 7);
/// # }
/// ```
pub async fn until<O: Ready>(what: &str, deadline: std::time::Duration, cond: impl AsyncFnMut() -> O) -> O::Value {
    match instance::wait_until(what, deadline, cond).await {
        Ok(value) => value,
        Err(e) => panic!("{e}"),
    }
}
