//! `keyorder failover`: how long a key waits after its owner is killed.
//!
//! A worker process (this binary, re-executed) owns every scope and is held
//! inside a handler; it is killed with `kill -9`; a second instance starts
//! and waits for the dead owner's leases to expire. The fail-over time is
//! from the kill to the first message the second instance applies, both on
//! the event store's clock (PostgreSQL). The checker then judges order and
//! loss over the whole run.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use keyorder::{KeySource, LeaseConfig};
use keyorder_check::instance::{keys, publish_keys, Instance, Switches};
use keyorder_check::pglog::PgEventLog;
use keyorder_check::worker::{WorkerConfig, WorkerProcess};
use keyorder_check::{check, EventLog, Expectation};

use crate::demo::uuid_like;
use crate::{progress, run};

#[derive(Debug, Args)]
pub(crate) struct FailoverArgs {
    /// The transport URL (a transport whose consumers can run as processes).
    #[arg(long, hide_env_values = true, env = "KEYORDER_URL")]
    url: String,
    /// PostgreSQL URL of the event log (default: POSTGRES_URL, or the URL itself if it is postgres://).
    #[arg(long, hide_env_values = true, env = "POSTGRES_URL")]
    log_url: Option<String>,
    /// Distinct keys.
    #[arg(long, default_value_t = 20)]
    keys: usize,
    /// Lease TTL in ms.
    #[arg(long, default_value_t = 10_000)]
    ttl_ms: u64,
    /// Heartbeat in ms.
    #[arg(long, default_value_t = 2_000)]
    heartbeat_ms: u64,
    /// Self-fence margin in ms.
    #[arg(long, default_value_t = 3_000)]
    margin_ms: u64,
    /// The killed process comes back under its own instance id (a
    /// supervisor's restart) instead of another instance taking over.
    #[arg(long)]
    restart: bool,
    /// Print one JSON object as the last line on stdout, and draw no
    /// progress (progress shows only when stderr is a terminal anyway).
    #[arg(long)]
    json: bool,
}

pub(crate) async fn run(a: FailoverArgs) -> anyhow::Result<()> {
    let url = run::with_setup(&a.url);
    let log_url = match (&a.log_url, PgEventLog::can_open(&url)) {
        (Some(u), _) => u.clone(),
        (None, true) => a.url.clone(),
        (None, false) => anyhow::bail!("--log-url (or POSTGRES_URL) is needed for the event log"),
    };
    let run_id = format!("failover-{}", &uuid_like()[..10]);
    let log = Arc::new(PgEventLog::connect(&log_url, &run_id).await?);
    let category = format!("keyorder-failover-{}", &uuid_like()[..8]);
    let lease = LeaseConfig {
        ttl: Duration::from_millis(a.ttl_ms),
        heartbeat: Duration::from_millis(a.heartbeat_ms),
        margin: Duration::from_millis(a.margin_ms),
    };
    let w1 = WorkerProcess::spawn(&WorkerConfig {
        url: url.clone(),
        category: category.clone(),
        group: "g".into(),
        instance: "w1".into(),
        log_url,
        run: run_id,
        hold_from_seq: Some(3),
        hold_ms: 3_600_000,
        concurrency: 64,
        lease_ms: (a.ttl_ms, a.heartbeat_ms, a.margin_ms),
        crash_on_poison: false,
        park_after: None,
        max_attempts: None,
    })
    .await
    .map_err(anyhow::Error::msg)?;
    let client = keyorder::connect(&url).await?;
    let published = publish_keys(&client, &category, &keys("key", a.keys), 10, 0).await?;
    let spin = progress::spinner("failover", "waiting for the owner to be inside a handler", a.json);
    let held = log.clone();
    run::wait_for_async("the owner to be inside a handler", Duration::from_secs(60), || {
        let held = held.clone();
        async move {
            let events = held.events().await.unwrap_or_default();
            events
                .iter()
                .any(|e| e.instance == "w1" && e.seq >= 3 && e.end.is_none())
        }
    })
    .await?;
    let killed_at = log.now().await?;
    w1.kill9().await.map_err(anyhow::Error::msg)?;
    progress::suspend(|| eprintln!("killed the owner (kill -9) inside a handler; a second instance takes over"));
    spin.set_message(format!(
        "waiting for the takeover (lease ttl {} ms) and every message to be applied",
        a.ttl_ms
    ));
    let builder = client
        .subscribe(&category, "g")
        .ordered_by(KeySource::routing_key())
        .lease(lease);
    // A restart keeps the instance id ("w1"); the log calls it "i2" either way.
    let instance_id = if a.restart { "w1" } else { "i2" };
    let i2 = Instance::start_as(builder, instance_id, "i2", log.clone(), Arc::new(Switches::default())).await?;
    let want: HashSet<String> = published.iter().map(|p| p.id.clone()).collect();
    let all = log.clone();
    run::wait_for_async(
        "every message to be applied",
        Duration::from_secs(120 + 3 * a.ttl_ms / 1000),
        || {
            let (all, want) = (all.clone(), want.clone());
            async move {
                let events = all.events().await.unwrap_or_default();
                let done: HashSet<&str> = events.iter().filter(|e| e.ok).map(|e| e.message_id.as_str()).collect();
                want.iter().all(|id| done.contains(id.as_str()))
            }
        },
    )
    .await?;
    spin.finish_and_clear();
    i2.stop().await.map_err(anyhow::Error::msg)?;
    let events = log.events().await?;
    let first = events
        .iter()
        .filter(|e| e.instance == "i2")
        .map(|e| e.start)
        .min()
        .ok_or_else(|| anyhow::anyhow!("the second instance applied nothing"))?;
    let verdict = check(
        &events,
        &Expectation {
            published,
            kills: vec![("w1".into(), killed_at)],
            ..Default::default()
        },
    );
    let failover_ms = first.saturating_sub(killed_at) as f64 / 1000.0;
    println!(
        "failover {failover_ms:.0} ms after kill -9, {} (lease ttl {} ms, heartbeat {} ms); {verdict}",
        if a.restart {
            "restarted under its instance id"
        } else {
            "another instance takes over"
        },
        a.ttl_ms,
        a.heartbeat_ms
    );
    if a.json {
        println!(
            "{}",
            serde_json::json!({
                "failover_ms": failover_ms,
                "restart": a.restart,
                "keys": a.keys,
                "ttl_ms": a.ttl_ms,
                "heartbeat_ms": a.heartbeat_ms,
                "margin_ms": a.margin_ms,
                "violations": verdict.order.len(),
                "lost": verdict.lost.len(),
                "duplicates": verdict.duplicates,
                "ok": verdict.is_ok(),
            })
        );
    }
    if !verdict.is_ok() {
        anyhow::bail!("the checker found defects: {verdict}");
    }
    Ok(())
}
