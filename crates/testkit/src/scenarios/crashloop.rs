//! C22: a message whose handler kills its own process on every attempt,
//! under a supervisor that restarts the worker.

use std::collections::HashSet;
use std::time::Duration;

use keyorder_core::{HeadAction, Message, OrderingKey};

use super::ctx::{ensure, err, Ctx, Outcome};
use crate::checker::{Expectation, Published};
use crate::instance::{keys, Payload};
use keyorder_check::worker::WorkerProcess;

/// Attempts before the poison policy applies.
const MAX_ATTEMPTS: u32 = 3;

/// C22, once with `Halt` (the head shows halted to operators, who skip it)
/// and once with `Park` (the head is dead-lettered): a supervisor restarts
/// the worker each time the poison message killed it. Checks, from the
/// event log and the admin view: the poison head ran exactly
/// [`MAX_ATTEMPTS`] times (each run a crash), then reached the policy without
/// running again; every other message was applied, in order.
pub(crate) async fn c22(ctx: &Ctx<'_>) -> Outcome {
    let caps = ctx.h.capabilities();
    let mut expect = Expectation::default();
    if caps.halt_on_poison {
        run(ctx, "halt", None, &mut expect).await?;
    }
    if caps.park_and_release {
        run(ctx, "park", Some(MAX_ATTEMPTS), &mut expect).await?;
    }
    ctx.verdict(&expect).await?.assert_ok()
}

/// One variant, on a category and keys of its own (`{variant}-0`, ...);
/// adds what it published, excused and killed to `expect`.
async fn run(ctx: &Ctx<'_>, variant: &str, park_after: Option<u32>, expect: &mut Expectation) -> Outcome {
    let poison_key = format!("{variant}-0");
    let cat = ctx.category(&format!("crash-{variant}"));
    let client = ctx.client().await?;
    let admin = client.admin();
    let publisher = client.publisher(&cat).await.map_err(err)?;
    let mut published = Vec::new();
    for seq in 0..5u64 {
        for key in keys(variant, 4) {
            let payload = Payload {
                key: key.clone(),
                seq,
                sleep_ms: 0,
                poison: key == poison_key && seq == 1,
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
    let poison = published
        .iter()
        .find(|p| p.key == poison_key && p.seq == 1)
        .unwrap()
        .id
        .clone();
    // Transports name a halted head by their own id (a stream entry id on
    // Redis), so the halt is found by the key's label.
    let poison_label = OrderingKey::new(&poison_key).map_err(err)?.label();
    let config = |n: usize| -> Result<_, String> {
        let mut cfg = ctx.worker_config(&cat, &format!("{variant}-w{n}"), None, Duration::ZERO, 8)?;
        cfg.crash_on_poison = true;
        cfg.max_attempts = Some(MAX_ATTEMPTS);
        cfg.park_after = park_after;
        Ok(cfg)
    };
    // The supervisor: restart the worker whenever it died, until the
    // policy was applied (or the crashes exceed what the attempts allow).
    let mut restarts = 0usize;
    let mut kills = Vec::new();
    let mut worker = WorkerProcess::spawn(&config(restarts)?).await?;
    let log = ctx.log.clone();
    let deadline = tokio::time::Instant::now() + ctx.h.deadline();
    loop {
        let reached = if park_after.is_some() {
            admin
                .dead_letters(&cat, "g")
                .await
                .is_ok_and(|d| d.iter().any(|l| l.id == poison))
        } else {
            admin
                .halted(&cat, "g")
                .await
                .is_ok_and(|h| h.iter().any(|h| h.label == poison_label))
        };
        if reached {
            break;
        }
        if worker.exited() {
            kills.push((worker.id.clone(), log.now().await.map_err(err)?));
            restarts += 1;
            ensure(restarts <= MAX_ATTEMPTS as usize + 1, || {
                format!(
                    "{variant}: the poison message crashed the worker {restarts} times and never reached the \
                     poison policy (attempts are not counted across restarts)"
                )
            })?;
            worker = WorkerProcess::spawn(&config(restarts)?).await?;
            continue;
        }
        ensure(tokio::time::Instant::now() < deadline, || {
            format!("{variant}: the poison policy was not applied in time ({restarts} restarts)")
        })?;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let runs = |events: &[crate::Event]| events.iter().filter(|e| e.message_id == poison).count();
    let events = ctx.log.events().await.map_err(err)?;
    ensure(runs(&events) == MAX_ATTEMPTS as usize, || {
        format!(
            "{variant}: the poison head ran {} times, expected {MAX_ATTEMPTS} ({restarts} restarts)",
            runs(&events)
        )
    })?;
    ensure(restarts == MAX_ATTEMPTS as usize, || {
        format!("{variant}: {restarts} restarts, expected one per attempt ({MAX_ATTEMPTS})")
    })?;
    let excused: HashSet<String> = [poison.clone()].into();
    if park_after.is_none() {
        // Halted: the key's later messages wait; every other key completes.
        let others: Vec<Published> = published
            .iter()
            .filter(|p| p.key != poison_key || p.seq < 1)
            .cloned()
            .collect();
        ctx.wait_applied(&others, &HashSet::new()).await?;
        let halted = admin.halted(&cat, "g").await.map_err(err)?;
        let label = OrderingKey::new(&poison_key).map_err(err)?.label();
        ensure(
            halted.len() == 1 && halted[0].label == label && halted[0].attempts >= MAX_ATTEMPTS,
            || format!("{variant}: halted keys: {halted:?}"),
        )?;
        let later = ctx.log.events().await.map_err(err)?;
        ensure(!later.iter().any(|e| e.key == poison_key && e.seq > 1), || {
            format!("{variant}: the halted key applied messages after its head")
        })?;
        // The operator skips the head; the key completes without it.
        admin.resolve(&cat, "g", &label, HeadAction::Skip).await.map_err(err)?;
    } else {
        let dead = admin.dead_letters(&cat, "g").await.map_err(err)?;
        ensure(dead.len() == 1 && dead[0].id == poison, || {
            format!("{variant}: dead letters: {dead:?}")
        })?;
    }
    ctx.wait_applied(&published, &excused).await?;
    let events = ctx.log.events().await.map_err(err)?;
    ensure(runs(&events) == MAX_ATTEMPTS as usize, || {
        format!(
            "{variant}: the poison head ran again after the policy: {} runs",
            runs(&events)
        )
    })?;
    worker.terminate().await?;
    expect.published.extend(published);
    expect.excused.extend(excused);
    expect.kills.extend(kills);
    Ok(())
}
