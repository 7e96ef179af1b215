//! The scenarios themselves (C1, C2, C6, C7, C12, C15).

use std::collections::BTreeSet;

use keyorder_core::Error;
use keyorder_outbox::sqlx::{self, AssertSqlSafe};
use keyorder_outbox::{Outbox, Outgoing};

use super::common::*;
use super::hold::*;
use super::relays::*;
use super::trial::*;
use crate::checker::Published;
use crate::eventlog::EventLog;
use crate::instance::{wait_until, Instance};

// -------------------------------------------------------------- scenarios

/// C1: two relays, two consumers; a backlog staged before the consumers
/// start and more while they run, several keys per transaction; every key's
/// records are applied in sequence order, none lost, none twice, and every
/// record is marked published.
pub(super) async fn c1(t: &mut Trial<'_>) -> Outcome {
    let relays = vec![t.relay("r1", None).await?, t.relay("r2", None).await?];
    t.wait_split(&["r1", "r2"]).await?;
    let ks = crate::instance::keys("k", 16);
    let mut published = t.stage(&ks, 6, 0).await?;
    let consumers = t.consumers(2).await?;
    published.extend(t.stage(&ks, 6, 1).await?);
    t.wait_applied(&published).await?;
    stop_instances(consumers).await?;
    stop_relays(relays).await?;
    t.all_published(published.len()).await?;
    t.judge(published, Vec::new()).await
}

/// C2: both relays publish (each holds half the slots and half the keys),
/// both consumers apply, and no key is ever in two handlers at once.
pub(super) async fn c2(t: &mut Trial<'_>) -> Outcome {
    let relays = vec![t.relay("r1", None).await?, t.relay("r2", None).await?];
    let split = t.wait_split(&["r1", "r2"]).await?;
    let ks = t.keys_split(&split["r1"], 8);
    let consumers = t.consumers(2).await?;
    let published = t.stage(&ks, 10, 2).await?;
    t.wait_applied(&published).await?;
    stop_instances(consumers).await?;
    stop_relays(relays).await?;
    t.all_published(published.len()).await?;
    for r in ["r1", "r2"] {
        let n = t
            .count(&format!(
                "select count(*) from {}.records where resolved_by like '{r}:%'",
                t.schema
            ))
            .await?;
        ensure(n > 0, || format!("relay {r} published nothing"))?;
    }
    let spread = if t.h.spreads() {
        vec!["c0".to_owned(), "c1".to_owned()]
    } else {
        Vec::new()
    };
    t.judge(published, spread).await
}

/// C6 and C7's start: relays r1 (holding its first publish of a record
/// with sequence 4 or more, before or after the broker confirmed it) and r2
/// split the slots; two consumers; 6 keys of r1's slots and 6 of r2's, 8
/// records each; returns once r1 holds.
pub(super) struct Held {
    pub(super) r1: RelayUnderTest,
    pub(super) r2: RelayUnderTest,
    pub(super) consumers: Vec<Instance>,
    pub(super) published: Vec<Published>,
    /// The id of the record r1 holds.
    pub(super) held: String,
}

pub(super) async fn held_by_r1(t: &mut Trial<'_>, after_publish: bool) -> std::result::Result<Held, String> {
    let hold = HoldRule {
        from_seq: 4,
        after_publish,
    };
    let r1 = t.relay("r1", Some(hold)).await?;
    let r2 = t.relay("r2", None).await?;
    let split = t.wait_split(&["r1", "r2"]).await?;
    let ks = t.keys_split(&split["r1"], 6);
    let consumers = t.consumers(2).await?;
    let published = t.stage(&ks, 8, 0).await?;
    wait_until("r1 to hold a publish", t.h.deadline(), || async { r1.held().is_some() }).await?;
    let held = r1.held().unwrap_or_default();
    Ok(Held {
        r1,
        r2,
        consumers,
        published,
        held,
    })
}

/// C6: relay r1 is held right after the broker confirmed one of its
/// records (published, not yet marked) and is killed there (`kill -9`).
/// r2 takes r1's slots once the lease ends and publishes the rest, the
/// held record again; the consumers drop that repeat. Nothing lost, order
/// kept, nothing applied twice.
pub(super) async fn c6(t: &mut Trial<'_>) -> Outcome {
    let Held {
        r1,
        r2,
        consumers,
        published,
        held,
    } = held_by_r1(t, true).await?;
    r1.crash().await?;
    t.wait_applied(&published).await?;
    t.wait_dropped(1, "the consumers to drop the republished copy of the held record")
        .await?;
    stop_instances(consumers).await?;
    stop_relays(vec![r2]).await?;
    let by = t.resolved_by(&held).await?.unwrap_or_default();
    ensure(by.starts_with("r2:"), || {
        format!("the held record was marked by {by:?}, not by r2 after the takeover")
    })?;
    t.all_published(published.len()).await?;
    t.judge(published, Vec::new()).await
}

/// C7: relay r1 is held inside a publish (the record not yet at the
/// broker) and stopped (`SIGSTOP`) past its lease. r2 takes over and
/// publishes the key, the held record included; the consumers apply all of
/// it. r1 continues (`SIGCONT`) and its late publish goes out: a broker
/// that fences publishes (memory, Redis, PostgreSQL) refuses it, because r2
/// published for the slot at a higher generation; elsewhere (RabbitMQ,
/// Kafka) it reaches the broker and the consumers drop it (its sequence is
/// not above the last applied). Either way the relay's fence refuses r1's
/// late confirmation. No stale record is applied; nothing lost or applied
/// twice.
pub(super) async fn c7(t: &mut Trial<'_>) -> Outcome {
    let Held {
        r1,
        r2,
        consumers,
        published,
        held,
    } = held_by_r1(t, false).await?;
    r1.stall()?;
    let key = published
        .iter()
        .find(|p| p.id == held)
        .map(|p| p.key.clone())
        .ok_or_else(|| format!("r1 held {held}, which the trial never staged"))?;
    let of_key: Vec<Published> = published.iter().filter(|p| p.key == key).cloned().collect();
    t.wait_applied(&of_key).await?;
    let dropped_before = t.dropped();
    let fences =
        t.h.client()
            .await
            .map_err(err)?
            .publisher(&t.category)
            .await
            .map_err(err)?
            .fences_publishes();
    r1.resume()?;
    wait_until("r1's held publish to return after SIGCONT", t.h.deadline(), || async {
        r1.released().is_some()
    })
    .await?;
    let late = r1.released().unwrap_or_default();
    if fences {
        // The broker refuses it: r2 published for the slot at a higher generation.
        ensure(late == "fenced", || {
            format!("the broker fences publishes, yet r1's late publish ended with `{late}`")
        })?;
    } else {
        ensure(late == "ok", || format!("r1's late publish ended with `{late}`"))?;
        t.wait_dropped(
            dropped_before + 1,
            "the consumers to drop r1's late publish after SIGCONT",
        )
        .await?;
    }
    t.wait_applied(&published).await?;
    let stats = stop_relays(vec![r1, r2]).await?;
    stop_instances(consumers).await?;
    ensure(stats[0]["fenced"].as_u64().unwrap_or(0) >= 1, || {
        format!("r1's late confirmation was not refused by the fence: {}", stats[0])
    })?;
    let by = t.resolved_by(&held).await?.unwrap_or_default();
    ensure(by.starts_with("r2:"), || {
        format!("the held record was marked by {by:?}, not by r2")
    })?;
    t.all_published(published.len()).await?;
    t.judge(published, Vec::new()).await
}

/// C12: an empty or over-long key fails the staging call with a key error
/// that does not echo it, and nothing is stored (one bad key among good
/// ones in `stage_many` stores none of them). Records with such keys
/// written around the API are abandoned by a relay at once, never
/// published, while every other key, those wave 1 refused (`a:b`, control
/// characters, NUL, `dlq`, ...) included, flows end to end under its own key.
pub(super) async fn c12(t: &mut Trial<'_>) -> Outcome {
    let long = "x".repeat(256);
    let unsafe_keys = ["", long.as_str()];
    for key in unsafe_keys {
        let mut tx = t.pool().begin().await.map_err(err)?;
        let res = t.outbox.stage(&mut tx, t.outgoing(key, 0)).await;
        tx.commit().await.map_err(err)?;
        match res {
            Err(Error::Key(e)) => ensure(key.len() < 16 || !e.to_string().contains(key), || {
                "the key error shows the whole key".into()
            })?,
            other => return Err(format!("staging an unsafe key ({} bytes) gave {other:?}", key.len())),
        }
    }
    let mut tx = t.pool().begin().await.map_err(err)?;
    let res = t
        .outbox
        .stage_many(&mut tx, vec![t.outgoing("good", 0), t.outgoing(&long, 0)])
        .await;
    tx.commit().await.map_err(err)?;
    ensure(matches!(res, Err(Error::Key(_))), || {
        format!("stage_many with one unsafe key gave {res:?}")
    })?;
    let stored = t.count(&format!("select count(*) from {}.records", t.schema)).await?;
    ensure(stored == 0, || {
        format!("{stored} records were stored by failed staging calls")
    })?;

    // Around the API: raw inserts with unsafe keys.
    for (id, key) in [("bad-empty", ""), ("bad-long", long.as_str())] {
        sqlx::query(AssertSqlSafe(format!(
            "insert into {}.records (message_id, category, key, slot, seq, payload) values ($1, $2, $3, $4, 1, 'x')",
            t.schema
        )))
        .bind(format!("{}-{id}", t.ns))
        .bind(&t.category)
        .bind(key)
        .bind(Outbox::slot_of(key, SLOTS) as i32)
        .execute(t.pool())
        .await
        .map_err(err)?;
    }
    let relays = vec![t.relay("r1", None).await?, t.relay("r2", None).await?];
    let consumers = t.consumers(2).await?;
    let mut carried = crate::instance::keys("k", 6);
    carried.extend(crate::scenarios::C12_CARRIED_KEYS.iter().map(|k| (*k).to_owned()));
    let published = t.stage(&carried, 3, 0).await?;
    t.wait_applied(&published).await?;
    wait_until("both unsafe records to be abandoned", t.h.deadline(), || async {
        t.in_state("abandoned").await.unwrap_or(0) == 2
    })
    .await?;
    stop_instances(consumers).await?;
    stop_relays(relays).await?;
    let attempted = t
        .count(&format!(
            "select coalesce(sum(attempts), 0) from {}.records where state = 'abandoned'",
            t.schema
        ))
        .await?;
    ensure(attempted == 0, || {
        format!("unsafe records were attempted {attempted} times before being abandoned")
    })?;
    let reasons = t
        .count(&format!(
            "select count(*) from {}.records where state = 'abandoned' and reason like '%invalid ordering key%'",
            t.schema
        ))
        .await?;
    ensure(reasons == 2, || {
        "an abandoned record does not name the invalid key as its reason".into()
    })?;
    let events = t.log.events().await.map_err(err)?;
    ensure(events.iter().all(|e| !e.message_id.contains("-bad-")), || {
        "a record with an unsafe key reached a handler".into()
    })?;
    // Each record ran under the key it was staged with.
    let sent: std::collections::HashMap<&str, &str> =
        published.iter().map(|p| (p.id.as_str(), p.key.as_str())).collect();
    if let Some(e) = events
        .iter()
        .find(|e| sent.get(e.message_id.as_str()).is_some_and(|k| *k != e.key))
    {
        return Err(format!(
            "a record ran under key {}, not the key it was staged with",
            keyorder_core::key::redact(&e.key)
        ));
    }
    t.all_published(published.len()).await?;
    t.judge(published, Vec::new()).await
}

/// C15: four stagers write shared keys at once (each transaction two keys,
/// `stage_many`), so same-key stagers serialise on the key's counter row;
/// and one transaction takes its transaction id first, stays open while
/// the others stage and commit, then stages a key and commits last: its
/// record has the key's highest sequence under the lowest transaction id.
/// Every key is applied in sequence order (its commit order), the late
/// record after the earlier ones, nothing lost.
pub(super) async fn c15(t: &mut Trial<'_>) -> Outcome {
    let relays = vec![t.relay("r1", None).await?, t.relay("r2", None).await?];
    let consumers = t.consumers(2).await?;
    let ks = crate::instance::keys("k", 6);
    let mut late = t.pool().begin().await.map_err(err)?;
    sqlx::query("select pg_current_xact_id()")
        .execute(&mut *late)
        .await
        .map_err(err)?;
    let t_ref: &Trial<'_> = t;
    let stagers = (0..4).map(|w| {
        let ks = ks.clone();
        async move {
            let mut out = Vec::new();
            for i in 0..15usize {
                let pair: BTreeSet<&String> = [&ks[(w + i) % ks.len()], &ks[(w * 2 + i * 5 + 1) % ks.len()]]
                    .into_iter()
                    .collect();
                let mut tx = t_ref.pool().begin().await.map_err(err)?;
                let batch: Vec<Outgoing> = pair.iter().map(|k| t_ref.outgoing(k, 0)).collect();
                let done = t_ref.outbox.stage_many(&mut tx, batch).await.map_err(err)?;
                tx.commit().await.map_err(err)?;
                out.extend(pair.iter().zip(done).map(|(k, s)| as_published(k, &s)));
            }
            Ok::<_, String>(out)
        }
    });
    let mut published = Vec::new();
    for part in futures::future::join_all(stagers).await {
        published.extend(part?);
    }
    let staged = t.outbox.stage(&mut late, t.outgoing(&ks[0], 0)).await.map_err(err)?;
    let max_before = published
        .iter()
        .filter(|p| p.key == ks[0])
        .map(|p| p.seq)
        .max()
        .unwrap_or(0);
    ensure(staged.seq > max_before, || {
        format!(
            "the late transaction's record has seq {} though {max_before} were committed before it",
            staged.seq
        )
    })?;
    late.commit().await.map_err(err)?;
    published.push(as_published(&ks[0], &staged));
    // The late record has the lowest transaction id of the trial.
    let lowest: String = sqlx::query_scalar(AssertSqlSafe(format!(
        "select message_id from {}.records where category = $1 order by txid, id limit 1",
        t.schema
    )))
    .bind(&t.category)
    .fetch_one(t.pool())
    .await
    .map_err(err)?;
    ensure(lowest == staged.message_id, || {
        "the late transaction's record does not hold the lowest transaction id".into()
    })?;
    t.wait_applied(&published).await?;
    stop_instances(consumers).await?;
    stop_relays(relays).await?;
    t.all_published(published.len()).await?;
    t.judge(published, Vec::new()).await
}
