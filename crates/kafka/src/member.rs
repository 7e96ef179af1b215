//! The group member: its rebalance callbacks (which read each assigned
//! partition's saved state before it starts, and hold a revoke until the
//! partitions drained), its creation, and its poll thread.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc as std_mpsc, Arc};
use std::time::Duration;

use keyorder_core::{Result, SourceSpec};
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::types::{RDKafkaErrorCode, RDKafkaRespErr};
use rdkafka::{ClientContext, Offset, TopicPartitionList};
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::config::{base_config, Assignor, StartAt};
use crate::error::{create_err, kafka_err};
use crate::owned::{Ctx, Ev, Member, Shared};
use crate::state;

impl ClientContext for Ctx {}

/// The partitions of `topic` in `tpl`.
fn parts_of(tpl: &TopicPartitionList, topic: &str) -> Vec<i32> {
    tpl.elements()
        .iter()
        .filter(|e| e.topic() == topic)
        .map(|e| e.partition())
        .collect()
}

impl Ctx {
    /// Where each of `fresh` (partitions without saved progress) starts,
    /// as the `start` option says; absent: at the beginning.
    fn first_offsets(
        &self,
        c: &BaseConsumer<Self>,
        fresh: &[i32],
        deadline: std::time::Instant,
    ) -> std::result::Result<HashMap<i32, i64>, String> {
        let mut out = HashMap::new();
        let Some(shared) = self.shared.upgrade() else {
            return Ok(out);
        };
        // A partition's (low, high) watermarks, within the callback's wait.
        let watermarks = |p: i32| {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Err("the assignment's wait ran out".to_owned());
            }
            c.fetch_watermarks(&self.topic, p, left.min(Duration::from_secs(10)))
                .map_err(|e| e.to_string())
        };
        match &shared.t.cfg.start {
            StartAt::Earliest => {}
            StartAt::Group(_) => {
                for p in fresh {
                    if let Some(o) = shared.start_offsets.get(p) {
                        // Within what the partition holds: an offset past
                        // its end (another topic's of the same name) would
                        // skip what comes next.
                        let (low, high) = watermarks(*p)?;
                        if *o > high {
                            tracing::warn!(partition = p, "kafka: start=group: the group's committed offset lies past the partition's end; starting at the end");
                        }
                        out.insert(*p, (*o).min(high).max(low));
                    }
                }
            }
            StartAt::Latest => {
                for p in fresh {
                    out.insert(*p, watermarks(*p)?.1);
                }
            }
        }
        Ok(out)
    }
}

impl ConsumerContext for Ctx {
    fn rebalance(&self, c: &BaseConsumer<Self>, err: RDKafkaRespErr, tpl: &mut TopicPartitionList) {
        // From the configuration, not `c.rebalance_protocol()`: that asks
        // librdkafka's main thread, which never answers while the consumer
        // is being destroyed (a last reference dropped off the poll thread
        // serves a final revoke from inside the drop: seen hanging a
        // process at exit).
        let cooperative = self.cooperative;
        match err {
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS => {
                // The group gave these partitions now; the read below may
                // take long, and the assignment is only known valid as of
                // here.
                let at = Instant::now();
                let deadline = std::time::Instant::now() + self.load_wait;
                // Read the saved progress first: the assignment starts
                // exactly where the state it comes with was written.
                // A partition beyond the layout (added to the topic while
                // in use) has no state partition and is never started: the
                // subscription stops at its next `maintain` (C23).
                let layout = self.shared.upgrade().map_or(i32::MAX, |s| s.partitions);
                let (parts, outside): (Vec<i32>, Vec<i32>) =
                    parts_of(tpl, &self.topic).into_iter().partition(|p| *p < layout);
                if let (Some(p), Some(shared)) = (outside.iter().max(), self.shared.upgrade()) {
                    shared.outside_layout.fetch_max(p + 1, Ordering::SeqCst);
                }
                tracing::debug!(instance = %self.instance, ?parts, "kafka: the group assigns; reading saved progress");
                // Never start without it: a partition taken from its committed
                // offset alone would run finished messages again. Retried up
                // to `load_wait` only: the poll is held meanwhile, and a
                // rebalance the group starts now waits for this member's
                // rejoin at most `max.poll.interval.ms` before expelling it.
                let limit = state::Limit {
                    until: Some(deadline),
                    stop: &self.stopping,
                };
                let mut saved = None;
                // A static member that found a gap, or failed for good,
                // starts nothing until it has checked for a newer
                // incarnation (see `Shared::newer_incarnation`): librdkafka
                // may rejoin on its own meanwhile.
                let held = self.shared.upgrade().is_some_and(|s| {
                    s.static_member
                        && (s.replace.load(Ordering::SeqCst)
                            || s.fatal.lock().unwrap_or_else(|e| e.into_inner()).is_some())
                });
                // And every assignment of a static member checks first: a
                // stalled incarnation's librdkafka may rejoin by itself.
                let mut held = held;
                let current = |s: &Shared| s.member().is_some_and(|m| std::ptr::eq(Arc::as_ptr(&m), c));
                if let Some(shared) = self
                    .shared
                    .upgrade()
                    .filter(|s| s.static_member && !held && !self.stopping.load(Ordering::SeqCst) && current(s))
                {
                    loop {
                        match shared.newer_incarnation_with(&self.reader, Duration::from_secs(5), Some(deadline)) {
                            Ok(false) => break,
                            Ok(true) => {
                                held = true;
                                break;
                            }
                            Err(e)
                                if self.stopping.load(Ordering::SeqCst)
                                    || std::time::Instant::now() + Duration::from_secs(1) >= deadline =>
                            {
                                tracing::warn!(instance = %self.instance, error = %e, "kafka: static member could not check for a newer incarnation; not starting the assigned partitions");
                                if current(&shared) {
                                    shared.replace.store(true, Ordering::SeqCst);
                                }
                                held = true;
                                break;
                            }
                            Err(_) => {
                                // The poll thread, not a runtime worker.
                                #[allow(clippy::disallowed_methods)]
                                std::thread::sleep(Duration::from_millis(200));
                            }
                        }
                    }
                }
                if held {
                    tracing::debug!(instance = %self.instance, ?parts, "kafka: static member not checked; not starting the assigned partitions");
                }
                while !held
                    && saved.is_none()
                    && !self.stopping.load(Ordering::SeqCst)
                    && std::time::Instant::now() < deadline
                {
                    match state::load(
                        c,
                        &self.reader,
                        &self.producer,
                        &self.names,
                        &self.group_id,
                        &parts,
                        Duration::from_secs(10),
                        limit,
                    ) {
                        Ok(list) => saved = Some(list),
                        Err(e) => {
                            let _ = self
                                .tx
                                .send(Ev::Error(format!("reading saved progress: {e}; retrying")));
                            // A broker refusing at once is not asked in a spin.
                            // This is the poll thread, not a runtime worker.
                            #[allow(clippy::disallowed_methods)]
                            std::thread::sleep(Duration::from_millis(200));
                        }
                    }
                }
                if !held && saved.is_none() && !self.stopping.load(Ordering::SeqCst) {
                    // Not loadable in time: none of these start here. The
                    // member leaves and rejoins, so that the group hands
                    // them out again (to this member or another) rather
                    // than leaving them with a member that runs none.
                    tracing::warn!(
                        instance = %self.instance,
                        ?parts,
                        wait_ms = self.load_wait.as_millis() as u64,
                        "kafka: saved progress not read in time; not starting the assigned partitions, rejoining"
                    );
                    if let Some(shared) = self.shared.upgrade() {
                        shared.replace.store(true, Ordering::SeqCst);
                    }
                } else if saved.is_some() && c.assignment_lost() {
                    // The group expelled this member while it read (and the
                    // assign call below would clear the flag): nothing starts,
                    // what it owned from before is lost too, and the member
                    // rejoins (as after a gap) so that no partition stays
                    // with it unread.
                    tracing::warn!(instance = %self.instance, ?parts, "kafka: assignment lost while reading saved progress; rejoining");
                    saved = None;
                    if let Some(shared) = self.shared.upgrade() {
                        shared.lose_all("the assignment was lost while reading saved progress");
                        shared.replace.store(true, Ordering::SeqCst);
                    }
                }
                // Where partitions this group never consumed start (the
                // `start` option); not readable in time: none start, the
                // member rejoins (as for saved progress).
                let mut firsts = HashMap::new();
                if let Some(list) = &saved {
                    let fresh: Vec<i32> = list.iter().filter(|s| !s.known).map(|s| s.partition).collect();
                    match self.first_offsets(c, &fresh, deadline) {
                        Ok(f) => firsts = f,
                        Err(e) => {
                            tracing::warn!(instance = %self.instance, error = %e, "kafka: start offsets not read in time; not starting the assigned partitions, rejoining");
                            saved = None;
                            if let Some(shared) = self.shared.upgrade() {
                                shared.replace.store(true, Ordering::SeqCst);
                            }
                        }
                    }
                }
                let mut assign = TopicPartitionList::new();
                if let Some(saved) = saved {
                    let mut info = Vec::new();
                    for mut s in saved {
                        let from = if s.known {
                            Offset::Offset(s.committed)
                        } else if let Some(first) = firsts.get(&s.partition) {
                            // The track starts there too, so that its first
                            // commit does not point back to the beginning.
                            s.committed = *first;
                            Offset::Offset(*first)
                        } else {
                            Offset::Beginning
                        };
                        let _ = assign.add_partition_offset(&self.topic, s.partition, from);
                        info.push((s.partition, s.committed, s.generation, s.meta, s.older, s.claim));
                    }
                    tracing::debug!(instance = %self.instance, ?parts, "kafka: saved progress read");
                    let _ = self.tx.send(Ev::Assigned { parts: info, at });
                }
                let r = if cooperative {
                    c.incremental_assign(&assign)
                } else {
                    c.assign(&assign)
                };
                if let Err(e) = r {
                    let _ = self.tx.send(Ev::Error(format!("assign: {e}")));
                }
            }
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__REVOKE_PARTITIONS => {
                let parts = parts_of(tpl, &self.topic);
                tracing::debug!(instance = %self.instance, ?parts, "kafka: the group revokes");
                if !parts.is_empty() && !self.stopping.load(Ordering::SeqCst) {
                    let (reply, wait) = std_mpsc::sync_channel(1);
                    let lost = c.assignment_lost();
                    let asked = parts.clone();
                    if self.tx.send(Ev::Revoke { parts, lost, reply }).is_ok() {
                        // Until the partitions drained and committed, or the
                        // source went away (the sender is dropped), at most
                        // `revoke_wait`: past it they are lost here first
                        // (their handlers' settlements are refused), so that
                        // the poll returns before the broker expels the member.
                        if let Err(std_mpsc::RecvTimeoutError::Timeout) = wait.recv_timeout(self.revoke_wait) {
                            tracing::warn!(
                                instance = %self.instance,
                                partitions = asked.len(),
                                wait_ms = self.revoke_wait.as_millis() as u64,
                                "kafka: revoked partitions did not drain in time (max.poll.interval.ms less the session timeout); handing them over as lost"
                            );
                            if let Some(shared) = self.shared.upgrade() {
                                shared.lose_parts(&asked, false);
                            }
                        }
                    }
                }
                let r = if cooperative {
                    c.incremental_unassign(tpl)
                } else {
                    c.unassign()
                };
                if let Err(e) = r {
                    let _ = self.tx.send(Ev::Error(format!("unassign: {e}")));
                }
            }
            other => {
                let _ = self.tx.send(Ev::Error(format!("rebalance error: {other:?}")));
            }
        }
    }
}

/// A group member started: the events its poll thread sends, the flag
/// that stops the thread, and what resolves once the thread has left the
/// group and closed.
pub(crate) struct Started {
    pub(crate) rx: mpsc::UnboundedReceiver<Ev>,
    pub(crate) stop: Arc<AtomicBool>,
    pub(crate) left: tokio::sync::oneshot::Receiver<()>,
}

/// Creates a group member of `shared`'s group for `spec`, makes it
/// `shared`'s member and starts its poll thread.
pub(crate) fn start(shared: &Arc<Shared>, spec: &SourceSpec) -> Result<Started> {
    let cfg = &shared.t.cfg;
    let mut c = base_config(cfg);
    let session_ms = spec.lease.ttl.as_millis().max(1000);
    let heartbeat_ms = spec.lease.heartbeat.as_millis().max(100);
    // A revoke holds the poll while its partitions drain; the broker
    // expels a member that does not poll within `max.poll.interval.ms`.
    // So a revoke waits at most that less the session timeout.
    let max_poll_ms: u128 = cfg
        .extra
        .get("max.poll.interval.ms")
        .and_then(|v| v.parse().ok())
        .unwrap_or(300_000)
        .max(session_ms + 1000);
    let revoke_wait = Duration::from_millis((max_poll_ms - session_ms) as u64);
    // An assignment's read of its saved progress holds the poll as a
    // revoke does, so it is bounded by the same reasoning, with room
    // to spare: half of it (145 s by default).
    let load_wait = revoke_wait / 2;
    c.set("group.id", shared.names.group_id(&spec.group))
        .set("client.id", format!("keyorder-{}", spec.instance))
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("auto.offset.reset", "earliest")
        .set("session.timeout.ms", session_ms.to_string())
        .set("heartbeat.interval.ms", heartbeat_ms.to_string())
        .set("fetch.wait.max.ms", cfg.fetch_wait_ms.to_string());
    for (k, v) in &cfg.extra {
        c.set(k, v);
    }
    // After the pass-through settings: the rebalance callback relies
    // on the `assignor` option's protocol.
    c.set("partition.assignment.strategy", cfg.assignor.name());
    if shared.static_member {
        c.set("group.instance.id", &shared.instance);
    }
    c.set("max.poll.interval.ms", max_poll_ms.to_string());
    let (tx, rx) = mpsc::unbounded_channel();
    let stop = Arc::new(AtomicBool::new(false));
    let mut rc = base_config(cfg);
    rc.set("group.id", "keyorder-state-reader")
        .set("enable.auto.commit", "false")
        .set("fetch.wait.max.ms", cfg.fetch_wait_ms.to_string());
    let ctx = Ctx {
        tx: tx.clone(),
        stopping: stop.clone(),
        topic: shared.names.topic().to_owned(),
        names: shared.names.clone(),
        group_id: shared.names.group_id(&spec.group),
        reader: rc.create().map_err(create_err)?,
        producer: shared.t.state_producer.clone(),
        instance: spec.instance.to_string(),
        revoke_wait,
        load_wait,
        shared: Arc::downgrade(shared),
        cooperative: cfg.assignor == Assignor::CooperativeSticky,
    };
    let member: Member = c.create_with_context(ctx).map_err(create_err)?;
    member.subscribe(&[shared.names.topic()]).map_err(kafka_err)?;
    let member = Arc::new(member);
    *shared.member.lock().unwrap_or_else(|e| e.into_inner()) = Some(member.clone());
    *shared.last_confirm.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
    let thread_stop = stop.clone();
    let (left_tx, left) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("keyorder-kafka-poll".into())
        .spawn(move || {
            poll_loop(member, tx, thread_stop);
            let _ = left_tx.send(());
        })
        .map_err(|e| keyorder_core::Error::Broker(format!("kafka: cannot start the poll thread: {e}")))?;
    Ok(Started { rx, stop, left })
}

/// The poll thread: forwards messages and errors, in order, until
/// stopped; then leaves the group and closes the member, bounded.
fn poll_loop(member: Arc<Member>, tx: mpsc::UnboundedSender<Ev>, stop: Arc<AtomicBool>) {
    while !stop.load(Ordering::SeqCst) {
        match member.poll(Duration::from_millis(100)) {
            Some(Ok(m)) if tx.send(Ev::Msg(m.detach())).is_err() => break,
            Some(Ok(_)) => {}
            Some(Err(e)) => {
                // The poll was held past `max.poll.interval.ms`: librdkafka
                // left the group (and rejoins), so every partition may be
                // another member's already. A gap in membership, as the
                // self-fence's: nothing owned here may run on.
                if e.rdkafka_error_code() == Some(RDKafkaErrorCode::PollExceeded) {
                    if let Some(shared) = member.context().shared.upgrade() {
                        shared.lose_all("max.poll.interval.ms exceeded");
                    }
                }
                // Given up for good (another consumer joined with this
                // static member's instance id): nothing may run on.
                // (An old member being replaced is not this source's any more.)
                if let Some((code, why)) = member.client().fatal_error() {
                    if let Some(shared) = member.context().shared.upgrade() {
                        if shared.member().is_some_and(|m| Arc::ptr_eq(&m, &member)) {
                            shared.fail(format!("{code:?}: {why}"));
                        }
                    }
                }
                let _ = tx.send(Ev::Error(e.to_string()));
            }
            None => {}
        }
    }
    // Leaving: the rebalance callback sees `stop` and does not wait.
    stop.store(true, Ordering::SeqCst);
    member.unsubscribe();
    // Serve the revoke the unsubscribe triggers.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while std::time::Instant::now() < deadline {
        if member.assignment().map(|a| a.count() == 0).unwrap_or(true) {
            break;
        }
        let _ = member.poll(Duration::from_millis(50));
    }
    // Close here, on the poll thread, bounded: wherever the last reference
    // goes later (a settle handle, an aborted task's closure), the
    // consumer's drop finds it closed and serves nothing (served off the
    // poll thread, a final revoke waited for librdkafka's main thread
    // forever: seen hanging a process at exit).
    if member.close_queue().is_ok() {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !member.closed() && std::time::Instant::now() < deadline {
            let _ = member.poll(Duration::from_millis(50));
        }
    }
}
