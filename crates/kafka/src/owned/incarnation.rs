//! A static member's incarnation: registered under its instance id before
//! it first joins, and checked so that an older incarnation never takes
//! its partitions back from a newer one.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use keyorder_core::{Result, SourceSpec};
use tokio::time::Instant;

use super::shared::{Incarnation, Shared};
use crate::broker::KafkaTransport;
use crate::error::broker;
use crate::state;

/// How long a static member may fail to check for a newer incarnation
/// before it fails for good (see [`Shared::newer_incarnation_with`]).
const UNCHECKED_LIMIT: Duration = Duration::from_secs(300);

impl Shared {
    /// Registers this static member's incarnation under its instance id,
    /// once, before it first joins (see [`Shared::newer_incarnation`]).
    pub(crate) async fn register_incarnation(self: &Arc<Self>) -> Result<()> {
        if !self.static_member || self.incarnation.lock().unwrap_or_else(|e| e.into_inner()).is_some() {
            return Ok(());
        }
        let me = self.clone();
        let token = uuid::Uuid::new_v4().simple().to_string();
        let partition = state::incarnation_partition(&self.instance, self.partitions);
        let t = token.clone();
        let from = tokio::task::spawn_blocking(move || {
            state::register_incarnation(
                &me.t.state_producer,
                &me.names,
                &me.names.group_id(&me.group),
                &me.instance,
                partition,
                &t,
                Duration::from_secs(10),
            )
        })
        .await
        .map_err(broker)?
        .map_err(|e| crate::error::broker_as(format!("kafka: registering the static member's incarnation: {e}"), e))?;
        *self.incarnation.lock().unwrap_or_else(|e| e.into_inner()) = Some(Incarnation {
            token,
            partition,
            from,
            first: true,
        });
        Ok(())
    }

    /// Whether a newer incarnation of this static member (another process
    /// with its instance id) registered since this one did. The broker
    /// hands a static member's partitions to its newer incarnation without
    /// asking the older one, which may be stalled rather than dead, and not
    /// every broker fences it (tansu 0.6 does not): an older incarnation
    /// that rejoined under the same id would take the partitions back, and
    /// the two would take turns. So an incarnation that finds a newer one
    /// fails for good, naming the fix, at its next heartbeat and before it
    /// rejoins after a gap; it cannot tell a newer incarnation from a slow
    /// rejoin of its own by the group alone. Each check reads only what
    /// was written since the last one. `Err`: not read.
    pub(crate) async fn newer_incarnation(self: &Arc<Self>) -> std::result::Result<bool, String> {
        let me = self.clone();
        tokio::task::spawn_blocking(move || {
            me.with_checker(|reader| Ok(me.newer_incarnation_with(reader, Duration::from_secs(5), None)))
                .map_err(|e| e.to_string())?
        })
        .await
        .map_err(|e| e.to_string())?
    }

    /// [`Shared::newer_incarnation`], blocking, with `reader` (the
    /// rebalance callback checks with its own before it loads anything).
    pub(crate) fn newer_incarnation_with(
        &self,
        reader: &state::Reader,
        timeout: Duration,
        until: Option<std::time::Instant>,
    ) -> std::result::Result<bool, String> {
        let Some(inc) = self.incarnation.lock().unwrap_or_else(|e| e.into_inner()).clone() else {
            return Ok(false);
        };
        let checked = state::newer_incarnation(
            reader,
            &self.t.state_producer,
            &self.names,
            &self.names.group_id(&self.group),
            &self.instance,
            inc.partition,
            &inc.token,
            inc.from,
            inc.first,
            timeout,
            state::Limit {
                until,
                stop: &self.closed,
            },
        );
        match checked {
            Ok((false, end)) => {
                if let Some(i) = self.incarnation.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
                    if i.token == inc.token {
                        i.from = i.from.max(end);
                        i.first = false;
                    }
                }
                *self.unchecked_since.lock().unwrap_or_else(|e| e.into_inner()) = None;
                Ok(false)
            }
            Ok((true, _)) => {
                self.fail(
                    "a newer incarnation of this static member (another process with its instance id) \
                     registered and took its partitions over"
                        .into(),
                );
                Ok(true)
            }
            Err(e) => {
                // Never stuck: a member that cannot check for long fails
                // for good rather than hold its assignment unread.
                let mut since = self.unchecked_since.lock().unwrap_or_else(|e| e.into_inner());
                let first = *since.get_or_insert_with(Instant::now);
                drop(since);
                if first.elapsed() > UNCHECKED_LIMIT {
                    self.fail(format!(
                        "could not read the state topic for a newer incarnation for {} s ({e}); open the \
                         subscription again once the state topic `{}` is readable",
                        UNCHECKED_LIMIT.as_secs(),
                        self.names.state()
                    ));
                }
                Err(e.to_string())
            }
        }
    }

    /// How long a static member's assigned partition waits, after its
    /// claim, before its work starts: the broker may have taken it from a
    /// stalled incarnation with the same instance id, whose leases were last
    /// confirmed by a claim check that began before this claim (see
    /// [`Shared::no_newer_claims`]), so they end within `ttl - margin` of it;
    /// one heartbeat more for slack.
    pub(crate) fn static_start_wait(spec: &SourceSpec) -> Duration {
        spec.lease.ttl.saturating_sub(spec.lease.margin) + spec.lease.heartbeat
    }
}

/// Refuses a static member whose instance id cannot be a
/// `group.instance.id`, or is already a member of the same group in this
/// transport (the two would fence each other).
pub(crate) fn check_static_member(t: &KafkaTransport, shared: &Arc<Shared>) -> Result<()> {
    let id = &shared.instance;
    let legal = !id.is_empty()
        && id.len() <= 200
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if !legal {
        return Err(keyorder_core::Error::Config(
            "kafka: static_membership=true needs an instance id of 1 to 200 ASCII letters, digits, `.`, `_` or `-` \
             (set one that survives a restart, such as the pod's name, with .instance_id(...))"
                .into(),
        ));
    }
    let uuid_like = id.len() == 36 && id.bytes().filter(|b| *b == b'-').count() == 4;
    if uuid_like {
        tracing::warn!(
            topic = %shared.names.topic(),
            "kafka: static membership with a generated instance id: a restart joins as a new member and the old one \
             keeps its partitions until its session times out; set .instance_id(...) to a name that survives a restart"
        );
    }
    let group_id = shared.names.group_id(&shared.group);
    let taken = t.registry.live::<Shared>().iter().any(|o| {
        !Arc::ptr_eq(o, shared)
            && o.static_member
            && !o.closed.load(Ordering::SeqCst)
            && o.instance == *id
            && o.names.group_id(&o.group) == group_id
    });
    if taken {
        return Err(keyorder_core::Error::Config(format!(
            "kafka: group `{group_id}` already has a static member with this instance id in this process: \
             give each subscription of a category and group its own .instance_id(...)"
        )));
    }
    Ok(())
}
