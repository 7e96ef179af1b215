//! Keys as real systems have them: C12 unsafe and colliding keys, C13
//! keyless messages.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use keyorder_core::{KeyRule, KeyRules, KeySource, KeylessPolicy, Message};
use tokio::sync::Barrier;

use super::ctx::{ensure, err, stop_all, Ctx, Outcome};
use crate::checker::{Expectation, Published};
use crate::instance::{publish_keys, wait_until, Payload};

/// The keys C12 carries: what wave 1 refused, and keys that would collide
/// with another key, a lane or an internal name if an adapter put them into
/// names unencoded.
pub const C12_CARRIED_KEYS: &[&str] = &[
    "a",
    "a:dlq",
    "a:backfill",
    "a:__lease__:g",
    "a:",
    ":a",
    "dlq",
    "backfill",
    "__partitions__",
    "__keyless__",
    "customer:42",
    "tag{x}",
    "{a}",
    "%3Aa",
    "line\u{1}break",
    "\u{1}0",
    "nul\u{0}key",
    "\u{0}",
    "\u{fffd}ff",
    "\u{7f}",
];

/// C12: empty and over-long keys fail in the caller's call and store
/// nothing; every other key is carried, each in its own order, delivered
/// under its own key, colliding with no other key or internal name.
pub(super) async fn c12(ctx: &Ctx<'_>) -> Outcome {
    let rules = KeyRules::default().with_lane("backfill");
    let client = ctx.client().await?.with_key_rules(rules.clone());
    let cat = ctx.category("orders");
    let publisher = client.publisher(&cat).await.map_err(err)?;
    let cases: Vec<(String, KeyRule)> = vec![(String::new(), KeyRule::Empty), ("x".repeat(256), KeyRule::TooLong)];
    for (bad, rule) in &cases {
        match Message::new("x").with_key_rules(bad, &rules) {
            Err(e) if e.rule() == *rule => {}
            other => {
                return Err(format!(
                    "key rule {rule:?}: expected rejection, got {:?}",
                    other.map(|_| ())
                ))
            }
        }
    }
    drop(publisher);
    // Every other key is carried: interleaved, several messages each.
    let carried: Vec<String> = C12_CARRIED_KEYS.iter().map(|k| (*k).to_owned()).collect();
    let published = publish_keys(&client, &cat, &carried, 4, 0).await.map_err(err)?;
    let inst = ctx.start(ctx.ordered(&client, &cat, "g"), "i1").await?;
    ctx.wait_applied(&published, &HashSet::new()).await?;
    stop_all(vec![inst]).await?;
    let events = ctx.log.events().await.map_err(err)?;
    // Each message ran under the key it was published with (no key was
    // read back as another, e.g. a decoded name), and nothing else ran.
    let sent: HashMap<&str, &str> = published.iter().map(|p| (p.id.as_str(), p.key.as_str())).collect();
    for e in &events {
        match sent.get(e.message_id.as_str()) {
            Some(k) if *k == e.key => {}
            Some(k) => {
                return Err(format!(
                    "a message of key {} ran under key {}",
                    keyorder_core::key::redact(k),
                    keyorder_core::key::redact(&e.key)
                ))
            }
            None => return Err(format!("an unknown message {} ran", e.message_id)),
        }
    }
    ctx.verdict(&Expectation {
        published,
        ..Default::default()
    })
    .await?
    .assert_ok()
}

/// C13: keyless messages run in parallel and are counted, or are rejected;
/// a routing-key mismatch is rejected and counted.
pub(super) async fn c13(ctx: &Ctx<'_>) -> Outcome {
    const N: usize = 4;
    let client = ctx.client().await?;
    // 1. Keyless, parallel: N keyless handlers meet in one barrier.
    let cat = ctx.category("keyless");
    *ctx.switches.barrier.lock().unwrap() = Some(Arc::new(Barrier::new(N)));
    let inst = ctx.start(ctx.ordered(&client, &cat, "g").concurrency(N), "i1").await?;
    let publisher = client.publisher(&cat).await.map_err(err)?;
    let mut published = Vec::new();
    for seq in 0..N as u64 {
        let msg = Message::new(
            Payload {
                key: String::new(),
                seq,
                ..Default::default()
            }
            .encode(),
        );
        published.push(Published {
            id: msg.id().to_owned(),
            key: String::new(),
            seq,
        });
        publisher.publish(msg).await.map_err(err)?;
    }
    let res = ctx.wait_applied(&published, &HashSet::new()).await;
    *ctx.switches.barrier.lock().unwrap() = None;
    res.map_err(|e| format!("keyless messages did not run in parallel: {e}"))?;
    let keyless = inst.stats.snapshot().keyless;
    ensure(keyless == N as u64, || {
        format!("keyless counted {keyless}, expected {N}")
    })?;
    stop_all(vec![inst]).await?;

    // 2. Keyless, rejected by policy: dead-lettered, counted, never run.
    let cat = ctx.category("reject");
    let before = ctx.log.events().await.map_err(err)?.len();
    let publisher = client.publisher(&cat).await.map_err(err)?;
    for seq in 0..3 {
        publisher
            .publish(Message::new(
                Payload {
                    seq,
                    ..Default::default()
                }
                .encode(),
            ))
            .await
            .map_err(err)?;
    }
    let keyed = publish_keys(&client, &cat, &["keyed".to_owned()], 1, 0)
        .await
        .map_err(err)?;
    let inst = ctx
        .start(ctx.ordered(&client, &cat, "g").keyless(KeylessPolicy::Reject), "i2")
        .await?;
    ctx.wait_applied(&keyed, &HashSet::new()).await?;
    let admin = client.admin();
    wait_until("3 keyless messages to be dead-lettered", ctx.h.deadline(), || {
        let admin = admin.clone();
        let cat = cat.clone();
        async move {
            admin
                .dead_letters(&cat, "g")
                .await
                .map(|d| d.len() == 3)
                .unwrap_or(false)
        }
    })
    .await?;
    let s = inst.stats.snapshot();
    ensure(s.keyless_rejected == 3, || format!("keyless_rejected: {s:?}"))?;
    stop_all(vec![inst]).await?;
    let ran = ctx.log.events().await.map_err(err)?.len() - before;
    ensure(ran == 1, || format!("rejected keyless messages ran: {ran} runs"))?;

    // 3. Routing-key mismatch: the selected key differs from the routed one.
    let cat = ctx.category("mismatch");
    let publisher = client.publisher(&cat).await.map_err(err)?;
    let body =
        |customer: &str, seq: u64| serde_json::json!({"key": customer, "seq": seq, "customer": customer}).to_string();
    let good = Message::new(body("c-1", 0)).with_key("c-1").map_err(err)?;
    let good_id = good.id().to_owned();
    publisher.publish(good).await.map_err(err)?;
    let bad = Message::new(body("c-9", 0)).with_key("c-2").map_err(err)?;
    let bad_id = bad.id().to_owned();
    publisher.publish(bad).await.map_err(err)?;
    let inst = ctx
        .start(
            client
                .subscribe(&cat, "g")
                .ordered_by(KeySource::field("customer"))
                .lease(ctx.h.lease()),
            "i3",
        )
        .await?;
    let good_pub = vec![Published {
        id: good_id,
        key: "c-1".into(),
        seq: 0,
    }];
    ctx.wait_applied(&good_pub, &HashSet::new()).await?;
    wait_until("the mismatched delivery to be rejected", ctx.h.deadline(), || {
        let stats = inst.stats.clone();
        async move { stats.snapshot().key_mismatches == 1 }
    })
    .await?;
    stop_all(vec![inst]).await?;
    let ran_bad = ctx.applied_count(|e| e.message_id == bad_id).await;
    ensure(ran_bad == 0, || "a mismatched delivery was processed".into())
}
