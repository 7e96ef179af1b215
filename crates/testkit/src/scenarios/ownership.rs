//! Ownership moving between live instances: C11 correlated categories,
//! C16 instances joining and leaving mid-stream.

use std::collections::HashSet;
use std::time::Duration;

use super::ctx::{ensure, err, stop_all, Ctx, Outcome};
use crate::checker::Expectation;
use crate::instance::{keys, publish_range, publish_stream, wait_until};

/// C11: one subscription over two categories partitioned by one correlation
/// value (orders and payments of one order id). Across two instances, no two
/// events of one value are ever in the handler at once, whichever category
/// they come from; each category keeps the value's order; different values
/// run in parallel.
pub(super) async fn c11(ctx: &Ctx<'_>) -> Outcome {
    const PAYMENTS: u64 = 1_000_000;
    let (orders, payments) = (ctx.category("orders"), ctx.category("payments"));
    let mut instances = Vec::new();
    for i in 0..2 {
        let client = ctx.client().await?;
        let b = ctx
            .ordered(&client, &orders, "g")
            .correlated_with(&payments)
            .concurrency(8);
        instances.push(ctx.start(b, &format!("i{i}")).await?);
    }
    let client = ctx.client().await?;
    let values = keys("order", 6);
    let mut published = Vec::new();
    for i in 0..5 {
        published.extend(
            publish_range(&client, &orders, &values, i..i + 1, 10)
                .await
                .map_err(err)?,
        );
        published.extend(
            publish_range(&client, &payments, &values, PAYMENTS + i..PAYMENTS + i + 1, 10)
                .await
                .map_err(err)?,
        );
    }
    let res = ctx.wait_applied(&published, &HashSet::new()).await;
    stop_all(instances).await?;
    res?;
    let mut events: Vec<_> = ctx
        .log
        .events()
        .await
        .map_err(err)?
        .into_iter()
        .filter(|e| e.ok)
        .collect();
    events.sort_by_key(|e| e.start);
    for v in &values {
        let mine: Vec<_> = events.iter().filter(|e| &e.key == v).collect();
        for w in mine.windows(2) {
            let end = w[0].end.unwrap_or(u64::MAX);
            ensure(end <= w[1].start, || {
                format!(
                    "two events of one correlation value ran at once: seq {} on {} and seq {} on {}",
                    w[0].seq, w[0].instance, w[1].seq, w[1].instance
                )
            })?;
        }
        for (name, range) in [("orders", 0..PAYMENTS), ("payments", PAYMENTS..u64::MAX)] {
            let seqs: Vec<u64> = mine.iter().map(|e| e.seq).filter(|s| range.contains(s)).collect();
            ensure(seqs.windows(2).all(|w| w[0] < w[1]), || {
                format!("{name} of one value applied out of order: {seqs:?}")
            })?;
        }
    }
    let parallel = events.iter().enumerate().any(|(i, a)| {
        events[i + 1..]
            .iter()
            .any(|b| b.key != a.key && b.start < a.end.unwrap_or(0))
    });
    ensure(parallel, || "different correlation values never ran in parallel".into())?;
    let by: HashSet<&str> = events.iter().map(|e| e.instance.as_str()).collect();
    ensure(by.len() == 2, || format!("only {by:?} applied anything"))
}

/// C16: instances join and leave mid-stream; ownership moves; order, loss,
/// overlap and spread hold.
pub(super) async fn c16(ctx: &Ctx<'_>) -> Outcome {
    let cat = ctx.category("orders");
    let producer_client = ctx.client().await?;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    // The stream runs until the last instance has joined and applied
    // something (a bounded stream could end before a slow rebalance hands
    // the third instance a partition, leaving it nothing to apply).
    let producer = publish_stream(
        producer_client,
        cat.clone(),
        keys("k", 12),
        0,
        1,
        Duration::from_millis(5),
        stop_rx,
    );
    let c1 = ctx.client().await?;
    let i1 = ctx.start(ctx.ordered(&c1, &cat, "g"), "i1").await?;
    let log = ctx.log.clone();
    let applied_by = |inst: &'static str| {
        let log = log.clone();
        move || {
            let log = log.clone();
            async move {
                log.events()
                    .await
                    .unwrap_or_default()
                    .iter()
                    .any(|e| e.ok && e.instance == inst)
            }
        }
    };
    wait_until("i1 to apply events", ctx.h.deadline(), applied_by("i1")).await?;
    // Where ownership does not spread (one single-active-consumer queue),
    // each phase waits for the stream to move on instead.
    let progressed = || {
        let log = log.clone();
        async move {
            let before = log.events().await.unwrap_or_default().len();
            wait_until("the stream to progress", Duration::from_secs(60), || {
                let log = log.clone();
                async move { log.events().await.unwrap_or_default().len() > before + 12 }
            })
            .await
        }
    };
    let c2 = ctx.client().await?;
    let i2 = ctx.start(ctx.ordered(&c2, &cat, "g"), "i2").await?;
    if ctx.h.spreads() {
        wait_until(
            "i2 to take over partitions and apply events",
            ctx.h.deadline(),
            applied_by("i2"),
        )
        .await?;
    } else {
        progressed().await?;
    }
    let c3 = ctx.client().await?;
    let i3 = ctx.start(ctx.ordered(&c3, &cat, "g"), "i3").await?;
    if ctx.h.spreads() {
        wait_until(
            "i3 to take over partitions and apply events",
            ctx.h.deadline(),
            applied_by("i3"),
        )
        .await?;
    } else {
        progressed().await?;
    }
    i2.stop().await?;
    let _ = stop_tx.send(true);
    let published = producer.await.map_err(err)?.map_err(err)?;
    ctx.wait_applied(&published, &HashSet::new()).await?;
    stop_all(vec![i1, i3]).await?;
    ctx.verdict(&Expectation {
        published,
        spread_over: if ctx.h.spreads() {
            vec!["i1".into(), "i2".into(), "i3".into()]
        } else {
            Vec::new()
        },
        ..Default::default()
    })
    .await?
    .assert_ok()
}
