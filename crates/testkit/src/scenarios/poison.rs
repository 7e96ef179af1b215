//! Poison: C4 halt on poison and the operator's release, C5 park and release.

use std::collections::HashSet;
use std::sync::atomic::Ordering;

use keyorder_core::{HeadAction, Message, PoisonPolicy};

use super::ctx::{ensure, err, stop_all, Ctx, Outcome};
use crate::checker::{Expectation, Published};
use crate::instance::{keys, wait_until, Payload};

/// C4: a poison head halts its key; other keys complete; skip and resume release it in order.
pub(super) async fn c4(ctx: &Ctx<'_>) -> Outcome {
    let client = ctx.client().await?;
    let cat = ctx.category("orders");
    let admin = client.admin();
    ctx.switches.broken.store(true, Ordering::SeqCst);
    let publisher = client.publisher(&cat).await.map_err(err)?;
    let mut published = Vec::new();
    let (skip_key, resume_key) = ("halt-skip".to_owned(), "halt-resume".to_owned());
    let healthy = keys("ok", 6);
    for seq in 0..5u64 {
        for key in healthy.iter().chain([&skip_key, &resume_key]) {
            let poison = seq == 2 && (key == &skip_key || key == &resume_key);
            let payload = Payload {
                key: key.clone(),
                seq,
                sleep_ms: 0,
                poison,
            };
            let msg = Message::new(payload.encode()).with_key(key).map_err(err)?;
            published.push(Published {
                id: msg.id().to_owned(),
                key: key.clone(),
                seq,
            });
            publisher.publish(msg).await.map_err(err)?;
        }
    }
    let inst = ctx
        .start(ctx.ordered(&client, &cat, "g").poison(PoisonPolicy::Halt), "i1")
        .await?;
    let healthy_ids: Vec<Published> = published.iter().filter(|p| p.key.starts_with("ok-")).cloned().collect();
    ctx.wait_applied(&healthy_ids, &HashSet::new()).await?;
    wait_until("both poisoned keys to show as halted", ctx.h.deadline(), || {
        let admin = admin.clone();
        let cat = cat.clone();
        async move { admin.halted(&cat, "g").await.map(|h| h.len() == 2).unwrap_or(false) }
    })
    .await?;
    let halted = admin.halted(&cat, "g").await.map_err(err)?;
    ensure(halted.iter().all(|h| h.attempts == 3), || {
        format!("halted heads should show 3 attempts: {halted:?}")
    })?;
    for key in [&skip_key, &resume_key] {
        let later = ctx.applied_count(|e| &e.key == key && e.seq >= 2).await;
        ensure(later == 0, || {
            format!("a halted key applied {later} events at or after its poison head")
        })?;
    }
    ensure(admin.dead_letters(&cat, "g").await.map_err(err)?.is_empty(), || {
        "halt dead-lettered something".into()
    })?;
    // The dispatcher counts the halt right after the broker recorded it.
    wait_until("the subscription to count both halted keys", ctx.h.deadline(), || {
        let stats = inst.stats.clone();
        async move { stats.snapshot().halted_now == 2 }
    })
    .await?;
    // Health: degraded by the halts, still live and ready (a probe must
    // not restart a process for a halted key).
    wait_until("health to report both halts as degraded", ctx.h.deadline(), || {
        let report = inst.health.check();
        async move { report.degraded && report.halted_keys == 2 }
    })
    .await?;
    let report = inst.health.check();
    ensure(report.live && report.ready && report.status() == "degraded", || {
        format!("a halted key must degrade, not kill or unready: {report:?}")
    })?;
    ensure(report.reasons.iter().any(|r| r.contains("halted")), || {
        format!("the reasons should name the halt: {report:?}")
    })?;

    // Operator: skip one head (released in order without it) ...
    admin
        .resolve(&cat, "g", &skip_key, HeadAction::Skip)
        .await
        .map_err(err)?;
    let skipped: HashSet<String> = published
        .iter()
        .filter(|p| p.key == skip_key && p.seq == 2)
        .map(|p| p.id.clone())
        .collect();
    let skip_rest: Vec<Published> = published.iter().filter(|p| p.key == skip_key).cloned().collect();
    ctx.wait_applied(&skip_rest, &skipped).await?;
    // ... and resume the other once the cause is fixed (its head runs again).
    ctx.switches.broken.store(false, Ordering::SeqCst);
    let label = keyorder_core::OrderingKey::new(&resume_key).map_err(err)?.label();
    ensure(halted.iter().any(|h| h.label == label), || {
        "the resume key is not listed as halted".into()
    })?;
    admin
        .resolve(&cat, "g", &label, HeadAction::Resume)
        .await
        .map_err(err)?;
    ctx.wait_applied(&published, &skipped).await?;
    ensure(admin.dead_letters(&cat, "g").await.map_err(err)?.is_empty(), || {
        "resume dead-lettered something".into()
    })?;
    wait_until(
        "health to be healthy once both halts are resolved",
        ctx.h.deadline(),
        || {
            let report = inst.health.check();
            async move { report.status() == "healthy" && report.reasons.is_empty() }
        },
    )
    .await?;
    let health = inst.health.clone();
    stop_all(vec![inst]).await?;
    let report = health.check();
    ensure(!report.live && !report.ready && report.status() == "dead", || {
        format!("a stopped subscription must not report live: {report:?}")
    })?;
    ctx.verdict(&Expectation {
        published,
        excused: skipped,
        ..Default::default()
    })
    .await?
    .assert_ok()
}

/// C5: after max attempts the head is dead-lettered and the key resumes.
pub(super) async fn c5(ctx: &Ctx<'_>) -> Outcome {
    let client = ctx.client().await?;
    let cat = ctx.category("orders");
    ctx.switches.broken.store(true, Ordering::SeqCst);
    let publisher = client.publisher(&cat).await.map_err(err)?;
    let mut published = Vec::new();
    for seq in 0..4u64 {
        for key in keys("k", 4) {
            let payload = Payload {
                key: key.clone(),
                seq,
                sleep_ms: 0,
                poison: key == "k-0" && seq == 1,
            };
            let msg = Message::new(payload.encode()).with_key(&key).map_err(err)?;
            published.push(Published {
                id: msg.id().to_owned(),
                key,
                seq,
            });
            publisher.publish(msg).await.map_err(err)?;
        }
    }
    let poison_id = published
        .iter()
        .find(|p| p.key == "k-0" && p.seq == 1)
        .unwrap()
        .id
        .clone();
    let excused: HashSet<String> = [poison_id.clone()].into();
    let inst = ctx
        .start(
            ctx.ordered(&client, &cat, "g")
                .poison(PoisonPolicy::Park { max_attempts: 3 }),
            "i1",
        )
        .await?;
    ctx.wait_applied(&published, &excused).await?;
    let dead = client.admin().dead_letters(&cat, "g").await.map_err(err)?;
    ensure(dead.len() == 1 && dead[0].id == poison_id, || {
        format!("dead letters: {dead:?}")
    })?;
    let runs = ctx
        .log
        .events()
        .await
        .map_err(err)?
        .iter()
        .filter(|e| e.message_id == poison_id)
        .count();
    // Attempts are counted durably: exactly max_attempts runs, then the park.
    ensure(runs == 3, || format!("the poison head ran {runs} times, expected 3"))?;
    let stats = inst.stats.snapshot();
    ensure(stats.parked == 1, || format!("parked count: {stats:?}"))?;
    stop_all(vec![inst]).await?;
    ctx.verdict(&Expectation {
        published,
        excused,
        ..Default::default()
    })
    .await?
    .assert_ok()
}
