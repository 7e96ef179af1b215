//! The operator's verbs from another transport: what the `keyorder` command
//! in another process does, through a client with its own connection and
//! state. Written once for every adapter that halts on poison (it was two
//! copies of one test, in the Kafka and RabbitMQ crates).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use keyorder_core::{Delivery, Error, HandlerError, HandlerResult, HeadAction, Message, PoisonPolicy, RetryPolicy};

use super::ctx::{ensure, err, Ctx, Outcome};
use crate::instance::wait_until;

/// How long each step may take: a hand-over of the scope on a slow broker
/// (Kafka's group join) fits well inside it.
const STEP: Duration = Duration::from_secs(90);

/// Operator from another transport: a key halts at its poison head while
/// another key of the category flows; a second client lists the halt
/// (under the key's label, with its attempts), refuses an unknown label
/// with `NotFound`, and skips the head by label; the owner then runs the
/// key's later messages in order and no halt is left.
pub(super) async fn operator_from_another_transport(ctx: &Ctx<'_>) -> Outcome {
    let owner = ctx.client().await?;
    let operator = ctx.client().await?;
    let cat = ctx.category("op");
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let broken = Arc::new(AtomicBool::new(true));
    let subscription = ctx
        .ordered(&owner, &cat, "g")
        .poison(PoisonPolicy::Halt)
        .retry(RetryPolicy {
            max_attempts: 2,
            initial_backoff: Duration::from_millis(20),
            max_backoff: Duration::from_millis(100),
        })
        .build()
        .await
        .map_err(err)?;
    let (log, fail) = (seen.clone(), broken.clone());
    let handler = move |d: Delivery| {
        let (log, fail) = (log.clone(), fail.clone());
        async move {
            let body = String::from_utf8_lossy(d.payload()).into_owned();
            if body == "p-2" && fail.load(Ordering::SeqCst) {
                return Err(HandlerError::retry("poison (test)"));
            }
            log.lock().unwrap_or_else(|e| e.into_inner()).push(body);
            HandlerResult::Ok(())
        }
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(subscription.run(handler, async move {
        let _ = stopped.await;
    }));
    let outcome = async {
        let publisher = owner.publisher(&cat).await.map_err(err)?;
        for i in 1..=4 {
            for key in ["p", "q"] {
                let msg = Message::new(format!("{key}-{i}")).with_key(key).map_err(err)?;
                publisher.publish(msg).await.map_err(err)?;
            }
        }
        let applied = |prefix: &'static str| {
            let seen = seen.clone();
            move || -> Vec<String> {
                seen.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .iter()
                    .filter(|s| s.starts_with(prefix))
                    .cloned()
                    .collect()
            }
        };
        let (p, q) = (applied("p-"), applied("q-"));
        // q flows; p halts at p-2.
        wait_until("q to be applied", STEP, || {
            let n = q().len();
            async move { n == 4 }
        })
        .await?;
        let admin = operator.admin();
        wait_until("the other transport to list the halt", STEP, || {
            let admin = admin.clone();
            let cat = cat.clone();
            async move { admin.halted(&cat, "g").await.map(|h| h.len() == 1).unwrap_or(false) }
        })
        .await?;
        let halted = admin.halted(&cat, "g").await.map_err(err)?;
        ensure(halted.len() == 1, || format!("listed then gone: {halted:?}"))?;
        let label = keyorder_core::key::label("p");
        ensure(halted[0].label == label, || {
            format!(
                "the halt is listed under {:?}, not the key's label {label:?}",
                halted[0].label
            )
        })?;
        ensure(halted[0].attempts >= 2, || format!("attempts: {halted:?}"))?;
        ensure(p() == ["p-1"], || format!("the key ran past its head: {:?}", p()))?;
        // An unknown label: refused with NotFound, nothing changes.
        let unknown = keyorder_core::key::label("a key never published");
        match admin.resolve(&cat, "g", &unknown, HeadAction::Skip).await {
            Err(Error::NotFound(_)) => {}
            other => return Err(format!("an unknown label: expected NotFound, got {other:?}")),
        }
        // Skip by label from the other transport: the owner acknowledges the
        // head and runs the key's later messages in order.
        admin.resolve(&cat, "g", &label, HeadAction::Skip).await.map_err(err)?;
        wait_until("p's later messages", STEP, || {
            let n = p().len();
            async move { n >= 3 }
        })
        .await?;
        ensure(p() == ["p-1", "p-3", "p-4"], || {
            format!("after the skip: {:?} (expected p-1 p-3 p-4)", p())
        })?;
        let left = admin.halted(&cat, "g").await.map_err(err)?;
        ensure(left.is_empty(), || format!("a halt is left: {left:?}"))
    }
    .await;
    let _ = stop.send(());
    let ran = run.await.map_err(err)?.map_err(err);
    outcome.and(ran.map(|_| ()))
}
