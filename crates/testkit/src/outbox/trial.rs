//! One trial: the outbox's schema, its relays and consumers, and what the
//! checker is told.

use std::collections::{BTreeMap, HashSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use keyorder_core::{Delivery, Error, HandlerError, HandlerResult, KeySource, RetryPolicy};
use keyorder_outbox::sqlx::{self, AssertSqlSafe, PgPool};
use keyorder_outbox::{GuardStats, Outbox, OutboxConfig, Outgoing, PgApplied, SequenceGuard, Staged};
use tokio::sync::oneshot;

use super::common::*;
use super::hold::*;
use super::relays::*;
use super::scenario::*;
use crate::checker::{check, Expectation, Published};
use crate::eventlog::{EventLog, EventStart, MemoryEventLog};
use crate::instance::{wait_until, Instance, Payload};
use crate::Harness;
use keyorder_check::worker::WorkerProcess;

// ------------------------------------------------------------ the trial

pub(super) struct Trial<'a> {
    pub(super) h: &'a dyn Harness,
    pub(super) ns: String,
    pub(super) category: String,
    pub(super) schema: String,
    pub(super) outbox: Outbox,
    pub(super) log: Arc<MemoryEventLog>,
    pub(super) applied: Arc<PgApplied>,
    pub(super) guards: Vec<Arc<GuardStats>>,
}

impl<'a> Trial<'a> {
    pub(super) async fn new(h: &'a dyn Harness, s: OutboxScenario) -> std::result::Result<Trial<'a>, String> {
        let tag = uuid::Uuid::new_v4().simple().to_string();
        let ns = format!("ob{}-{}", s.slug().split('_').next().unwrap_or("c"), &tag[..10]);
        let schema = format!("ko_e2e_{}", &tag[..12]);
        let client = h.client().await.map_err(err)?;
        let outbox = Outbox::connect(
            &h.event_log_url(),
            8,
            OutboxConfig {
                schema: schema.clone(),
                slots: SLOTS,
                key_rules: client.key_rules().clone(),
            },
        )
        .await
        .map_err(|e| format!("the outbox needs PostgreSQL at the event-log URL: {e}"))?;
        outbox.migrate().await.map_err(err)?;
        let applied = Arc::new(PgApplied::new(&outbox, "g"));
        Ok(Trial {
            h,
            category: format!("{ns}-orders"),
            ns,
            schema,
            outbox,
            log: Arc::new(MemoryEventLog::default()),
            applied,
            guards: Vec::new(),
        })
    }

    pub(super) fn pool(&self) -> &PgPool {
        self.outbox.pool()
    }

    pub(super) async fn count(&self, sql: &str) -> std::result::Result<i64, String> {
        sqlx::query_scalar(AssertSqlSafe(sql.to_owned()))
            .fetch_one(self.pool())
            .await
            .map_err(err)
    }

    /// Starts relay `id` (a process where the broker allows, else a task).
    pub(super) async fn relay(&self, id: &str, hold: Option<HoldRule>) -> std::result::Result<RelayUnderTest, String> {
        if let Some(url) = self.h.worker_url() {
            let cfg = RelayWorkerConfig {
                url,
                outbox_url: self.h.event_log_url(),
                schema: self.schema.clone(),
                instance: id.to_owned(),
                lease_ms: RELAY_LEASE_MS,
                hold,
            };
            let json = serde_json::to_string(&cfg).map_err(err)?;
            return Ok(RelayUnderTest::Process(Box::new(
                WorkerProcess::spawn_with(RELAY_ENV, json, id).await?,
            )));
        }
        let state = HoldState::new(hold, false);
        let client = holding_client(&self.h.client().await.map_err(err)?, state.clone());
        let mut relay = self.outbox.relay(client, relay_config(id, RELAY_LEASE_MS));
        let pause = Arc::new(AtomicBool::new(false));
        let paused = pause.clone();
        let (stop, mut stopped) = oneshot::channel::<()>();
        let join = tokio::spawn(async move {
            loop {
                tokio::select! {
                    biased;
                    _ = &mut stopped => break,
                    () = tokio::time::sleep(Duration::from_millis(20)) => {}
                }
                if paused.load(Ordering::SeqCst) {
                    continue;
                }
                match relay.step().await {
                    Ok(()) | Err(Error::Broker(_)) => {}
                    Err(e) => return Err(e),
                }
            }
            relay.run(std::future::ready(())).await
        });
        Ok(RelayUnderTest::Task(TaskRelay {
            pause,
            state,
            stop: Some(stop),
            join,
        }))
    }

    /// The live slot owners and how many slots each holds.
    pub(super) async fn owners(&self) -> std::result::Result<BTreeMap<String, Vec<u32>>, String> {
        let rows: Vec<(String, i32)> = sqlx::query_as(AssertSqlSafe(format!(
            "select owner, slot from {}.slots where owner is not null and lease_expiry > clock_timestamp()",
            self.schema
        )))
        .fetch_all(self.pool())
        .await
        .map_err(err)?;
        let mut out: BTreeMap<String, Vec<u32>> = BTreeMap::new();
        for (owner, slot) in rows {
            out.entry(owner).or_default().push(slot as u32);
        }
        Ok(out)
    }

    /// Waits until relays `ids` hold every slot, evenly; returns the slots of each.
    pub(super) async fn wait_split(&self, ids: &[&str]) -> std::result::Result<BTreeMap<String, Vec<u32>>, String> {
        let share = SLOTS as usize / ids.len();
        let found = Mutex::new(BTreeMap::new());
        wait_until("the relays to split the slots evenly", self.h.deadline(), || async {
            let owners = self.owners().await.unwrap_or_default();
            let even =
                owners.len() == ids.len() && ids.iter().all(|id| owners.get(*id).is_some_and(|s| s.len() == share));
            *found.lock().unwrap() = owners;
            even
        })
        .await
        .map_err(|e| format!("{e}: owners now {:?}", found.lock().unwrap()))?;
        Ok(found.into_inner().unwrap())
    }

    /// `n` keys whose slots `slots` holds, and `n` whose slots it does not.
    pub(super) fn keys_split(&self, slots: &[u32], n: usize) -> Vec<String> {
        let mine: HashSet<u32> = slots.iter().copied().collect();
        let (mut inside, mut outside) = (Vec::new(), Vec::new());
        for i in 0.. {
            let key = format!("k-{i}");
            let list = if mine.contains(&Outbox::slot_of(&key, SLOTS)) {
                &mut inside
            } else {
                &mut outside
            };
            if list.len() < n {
                list.push(key);
            }
            if inside.len() == n && outside.len() == n {
                break;
            }
        }
        inside.extend(outside);
        inside
    }

    /// Starts ordered consumer instances `c0..c{n-1}`, each behind a
    /// `SequenceGuard` over the shared `PgApplied` store.
    pub(super) async fn consumers(&mut self, n: usize) -> std::result::Result<Vec<Instance>, String> {
        let mut out = Vec::new();
        for i in 0..n {
            let id = format!("c{i}");
            let client = self.h.client().await.map_err(err)?;
            let builder = client
                .subscribe(&self.category, "g")
                .ordered_by(KeySource::routing_key())
                .lease(self.h.lease())
                .concurrency(8)
                .retry(RetryPolicy {
                    max_attempts: 5,
                    initial_backoff: Duration::from_millis(20),
                    max_backoff: Duration::from_millis(500),
                });
            let guard = SequenceGuard::new(applying_handler(self.log.clone(), id.clone()), self.applied.clone());
            self.guards.push(guard.stats());
            out.push(Instance::start_with(builder, &id, guard).await.map_err(err)?);
        }
        Ok(out)
    }

    pub(super) fn dropped(&self) -> u64 {
        self.guards.iter().map(|g| g.dropped()).sum()
    }

    pub(super) fn outgoing(&self, key: &str, sleep_ms: u64) -> Outgoing {
        let payload = Payload {
            key: key.to_owned(),
            seq: 0,
            sleep_ms,
            poison: false,
        };
        Outgoing::new(&self.category, key, payload.encode())
    }

    /// Stages one record per key and round, a transaction per round: even
    /// rounds with `stage_many` (keys given in reverse), odd ones a record
    /// at a time.
    pub(super) async fn stage(
        &self,
        keys: &[String],
        rounds: u64,
        sleep_ms: u64,
    ) -> std::result::Result<Vec<Published>, String> {
        let mut out = Vec::new();
        for round in 0..rounds {
            let mut tx = self.pool().begin().await.map_err(err)?;
            let mut staged = Vec::new();
            if round % 2 == 0 {
                let batch: Vec<Outgoing> = keys.iter().rev().map(|k| self.outgoing(k, sleep_ms)).collect();
                let keys_rev: Vec<&String> = keys.iter().rev().collect();
                let done = self.outbox.stage_many(&mut tx, batch).await.map_err(err)?;
                staged.extend(keys_rev.into_iter().cloned().zip(done));
            } else {
                for k in keys {
                    let s = self
                        .outbox
                        .stage(&mut tx, self.outgoing(k, sleep_ms))
                        .await
                        .map_err(err)?;
                    staged.push((k.clone(), s));
                }
            }
            tx.commit().await.map_err(err)?;
            out.extend(staged.into_iter().map(|(k, s)| as_published(&k, &s)));
        }
        Ok(out)
    }

    /// Waits until every id of `published` was applied.
    pub(super) async fn wait_applied(&self, published: &[Published]) -> Outcome {
        let want: HashSet<&str> = published.iter().map(|p| p.id.as_str()).collect();
        let missing = std::sync::atomic::AtomicUsize::new(want.len());
        wait_until("every staged record to be applied", self.h.deadline(), || async {
            let events = self.log.events().await.unwrap_or_default();
            let done: HashSet<&str> = events.iter().filter(|e| e.ok).map(|e| e.message_id.as_str()).collect();
            let n = want.iter().filter(|id| !done.contains(**id)).count();
            missing.store(n, Ordering::Relaxed);
            n == 0
        })
        .await
        .map_err(|e| {
            format!(
                "{e} ({} of {} still missing)",
                missing.load(Ordering::Relaxed),
                want.len()
            )
        })
    }

    /// Waits until the consumers' guards dropped at least `n` stale deliveries.
    pub(super) async fn wait_dropped(&self, n: u64, why: &str) -> Outcome {
        wait_until(why, self.h.deadline(), || async { self.dropped() >= n }).await
    }

    /// The checker's verdict, plus: nothing applied twice.
    pub(super) async fn judge(&self, published: Vec<Published>, spread_over: Vec<String>) -> Outcome {
        let events = self.log.events().await.map_err(err)?;
        // Every delivery carried its record's sequence (the header made it
        // through the broker) and the key it was staged with.
        let staged: std::collections::HashMap<&str, &Published> =
            published.iter().map(|p| (p.id.as_str(), p)).collect();
        for e in &events {
            let want = staged.get(e.message_id.as_str()).map(|p| (p.seq, p.key.as_str()));
            ensure(want == Some((e.seq, e.key.as_str())), || {
                format!(
                    "a delivery does not match its staged record (id {}: delivered seq {}, staged {:?}): \
                     the sequence header or the key did not survive the broker",
                    e.message_id,
                    e.seq,
                    want.map(|w| w.0)
                )
            })?;
        }
        let v = check(
            &events,
            &Expectation {
                published,
                spread_over,
                ..Default::default()
            },
        );
        v.assert_ok()?;
        if v.duplicates > 0 {
            return Err(format!(
                "{} records were applied twice: the guard let a repeat through ({v})",
                v.duplicates
            ));
        }
        Ok(())
    }

    /// Records of the trial's category in `state`.
    pub(super) async fn in_state(&self, state: &str) -> std::result::Result<i64, String> {
        self.count(&format!(
            "select count(*) from {}.records where category = '{}' and state = '{state}'",
            self.schema, self.category
        ))
        .await
    }

    /// Who marked message `id` (`resolved_by` is `<relay>:<generation>`).
    pub(super) async fn resolved_by(&self, id: &str) -> std::result::Result<Option<String>, String> {
        sqlx::query_scalar(AssertSqlSafe(format!(
            "select resolved_by from {}.records where message_id = $1",
            self.schema
        )))
        .bind(id)
        .fetch_one(self.pool())
        .await
        .map_err(err)
    }

    pub(super) async fn all_published(&self, n: usize) -> Outcome {
        let done = self.in_state("published").await?;
        if done == n as i64 {
            Ok(())
        } else {
            Err(format!("{done} of {n} records are marked published"))
        }
    }
}

pub(super) fn as_published(key: &str, s: &Staged) -> Published {
    Published {
        id: s.message_id.clone(),
        key: key.to_owned(),
        seq: s.seq,
    }
}

/// The consumers' inner handler: logs start and end with the record's
/// per-key sequence (its header), sleeping as the payload asks.
pub(super) fn applying_handler(
    log: Arc<dyn EventLog>,
    instance: String,
) -> impl Fn(Delivery) -> Pin<Box<dyn Future<Output = HandlerResult> + Send>> + Send + Sync + 'static {
    move |d: Delivery| {
        let (log, instance) = (log.clone(), instance.clone());
        Box::pin(async move {
            let sleep_ms = Payload::decode(d.payload()).map_or(0, |p| p.sleep_ms);
            let id = log
                .start(EventStart {
                    message_id: d.id().to_owned(),
                    key: d.key().map_or_else(String::new, |k| k.as_str().to_owned()),
                    seq: keyorder_outbox::sequence_of(d.message()).unwrap_or(0),
                    instance,
                    generation: d.fencing_token(),
                })
                .await
                .map_err(HandlerError::retry)?;
            if sleep_ms > 0 {
                tokio::time::sleep(Duration::from_millis(sleep_ms)).await;
            }
            log.end(id, true).await.map_err(HandlerError::retry)?;
            Ok(())
        })
    }
}

pub(super) async fn stop_instances(instances: Vec<Instance>) -> Outcome {
    for i in instances {
        i.stop().await?;
    }
    Ok(())
}

pub(super) async fn stop_relays(relays: Vec<RelayUnderTest>) -> std::result::Result<Vec<serde_json::Value>, String> {
    let mut out = Vec::new();
    for r in relays {
        out.push(r.stop().await?);
    }
    Ok(out)
}
