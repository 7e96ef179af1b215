//! The in-process broker: categories split into partition logs, consumer
//! groups owning every partition through one member at a time, halts.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::fmt;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use crate::error::{Error, Result};
use crate::message::Message;
use crate::transport::{DeadLetter, SourceEvent};

use super::names::scope_name;

pub(super) struct Broker {
    pub(super) partitions: u32,
    pub(super) state: Mutex<BrokerState>,
    pub(super) notify: Notify,
}

impl fmt::Debug for Broker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Broker").field("partitions", &self.partitions).finish()
    }
}

#[derive(Default)]
pub(super) struct BrokerState {
    pub(super) categories: HashMap<String, Category>,
}

pub(super) struct Stored {
    pub(super) message: Message,
}

#[derive(Default)]
pub(super) struct PartLog {
    pub(super) base: u64,
    pub(super) entries: VecDeque<Stored>,
}

impl PartLog {
    pub(super) fn end(&self) -> u64 {
        self.base + self.entries.len() as u64
    }
    pub(super) fn get(&self, offset: u64) -> Option<&Stored> {
        offset.checked_sub(self.base).and_then(|i| self.entries.get(i as usize))
    }
}

pub(super) struct Category {
    pub(super) logs: Vec<PartLog>,
    pub(super) next_keyless: u32,
    pub(super) groups: HashMap<String, Group>,
    /// Publish fences: the highest token seen per scope.
    pub(super) fences: HashMap<String, u64>,
}

#[derive(Default, Clone)]
pub(super) struct GroupPart {
    pub(super) owner: Option<(String, u64)>,
    pub(super) generation: u64,
    pub(super) acked_upto: u64,
    pub(super) acked: BTreeSet<u64>,
    pub(super) next: u64,
    pub(super) revoking: bool,
}

impl GroupPart {
    pub(super) fn ack(&mut self, offset: u64) {
        if offset < self.acked_upto {
            return;
        }
        self.acked.insert(offset);
        while self.acked.remove(&self.acked_upto) {
            self.acked_upto += 1;
        }
    }
    pub(super) fn is_acked(&self, offset: u64) -> bool {
        offset < self.acked_upto || self.acked.contains(&offset)
    }
    pub(super) fn hand_back(&mut self) {
        self.owner = None;
        self.revoking = false;
        self.next = self.acked_upto;
    }
}

pub(super) struct Member {
    pub(super) last_seen: Instant,
    pub(super) ttl: Duration,
    pub(super) events: Vec<SourceEvent>,
}

pub(super) struct Halt {
    pub(super) part: u32,
    pub(super) offset: u64,
    pub(super) key: String,
    pub(super) id: String,
    pub(super) reason: String,
}

pub(super) struct Group {
    pub(super) ordered: bool,
    pub(super) members: BTreeMap<String, Member>,
    pub(super) parts: Vec<GroupPart>,
    pub(super) attempts: HashMap<(u32, u64), u32>,
    pub(super) halted: Vec<Halt>,
    pub(super) dead: Vec<DeadLetter>,
    /// Unordered mode: entries handed to a member and not yet settled.
    pub(super) inflight: HashMap<(u32, u64), String>,
    pub(super) redeliver: BTreeSet<(u32, u64)>,
}

impl Broker {
    pub(super) fn lock(&self) -> MutexGuard<'_, BrokerState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn category<'a>(&self, st: &'a mut BrokerState, name: &str) -> &'a mut Category {
        let partitions = self.partitions as usize;
        st.categories.entry(name.to_owned()).or_insert_with(|| Category {
            logs: (0..partitions).map(|_| PartLog::default()).collect(),
            next_keyless: 0,
            groups: HashMap::new(),
            fences: HashMap::new(),
        })
    }
}

impl Category {
    pub(super) fn group_mut(&mut self, group: &str) -> Result<&mut Group> {
        self.groups
            .get_mut(group)
            .ok_or_else(|| Error::NotFound(format!("consumer group `{group}`")))
    }

    /// Drops entries every group has acknowledged (bounded memory).
    pub(super) fn trim(&mut self) {
        if self.groups.is_empty() {
            return;
        }
        for (p, log) in self.logs.iter_mut().enumerate() {
            let floor = self
                .groups
                .values()
                .map(|g| g.parts[p].acked_upto)
                .min()
                .unwrap_or(log.base);
            while log.base < floor && !log.entries.is_empty() {
                log.entries.pop_front();
                log.base += 1;
            }
        }
    }
}

impl Group {
    /// Expires silent members and spreads partitions fairly over live ones.
    pub(super) fn rebalance(&mut self, now: Instant, partitions: u32, category: &str) {
        let expired: Vec<String> = self
            .members
            .iter()
            .filter(|(_, m)| now.duration_since(m.last_seen) > m.ttl)
            .map(|(id, _)| id.clone())
            .collect();
        for id in expired {
            self.leave(&id);
        }
        if !self.ordered || self.members.is_empty() {
            return;
        }
        let wanted = self.wanted(partitions);
        for p in 0..partitions {
            let want = &wanted[p as usize];
            let part = &mut self.parts[p as usize];
            if let Some((owner, _)) = &part.owner {
                if Some(owner) != want.as_ref() && !part.revoking {
                    part.revoking = true;
                    let owner = owner.clone();
                    if let Some(m) = self.members.get_mut(&owner) {
                        m.events.push(SourceEvent::Revoke(scope_name(category, p)));
                    }
                }
            }
        }
    }

    /// Which live member should own each partition: [`crate::assign::assign`]
    /// over the partitions' numbers, the policy every adapter uses.
    pub(super) fn wanted(&self, partitions: u32) -> Vec<Option<String>> {
        let members: Vec<String> = self.members.keys().cloned().collect();
        let names: Vec<String> = (0..partitions).map(|p| p.to_string()).collect();
        let owners = crate::assign::assign(&members, &names);
        names
            .iter()
            .map(|n| owners.get(n.as_str()).map(|m| (*m).to_owned()))
            .collect()
    }

    pub(super) fn leave(&mut self, member: &str) {
        self.members.remove(member);
        for part in &mut self.parts {
            if part.owner.as_ref().is_some_and(|(o, _)| o == member) {
                part.hand_back();
            }
        }
        let mine: Vec<(u32, u64)> = self
            .inflight
            .iter()
            .filter(|(_, m)| m.as_str() == member)
            .map(|(k, _)| *k)
            .collect();
        for k in mine {
            self.inflight.remove(&k);
            self.redeliver.insert(k);
        }
    }

    pub(super) fn fence(&self, part: u32, member: &str, generation: u64, scope: &str) -> Result<()> {
        let ok = if self.ordered {
            self.parts[part as usize]
                .owner
                .as_ref()
                .is_some_and(|(o, g)| o == member && *g == generation)
        } else {
            self.members.contains_key(member)
        };
        if ok {
            Ok(())
        } else {
            Err(Error::Fenced {
                scope: scope.to_owned(),
                generation,
            })
        }
    }

    pub(super) fn settle(&mut self, part: u32, offset: u64) {
        self.parts[part as usize].ack(offset);
        self.attempts.remove(&(part, offset));
        self.inflight.remove(&(part, offset));
        self.redeliver.remove(&(part, offset));
        self.halted.retain(|h| !(h.part == part && h.offset == offset));
    }
}
