//! The transactional outbox end to end: stage records inside business
//! transactions, relay them with two relays, consume them ordered by key.
//!
//! `cargo run --example outbox --features postgres` (PostgreSQL at
//! `POSTGRES_URL`, default `postgres://postgres@127.0.0.1:5432/test`; the
//! relays publish to the in-memory transport; set `KEYORDER_URL` to publish
//! to a broker instead, e.g. `redis://127.0.0.1:6379` with `--features redis`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use keyorder::{connect, Client, Delivery, HandlerResult, KeySource};
use keyorder_outbox::{Outbox, OutboxConfig, Outgoing, RelayConfig, SequenceGuard};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let db = std::env::var("POSTGRES_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let outbox = Outbox::connect(
        &db,
        4,
        OutboxConfig {
            schema: "keyorder_outbox_example".into(),
            ..OutboxConfig::default()
        },
    )
    .await?;
    outbox.migrate().await?;
    let client: Client = match std::env::var("KEYORDER_URL") {
        Ok(url) => connect(&url).await?,
        Err(_) => Client::memory(),
    };
    let category = format!("payments-{}", std::process::id());

    // Producer: each record commits with the business change (here: none).
    for step in 0..5 {
        for account in ["acct-1", "acct-2", "acct-3"] {
            let mut tx = outbox.pool().begin().await?;
            outbox
                .stage(&mut tx, Outgoing::new(&category, account, format!("step {step}")))
                .await?;
            tx.commit().await?;
        }
    }

    // Two relays at once: no key is ever published by both.
    let stop = Arc::new(tokio::sync::Notify::new());
    let mut relays = Vec::new();
    for _ in 0..2 {
        let relay = outbox.relay(client.clone(), RelayConfig::default());
        let stop = stop.clone();
        relays.push(tokio::spawn(relay.run(async move { stop.notified().await })));
    }

    // Consumer: ordered by key; SequenceGuard drops stale repeats.
    let seen: Arc<Mutex<HashMap<String, Vec<String>>>> = Arc::default();
    let done = Arc::new(tokio::sync::Notify::new());
    let handler = {
        let (seen, done) = (seen.clone(), done.clone());
        move |d: Delivery| {
            let (seen, done) = (seen.clone(), done.clone());
            async move {
                let key = d.key().map(|k| k.as_str().to_owned()).unwrap_or_default();
                let body = String::from_utf8_lossy(d.payload()).into_owned();
                let mut seen = seen.lock().unwrap();
                seen.entry(key).or_default().push(body);
                if seen.values().map(Vec::len).sum::<usize>() == 15 {
                    done.notify_one();
                }
                HandlerResult::Ok(())
            }
        }
    };
    let subscription = client
        .subscribe(&category, "ledger")
        .ordered_by(KeySource::routing_key())
        .build()
        .await?;
    subscription
        .run(SequenceGuard::in_memory(handler, 10_000), async move {
            done.notified().await
        })
        .await?;
    stop.notify_waiters();
    for r in relays {
        r.await??;
    }
    for (key, steps) in seen.lock().unwrap().iter() {
        println!("{key}: {}", steps.join(", "));
    }
    Ok(())
}
