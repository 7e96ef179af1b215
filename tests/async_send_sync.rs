//! The public types and futures users hold across `.await` and move into
//! tasks are `Send` (and the shared ones `Sync`).

use keyorder::{Client, Delivery, HandlerResult, Message, Publisher, Subscription, SubscriptionBuilder};

fn send<T: Send>(_: &T) {}
fn send_sync<T: Send + Sync>() {}

#[test]
fn handles_are_send_and_sync() {
    send_sync::<Client>();
    send_sync::<Publisher>();
    send_sync::<Subscription>();
    send_sync::<SubscriptionBuilder>();
    send_sync::<Message>();
    send_sync::<Delivery>();
    send_sync::<keyorder::Error>();
}

#[test]
fn futures_are_send() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        send(&keyorder::connect("memory://"));
        let client = Client::memory();
        send(&client.publisher("orders"));
        let publisher = client.publisher("orders").await.unwrap();
        send(&publisher.publish(Message::new("x")));
        send(&client.subscribe("orders", "g").build());
        let subscription = client.subscribe("orders", "g").build().await.unwrap();
        let run = subscription.run(|_d: Delivery| async { HandlerResult::Ok(()) }, async {});
        send(&run);
        // The shutdown future is ready: the run drains and returns at once.
        run.await.unwrap();
    });
}
