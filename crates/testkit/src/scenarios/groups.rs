//! C17 (many groups on one category) and C18 (the operator resolves a halt
//! while the rest of its scope flows), and the operator process C18 runs.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use keyorder_core::{Admin, Client, Delivery, HeadAction, Message, OrderingKey, PoisonPolicy};
use serde::{Deserialize, Serialize};

use super::ctx::{ensure, err, stop_all, Ctx, Outcome};
use crate::checker::{Expectation, Published};
use crate::eventlog::{EventLog, MemoryEventLog};
use crate::instance::{keys, logging_handler, publish_range, publish_stream, wait_until, Instance, Payload};
use crate::NewGroupStart;
use keyorder_check::worker::{Connector, WorkerProcess};

/// Starts an ordered instance of `group` whose handler logs to `log` and
/// first waits `pace` (groups consume at different paces).
async fn start_paced(
    ctx: &Ctx<'_>,
    client: &Client,
    cat: &str,
    group: &str,
    id: &str,
    log: Arc<dyn EventLog>,
    pace: Duration,
) -> Result<Instance, String> {
    let inner = logging_handler(log, id.to_owned(), ctx.switches.clone());
    let handler = move |d: Delivery| {
        let run = inner(d);
        async move {
            tokio::time::sleep(pace).await;
            run.await
        }
    };
    Instance::start_with(ctx.ordered(client, cat, group), id, handler)
        .await
        .map_err(err)
}

/// The same scenario context with its own event log (one per group).
fn with_log<'a>(ctx: &Ctx<'a>, log: Arc<dyn EventLog>) -> Ctx<'a> {
    Ctx {
        h: ctx.h,
        ns: ctx.ns.clone(),
        log,
        switches: ctx.switches.clone(),
    }
}

/// C17: groups `a` (fast) and `b` (slower) on one category. `b` stops while
/// `a` consumes, acknowledges, trims and reaps (idle thresholds shortened),
/// and keys `a` just reaped are published again; `b` then receives every
/// message in per-key order. A group that subscribes late receives what
/// the transport promises a new group. Each group's log is checked apart.
pub(crate) async fn c17(ctx: &Ctx<'_>) -> Outcome {
    let cat = ctx.category("orders");
    let producer = ctx.h.housekeeping_client().await.map_err(err)?;
    let log_a: Arc<dyn EventLog> = Arc::new(MemoryEventLog::default());
    let log_b: Arc<dyn EventLog> = Arc::new(MemoryEventLog::default());
    let (ga, gb) = (with_log(ctx, log_a.clone()), with_log(ctx, log_b.clone()));
    let client_a = ctx.h.housekeeping_client().await.map_err(err)?;
    let client_b = ctx.h.housekeeping_client().await.map_err(err)?;
    let a = start_paced(ctx, &client_a, &cat, "c17-a", "a1", log_a.clone(), Duration::ZERO).await?;
    let b = start_paced(
        ctx,
        &client_b,
        &cat,
        "c17-b",
        "b1",
        log_b.clone(),
        Duration::from_millis(3),
    )
    .await?;

    // Phase 1, both groups running: keys k (kept on) and r (to be reaped).
    let ks = keys("k", 10);
    let rs = keys("r", 4);
    let both: Vec<String> = ks.iter().chain(&rs).cloned().collect();
    let mut published = publish_range(&producer, &cat, &both, 0..5, 0).await.map_err(err)?;
    ga.wait_applied(&published, &HashSet::new()).await?;
    gb.wait_applied(&published, &HashSet::new()).await?;

    // Phase 2, b stopped: more of the k keys and ten new keys.
    stop_all(vec![b]).await?;
    let wide: Vec<String> = ks.iter().cloned().chain(keys("n", 10)).collect();
    published.extend(publish_range(&producer, &cat, &wide, 5..10, 0).await.map_err(err)?);
    ga.wait_applied(&published, &HashSet::new()).await?;
    if ctx.h.reaps_partitions() {
        // Both groups passed the end of the r keys: a reaps them once idle.
        let admin = client_a.admin();
        let labels: Vec<String> = rs
            .iter()
            .map(|k| OrderingKey::new(k).map(|k| k.label()))
            .collect::<Result<_, _>>()
            .map_err(err)?;
        wait_until("group a to reap the idle r keys", ctx.h.deadline(), || {
            let (admin, labels, cat) = (admin.clone(), &labels, &cat);
            async move {
                match admin.scopes(cat, "c17-a").await {
                    Ok(scopes) => !scopes
                        .iter()
                        .any(|s| labels.iter().any(|l| s.scope.ends_with(l.as_str()))),
                    Err(_) => false,
                }
            }
        })
        .await?;
    }
    // Phase 3: the reaped keys published again, with more of the rest.
    let again: Vec<String> = rs.iter().chain(&ks).cloned().collect();
    published.extend(publish_range(&producer, &cat, &again, 10..13, 0).await.map_err(err)?);
    ga.wait_applied(&published, &HashSet::new()).await?;

    // b comes back: every message since the category existed.
    let client_b2 = ctx.h.housekeeping_client().await.map_err(err)?;
    let b = start_paced(
        ctx,
        &client_b2,
        &cat,
        "c17-b",
        "b2",
        log_b.clone(),
        Duration::from_millis(3),
    )
    .await?;
    gb.wait_applied(&published, &HashSet::new()).await?;

    // A group that subscribes late.
    let log_c: Arc<dyn EventLog> = Arc::new(MemoryEventLog::default());
    let gc = with_log(ctx, log_c.clone());
    let client_c = ctx.h.housekeeping_client().await.map_err(err)?;
    let c = start_paced(ctx, &client_c, &cat, "c17-late", "c1", log_c.clone(), Duration::ZERO).await?;
    let later = publish_range(&producer, &cat, &ks, 13..16, 0).await.map_err(err)?;
    published.extend(later.iter().cloned());
    let start = ctx.h.new_group_start();
    let owed: Vec<Published> = match start {
        NewGroupStart::Beginning => published.clone(),
        NewGroupStart::Retained | NewGroupStart::Subscribed => later,
    };
    let owed_ids: Vec<String> = owed.iter().map(|p| p.id.clone()).collect();
    gc.wait_applied(&owed, &HashSet::new()).await?;
    ga.wait_applied(&published, &HashSet::new()).await?;
    gb.wait_applied(&published, &HashSet::new()).await?;
    stop_all(vec![a, b, c]).await?;

    for (name, g) in [("c17-a", &ga), ("c17-b", &gb)] {
        let v = g
            .verdict(&Expectation {
                published: published.clone(),
                ..Default::default()
            })
            .await?;
        v.assert_ok().map_err(|e| format!("group {name}: {e}"))?;
    }
    // The late group: order and overlap over what it applied, loss over
    // what it is owed.
    let v = gc
        .verdict(&Expectation {
            published: owed,
            ..Default::default()
        })
        .await?;
    v.assert_ok()
        .map_err(|e| format!("group c17-late (starts: {start:?}): {e}"))?;
    let applied_c: HashSet<String> = log_c
        .events()
        .await
        .map_err(err)?
        .into_iter()
        .filter(|e| e.ok)
        .map(|e| e.message_id)
        .collect();
    if start == NewGroupStart::Subscribed {
        let late: HashSet<&str> = owed_ids.iter().map(String::as_str).collect();
        let early = applied_c.iter().filter(|id| !late.contains(id.as_str())).count();
        ensure(early == 0, || {
            format!("the late group applied {early} messages published before it subscribed")
        })?;
    }
    Ok(())
}

/// The environment variable that carries an operator process's
/// configuration (JSON).
pub(crate) const OPERATOR_ENV: &str = "KEYORDER_TESTKIT_OPERATOR";

/// What an operator process does: waits until `key` is halted, resolves it
/// with the next of `actions`, and again, then exits.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct OperatorConfig {
    /// The transport URL.
    pub(crate) url: String,
    /// The category.
    pub(crate) category: String,
    /// The consumer group.
    pub(crate) group: String,
    /// The halted key (its value; the operator resolves it by its label).
    pub(crate) key: String,
    /// `skip`, `resume` or `dlq`, in order.
    pub(crate) actions: Vec<String>,
    /// How long to wait for each halt, in seconds.
    pub(crate) deadline_s: u64,
}

/// If this process was spawned as an operator, runs it and exits.
pub(crate) fn run_if_operator(connect: Connector) {
    keyorder_check::worker::run_from_env(OPERATOR_ENV, "operator", |cfg: OperatorConfig| async move {
        let client = connect(cfg.url.clone()).await?;
        let admin = client.admin();
        println!("KEYORDER_WORKER_READY");
        let done = operate(&*admin, &cfg).await.map_err(keyorder_core::Error::Config)?;
        Ok(serde_json::json!({ "resolved": done }))
    });
}

/// Resolves `cfg.key`'s halt with each action in turn; returns how many.
async fn operate(admin: &dyn Admin, cfg: &OperatorConfig) -> Result<usize, String> {
    let label = OrderingKey::new(&cfg.key).map_err(err)?.label();
    let mut done = 0;
    for name in &cfg.actions {
        let action = HeadAction::from_name(name).ok_or_else(|| format!("unknown action {name}"))?;
        wait_until(
            &format!("the key to halt before resolution {}", done + 1),
            Duration::from_secs(cfg.deadline_s),
            || {
                let label = &label;
                async move {
                    admin
                        .halted(&cfg.category, &cfg.group)
                        .await
                        .map(|h| h.iter().any(|h| &h.label == label))
                        .unwrap_or(false)
                }
            },
        )
        .await?;
        admin
            .resolve(&cfg.category, &cfg.group, &label, action)
            .await
            .map_err(|e| format!("resolution {} ({name}): {e}", done + 1))?;
        done += 1;
    }
    Ok(done)
}

/// C18: one scope holds a poison key and sixteen healthy keys that keep
/// flowing; the operator resolves the poison key's halt 24 times (skip,
/// resume, dead letter, eight of each) from another process (in-process
/// where the transport has one process). No healthy key applies a message
/// twice or an older after a newer; the poison key's messages that were
/// not skipped or dead-lettered run in order.
pub(crate) async fn c18(ctx: &Ctx<'_>) -> Outcome {
    // Eight of each, in an order where every action follows every other.
    const ACTIONS: [&str; 24] = [
        "skip", "resume", "dlq", "resume", "dlq", "skip", "dlq", "skip", "resume", "skip", "resume", "dlq", "resume",
        "dlq", "skip", "dlq", "skip", "resume", "skip", "resume", "dlq", "resume", "dlq", "skip",
    ];
    let removed = ACTIONS.iter().filter(|a| **a != "resume").count() as u64;
    let cat = ctx.category("orders");
    let group = "g";
    let client = ctx.h.one_scope_client().await.map_err(err)?;
    ctx.switches.broken.store(true, Ordering::SeqCst);
    let poison_key = "poison".to_owned();
    let healthy = keys("ok", 16);

    // The poison key: every message fails while the scenario is broken.
    let publisher = client.publisher(&cat).await.map_err(err)?;
    let mut published = Vec::new();
    for seq in 0..removed + 4 {
        let payload = Payload {
            key: poison_key.clone(),
            seq,
            sleep_ms: 0,
            poison: true,
        };
        let msg = Message::new(payload.encode()).with_key(&poison_key).map_err(err)?;
        published.push(Published {
            id: msg.id().to_owned(),
            key: poison_key.clone(),
            seq,
        });
        publisher.publish(msg).await.map_err(err)?;
    }
    let inst = ctx
        .start(ctx.ordered(&client, &cat, group).poison(PoisonPolicy::Halt), "i1")
        .await?;

    // The healthy keys flow (1 ms handlers) until the operator is done.
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let flow = publish_stream(
        client.clone(),
        cat.clone(),
        healthy.clone(),
        0,
        1,
        Duration::from_millis(10),
        stop_rx,
    );
    let cfg = OperatorConfig {
        url: ctx.h.worker_url().unwrap_or_default(),
        category: cat.clone(),
        group: group.into(),
        key: poison_key.clone(),
        actions: ACTIONS.iter().map(|a| (*a).to_owned()).collect(),
        deadline_s: ctx.h.deadline().as_secs(),
    };
    let operated = if ctx.h.worker_url().is_some() && ctx.h.capabilities().multi_process {
        let json = serde_json::to_string(&cfg).map_err(err)?;
        let process = WorkerProcess::spawn_with(OPERATOR_ENV, json, "operator").await?;
        process
            .finish(ctx.h.deadline() * ACTIONS.len() as u32)
            .await
            .and_then(|stats| {
                stats["resolved"]
                    .as_u64()
                    .ok_or_else(|| format!("operator stats: {stats}"))
            })
    } else {
        operate(&*client.admin(), &cfg).await.map(|n| n as u64)
    };
    let _ = stop_tx.send(true);
    let flowed = flow.await.map_err(err)?.map_err(err);
    let operated = operated?;
    let flowed = flowed?;
    ensure(operated == ACTIONS.len() as u64, || {
        format!("the operator resolved {operated} of {} halts", ACTIONS.len())
    })?;
    let healthy_published = flowed.len();
    published.extend(flowed);

    // The cause is fixed; the last halt is resumed; everything left runs.
    let admin = client.admin();
    let label = OrderingKey::new(&poison_key).map_err(err)?.label();
    wait_until("the poison key to halt once more", ctx.h.deadline(), || {
        let (admin, cat, label) = (admin.clone(), &cat, &label);
        async move {
            admin
                .halted(cat, group)
                .await
                .map(|h| h.iter().any(|h| &h.label == label))
                .unwrap_or(false)
        }
    })
    .await?;
    ctx.switches.broken.store(false, Ordering::SeqCst);
    admin
        .resolve(&cat, group, &label, HeadAction::Resume)
        .await
        .map_err(err)?;
    // Skip and dead letter each removed one head, in order: the first ones.
    let excused: HashSet<String> = published
        .iter()
        .filter(|p| p.key == poison_key && p.seq < removed)
        .map(|p| p.id.clone())
        .collect();
    ctx.wait_applied(&published, &excused).await?;
    stop_all(vec![inst]).await?;

    let events = ctx.log.events().await.map_err(err)?;
    let mut runs: HashMap<&str, usize> = HashMap::new();
    let mut poison_applied: BTreeMap<u64, usize> = BTreeMap::new();
    for e in events.iter().filter(|e| e.ok && e.end.is_some()) {
        if e.key == poison_key {
            *poison_applied.entry(e.seq).or_default() += 1;
        } else {
            *runs.entry(e.message_id.as_str()).or_default() += 1;
        }
    }
    let again: Vec<(&&str, &usize)> = runs.iter().filter(|(_, n)| **n > 1).collect();
    ensure(again.is_empty(), || {
        format!(
            "{} healthy messages were applied more than once (of {healthy_published}), e.g. {:?}",
            again.len(),
            again.first()
        )
    })?;
    let applied_poison: Vec<u64> = poison_applied.keys().copied().collect();
    ensure(applied_poison == (removed..removed + 4).collect::<Vec<_>>(), || {
        format!("the poison key applied seqs {applied_poison:?}; expected the {removed} first skipped or dead-lettered")
    })?;
    let dead = admin.dead_letters(&cat, group).await.map_err(err)?;
    let dead_poison = dead.iter().filter(|d| d.label == label).count();
    let by_dlq = ACTIONS.iter().filter(|a| **a == "dlq").count();
    ensure(dead_poison == by_dlq, || {
        format!("{dead_poison} dead letters of the poison key, expected {by_dlq}")
    })?;
    ctx.verdict(&Expectation {
        published,
        excused,
        ..Default::default()
    })
    .await?
    .assert_ok()
}
