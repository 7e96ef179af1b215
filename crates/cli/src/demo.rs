//! `keyorder demo`: several instances, many keys, a randomly slow handler.

use std::sync::atomic::Ordering;
use std::time::Duration;

use clap::Args;
use keyorder_check::{check, EventLog, Expectation};
use rand::Rng;

use crate::{progress, run};

#[derive(Debug, Args)]
pub(crate) struct DemoArgs {
    /// The transport URL.
    #[arg(long, hide_env_values = true, env = "KEYORDER_URL", default_value = "memory://")]
    url: String,
    /// Consumer instances.
    #[arg(long, default_value_t = 3)]
    instances: usize,
    /// Distinct keys.
    #[arg(long, default_value_t = 200)]
    keys: usize,
    /// Messages in all.
    #[arg(long, default_value_t = 5_000)]
    messages: u64,
    /// The handler sleeps a random 0..=N ms.
    #[arg(long, default_value_t = 5)]
    max_handler_ms: u64,
    /// Handlers running at once per instance.
    #[arg(long, default_value_t = 64)]
    concurrency: usize,
    /// Print one JSON object as the last line on stdout, and draw no
    /// progress (progress shows only when stderr is a terminal anyway).
    #[arg(long)]
    json: bool,
}

pub(crate) async fn run(a: DemoArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        a.instances >= 1 && a.keys >= 1 && a.messages >= 1,
        "instances, keys and messages must be >= 1"
    );
    let clients = run::clients(&a.url, a.instances).await?;
    let category = format!("keyorder-demo-{}", &uuid_like()[..8]);
    let rec = run::Recorder::new();
    let mut instances = Vec::new();
    let mut ids = Vec::new();
    for (i, client) in clients.iter().enumerate() {
        let id = format!("instance-{i}");
        instances.push(
            run::start(
                run::builder(client, &category, true, a.concurrency),
                id.clone(),
                rec.clone(),
            )
            .await?,
        );
        ids.push(id);
    }
    // Let ownership spread over the instances before messages flow (where
    // partitions exist before the first publish: not with a stream per key).
    let admin = clients[0].admin();
    let fixed = !clients[0].capabilities().dynamic_partitions;
    let settle = if !fixed {
        Ok(())
    } else {
        run::wait_for_async(
            "ownership to spread over the instances",
            Duration::from_secs(20),
            || {
                let (admin, category) = (admin.clone(), category.clone());
                let want = a.instances;
                async move {
                    let owners: std::collections::HashSet<String> = admin
                        .scopes(&category, run::GROUP)
                        .await
                        .unwrap_or_default()
                        .into_iter()
                        .filter_map(|s| s.owner)
                        .collect();
                    owners.len() >= want
                }
            },
        )
        .await
    };
    if let Err(e) = settle {
        eprintln!("warning: {e}; continuing");
    }
    eprintln!(
        "demo on {}: {} instances, {} keys, {} messages, handler 0..={} ms",
        clients[0].transport_name(),
        a.instances,
        a.keys,
        a.messages,
        a.max_handler_ms
    );
    let keys: Vec<String> = (0..a.keys).map(|i| format!("customer-{i}")).collect();
    let bar = progress::bar(a.messages, "demo", "applied", a.json);
    let max = a.max_handler_ms;
    let producer = {
        let clients = clients.clone();
        let category = category.clone();
        tokio::spawn(async move {
            run::produce(
                &clients,
                &category,
                &keys,
                a.messages,
                move || rand::rng().random_range(0..=max),
                4,
                None,
            )
            .await
        })
    };
    let follow = {
        let rec = rec.clone();
        progress::Follow::new(&bar, move || rec.applied.load(Ordering::Relaxed))
    };
    let published = producer.await??;
    let target = published.len() as u64;
    let deadline = Duration::from_secs(60 + target / 50);
    let outcome = run::wait_for("every message to be applied", deadline, || {
        rec.applied.load(Ordering::Relaxed) >= target
    })
    .await;
    drop(follow);
    bar.set_position(rec.applied.load(Ordering::Relaxed));
    bar.finish();
    for i in instances {
        i.stop().await?;
    }
    outcome?;
    let events = rec.log.events().await?;
    let verdict = check(
        &events,
        &Expectation {
            published,
            spread_over: ids,
            ..Default::default()
        },
    );
    let secs = rec.busy_secs();
    println!(
        "violations={} lost={} duplicates={} throughput={:.0} msg/s ({} messages in {:.2} s)",
        verdict.order.len(),
        verdict.lost.len(),
        verdict.duplicates,
        target as f64 / secs.max(1e-9),
        target,
        secs
    );
    if a.json {
        println!(
            "{}",
            serde_json::json!({
                "transport": clients[0].transport_name(),
                "instances": a.instances,
                "keys": a.keys,
                "messages": target,
                "max_handler_ms": a.max_handler_ms,
                "concurrency": a.concurrency,
                "violations": verdict.order.len(),
                "lost": verdict.lost.len(),
                "duplicates": verdict.duplicates,
                "msgs_per_s": target as f64 / secs.max(1e-9),
                "secs": secs,
                "ok": verdict.is_ok(),
            })
        );
    }
    if !verdict.is_ok() {
        anyhow::bail!("the checker found defects: {verdict}");
    }
    Ok(())
}

pub(crate) fn uuid_like() -> String {
    let mut rng = rand::rng();
    (0..16)
        .map(|_| char::from_digit(rng.random_range(0..16), 16).unwrap_or('0'))
        .collect()
}
