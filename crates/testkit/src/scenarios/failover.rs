//! Failures of a worker or the broker: C6 `kill -9`, C7 `SIGSTOP` past the
//! lease, C14 a broker restart, C24 a cluster node lost.

use std::collections::HashSet;
use std::time::Duration;

use futures::FutureExt;
use keyorder_core::{Client, Message};

use super::ctx::{ensure, err, stop_all, Ctx, Outcome};
use crate::checker::{Expectation, Published};
use crate::instance::{keys, publish_keys, wait_until, Payload};
use keyorder_check::worker::WorkerProcess;

/// C6: `kill -9` an owner inside a handler; another instance reclaims its
/// pending messages; order, loss and overlap hold.
pub(super) async fn c6(ctx: &Ctx<'_>) -> Outcome {
    let cat = ctx.category("orders");
    let w1 = WorkerProcess::spawn(&ctx.worker_config(&cat, "w1", Some(5), Duration::from_secs(3600), 64)?).await?;
    let client = ctx.client().await?;
    let published = publish_keys(&client, &cat, &keys("k", 12), 20, 0).await.map_err(err)?;
    ctx.wait_held("w1", 5).await?;
    let killed_at = ctx.log.now().await.map_err(err)?;
    w1.kill9().await?;
    let i2 = ctx.start(ctx.ordered(&client, &cat, "g"), "i2").await?;
    ctx.wait_applied(&published, &HashSet::new()).await?;
    stop_all(vec![i2]).await?;
    let events = ctx.log.events().await.map_err(err)?;
    ensure(events.iter().any(|e| e.instance == "w1" && e.ok), || {
        "w1 applied nothing before the kill".into()
    })?;
    ctx.verdict(&Expectation {
        published,
        kills: vec![("w1".into(), killed_at)],
        ..Default::default()
    })
    .await?
    .assert_ok()
}

/// C7: `SIGSTOP` an owner inside a handler past its lease while later
/// messages of the key are buffered; another instance takes the key over;
/// after `SIGCONT` the stalled process applies nothing more of it.
pub(super) async fn c7(ctx: &Ctx<'_>) -> Outcome {
    let cat = ctx.category("orders");
    // The held handler sleeps 1 s; the stop lasts past the lease, so on
    // SIGCONT the handler returns at once: the one fenced straggler. One
    // handler at a time, so the held one is the only one in flight at the stop.
    let w1 = WorkerProcess::spawn(&ctx.worker_config(&cat, "w1", Some(5), Duration::from_secs(1), 1)?).await?;
    let client = ctx.client().await?;
    let published = publish_keys(&client, &cat, &keys("k", 12), 20, 0).await.map_err(err)?;
    let key = ctx.wait_held("w1", 5).await?;
    w1.stop()?;
    let i2 = ctx.start(ctx.ordered(&client, &cat, "g"), "i2").await?;
    let log = ctx.log.clone();
    let k = key.clone();
    wait_until(
        "i2 to own the stalled key and apply its later messages",
        ctx.h.deadline(),
        || {
            let (log, k) = (log.clone(), k.clone());
            async move {
                let events = log.events().await.unwrap_or_default();
                events
                    .iter()
                    .any(|e| e.instance == "i2" && e.key == k && e.seq > 5 && e.ok)
            }
        },
    )
    .await?;
    w1.cont()?;
    wait_until("the stalled handler to return after SIGCONT", ctx.h.deadline(), || {
        let log = log.clone();
        async move {
            let events = log.events().await.unwrap_or_default();
            !events.iter().any(|e| e.instance == "w1" && e.end.is_none())
        }
    })
    .await?;
    ctx.wait_applied(&published, &HashSet::new()).await?;
    let stats = w1.terminate().await?;
    stop_all(vec![i2]).await?;
    let refused = stats["fence_rejections"].as_u64().unwrap_or(0) + stats["self_fence_discards"].as_u64().unwrap_or(0);
    ensure(refused >= 1, || {
        format!("the resumed owner neither had an ack rejected nor self-fenced: {stats}")
    })?;
    let events = ctx.log.events().await.map_err(err)?;
    let resumed_at = events
        .iter()
        .filter(|e| e.instance == "i2" && e.key == key)
        .map(|e| e.start)
        .min()
        .unwrap_or(u64::MAX);
    // The generation the stalled owner held the key under: after the
    // takeover it starts nothing more under it. (Once resumed and live again
    // it may legitimately be handed the key back, under a new generation.)
    let stalled_gen = events
        .iter()
        .filter(|e| e.instance == "w1" && e.key == key && e.start < resumed_at)
        .map(|e| e.generation)
        .max()
        .unwrap_or(0);
    let late = events
        .iter()
        .filter(|e| e.instance == "w1" && e.key == key && e.start > resumed_at && e.generation <= stalled_gen)
        .count();
    ensure(late == 0, || {
        format!("the stalled owner started {late} messages of the key under its lost generation after the takeover")
    })?;
    ctx.verdict(&Expectation {
        published,
        max_stragglers: Some(1),
        ..Default::default()
    })
    .await?
    .assert_ok()
}

/// Publishes, retrying a failed publish of the same message (same id) until
/// the broker acknowledges it: a restart may refuse publishes for a while.
async fn publish_through_outage(
    client: &Client,
    cat: &str,
    ks: &[String],
    seqs: std::ops::Range<u64>,
    deadline: Duration,
) -> Result<Vec<Published>, String> {
    let publisher = client.publisher(cat).await.map_err(err)?;
    let mut out = Vec::new();
    for seq in seqs {
        for key in ks {
            let payload = Payload {
                key: key.clone(),
                seq,
                sleep_ms: 1,
                poison: false,
            };
            let msg = Message::new(payload.encode()).with_key(key).map_err(err)?;
            let until = tokio::time::Instant::now() + deadline;
            loop {
                match publisher.publish(msg.clone()).await {
                    Ok(()) => break,
                    Err(e) if tokio::time::Instant::now() < until => {
                        tracing::debug!(error = %e, "publish failed during the outage; retrying");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    Err(e) => return Err(format!("publish never succeeded: {e}")),
                }
            }
            out.push(Published {
                id: msg.id().to_owned(),
                key: key.clone(),
                seq,
            });
        }
    }
    Ok(out)
}

/// C14: the broker restarts mid-stream; consumers reconnect; order and loss hold.
pub(super) async fn c14(ctx: &Ctx<'_>) -> Outcome {
    let cat = ctx.category("orders");
    let client = ctx.client().await?;
    let ks = keys("k", 12);
    let inst = ctx.start(ctx.ordered(&client, &cat, "g"), "i1").await?;
    let mut published = publish_through_outage(&client, &cat, &ks, 0..15, ctx.h.deadline()).await?;
    let log = ctx.log.clone();
    wait_until("some events applied before the restart", ctx.h.deadline(), || {
        let log = log.clone();
        async move { log.events().await.unwrap_or_default().iter().filter(|e| e.ok).count() >= 12 }
    })
    .await?;
    ctx.h.restart_broker().await.map_err(err)?;
    published.extend(publish_through_outage(&client, &cat, &ks, 15..30, ctx.h.deadline()).await?);
    ctx.wait_applied(&published, &HashSet::new()).await?;
    stop_all(vec![inst]).await?;
    ctx.verdict(&Expectation {
        published,
        ..Default::default()
    })
    .await?
    .assert_ok()
}

/// C24: a broker node that leads one of the group's queues is lost
/// mid-stream (a cluster). Instance `i1` and the publisher connect through
/// another node, `i2` through the lost one: the queue's leadership moves to
/// a node still up, `i2`'s connection is gone, so the queues it consumed
/// go to `i1` (it applies keys `i2` had applied before); publishing goes on
/// through the loss and after the node is back; order and loss hold.
pub(super) async fn c24(ctx: &Ctx<'_>) -> Outcome {
    let cat = ctx.category("orders");
    let client = ctx.client().await?;
    let via_lost = ctx.h.client_on_lost_node().await.map_err(err)?;
    // Enough keys that every one of the group's 8 queues carries some
    // (with 12, a given queue has none one time in five, and losing its
    // leader would test nothing): 48 leave a queue empty once in ~600.
    let ks = keys("k", 48);
    let i1 = ctx.start(ctx.ordered(&client, &cat, "g"), "i1").await?;
    let i2 = ctx.start(ctx.ordered(&via_lost, &cat, "g"), "i2").await?;
    let mut published = publish_through_outage(&client, &cat, &ks, 0..15, ctx.h.deadline()).await?;
    let log = ctx.log.clone();
    wait_until(
        "both instances to apply before the node is lost",
        ctx.h.deadline(),
        || {
            let log = log.clone();
            async move {
                let events = log.events().await.unwrap_or_default();
                let applied = |i: &str| events.iter().filter(|e| e.ok && e.instance == i).count();
                applied("i1") >= 6 && applied("i2") >= 6
            }
        },
    )
    .await?;
    let before = ctx.log.now().await.map_err(err)?;
    let lost = ctx.h.stop_node(&cat, "g").await.map_err(err)?;
    // Whatever happens while the node is down, it is started again, a
    // panic included (it is resumed once the node is back).
    let during = std::panic::AssertUnwindSafe(async {
        published.extend(publish_through_outage(&client, &cat, &ks, 15..30, ctx.h.deadline()).await?);
        let leader = wait_until(
            "the lost node's queue to elect a leader on a node still up",
            ctx.h.deadline(),
            async || match ctx.h.queue_leader(&lost.queue).await {
                Ok(leader) if leader != lost.node => Ok(leader),
                Ok(leader) => Err(format!("leader still {leader}")),
                Err(e) => Err(e.to_string()),
            },
        )
        .await?;
        tracing::info!(queue = %lost.queue, from = %lost.node, to = %leader, "C24: leadership moved");
        ctx.wait_applied(&published, &HashSet::new()).await
    })
    .catch_unwind()
    .await;
    let restarted = ctx.h.start_node(&lost.node).await.map_err(err);
    let during = during.unwrap_or_else(|panic| std::panic::resume_unwind(panic));
    during?;
    restarted?;
    // i2's keys went to i1 while the node was down.
    let events = ctx.log.events().await.map_err(err)?;
    let i2_keys: HashSet<&str> = events
        .iter()
        .filter(|e| e.ok && e.instance == "i2" && e.start < before)
        .map(|e| e.key.as_str())
        .collect();
    ensure(
        events
            .iter()
            .any(|e| e.ok && e.instance == "i1" && e.start > before && i2_keys.contains(e.key.as_str())),
        || "i1 applied none of the keys i2 held before its node was lost".into(),
    )?;
    published.extend(publish_through_outage(&client, &cat, &ks, 30..40, ctx.h.deadline()).await?);
    ctx.wait_applied(&published, &HashSet::new()).await?;
    stop_all(vec![i1, i2]).await?;
    let verdict = ctx
        .verdict(&Expectation {
            published,
            ..Default::default()
        })
        .await?;
    tracing::info!("C24: {verdict}");
    verdict.assert_ok()
}
