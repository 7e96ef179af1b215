//! C21: one scope handed over again and again, one of its owners stalled
//! with work in flight that completes after the next hand-over.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use super::ctx::{ensure, err, stop_all, Ctx, Outcome};
use crate::checker::Expectation;
use crate::eventlog::{Event, EventLog};
use crate::instance::{keys, publish_range, wait_until, Instance};
use keyorder_check::worker::WorkerProcess;

async fn events(log: &Arc<dyn EventLog>) -> Vec<Event> {
    log.events().await.unwrap_or_default()
}

/// Waits until `instance` applied a message of `key` with a sequence of at
/// least `seq`.
async fn wait_owner(ctx: &Ctx<'_>, instance: &str, key: &str, seq: u64) -> Outcome {
    let log = ctx.log.clone();
    wait_until(
        &format!("{instance} to own the key and apply its sequence {seq} or later"),
        ctx.h.deadline(),
        || {
            let log = log.clone();
            async move {
                events(&log)
                    .await
                    .iter()
                    .any(|e| e.instance == instance && e.key == key && e.seq >= seq && e.ok)
            }
        },
    )
    .await
}

/// Where the harness asks for it ([`crate::Harness::settle_joins`]): lets
/// `instance`, which just joined or rejoined, receive work before another
/// member leaves. Publishes one more message per key at a time (sequence
/// `next`) until `instance` applied one of them.
async fn settle_join(
    ctx: &Ctx<'_>,
    client: &keyorder_core::Client,
    cat: &str,
    ks: &[String],
    instance: &str,
    next: &mut u64,
    published: &mut Vec<crate::checker::Published>,
) -> Outcome {
    if !ctx.h.settle_joins() {
        return Ok(());
    }
    let from = *next;
    let deadline = tokio::time::Instant::now() + ctx.h.deadline();
    loop {
        published.extend(publish_range(client, cat, ks, *next..*next + 1, 0).await.map_err(err)?);
        *next += 1;
        let log = ctx.log.clone();
        let got = wait_until(&format!("{instance} to receive work"), Duration::from_secs(5), || {
            let log = log.clone();
            async move {
                events(&log)
                    .await
                    .iter()
                    .any(|e| e.instance == instance && e.seq >= from && e.ok)
            }
        })
        .await;
        if got.is_ok() {
            return ctx.wait_applied(published, &HashSet::new()).await;
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(format!("{instance} received no work after it joined"));
        }
    }
}

/// The owners of `key` in the order their runs started, each with the
/// lowest and highest fencing token it ran the key under: a new run starts
/// where the instance changes.
pub(crate) fn owner_runs(events: &[Event], key: &str) -> Vec<(String, u64, u64)> {
    let mut mine: Vec<&Event> = events.iter().filter(|e| e.key == key).collect();
    mine.sort_by_key(|e| e.start);
    let mut runs: Vec<(String, u64, u64)> = Vec::new();
    for e in mine {
        match runs.last_mut() {
            Some((who, lo, hi)) if *who == e.instance => {
                *lo = (*lo).min(e.generation);
                *hi = (*hi).max(e.generation);
            }
            _ => runs.push((e.instance.clone(), e.generation, e.generation)),
        }
    }
    runs
}

/// Where a fencing token repeats or goes down from one owner to the next.
pub(crate) fn token_regressions(runs: &[(String, u64, u64)]) -> Vec<String> {
    runs.windows(2)
        .filter(|w| w[1].1 <= w[0].2)
        .map(|w| {
            format!(
                "{} ran the key under tokens {}..={}, then {} under {}..={}",
                w[0].0, w[0].1, w[0].2, w[1].0, w[1].1, w[1].2
            )
        })
        .collect()
}

/// C21: the key's scope moves w1 (stalled by `SIGSTOP` inside a handler)
/// -> i2 -> w1 (resumed; i2 stops) -> i3 (w1 stops) -> i4 (i3 stops),
/// each new owner applying a new batch of the key. Checks, from the
/// deliveries: the scope changed owner at least three times, a fencing token
/// never repeated or went down from one owner to the next, and order, loss
/// and overlap hold with at most one fenced straggler.
pub(crate) async fn c21(ctx: &Ctx<'_>) -> Outcome {
    let cat = ctx.category("orders");
    // The held handler sleeps 1 s; the stop lasts past the lease, so on
    // SIGCONT the handler returns at once (its settlement, and the state
    // writes and commits the stalled process had in flight, come late).
    let w1 = WorkerProcess::spawn(&ctx.worker_config(&cat, "w1", Some(5), Duration::from_secs(1), 1)?).await?;
    let client = ctx.client().await?;
    let ks = keys("k", 8);
    let mut published = publish_range(&client, &cat, &ks, 0..20, 0).await.map_err(err)?;
    let key = ctx.wait_held("w1", 5).await?;
    // Hand-over 1: w1 stalls with a handler in flight; i2 takes the key.
    w1.stop()?;
    let i2 = ctx.start(ctx.ordered(&client, &cat, "g"), "i2").await?;
    wait_owner(ctx, "i2", &key, 6).await?;
    w1.cont()?;
    let log = ctx.log.clone();
    wait_until("the stalled handler to return after SIGCONT", ctx.h.deadline(), || {
        let log = log.clone();
        async move { !events(&log).await.iter().any(|e| e.instance == "w1" && e.end.is_none()) }
    })
    .await?;
    ctx.wait_applied(&published, &HashSet::new()).await?;
    let mut next = 20;
    settle_join(ctx, &client, &cat, &ks, "w1", &mut next, &mut published).await?;
    // Hand-over 2: i2 leaves; the resumed w1 is the only owner left.
    stop_all(vec![i2]).await?;
    let from = next;
    published.extend(
        publish_range(&client, &cat, &ks, from..from + 10, 0)
            .await
            .map_err(err)?,
    );
    next += 10;
    wait_owner(ctx, "w1", &key, from).await?;
    ctx.wait_applied(&published, &HashSet::new()).await?;
    // Hand-over 3: i3 joins, w1 leaves.
    let i3 = ctx.start(ctx.ordered(&client, &cat, "g"), "i3").await?;
    settle_join(ctx, &client, &cat, &ks, "i3", &mut next, &mut published).await?;
    let w1_stats = w1.terminate().await?;
    let from = next;
    published.extend(
        publish_range(&client, &cat, &ks, from..from + 10, 0)
            .await
            .map_err(err)?,
    );
    next += 10;
    wait_owner(ctx, "i3", &key, from).await?;
    ctx.wait_applied(&published, &HashSet::new()).await?;
    // Hand-over 4: i4 joins, i3 leaves.
    let i4: Instance = ctx.start(ctx.ordered(&client, &cat, "g"), "i4").await?;
    settle_join(ctx, &client, &cat, &ks, "i4", &mut next, &mut published).await?;
    stop_all(vec![i3]).await?;
    let from = next;
    published.extend(
        publish_range(&client, &cat, &ks, from..from + 10, 0)
            .await
            .map_err(err)?,
    );
    wait_owner(ctx, "i4", &key, from).await?;
    ctx.wait_applied(&published, &HashSet::new()).await?;
    stop_all(vec![i4]).await?;
    let refused =
        w1_stats["fence_rejections"].as_u64().unwrap_or(0) + w1_stats["self_fence_discards"].as_u64().unwrap_or(0);
    ensure(refused >= 1, || {
        format!("the resumed owner neither had a settlement refused nor self-fenced: {w1_stats}")
    })?;
    let all = ctx.log.events().await.map_err(err)?;
    for k in &ks {
        let runs = owner_runs(&all, k);
        let bad = token_regressions(&runs);
        ensure(bad.is_empty(), || {
            format!("fencing tokens repeated or went down across hand-overs: {bad:?} (owners: {runs:?})")
        })?;
        if *k == key {
            ensure(runs.len() >= 4, || {
                format!(
                    "the stalled key changed owner only {} times: {runs:?}",
                    runs.len().saturating_sub(1)
                )
            })?;
        }
    }
    ctx.verdict(&Expectation {
        published,
        max_stragglers: Some(1),
        ..Default::default()
    })
    .await?
    .assert_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(instance: &str, generation: u64, start: u64) -> Event {
        Event {
            message_id: format!("{instance}-{start}"),
            key: "k".into(),
            seq: start,
            instance: instance.into(),
            generation,
            start,
            end: Some(start + 1),
            ok: true,
        }
    }

    #[test]
    fn a_repeated_or_lower_token_across_owners_is_found() {
        let ok = [
            ev("a", 1, 1),
            ev("a", 1, 2),
            ev("b", 4, 3),
            ev("a", 7, 4),
            ev("c", 9, 5),
        ];
        let runs = owner_runs(&ok, "k");
        assert_eq!(runs.len(), 4);
        assert!(token_regressions(&runs).is_empty());
        let repeated = [ev("a", 1, 1), ev("b", 2, 2), ev("c", 2, 3)];
        assert_eq!(token_regressions(&owner_runs(&repeated, "k")).len(), 1);
        let lower = [ev("a", 3, 1), ev("b", 5, 2), ev("a", 3, 3)];
        assert_eq!(token_regressions(&owner_runs(&lower, "k")).len(), 1);
    }
}
