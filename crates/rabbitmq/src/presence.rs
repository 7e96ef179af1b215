//! Who is live in a `hash` group, confirmed by the broker (issue 37).
//!
//! Every running source announces itself on the group's presence exchange
//! every heartbeat: `started:who` (its join claim's offset and instance id)
//! with a random **nonce** in a header ([`NONCE_HEADER`]), made once per
//! source. It also holds, on its own connection, an exclusive queue named
//! after the group, the join claim, the id and the nonce
//! ([`crate::names::GroupNames::live`]); the broker deletes it with the
//! connection. An announcement counts only while the broker says that queue
//! is locked to another connection (a passive declaration answered
//! `RESOURCE_LOCKED`).
//!
//! So a client that may only publish on the presence exchange cannot add
//! members: it does not know a live member's nonce (announcements go only
//! to the members' own exclusive queues), and an announcement it makes up
//! names no held queue. Each announcement is its own entry, keyed by all of
//! `(started, who, nonce)`, so a forged one for a real id neither replaces
//! the real member's entry nor its plan. What the broker did not confirm is
//! ignored for a lease TTL, and at most [`CONFIRMS_PER_HEARTBEAT`] checks
//! are asked for per heartbeat interval, re-checks of confirmed members
//! first: a flood of made-up ids costs the broker a bounded number of round
//! trips and never crowds out the real members. A client that can also
//! *read* the presence exchange learns the nonces; the permissions in
//! SECURITY.md keep publishers off both.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use crate::plan::Plan;

/// The header of a presence announcement that carries its source's nonce.
pub(crate) const NONCE_HEADER: &str = "x-keyorder-nonce";

/// Confirmations asked of the broker per heartbeat interval, at most.
pub(crate) const CONFIRMS_PER_HEARTBEAT: usize = 16;

/// Announcements, plans and rejections kept, each at most (a flood of
/// made-up ids fills no memory).
const MAX_ENTRIES: usize = 4096;

/// One announcement's identity.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct Announcer {
    /// The join claim's offset (the plan's member order).
    pub started: u64,
    /// The instance id.
    pub who: String,
    /// The source's nonce (empty from a version that sends none).
    pub nonce: String,
}

/// What the presence listener heard, shared with the source.
#[derive(Debug, Default)]
pub(crate) struct Board {
    /// This source's instance id: announcements naming it are not kept.
    me: String,
    /// Announcements the broker confirmed, with when: kept however full
    /// the board is.
    confirmed: HashMap<Announcer, Instant>,
    /// Announcements, with when each was first and last heard.
    heard: HashMap<Announcer, (Instant, Instant)>,
    /// The newest plan each announcer that follows plans sent (`None`: it
    /// follows but makes none).
    plans: HashMap<Announcer, Option<Plan>>,
    /// Announcements the broker did not confirm, with when: not heard
    /// again until a lease TTL passed.
    rejected: HashMap<Announcer, Instant>,
}

/// The board as the listener and the source share it.
pub(crate) type SharedBoard = Arc<Mutex<Board>>;

impl Board {
    /// A board for the source whose instance id is `me`.
    pub(crate) fn new(me: &str) -> Board {
        Board {
            me: me.to_owned(),
            ..Board::default()
        }
    }

    /// Whether an announcement is worth keeping at all: not this source's
    /// own id, an id that fits an AMQP name, a nonce as sources make them
    /// (or none, from an older version), never one rejected within a TTL.
    pub(crate) fn admits(&self, a: &Announcer) -> bool {
        a.who != self.me
            && !a.who.is_empty()
            && a.who.len() <= 255
            && (a.nonce.is_empty() || (a.nonce.len() == 32 && a.nonce.bytes().all(|b| b.is_ascii_hexdigit())))
            && !self.rejected.contains_key(a)
    }

    /// Records an announcement (and its plan header, if it had one);
    /// whether the group changed (a new announcer, or another plan), so the
    /// source should look again now.
    pub(crate) fn hear(&mut self, a: Announcer, plan: Option<Option<Plan>>) -> bool {
        if !self.admits(&a) {
            return false;
        }
        if self.heard.len() >= MAX_ENTRIES && !self.heard.contains_key(&a) {
            // Full: forget what is unconfirmed and was not heard again for a
            // while; a confirmed member is never pushed out.
            let recent = Duration::from_secs(5);
            let confirmed = &self.confirmed;
            self.heard
                .retain(|a, (_, last)| confirmed.contains_key(a) || last.elapsed() < recent);
            let heard = &self.heard;
            self.plans.retain(|a, _| heard.contains_key(a));
            if self.heard.len() >= MAX_ENTRIES {
                return false;
            }
        }
        let now = Instant::now();
        let fresh = match self.heard.get_mut(&a) {
            Some((_, last)) => {
                *last = now;
                false
            }
            None => {
                self.heard.insert(a.clone(), (now, now));
                true
            }
        };
        let changed = match plan {
            Some(p) => self.plans.insert(a, p.clone()) != Some(p),
            None => false,
        };
        fresh || changed
    }

    /// Forgets what was not heard within `ttl`, and rejections older than
    /// `ttl`; the announcements heard within `ttl`, this source's id
    /// excluded, the longest-known first (so the confirmations go round
    /// them all, and a real member announcing every heartbeat is reached
    /// within a TTL however many made-up ids arrive after it).
    pub(crate) fn fresh(&mut self, me: &str, ttl: Duration) -> Vec<Announcer> {
        self.heard.retain(|_, (_, last)| last.elapsed() < ttl);
        let heard = &self.heard;
        self.plans.retain(|a, _| heard.contains_key(a));
        self.rejected.retain(|_, at| at.elapsed() < ttl);
        let mut out: Vec<(Instant, Announcer)> = self
            .heard
            .iter()
            .filter(|(a, _)| a.who != me)
            .map(|(a, (first, _))| (*first, a.clone()))
            .collect();
        out.sort();
        out.into_iter().map(|(_, a)| a).collect()
    }

    /// The announcements confirmed, with when.
    pub(crate) fn confirmed(&mut self) -> &mut HashMap<Announcer, Instant> {
        &mut self.confirmed
    }

    /// The broker did not confirm `a`, never confirmed before: ignored for
    /// a lease TTL.
    pub(crate) fn reject(&mut self, a: &Announcer) {
        self.confirmed.remove(a);
        self.heard.remove(a);
        self.plans.remove(a);
        if self.rejected.len() < MAX_ENTRIES {
            self.rejected.insert(a.clone(), Instant::now());
        }
    }

    /// Whether `a` announced that it follows plans.
    pub(crate) fn follows(&self, a: &Announcer) -> bool {
        self.plans.contains_key(a)
    }

    /// The newest plan `a` announced.
    pub(crate) fn plan(&self, a: &Announcer) -> Option<Plan> {
        self.plans.get(a).cloned().flatten()
    }
}

/// A fresh random nonce (128 bits, hex).
pub(crate) fn nonce() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(started: u64, who: &str, nonce: &str) -> Announcer {
        Announcer {
            started,
            who: who.into(),
            nonce: nonce.into(),
        }
    }

    /// A forged announcement for a real id is an entry of its own: it
    /// replaces neither the real one nor its plan, and once rejected it is
    /// not heard again for a TTL.
    #[test]
    fn a_forged_announcement_replaces_nothing() {
        let mut b = Board::new("me");
        let real = a(7, "x", "0123456789abcdef0123456789abcdef");
        let plan = Plan::make(&["x".into()], &["q".into()], &[], 0);
        assert!(b.hear(real.clone(), Some(Some(plan.clone()))));
        let forged = a(0, "x", "");
        assert!(b.hear(forged.clone(), Some(None)));
        assert_eq!(b.plan(&real), Some(plan));
        b.reject(&forged);
        assert!(
            !b.hear(forged.clone(), None),
            "a rejected announcement is not heard again"
        );
        let ttl = Duration::from_secs(5);
        assert_eq!(b.fresh("me", ttl), vec![real]);
    }

    /// Made-up ids fill at most MAX_ENTRIES.
    #[test]
    fn a_flood_is_bounded() {
        let mut b = Board::new("me");
        let real = a(9, "real", "0123456789abcdef0123456789abcdef");
        b.hear(real.clone(), None);
        b.confirmed().insert(real.clone(), Instant::now());
        for i in 0..(MAX_ENTRIES + 100) {
            b.hear(a(0, &format!("ghost-{i}"), ""), Some(None));
        }
        assert_eq!(b.heard.len(), MAX_ENTRIES);
        assert!(b.plans.len() <= MAX_ENTRIES);
        assert!(b.heard.contains_key(&real), "a confirmed member is never pushed out");
        // Oversized ids, odd nonces and this source's own id are not kept.
        assert!(!b.admits(&a(0, &"x".repeat(256), "")));
        assert!(!b.admits(&a(0, "y", "guessed")));
        assert!(!b.admits(&a(0, "me", "")));
    }
}
