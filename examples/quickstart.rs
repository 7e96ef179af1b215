//! The quick start: publish keyed messages, consume them ordered by key.
//!
//! `cargo run --example quickstart` (on `memory://`), or with another broker:
//! `KEYORDER_URL=redis://127.0.0.1:6379 cargo run --example quickstart --features redis`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use keyorder::{connect, Delivery, HandlerResult, KeySource, Message, PoisonPolicy, Strategy};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("KEYORDER_URL").unwrap_or_else(|_| "memory://".into());
    let transport = connect(&url).await?;

    // Producer side: the key is validated here, in the caller's call.
    let orders = transport.publisher("orders").await?;
    for step in ["created", "paid", "shipped"] {
        for client in ["client-1", "client-2", "client-3"] {
            orders.publish(Message::new(step).with_key(client)?).await?;
        }
    }

    // Consumer side: every option is checked here, before any message flows.
    let subscription = transport
        .subscribe("orders", "billing")
        .ordered_by(KeySource::routing_key())
        .strategy(Strategy::Auto)
        .concurrency(64)
        .poison(PoisonPolicy::Halt)
        .build()
        .await?;

    let seen = Arc::new(AtomicUsize::new(0));
    let all_done = Arc::new(tokio::sync::Notify::new());
    let handler = {
        let (seen, all_done) = (seen.clone(), all_done.clone());
        move |d: Delivery| {
            let (seen, all_done) = (seen.clone(), all_done.clone());
            async move {
                let step = String::from_utf8_lossy(d.payload());
                println!(
                    "{} {step} (attempt {}, token {})",
                    d.key().unwrap(),
                    d.attempt(),
                    d.fencing_token()
                );
                if seen.fetch_add(1, Ordering::SeqCst) + 1 == 9 {
                    all_done.notify_one();
                }
                HandlerResult::Ok(())
            }
        }
    };
    // Runs until the shutdown future completes, then drains in-flight work.
    let report = subscription
        .run(handler, async move { all_done.notified().await })
        .await?;
    println!("applied {} messages", report.stats.applied);
    Ok(())
}
