//! The pointer checks: every [`CHECKPOINT_EVERY`] and at a hand-over the
//! owner moves its pointers into the state partitions, checking first that
//! no newer owner wrote or claimed them, and then deletes the record keys
//! of the owners before it.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use rdkafka::consumer::CommitMode;

use super::shared::Shared;
use crate::state::{self, CHECKPOINT_EVERY};

impl Shared {
    /// Moves the state partitions' pointers to the newest records written
    /// (see [`state::advance`]), checking first that no newer owner wrote:
    /// a partition that one did is lost, and the member is replaced. Waits
    /// for the check; the commit itself is sent without waiting.
    pub(crate) async fn checkpoint(self: &Arc<Self>) {
        let _one = self.checking.lock().await;
        let Some(member) = self.member() else { return };
        if self.check_gap() {
            return;
        }
        let list: Vec<(i32, u64, i64)> = {
            let mut pointers = self.pointers.lock().unwrap_or_else(|e| e.into_inner());
            std::mem::take(&mut pointers.state)
                .into_iter()
                .filter(|(p, (g, _))| {
                    self.part(*p)
                        .is_some_and(|part| !part.lease.is_lost() && part.lease.generation() == *g)
                })
                .map(|(p, (g, at))| (p, g, at))
                .collect()
        };
        if list.is_empty() {
            return;
        }
        let me = self.clone();
        let (group_id, names) = (self.names.group_id(&self.group), self.names.clone());
        let asked = list.clone();
        let claims: HashMap<i32, String> = list
            .iter()
            .filter_map(|(p, _, _)| self.part(*p).map(|part| (*p, part.claim.clone())))
            .collect();
        let checked_claims = claims.clone();
        let checked = tokio::task::spawn_blocking(move || {
            let prober = me.prober()?;
            me.with_checker(|reader| {
                state::advance(
                    &*member,
                    &prober,
                    reader,
                    &me.t.state_producer,
                    &names,
                    &group_id,
                    &asked,
                    &claims,
                    Duration::from_secs(10),
                    CommitMode::Async,
                    // A close does not wait out the check's read.
                    state::Limit {
                        until: None,
                        stop: &me.closed,
                    },
                )
            })
        })
        .await;
        match checked {
            Ok(Ok(stale)) => {
                if !stale.is_empty() {
                    // A static member does not rejoin: under its instance
                    // id it would take them back from a newer incarnation.
                    self.lose_claims(&stale, Some(&checked_claims), !self.static_member);
                }
                self.tombstone_superseded(&list, &stale).await;
            }
            other => {
                let error = match other {
                    Ok(Err(e)) => e.to_string(),
                    Err(e) => e.to_string(),
                    Ok(Ok(_)) => String::new(),
                };
                tracing::debug!(error = %error, "kafka: state pointer check failed; retrying at the next");
                // Try again with these, unless newer records came meanwhile.
                let mut pointers = self.pointers.lock().unwrap_or_else(|e| e.into_inner());
                for (p, g, at) in list {
                    pointers.state.entry(p).or_insert((g, at));
                }
            }
        }
    }

    /// Deletes the keys of the earlier owners' records each claim found
    /// (see [`state::tombstone`]) for the partitions whose pointer check
    /// just passed with a durable record of this owner's generation: the
    /// state topic would otherwise keep a key per generation for good.
    async fn tombstone_superseded(&self, checked: &[(i32, u64, i64)], stale: &[i32]) {
        let group_id = self.names.group_id(&self.group);
        for (partition, generation, _) in checked {
            if stale.contains(partition) {
                continue;
            }
            let Some(part) = self.part(*partition) else { continue };
            if part.lease.is_lost() || part.lease.generation() != *generation {
                continue;
            }
            let older: Vec<u64> = std::mem::take(&mut *part.superseded.lock().unwrap_or_else(|e| e.into_inner()))
                .into_iter()
                .filter(|g| g < generation)
                .collect();
            if older.is_empty() {
                continue;
            }
            match state::tombstone(&self.t.state_producer, &self.names, &group_id, *partition, &older).await {
                Ok(()) => {
                    tracing::debug!(partition, generations = ?older, "kafka: earlier owners' state records deleted");
                }
                Err(e) => {
                    tracing::debug!(error = %e, partition, "kafka: deleting earlier owners' state records failed; retrying at the next check");
                    part.superseded.lock().unwrap_or_else(|e| e.into_inner()).extend(older);
                }
            }
        }
    }

    /// Moves the state pointers every [`CHECKPOINT_EVERY`].
    pub(crate) async fn checkpointer(self: Arc<Self>) {
        let mut tick = tokio::time::interval(CHECKPOINT_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            if self.closed.load(Ordering::SeqCst) {
                return;
            }
            self.checkpoint().await;
        }
    }
}
