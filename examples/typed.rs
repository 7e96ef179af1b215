//! Typed payloads: publish Rust values as JSON, decode them in the handler,
//! and see an undecodable message halt its key (poison), not vanish.
//!
//! `cargo run --example typed --features serde` (on `memory://`), or with
//! another broker:
//! `KEYORDER_URL=postgres://postgres@127.0.0.1:5432/test?migrate=true cargo run --example typed --features serde,postgres`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use keyorder::{connect, Delivery, HandlerResult, KeySource, Message, PoisonPolicy, Settlement};
use serde::{Deserialize, Serialize};

#[derive(Debug, Serialize, Deserialize)]
struct OrderEvent {
    order: u64,
    step: String,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("KEYORDER_URL").unwrap_or_else(|_| "memory://".into());
    let transport = connect(&url).await?;
    let category = format!("typed-orders-{}", std::process::id());

    // Producer side: `Message::json` encodes the value and stamps
    // `keyorder-content-type: application/json`; the builder goes on as usual.
    let orders = transport.publisher(&category).await?;
    for order in [1_u64, 2] {
        for step in ["created", "paid", "shipped"] {
            let event = OrderEvent {
                order,
                step: step.into(),
            };
            orders
                .publish(Message::json(&event)?.with_key(format!("order-{order}"))?)
                .await?;
        }
    }
    // A producer bug: a payload that is no `OrderEvent`.
    orders
        .publish(Message::new(r#"{"order":"three","step":"created"}"#).with_key("order-3")?)
        .await?;

    let (halted_tx, halted_rx) = tokio::sync::oneshot::channel::<()>();
    let halted_tx = std::sync::Mutex::new(Some(halted_tx));
    let subscription = transport
        .subscribe(&category, "billing")
        .ordered_by(KeySource::routing_key())
        .poison(PoisonPolicy::Halt)
        .on_settled(move |s| {
            if s.settlement == Settlement::Halted {
                if let Some(tx) = halted_tx.lock().unwrap().take() {
                    let _ = tx.send(());
                }
            }
        })
        .build()
        .await?;

    let applied = Arc::new(AtomicUsize::new(0));
    let all_done = Arc::new(tokio::sync::Notify::new());
    let handler = {
        let (applied, all_done) = (applied.clone(), all_done.clone());
        move |d: Delivery| {
            let (applied, all_done) = (applied.clone(), all_done.clone());
            async move {
                // A payload that does not decode is poison: the key halts
                // here at once (or is parked, with `PoisonPolicy::Park`).
                let event: OrderEvent = d.json()?;
                println!("order {} {} (key {})", event.order, event.step, d.key().unwrap());
                if applied.fetch_add(1, Ordering::SeqCst) + 1 == 6 {
                    all_done.notify_one();
                }
                HandlerResult::Ok(())
            }
        }
    };
    let report = subscription
        .run(handler, async move {
            all_done.notified().await;
            let _ = halted_rx.await;
        })
        .await?;
    println!("applied {} messages", report.stats.applied);

    // What an operator sees (`keyorder halted`): the key's label, never its
    // value, and the decode error as the reason.
    for head in transport.admin().halted(&category, "billing").await? {
        println!("halted {} at {}: {}", head.label, head.head_id, head.reason);
    }
    Ok(())
}
