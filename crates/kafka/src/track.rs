//! Per-partition bookkeeping: which delivered offsets are unfinished, the
//! attempts begun on them, halted heads, and the state record they add up
//! to (see `state`).
//!
//! The committed offset is the lowest unfinished offset (never past an
//! unfinished message). Messages above it that are already done are
//! recorded in the partition's state record (its progress text, below), so
//! a later owner skips them instead of running a key's finished message
//! again after a later one (which would break the key's order). The text
//! lists the unfinished offsets
//! between the committed offset and the high-water mark (the offset after the
//! last delivered message), each with its durable attempt count and halt
//! flag; it stays small because only unfinished messages are listed, and
//! those are bounded by the in-flight budget.
//!
//! Format (version 2): `ko2;n=<partitions>;hw=<hw>;u=<entries>` where each
//! entry is `<delta>[:<attempts>][!]`, numbers in lower-case base 36, the
//! delta counted from the committed offset for the first entry and from the
//! previous entry after; `;r<offset>=<reason>` records a halt reason. The
//! markers `:` and `!` are not base-36 digits.
//!
//! Version 1 (`ko1`) marked attempts and halts with `a` and `h`, which are
//! base-36 digits too: a delta of 10 (`a`), 17 (`h`) or 46 (`1a`) was read
//! back wrong, so an unfinished offset could be taken for done (skipped)
//! and a done one for unfinished (run again after a later one of its key).
//! Its entries cannot be read safely, so a `ko1` record restores only its
//! partition count: the new owner delivers everything from the committed
//! offset again (repeats, never skips).

use std::collections::BTreeMap;
use std::fmt::Write as _;

/// The progress text's format version.
const VERSION: &str = "ko2";
/// Marks an entry's attempt count (not a base-36 digit).
const ATTEMPTS: char = ':';
/// Marks an entry's halt (not a base-36 digit).
const HALTED: char = '!';

/// The most bytes of a halt reason kept in a state record.
const REASON_BYTES: usize = 120;

/// One unfinished offset.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Entry {
    /// Attempts begun (durable once committed).
    pub(crate) attempts: u32,
    /// The key halted here, with the reason.
    pub(crate) halted: Option<String>,
}

/// What a state record's progress text says about a partition.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Restored {
    /// The partition count the record was written under.
    pub(crate) partitions: Option<i32>,
    /// The high-water mark: offsets below it not listed are done.
    pub(crate) hw: i64,
    /// Unfinished offsets at or above the committed offset.
    pub(crate) unfinished: BTreeMap<i64, Entry>,
}

fn b36(mut n: u64, out: &mut String) {
    const DIGITS: &[u8; 36] = b"0123456789abcdefghijklmnopqrstuvwxyz";
    let mut buf = [0u8; 16];
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = DIGITS[(n % 36) as usize];
        n /= 36;
        if n == 0 {
            break;
        }
    }
    out.push_str(std::str::from_utf8(&buf[i..]).unwrap_or("0"));
}

fn clean_reason(reason: &str) -> String {
    let mut out: String = reason
        .chars()
        .map(|c| if c == ';' || c == '=' || c.is_control() { ' ' } else { c })
        .collect();
    if out.len() > REASON_BYTES {
        let mut cut = REASON_BYTES;
        while !out.is_char_boundary(cut) {
            cut -= 1;
        }
        out.truncate(cut);
    }
    out
}

/// Encodes the progress text of a state record at `committed`.
pub(crate) fn encode(partitions: i32, committed: i64, hw: i64, unfinished: &BTreeMap<i64, Entry>) -> String {
    let mut s = format!("{VERSION};n={partitions};hw=");
    b36(hw.max(0) as u64, &mut s);
    s.push_str(";u=");
    let mut prev = committed;
    let mut reasons = String::new();
    for (i, (off, e)) in unfinished.range(committed..).enumerate() {
        if i > 0 {
            s.push(',');
        }
        b36((off - prev) as u64, &mut s);
        prev = *off;
        if e.attempts > 0 {
            s.push(ATTEMPTS);
            b36(u64::from(e.attempts), &mut s);
        }
        if let Some(r) = &e.halted {
            s.push(HALTED);
            let _ = write!(reasons, ";r{off}={}", clean_reason(r));
        }
    }
    s.push_str(&reasons);
    s
}

/// Decodes a progress text written by [`encode`] for a state record at
/// `committed`; anything else (another client's text, none) restores
/// nothing.
pub(crate) fn decode(committed: i64, meta: &str) -> Restored {
    let mut r = Restored {
        hw: committed,
        ..Restored::default()
    };
    let mut parts = meta.split(';');
    match parts.next() {
        Some(VERSION) => {}
        Some("ko1") => {
            // Entries unreadable (see the module doc): replay from `committed`.
            r.partitions = parts.find_map(|p| p.strip_prefix("n=")).and_then(|n| n.parse().ok());
            return r;
        }
        _ => return r,
    }
    let mut reasons = BTreeMap::new();
    for part in parts {
        if let Some(n) = part.strip_prefix("n=") {
            r.partitions = n.parse().ok();
        } else if let Some(hw) = part.strip_prefix("hw=") {
            r.hw = i64::from_str_radix(hw, 36).unwrap_or(committed).max(committed);
        } else if let Some(list) = part.strip_prefix("u=") {
            let mut prev = committed;
            for item in list.split(',').filter(|s| !s.is_empty()) {
                let end = item.find([ATTEMPTS, HALTED]).unwrap_or(item.len());
                let Some(delta) = i64::from_str_radix(&item[..end], 36).ok().filter(|d| *d >= 0) else {
                    // An entry not read is an offset not known: everything
                    // after it would be misplaced, and an unlisted offset
                    // below the high-water mark counts as done. Restore
                    // nothing instead (replay from `committed`).
                    return Restored {
                        partitions: r.partitions,
                        hw: committed,
                        unfinished: BTreeMap::new(),
                    };
                };
                let off = prev + delta;
                prev = off;
                let rest = &item[end..];
                let halted = rest.contains(HALTED);
                let attempts = rest
                    .strip_prefix(ATTEMPTS)
                    .map(|a| a.split(HALTED).next().unwrap_or(""))
                    .and_then(|a| u32::from_str_radix(a, 36).ok())
                    .unwrap_or(0);
                r.unfinished.insert(
                    off,
                    Entry {
                        attempts,
                        halted: halted.then(String::new),
                    },
                );
            }
        } else if let Some(rest) = part.strip_prefix('r') {
            if let Some((off, reason)) = rest.split_once('=') {
                if let Ok(off) = off.parse::<i64>() {
                    reasons.insert(off, reason.to_owned());
                }
            }
        }
    }
    for (off, reason) in reasons {
        if let Some(e) = r.unfinished.get_mut(&off) {
            if e.halted.is_some() {
                e.halted = Some(reason);
            }
        }
    }
    r
}

/// What to do with a delivered offset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Admit {
    /// Deliver it; attempts already made on it (by earlier owners).
    Deliver {
        /// Durable attempts so far.
        attempts: u32,
        /// The earlier owner halted the key here.
        halted: Option<String>,
    },
    /// Done by an earlier owner, or already delivered here: drop it.
    Skip,
}

/// The bookkeeping of one owned partition.
#[derive(Debug, Clone)]
pub(crate) struct Track {
    /// The offset this owner started from (the committed offset it found).
    start: i64,
    /// The offset after the last delivered message.
    hw: i64,
    /// What the earlier owner left unfinished, and its high-water mark.
    prior: BTreeMap<i64, Entry>,
    prior_hw: i64,
    /// Delivered, not yet done.
    unfinished: BTreeMap<i64, Entry>,
    /// Bumped on every change a state record must carry.
    pub(crate) version: u64,
    /// The high-water mark of the newest durable state.
    durable_hw: i64,
}

impl Track {
    /// A partition taken over at `committed` with what its state record says.
    ///
    /// A message the earlier owner had fetched but not finished counts at
    /// least one attempt: it may have started (and crashed its process)
    /// after the last state was saved.
    pub(crate) fn new(committed: i64, restored: Restored) -> Self {
        let prior_hw = restored.hw.max(committed);
        let mut prior = restored.unfinished;
        for e in prior.values_mut() {
            e.attempts = e.attempts.max(1);
        }
        Track {
            start: committed,
            hw: committed,
            prior_hw,
            prior,
            unfinished: BTreeMap::new(),
            version: 0,
            durable_hw: committed,
        }
    }

    /// Records that the state up to high-water mark `hw` is durable.
    pub(crate) fn saved(&mut self, hw: i64) {
        self.durable_hw = self.durable_hw.max(hw);
    }

    /// Whether beginning attempt `attempt` on `offset` needs a durable
    /// write first: a first attempt does not once the offset is below a
    /// durable high-water mark (a later owner counts it as attempted).
    pub(crate) fn begin_needs_save(&self, offset: i64, attempt: u32) -> bool {
        attempt > 1 || offset >= self.durable_hw
    }

    /// The offset after the last delivered message (where to resume fetching).
    pub(crate) fn position(&self) -> i64 {
        self.hw
    }

    /// Unfinished messages delivered here.
    pub(crate) fn unfinished(&self) -> usize {
        self.unfinished.len()
    }

    /// A message at `offset` arrived from the broker.
    pub(crate) fn admit(&mut self, offset: i64) -> Admit {
        if offset < self.hw || offset < self.start {
            return Admit::Skip;
        }
        self.hw = offset + 1;
        let from_prior = self.prior.remove(&offset);
        if offset < self.prior_hw && from_prior.is_none() {
            // Finished by an earlier owner.
            self.version += 1;
            return Admit::Skip;
        }
        let e = from_prior.unwrap_or_default();
        let admit = Admit::Deliver {
            attempts: e.attempts,
            halted: e.halted.clone(),
        };
        self.unfinished.insert(offset, e);
        self.version += 1;
        admit
    }

    /// Begins an attempt on `offset`; returns the attempt number.
    pub(crate) fn begin(&mut self, offset: i64) -> Option<u32> {
        let e = self.unfinished.get_mut(&offset)?;
        e.attempts += 1;
        self.version += 1;
        Some(e.attempts)
    }

    /// Resets the attempts of `offset` (an operator's resume) and clears its halt.
    pub(crate) fn reset(&mut self, offset: i64) -> bool {
        let Some(e) = self.unfinished.get_mut(&offset) else {
            return false;
        };
        e.attempts = 0;
        e.halted = None;
        self.version += 1;
        true
    }

    /// Records that the key halted at `offset`.
    pub(crate) fn halt(&mut self, offset: i64, reason: &str) -> bool {
        let Some(e) = self.unfinished.get_mut(&offset) else {
            return false;
        };
        e.halted = Some(reason.to_owned());
        self.version += 1;
        true
    }

    /// Marks `offset` done (acknowledged, parked or skipped).
    pub(crate) fn done(&mut self, offset: i64) -> bool {
        let was = self.unfinished.remove(&offset).is_some();
        if was {
            self.version += 1;
        }
        was
    }

    /// The state record this adds up to: the committed offset, the
    /// high-water mark and the progress text.
    pub(crate) fn commit(&self, partitions: i32) -> (i64, i64, String) {
        // The earlier owner's unfinished offsets not yet delivered again stay listed.
        let mut listed = self.unfinished.clone();
        for (o, e) in self.prior.range(self.hw..) {
            listed.insert(*o, e.clone());
        }
        let hw = self.hw.max(self.prior_hw);
        let committed = listed.keys().next().copied().unwrap_or(hw);
        (committed, hw, encode(partitions, committed, hw, &listed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_commit_never_passes_an_unfinished_message_and_metadata_lists_only_unfinished_ones() {
        let mut t = Track::new(100, Restored::default());
        for o in [100, 101, 103, 104] {
            assert!(matches!(t.admit(o), Admit::Deliver { attempts: 0, .. }));
        }
        assert_eq!(t.begin(101), Some(1));
        assert!(t.done(100));
        assert!(t.done(103));
        let (c, _, meta) = t.commit(4);
        assert_eq!(c, 101);
        let r = decode(c, &meta);
        assert_eq!(r.partitions, Some(4));
        assert_eq!(r.hw, 105);
        assert_eq!(r.unfinished.keys().copied().collect::<Vec<_>>(), vec![101, 104]);
        assert_eq!(r.unfinished[&101].attempts, 1);
        assert!(t.done(101));
        assert!(t.done(104));
        assert_eq!(t.commit(4).0, 105);
    }

    /// Every gap between unfinished offsets and every attempt count comes
    /// back as written, whatever its base-36 digits (in version 1, gaps of
    /// 10, 17 and 46 and 17 attempts were read back wrong).
    #[test]
    fn every_gap_and_attempt_count_round_trips() {
        for gap in 1..=1300i64 {
            let mut t = Track::new(100, Restored::default());
            for o in 100..=100 + gap {
                t.admit(o);
            }
            for o in 101..100 + gap {
                t.done(o);
            }
            let attempts = (gap % 50) as u32;
            for _ in 0..attempts {
                t.begin(100 + gap);
            }
            if gap % 3 == 0 {
                t.halt(100 + gap, "stuck");
            }
            let (c, _, meta) = t.commit(4);
            assert_eq!(c, 100);
            let r = decode(c, &meta);
            assert_eq!(r.hw, 101 + gap, "gap {gap}: {meta}");
            assert_eq!(
                r.unfinished.keys().copied().collect::<Vec<_>>(),
                vec![100, 100 + gap],
                "gap {gap}: {meta}"
            );
            let last = &r.unfinished[&(100 + gap)];
            assert_eq!(last.attempts, attempts, "gap {gap}: {meta}");
            assert_eq!(last.halted.is_some(), gap % 3 == 0, "gap {gap}: {meta}");
            let mut next = Track::new(c, r);
            assert!(matches!(next.admit(100), Admit::Deliver { .. }));
            assert!(
                matches!(next.admit(100 + gap), Admit::Deliver { .. }),
                "gap {gap}: {meta}"
            );
            if gap > 1 {
                assert_eq!(next.admit(101), Admit::Skip, "gap {gap}: {meta}");
            }
        }
    }

    /// Version 1 entries cannot be read safely: such a record restores its
    /// partition count only, and the new owner delivers everything from
    /// the committed offset (repeats, never skips).
    #[test]
    fn a_version_1_record_replays_from_its_committed_offset() {
        let r = decode(100, "ko1;n=4;hw=3n;u=0,a");
        assert_eq!(r.partitions, Some(4));
        assert_eq!(r.hw, 100);
        assert!(r.unfinished.is_empty());
        let mut next = Track::new(100, r);
        for o in 100..131 {
            assert!(matches!(next.admit(o), Admit::Deliver { .. }), "{o}");
        }
        // An unreadable entry of the current version restores nothing either.
        for bad in ["ko2;n=4;hw=3n;u=0,#!", "ko2;n=4;hw=3n;u=0,-5", "ko2;n=4;hw=3n;u=0,,:3"] {
            let r = decode(100, bad);
            assert_eq!((r.partitions, r.hw, r.unfinished.len()), (Some(4), 100, 0), "{bad}");
        }
    }

    #[test]
    fn a_new_owner_skips_finished_messages_and_keeps_attempts_and_halts() {
        let mut t = Track::new(10, Restored::default());
        for o in 10..20 {
            t.admit(o);
        }
        for o in [10, 11, 13, 14, 15, 17, 18] {
            t.done(o);
        }
        t.begin(12);
        t.begin(12);
        t.halt(12, "bad; input=\n x");
        t.begin(16);
        let (c, _, meta) = t.commit(8);
        assert_eq!(c, 12);
        let mut next = Track::new(c, decode(c, &meta));
        assert_eq!(
            next.admit(12),
            Admit::Deliver {
                attempts: 2,
                halted: Some("bad  input   x".into())
            }
        );
        assert_eq!(next.admit(13), Admit::Skip);
        assert_eq!(next.admit(14), Admit::Skip);
        assert_eq!(next.admit(15), Admit::Skip);
        assert_eq!(
            next.admit(16),
            Admit::Deliver {
                attempts: 1,
                halted: None
            }
        );
        // Before 19 comes again, the commit still lists it and keeps the mark.
        let (c2, _, meta2) = next.commit(8);
        assert_eq!(c2, 12);
        let r2 = decode(c2, &meta2);
        assert_eq!(r2.hw, 20);
        assert_eq!(r2.unfinished.keys().copied().collect::<Vec<_>>(), vec![12, 16, 19]);
        assert_eq!(next.admit(17), Admit::Skip);
        assert_eq!(next.admit(18), Admit::Skip);
        // Fetched by the earlier owner, unfinished: it may have started.
        assert_eq!(
            next.admit(19),
            Admit::Deliver {
                attempts: 1,
                halted: None
            }
        );
        assert_eq!(
            next.admit(20),
            Admit::Deliver {
                attempts: 0,
                halted: None
            }
        );
        // A duplicate delivery (after a seek) is dropped.
        assert_eq!(next.admit(16), Admit::Skip);
        for o in [12, 16, 19, 20] {
            next.done(o);
        }
        assert_eq!(next.commit(8).0, 21);
    }

    #[test]
    fn a_first_attempt_needs_no_save_below_the_durable_high_water_mark() {
        let mut t = Track::new(0, Restored::default());
        t.admit(0);
        t.admit(1);
        assert!(t.begin_needs_save(0, 1));
        let (_, hw, _) = t.commit(1);
        t.saved(hw);
        assert!(!t.begin_needs_save(1, 1));
        assert!(t.begin_needs_save(1, 2));
        t.admit(2);
        assert!(t.begin_needs_save(2, 1));
    }

    #[test]
    fn foreign_or_empty_metadata_restores_nothing() {
        assert_eq!(decode(5, "").hw, 5);
        assert!(decode(5, "something else").unfinished.is_empty());
        let mut t = Track::new(5, decode(5, ""));
        assert_eq!(t.commit(3).0, 5);
        assert!(matches!(t.admit(5), Admit::Deliver { .. }));
    }

    #[test]
    fn metadata_stays_small_for_a_bounded_window() {
        let mut t = Track::new(0, Restored::default());
        for o in 0..100_000 {
            t.admit(o);
            if o % 200 != 7 {
                t.done(o);
            }
        }
        let (c, _, meta) = t.commit(16);
        assert_eq!(c, 7);
        assert_eq!(t.unfinished(), 500);
        assert!(meta.len() < 2_000, "{} bytes", meta.len());
        assert_eq!(decode(c, &meta).unfinished.len(), 500);
    }
}
