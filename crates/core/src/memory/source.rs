//! `MemorySource`, the ordered source: takes partitions by lease and reads
//! what their owner has not settled.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tokio::time::Instant;

use crate::error::{Error, Result};
use crate::lease::{LeaseConfig, ScopeLease};
use crate::message::Message;
use crate::transport::{Inbound, Room, SourceEvent, TransportSource};

use super::broker::{Broker, BrokerState, Category, Group, PartLog};
use super::names::{parse_scope, scope_name};
use super::settle::MemorySettle;

pub(super) struct MemorySource {
    pub(super) broker: Arc<Broker>,
    pub(super) category: String,
    pub(super) group: String,
    pub(super) member: String,
    pub(super) ordered: bool,
    pub(super) lease_cfg: LeaseConfig,
    pub(super) leases: HashMap<u32, Arc<ScopeLease>>,
    pub(super) events: Vec<SourceEvent>,
    pub(super) cursor: u32,
    pub(super) closed: bool,
}

impl fmt::Debug for MemorySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemorySource")
            .field("category", &self.category)
            .field("group", &self.group)
            .field("owned", &self.leases.len())
            .finish()
    }
}

impl MemorySource {
    /// Heartbeat, rebalance, lease bookkeeping: one fenced round trip.
    /// Collects the member's events for the next `maintain`, or fails with
    /// `Fenced` if the member was expired.
    pub(super) fn round_trip(&mut self, st: &mut BrokerState) -> Result<()> {
        let sent = Instant::now();
        let partitions = self.broker.partitions;
        let cat = self.broker.category(st, &self.category);
        let group = cat.group_mut(&self.group)?;
        group.rebalance(sent, partitions, &self.category);
        let Some(me) = group.members.get_mut(&self.member) else {
            for lease in self.leases.values() {
                lease.lose_to_broker();
            }
            self.leases.clear();
            return Err(Error::Fenced {
                scope: format!("{}/*", self.category),
                generation: 0,
            });
        };
        me.last_seen = sent;
        let events = std::mem::take(&mut me.events);
        let wanted = if self.ordered {
            group.wanted(partitions)
        } else {
            Vec::new()
        };
        for p in 0..partitions {
            let part = &mut group.parts[p as usize];
            if self.ordered && part.owner.is_none() && wanted[p as usize].as_ref() == Some(&self.member) {
                part.generation += 1;
                part.owner = Some((self.member.clone(), part.generation));
                part.next = part.acked_upto;
            }
            let held = if self.ordered {
                part.owner.as_ref().filter(|(o, _)| *o == self.member).map(|(_, g)| *g)
            } else {
                Some(0)
            };
            match (held, self.leases.get(&p)) {
                (Some(gen), Some(lease)) if lease.generation() == gen => lease.confirm(sent),
                (Some(gen), old) => {
                    if let Some(old) = old {
                        old.lose_to_broker();
                    }
                    let lease = ScopeLease::new(scope_name(&self.category, p), gen, &self.lease_cfg, sent);
                    self.leases.insert(p, lease);
                }
                (None, Some(lease)) => {
                    lease.lose_to_broker();
                    self.leases.remove(&p);
                }
                (None, None) => {}
            }
        }
        self.events.extend(events);
        Ok(())
    }

    pub(super) fn try_fetch(&mut self, room: &Room) -> Result<Vec<Inbound>> {
        let max = room.max();
        let broker = self.broker.clone();
        let mut st = broker.lock();
        self.round_trip(&mut st)?;
        let partitions = self.broker.partitions;
        let cat = self.broker.category(&mut st, &self.category);
        let Category { logs, groups, .. } = cat;
        let group = groups
            .get_mut(&self.group)
            .ok_or_else(|| Error::NotFound(format!("consumer group `{}`", self.group)))?;
        let mut out = Vec::new();
        if !self.ordered {
            while out.len() < max {
                let Some((p, off)) = group.redeliver.pop_first() else {
                    break;
                };
                if let Some(s) = logs[p as usize].get(off) {
                    group.inflight.insert((p, off), self.member.clone());
                    out.push(self.inbound(p, off, s.message.clone()));
                }
            }
        }
        if self.ordered {
            // The readable partitions, starting one further each fetch.
            let readable: Vec<u32> = (0..partitions)
                .map(|i| (self.cursor + i) % partitions)
                .filter(|p| {
                    self.leases.get(p).is_some_and(|l| !room.is_paused(l.scope()))
                        && !group.parts[*p as usize].revoking
                        && group.parts[*p as usize].next < logs[*p as usize].end()
                })
                .collect();
            // The room is shared by the one policy (`Room::split`); what a
            // partition cannot use goes round the others one at a time.
            let scopes: Vec<&str> = readable.iter().map(|p| &**self.leases[p].scope()).collect();
            let levels = room.split(&scopes, max - out.len(), 0);
            for (p, level) in readable.iter().zip(levels) {
                self.take_from(group, logs, *p, level, max, &mut out);
            }
            while out.len() < max {
                let before = out.len();
                for p in &readable {
                    self.take_from(group, logs, *p, 1, max, &mut out);
                }
                if out.len() == before {
                    break;
                }
            }
        } else {
            // Round-robin over partitions so one busy partition does not starve the rest.
            for i in 0..partitions {
                if out.len() >= max {
                    break;
                }
                let p = (self.cursor + i) % partitions;
                let Some(lease) = self.leases.get(&p) else { continue };
                if room.is_paused(lease.scope()) || group.parts[p as usize].revoking {
                    continue;
                }
                let share = (max - out.len()).div_ceil((partitions - i) as usize).max(1);
                self.take_from(group, logs, p, share, max, &mut out);
            }
        }
        self.cursor = (self.cursor + 1) % partitions;
        Ok(out)
    }

    /// Delivers up to `limit` unacknowledged entries of partition `p` from
    /// its read position, without `out` passing `max`.
    pub(super) fn take_from(
        &self,
        group: &mut Group,
        logs: &[PartLog],
        p: u32,
        limit: usize,
        max: usize,
        out: &mut Vec<Inbound>,
    ) {
        let part = &mut group.parts[p as usize];
        let log = &logs[p as usize];
        let mut taken = 0;
        while taken < limit && out.len() < max && part.next < log.end() {
            let off = part.next;
            part.next += 1;
            if part.is_acked(off) {
                continue;
            }
            let message = log.get(off).expect("offset within log").message.clone();
            if !self.ordered {
                group.inflight.insert((p, off), self.member.clone());
            }
            taken += 1;
            out.push(self.inbound(p, off, message));
        }
    }

    pub(super) fn inbound(&self, part: u32, offset: u64, message: Message) -> Inbound {
        let lease = self.leases[&part].clone();
        Inbound {
            settle: Box::new(MemorySettle {
                broker: self.broker.clone(),
                category: self.category.clone(),
                group: self.group.clone(),
                member: self.member.clone(),
                scope: lease.scope().clone(),
                generation: lease.generation(),
                part,
                offset,
                key: message.key().cloned(),
                id: message.id().to_owned(),
            }),
            lease,
            message,
        }
    }
}

#[async_trait]
impl TransportSource for MemorySource {
    async fn fetch(&mut self, room: &Room, wait: Duration) -> Result<Vec<Inbound>> {
        let broker = self.broker.clone();
        let notified = broker.notify.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let batch = self.try_fetch(room)?;
        if !batch.is_empty() {
            return Ok(batch);
        }
        let _ = tokio::time::timeout(wait, notified).await;
        self.try_fetch(room)
    }

    async fn maintain(&mut self) -> Result<Vec<SourceEvent>> {
        let broker = self.broker.clone();
        let mut st = broker.lock();
        self.round_trip(&mut st)?;
        Ok(std::mem::take(&mut self.events))
    }

    async fn release(&mut self, scope: &str) -> Result<()> {
        let Some(p) = parse_scope(scope) else {
            return Err(Error::NotFound(format!("scope `{scope}`")));
        };
        {
            let mut st = self.broker.lock();
            let cat = self.broker.category(&mut st, &self.category);
            let group = cat.group_mut(&self.group)?;
            let part = &mut group.parts[p as usize];
            if part.owner.as_ref().is_some_and(|(o, _)| *o == self.member) {
                part.hand_back();
            }
        }
        if let Some(lease) = self.leases.remove(&p) {
            lease.lose();
        }
        self.broker.notify.notify_waiters();
        Ok(())
    }

    async fn close(&mut self) -> Result<()> {
        if self.closed {
            return Ok(());
        }
        self.closed = true;
        {
            let mut st = self.broker.lock();
            let cat = self.broker.category(&mut st, &self.category);
            if let Ok(group) = cat.group_mut(&self.group) {
                group.leave(&self.member);
            }
        }
        for lease in self.leases.values() {
            lease.lose();
        }
        self.leases.clear();
        self.broker.notify.notify_waiters();
        Ok(())
    }
}

impl Drop for MemorySource {
    fn drop(&mut self) {
        if !self.closed {
            // Dropped without close (for example a task aborted): the member
            // is left to expire after its lease TTL, like a crashed process.
        }
    }
}
