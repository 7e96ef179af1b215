//! The heartbeat and the self-fence: owned partitions are confirmed by a
//! round trip to the group coordinator (and, for a static member, by its
//! claim and incarnation checks); past a gap they are all lost.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::TopicPartitionList;
use tokio::time::Instant;

use super::part::Part;
use super::shared::Shared;
use crate::state;

impl Shared {
    /// A static member's confirmation: the broker hands a restarted
    /// member's partitions to its new incarnation without asking the old
    /// one, which may be stalled rather than dead, and not every broker
    /// fences the old one (tansu 0.6 does not), so the state topic decides:
    /// no newer claim of any owned partition may precede this check's
    /// markers. A partition with one is lost here, and the member does not
    /// rejoin for it: a newer incarnation with this instance id took over,
    /// and a rejoin under the same id would take it back (the two would
    /// take turns). On Apache Kafka the broker also fences the old
    /// incarnation (`FENCED_INSTANCE_ID`), which fails its subscription.
    async fn no_newer_claims(self: &Arc<Self>, parts: &[Arc<Part>]) -> bool {
        // The group's pointers are read through the prober, not the
        // member: on the member's connection the read would wait behind
        // its pending join (see `membership_confirmed`).
        let (member, me) = match self.prober() {
            Ok(prober) => (prober, self.clone()),
            Err(e) => {
                tracing::debug!(error = %e, "kafka: static member's claim check: no prober; not confirmed");
                return false;
            }
        };
        let own: Vec<(i32, u64)> = parts.iter().map(|p| (p.partition, p.lease.generation())).collect();
        let claims: HashMap<i32, String> = parts.iter().map(|p| (p.partition, p.claim.clone())).collect();
        let checked_claims = claims.clone();
        let group_id = self.names.group_id(&self.group);
        let checked = tokio::task::spawn_blocking(move || {
            me.with_checker(|reader| {
                state::newer_claims(
                    &*member,
                    reader,
                    &me.t.state_producer,
                    &me.names,
                    &group_id,
                    &own,
                    &claims,
                    Duration::from_secs(5),
                    state::Limit {
                        until: None,
                        stop: &me.closed,
                    },
                )
            })
        })
        .await;
        match checked {
            Ok(Ok(stale)) if stale.is_empty() => true,
            Ok(Ok(stale)) => {
                // Not rejoining (see `checkpoint`); the others are confirmed
                // at the next heartbeat.
                self.lose_claims(&stale, Some(&checked_claims), false);
                false
            }
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "kafka: static member's claim check failed; not confirmed");
                false
            }
            Err(_) => false,
        }
    }

    /// The heartbeat: confirms owned partitions with a round trip to the
    /// group coordinator, or marks them lost after a gap.
    pub(crate) async fn heartbeat(self: Arc<Self>, every: Duration) {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            if self.closed.load(Ordering::SeqCst) {
                return;
            }
            if self.check_gap() {
                continue;
            }
            let Some(member) = self.member() else { continue };
            // Also with nothing owned: membership is confirmed while an
            // assignment reads its saved progress (librdkafka heartbeats
            // meanwhile), so a long read does not end in a gap.
            let parts = self.owned();
            let sent = Instant::now();
            let (topic, first) = (self.names.topic().to_owned(), parts.first().map_or(0, |p| p.partition));
            let prober = self.prober();
            let mut ok = match prober {
                Ok(prober) => {
                    tokio::task::spawn_blocking(move || membership_confirmed(&*member, &prober, &topic, first))
                        .await
                        .unwrap_or(false)
                }
                Err(e) => {
                    tracing::debug!(topic = %self.names.topic(), error = %e, "kafka: the heartbeat's prober could not be created");
                    false
                }
            };
            let mut step = "coordinator round trip";
            if ok && self.static_member && !parts.is_empty() {
                ok = self.no_newer_claims(&parts).await;
                step = "claim check";
            }
            if ok && self.static_member {
                // A newer incarnation fails this one; an unreadable check
                // does not stop the leases' confirmation (the coordinator
                // round trip confirms membership), it is retried.
                ok = !matches!(self.newer_incarnation().await, Ok(true));
                step = "incarnation check";
            }
            if !ok {
                tracing::debug!(topic = %self.names.topic(), instance = %self.instance, step, took_ms = sent.elapsed().as_millis() as u64, "kafka: heartbeat round trip failed");
                if let Some(member) = self.member() {
                    if let Some((code, why)) = member.client().fatal_error() {
                        self.fail(format!("{code:?}: {why}"));
                    }
                }
            }
            if ok && !self.check_gap() {
                {
                    let mut last = self.last_confirm.lock().unwrap_or_else(|e| e.into_inner());
                    *last = (*last).max(sent);
                }
                for p in parts {
                    p.lease.confirm(sent);
                }
            }
        }
    }
}

/// The heartbeat's round trip: whether `member` still holds its
/// assignment. An offset fetch from the group's coordinator, not only a
/// partition leader: a member cut off from its coordinator cannot heartbeat
/// either, and the broker hands its partitions on after the session
/// timeout. The fetch alone does not show membership: the coordinator
/// answers it for a member it expelled too (past `max.poll.interval.ms`,
/// or its session timed out), so the assignment must also not be lost
/// (librdkafka marks it lost then; the lost revoke comes only at a later
/// poll). The pointer check finds a newer owner's state (see `checkpoint`).
///
/// The fetch goes through `prober`, a consumer of the same group id that
/// never joins, on its own connection: a broker serves one request of a
/// connection at a time, so on the member's own connection it waited
/// behind the member's pending join for as long as a rebalance took (a
/// static member's restart waits out the old incarnation's session), and
/// a member that kept its partitions through the rebalance took that for
/// a lost membership, was replaced, and its replacement's join started
/// the wait over for the others.
///
/// What this gives up: the fetch no longer shows that the member's own
/// connection to the coordinator lives. A member whose coordinator
/// connection alone dies silently (no reset) while its join is pending is
/// confirmed by the prober until librdkafka's join request times out
/// (`max.poll.interval.ms` plus 3 s), and a dynamic member's partitions may
/// meanwhile be handed on when the coordinator expires it; outside a
/// rebalance librdkafka marks the assignment lost at the session timeout.
/// A fault that takes the process's connections down together (C19) stops
/// the prober too. Static members also check claims at every heartbeat.
pub(crate) fn membership_confirmed<C: ConsumerContext>(
    member: &BaseConsumer<C>,
    prober: &BaseConsumer,
    topic: &str,
    partition: i32,
) -> bool {
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition(topic, partition);
    // Checked after the round trip: a loss while it ran is seen.
    prober.committed_offsets(tpl, Duration::from_secs(5)).is_ok()
        && !member.assignment_lost()
        && member.client().fatal_error().is_none()
}

/// The heartbeat's confirmation on the test broker (`KAFKA_BROKERS`).
#[cfg(test)]
mod broker_tests {
    use super::*;
    use crate::broker::KafkaTransport;
    use crate::config::base_config;
    use crate::config::KafkaConfig;
    use crate::names::Names;

    /// A member the group expelled (its poll held past
    /// `max.poll.interval.ms`) still gets its offset fetch answered: that
    /// round trip alone kept confirming its leases, and its self-fence let
    /// work start on partitions another member may own.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_expelled_member_is_not_confirmed() {
        let brokers = std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into());
        let cfg = KafkaConfig {
            brokers,
            partitions: 1,
            ..KafkaConfig::default()
        };
        let t = KafkaTransport::connect(cfg).await.expect("the test broker answers");
        let nonce = uuid::Uuid::new_v4().simple().to_string();
        let names = Names::new(&format!("ko-expel-{}", &nonce[..12])).unwrap();
        t.ensure(&names).await.unwrap();
        let mut c = base_config(&t.cfg);
        c.set("group.id", names.group_id("g"))
            .set("enable.auto.commit", "false")
            .set("session.timeout.ms", "6000")
            .set("heartbeat.interval.ms", "500")
            .set("max.poll.interval.ms", "6000");
        let member: Arc<BaseConsumer> = Arc::new(c.create().unwrap());
        member.subscribe(&[names.topic()]).unwrap();
        let mut p = base_config(&t.cfg);
        p.set("group.id", names.group_id("g"))
            .set("enable.auto.commit", "false");
        let prober: Arc<BaseConsumer> = Arc::new(p.create().unwrap());
        let topic = names.topic().to_owned();
        let confirmed = |member: &Arc<BaseConsumer>| {
            let (member, prober, topic) = (member.clone(), prober.clone(), topic.clone());
            tokio::task::spawn_blocking(move || membership_confirmed(&*member, &prober, &topic, 0))
        };
        let m = member.clone();
        tokio::task::spawn_blocking(move || {
            let deadline = std::time::Instant::now() + Duration::from_secs(60);
            while m.assignment().map(|a| a.count()).unwrap_or(0) == 0 {
                assert!(std::time::Instant::now() < deadline, "the member gets its partition");
                let _ = m.poll(Duration::from_millis(100));
            }
        })
        .await
        .unwrap();
        assert!(confirmed(&member).await.unwrap(), "a member in the group is confirmed");
        // Not polled for longer than `max.poll.interval.ms`: librdkafka
        // leaves the group and marks the assignment lost.
        let deadline = Instant::now() + Duration::from_secs(30);
        while !member.assignment_lost() {
            assert!(Instant::now() < deadline, "librdkafka marks the assignment lost");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let (m, t2) = (member.clone(), topic.clone());
        let fetched = tokio::task::spawn_blocking(move || {
            let mut tpl = TopicPartitionList::new();
            tpl.add_partition(&t2, 0);
            m.committed_offsets(tpl, Duration::from_secs(5)).is_ok()
        })
        .await
        .unwrap();
        assert!(
            fetched,
            "the coordinator still answers the expelled member's offset fetch"
        );
        assert!(
            !confirmed(&member).await.unwrap(),
            "an expelled member's round trip confirms nothing"
        );
        drop(member);
    }
}
