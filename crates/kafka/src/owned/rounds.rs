//! The state rounds: one committer task writes the state records of every
//! changed partition, up to [`MAX_ROUNDS`] at a time, and an
//! acknowledgement, attempt or halt waits for the round that carries it.
//! The topic partitions' committed offsets follow, without waiting.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use keyorder_core::Result;
use rdkafka::consumer::{CommitMode, Consumer};
use rdkafka::{Offset, TopicPartitionList};
use tokio::time::Instant;

use super::part::Part;
use super::shared::{Member, Shared};
use crate::error::fenced;
use crate::state;

/// State rounds in flight at once (each waits for its records' delivery
/// reports; acknowledgements wait for the round that carries them). Fewer,
/// larger rounds cost the broker less: measured on tansu at 100 keys and a
/// 1 ms handler, 8 in flight ran 6,500-7,000 msg/s, 4 about 7,800, 2 about
/// 9,000 (before the pointer commits were spaced out).
const MAX_ROUNDS: usize = 2;

/// The topic partitions' committed offsets (for lag and other tools) go
/// out at most this often, without waiting. One commit per round cost the
/// broker a group-coordinator request per round.
const POINTER_EVERY: Duration = Duration::from_millis(250);

/// One partition's state in a write round.
struct Write {
    part: Arc<Part>,
    version: u64,
    committed: i64,
    hw: i64,
    meta: String,
}

impl Shared {
    /// Asks for a state round carrying everything recorded so far and waits
    /// for it; fails with `Fenced` once `part` was lost.
    pub(crate) async fn commit_through(&self, part: &Part) -> Result<()> {
        let seq = self.wanted.fetch_add(1, Ordering::SeqCst) + 1;
        self.wake.notify_one();
        let mut rx = self.completed.subscribe();
        let lease = &part.lease;
        let r = rx.wait_for(|done| *done >= seq || lease.is_lost()).await;
        if r.is_err() || lease.is_lost() {
            return Err(fenced(lease));
        }
        Ok(())
    }

    /// The committer: writes the state of every changed partition in
    /// rounds, up to [`MAX_ROUNDS`] in flight. Rounds complete in order (records of
    /// one partition are appended in order by the idempotent producer), so
    /// a completed request number means everything recorded before it is
    /// durable. A failed round is covered by the next: a partition stays
    /// changed until a round carrying it succeeded.
    pub(crate) async fn committer(self: Arc<Self>) {
        use futures::stream::{FuturesOrdered, StreamExt};
        let mut tick = tokio::time::interval(Duration::from_millis(500));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut rounds = FuturesOrdered::new();
        let mut started = 0u64;
        loop {
            if self.closed.load(Ordering::SeqCst) {
                return;
            }
            let wanted = self.wanted.load(Ordering::SeqCst);
            let mut ticked = false;
            if wanted <= started || rounds.len() >= MAX_ROUNDS {
                tokio::select! {
                    () = self.wake.notified() => {}
                    _ = tick.tick() => ticked = true,
                    Some(done) = rounds.next(), if !rounds.is_empty() => {
                        self.finish(done);
                        continue;
                    }
                }
                if rounds.len() >= MAX_ROUNDS {
                    continue;
                }
            }
            let target = self.wanted.load(Ordering::SeqCst);
            if target <= started && !ticked {
                continue;
            }
            if self.check_gap() {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
            let Some(member) = self.member() else {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            };
            if ticked {
                self.commit_pointers(&member, false);
            }
            let parts = self.owned();
            let mut dirty = Vec::new();
            for p in &parts {
                if p.lease.is_lost() {
                    continue;
                }
                let (version, committed, hw, meta) = {
                    let t = p.track();
                    let (committed, hw, meta) = t.commit(self.partitions);
                    (t.version, committed, hw, meta)
                };
                if version > p.sent_version.load(Ordering::SeqCst) {
                    p.sent_version.fetch_max(version, Ordering::SeqCst);
                    dirty.push(Write {
                        part: p.clone(),
                        version,
                        committed,
                        hw,
                        meta,
                    });
                }
            }
            started = started.max(target);
            tracing::trace!(
                target,
                partitions = dirty.len(),
                in_flight = rounds.len(),
                "kafka: state round"
            );
            let me = self.clone();
            rounds.push_back(async move {
                let ok = me.write(&member, &dirty).await;
                (target, ok, dirty)
            });
        }
    }

    /// Writes one round's state records, then sends the pointer commit.
    async fn write(&self, member: &Member, dirty: &[Write]) -> bool {
        if dirty.is_empty() {
            return true;
        }
        // Behind the self-fence: nothing is written for a partition that may
        // have been given away.
        if self.check_gap() || dirty.iter().any(|w| w.part.lease.is_lost()) {
            return false;
        }
        let state_topic = self.names.state();
        let group_id = self.names.group_id(&self.group);
        let writes = dirty.iter().map(|w| {
            let generation = w.part.lease.generation();
            let value = state::encode(generation, w.committed, &w.meta);
            let key = state::record_key(&group_id, generation);
            let (t, topic) = (&self.t, &state_topic);
            async move {
                t.produce_state(topic, w.part.partition, key.as_bytes(), value.as_bytes())
                    .await
            }
        });
        let written = futures::future::join_all(writes).await;
        let mut ok = true;
        {
            let mut pointers = self.pointers.lock().unwrap_or_else(|e| e.into_inner());
            for (w, r) in dirty.iter().zip(written) {
                match r {
                    Ok((_, at)) => {
                        let generation = w.part.lease.generation();
                        let e = pointers.state.entry(w.part.partition).or_insert((generation, at));
                        if at >= e.1 {
                            *e = (generation, at);
                            pointers.pending.insert(w.part.partition, w.committed);
                        }
                    }
                    Err(e) => {
                        ok = false;
                        metrics::counter!("keyorder_kafka_state_write_errors_total").increment(1);
                        tracing::warn!(error = %e, "kafka: writing partition state failed; retrying");
                    }
                }
            }
        }
        self.commit_pointers(member, false);
        ok
    }

    /// A round completed (in order).
    fn finish(&self, (target, ok, dirty): (u64, bool, Vec<Write>)) {
        if ok {
            for w in &dirty {
                w.part.saved_version.fetch_max(w.version, Ordering::SeqCst);
                w.part.track().saved(w.hw);
            }
            metrics::counter!("keyorder_kafka_state_writes_total").increment(1);
            self.completed.send_modify(|d| *d = (*d).max(target));
        } else {
            // Write these again in the next round.
            for w in &dirty {
                w.part
                    .sent_version
                    .store(w.part.saved_version.load(Ordering::SeqCst), Ordering::SeqCst);
            }
            self.wanted.fetch_add(1, Ordering::SeqCst);
            self.wake.notify_one();
        }
    }

    /// Sends the pending commits of the topic partitions' committed offsets
    /// (for lag and other tools), without waiting, if [`POINTER_EVERY`]
    /// passed since the last (or `now`). Only partitions still owned, and
    /// only behind the self-fence, are committed.
    pub(crate) fn commit_pointers(&self, member: &Member, now: bool) {
        if self.check_gap() {
            return;
        }
        let pending = {
            let mut pointers = self.pointers.lock().unwrap_or_else(|e| e.into_inner());
            if pointers.pending.is_empty() || (!now && pointers.last.elapsed() < POINTER_EVERY) {
                return;
            }
            pointers.last = Instant::now();
            std::mem::take(&mut pointers.pending)
        };
        let mut tpl = TopicPartitionList::new();
        for (partition, committed) in pending {
            if self.part(partition).is_none_or(|p| p.lease.is_lost()) {
                continue;
            }
            let _ = tpl.add_partition_offset(self.names.topic(), partition, Offset::Offset(committed));
        }
        if tpl.count() > 0 {
            if let Err(e) = member.commit(&tpl, CommitMode::Async) {
                tracing::debug!(error = %e, "kafka: offset commit not sent");
            }
        }
    }
}
