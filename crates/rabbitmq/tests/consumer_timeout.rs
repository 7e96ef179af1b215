//! RabbitMQ's `consumer_timeout` would redeliver a halted head (it stays
//! unacknowledged): on the real broker, an ordered subscription starts only
//! where that cannot happen unannounced. From 3.11.15 on each consumer sets
//! its own timeout; before, the URL must state the broker's setting.

// Shared set-up; this file uses only part of it.
#[allow(dead_code)]
mod common;

use common::base;
use std::sync::Arc;

use keyorder_core::{Client, Error, KeySource};
use keyorder_rabbitmq::RabbitTransport;

async fn transport(options: &str) -> RabbitTransport {
    let url = format!(
        "{}?topology=hash&queues=2&queue_type=classic&expires_ms=60000{options}",
        base()
    );
    common::connect(&url).await
}

async fn build(t: RabbitTransport, category: &str) -> keyorder_core::Result<()> {
    let client = Client::new(Arc::new(t));
    let sub = client
        .subscribe(category, "g")
        .ordered_by(KeySource::routing_key())
        .build()
        .await?;
    drop(sub);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ordered_start_needs_a_consumer_timeout_that_spares_halted_heads() {
    let category = format!("ct-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let unstated = transport("").await;
    let version = unstated.broker_version().await.expect("the broker tells its version");
    let parts: Vec<&str> = version.split('.').collect();
    assert!(
        parts.len() >= 2 && parts[0].parse::<u32>().is_ok() && parts[1].parse::<u32>().is_ok(),
        "not a version: {version}"
    );
    let (major, minor): (u32, u32) = (parts[0].parse().unwrap(), parts[1].parse().unwrap());
    let patch: u32 = parts.get(2).and_then(|p| p.parse().ok()).unwrap_or(0);
    let per_consumer = (major, minor, patch) >= (3, 11, 15);

    let first = build(unstated, &category).await;
    if per_consumer {
        // The consumer sets its own timeout: nothing to state.
        first.unwrap_or_else(|e| panic!("RabbitMQ {version} takes x-consumer-timeout: {e}"));
    } else {
        let e = first.expect_err("an old broker's consumer_timeout is unknown: refused");
        assert!(matches!(e, Error::Config(_)), "{e:?}");
        let text = e.to_string();
        for fix in [
            version.as_str(),
            "consumer_timeout = <ms>",
            "consumer_timeout_ms=",
            "3.11.15",
        ] {
            assert!(text.contains(fix), "the error names `{fix}`: {text}");
        }
    }
    // Stated (what scripts/services configures): it starts on any version.
    build(transport("&consumer_timeout_ms=3600000").await, &category)
        .await
        .expect("a stated consumer_timeout starts");
    build(transport("&consumer_timeout_ms=off").await, &category)
        .await
        .expect("consumer_timeout off starts");
    // An unordered (plain) subscription never halts: no check.
    let plain = RabbitTransport::from_url(&format!("{}?topology=plain&expires_ms=60000", base()).parse().unwrap())
        .await
        .unwrap();
    let client = Client::new(Arc::new(plain));
    client
        .subscribe(&format!("{category}-plain"), "g")
        .build()
        .await
        .expect("an unordered subscription starts without it");
}

#[test]
fn a_bad_value_names_the_accepted_ones() {
    for bad in ["5", "abc", "-1", "3000000000"] {
        let url = format!("{}?topology=hash&consumer_timeout_ms={bad}", base());
        let e = keyorder_rabbitmq::RabbitConfig::from_url(&url.parse().unwrap()).unwrap_err();
        assert!(e.to_string().contains("`off` or a whole number of ms"), "{bad}: {e}");
    }
}
