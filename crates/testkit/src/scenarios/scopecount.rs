//! C23: the scope count changed while publishers and consumers run.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use keyorder_core::{Error, Message};

use super::ctx::{ensure, err, Ctx, Outcome};
use crate::checker::Published;
use crate::instance::{keys, publish_keys, Payload};

/// C23: a category flows (a publisher held open, one subscription); the
/// harness changes its scope count behind keyorder's back, as an operator
/// would (Kafka: partitions added). Checks, from what happened:
/// - the open publisher refuses a publish within the harness's stated time
///   ([`crate::Harness::scope_count_detect`]), with an [`Error::Config`]
///   that names the change; a publisher opened afterwards is refused at
///   once, and so is a new subscription;
/// - the running subscription stops (its run ends with an
///   [`Error::Config`] naming the change) within the same time;
/// - nothing was applied out of order: per key, the applied sequences only
///   go up; every message published before the change was applied;
/// - the operator's `scopes` view says the layout changed.
pub(crate) async fn c23(ctx: &Ctx<'_>) -> Outcome {
    let bound = ctx.h.scope_count_detect();
    let cat = ctx.category("count");
    let client = ctx.client().await?;
    let ks = keys("n", 12);
    let mut published = publish_keys(&client, &cat, &ks, 3, 0).await.map_err(err)?;
    let inst = ctx.start(ctx.ordered(&client, &cat, "g"), "i1").await?;
    ctx.wait_applied(&published, &HashSet::new()).await?;

    // A publisher that stays open across the change, publishing a round of
    // every key every 20 ms.
    let publisher = client.publisher(&cat).await.map_err(err)?;
    let mut seq = 3u64;
    // A few rounds before the change, through the same publisher, so that
    // messages of every key are in flight across it.
    for _ in 0..3 {
        for key in &ks {
            let payload = Payload {
                key: key.clone(),
                seq,
                sleep_ms: 0,
                poison: false,
            };
            let msg = Message::new(payload.encode()).with_key(key).map_err(err)?;
            let id = msg.id().to_owned();
            publisher.publish(msg).await.map_err(err)?;
            published.push(Published {
                id,
                key: key.clone(),
                seq,
            });
        }
        seq += 1;
    }
    let change = ctx
        .h
        .change_scope_count(&cat)
        .await
        .ok_or_else(|| format!("{}: no scope count change hook", ctx.h.name()))??;
    let changed_at = tokio::time::Instant::now();
    let refused = 'publishing: loop {
        for key in &ks {
            let payload = Payload {
                key: key.clone(),
                seq,
                sleep_ms: 0,
                poison: false,
            };
            let msg = Message::new(payload.encode()).with_key(key).map_err(err)?;
            let id = msg.id().to_owned();
            match publisher.publish(msg).await {
                Ok(()) => published.push(Published {
                    id,
                    key: key.clone(),
                    seq,
                }),
                Err(e) => break 'publishing e,
            }
        }
        seq += 1;
        ensure(changed_at.elapsed() < bound, || {
            format!(
                "the open publisher still published {} s after the scope count changed ({change})",
                bound.as_secs()
            )
        })?;
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let publisher_s = changed_at.elapsed().as_secs_f64();
    ensure(matches!(refused, Error::Config(_)), || {
        format!("the open publisher failed with {refused:?}, not a configuration error naming the change")
    })?;
    ensure(names_the_change(&refused), || {
        format!("the publisher's error does not name the change and its fix: {refused}")
    })?;

    // The running subscription stops, naming the change.
    let deadline = changed_at + bound;
    while !inst.is_finished() {
        ensure(tokio::time::Instant::now() < deadline, || {
            format!(
                "the subscription still ran {} s after the scope count changed ({change})",
                bound.as_secs()
            )
        })?;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let consumer_s = changed_at.elapsed().as_secs_f64();
    let stopped = match inst.stop().await {
        Ok(_) => return Err("the subscription ended without an error after the scope count changed".into()),
        Err(e) => e,
    };
    ensure(names_the_change_text(&stopped), || {
        format!("the subscription's error does not name the change: {stopped}")
    })?;

    // Whoever comes later is refused at once: a new client's publisher and
    // subscription.
    let late = ctx.client().await?;
    match late.publisher(&cat).await {
        Err(e @ Error::Config(_)) if names_the_change(&e) => {}
        Err(e) => return Err(format!("a publisher opened after the change failed with {e:?}")),
        Ok(p) => {
            let msg = Message::new(b"late".to_vec()).with_key("n-0").map_err(err)?;
            match p.publish(msg).await {
                Err(e @ Error::Config(_)) if names_the_change(&e) => {}
                other => return Err(format!("a publisher opened after the change published: {other:?}")),
            }
        }
    }
    match ctx.ordered(&late, &cat, "g").instance_id("late").build().await {
        Err(e @ Error::Config(_)) if names_the_change(&e) => {}
        Err(e) => return Err(format!("a subscription built after the change failed with {e:?}")),
        Ok(_) => return Err("a subscription built after the change was accepted".into()),
    }

    // The operator's view says so.
    let scopes = client.admin().scopes(&cat, "g").await;
    let shown = match &scopes {
        Ok(list) => list.iter().any(|s| s.scope.contains("layout")),
        Err(e) => names_the_change(e),
    };
    ensure(shown, || {
        format!("`scopes` does not show the changed layout: {scopes:?}")
    })?;

    // Nothing out of order; everything published before the change applied.
    let events = ctx.log.events().await.map_err(err)?;
    let mut last: HashMap<&str, u64> = HashMap::new();
    for e in events.iter().filter(|e| e.ok) {
        if let Some(prev) = last.insert(e.key.as_str(), e.seq) {
            ensure(e.seq > prev, || {
                format!(
                    "key {} applied seq {} after seq {prev}: reordered across the change",
                    e.key, e.seq
                )
            })?;
        }
    }
    let applied: HashSet<&str> = events.iter().filter(|e| e.ok).map(|e| e.message_id.as_str()).collect();
    let before: Vec<&Published> = published.iter().filter(|p| p.seq < 3).collect();
    ensure(before.iter().all(|p| applied.contains(p.id.as_str())), || {
        "a message published before the change was not applied".to_owned()
    })?;
    tracing::info!(
        change = %change,
        publisher_s,
        consumer_s,
        "c23: the publisher and the subscription stopped after the change"
    );
    Ok(())
}

fn names_the_change(e: &Error) -> bool {
    names_the_change_text(&e.to_string())
}

fn names_the_change_text(text: &str) -> bool {
    text.contains("layout") && text.contains("Fix")
}
