//! The one checker: turns an event log into a verdict on order, loss,
//! overlap and spread (see `shared/design/CONFORMANCE.md`).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;

use crate::eventlog::Event;

/// A message the producer published and the broker acknowledged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Published {
    /// The message id.
    pub id: String,
    /// The key.
    pub key: String,
    /// The per-key sequence.
    pub seq: u64,
}

/// What the checker is told besides the log.
#[derive(Debug, Clone, Default)]
pub struct Expectation {
    /// Every acknowledged publish.
    pub published: Vec<Published>,
    /// Message ids allowed to be missing (parked or skipped on purpose).
    pub excused: HashSet<String>,
    /// Instances that must each have applied something (spread); empty: no spread check.
    pub spread_over: Vec<String>,
    /// Instances killed, with the store-clock time of the kill: their open
    /// intervals are closed there.
    pub kills: Vec<(String, u64)>,
    /// Fenced stragglers allowed (C7 allows at most one).
    pub max_stragglers: Option<usize>,
}

/// A per-key order violation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OrderViolation {
    /// The key.
    pub key: String,
    /// The sequence applied before.
    pub before: u64,
    /// The sequence applied after it, not greater.
    pub after: u64,
}

/// Two runs of one key whose intervals intersect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Overlap {
    /// The key.
    pub key: String,
    /// The earlier run's sequence, instance and generation.
    pub first: (u64, String, u64),
    /// The later run's sequence, instance and generation.
    pub second: (u64, String, u64),
}

/// The checker's verdict.
#[derive(Debug, Clone, Default)]
pub struct Verdict {
    /// Per-key order violations.
    pub order: Vec<OrderViolation>,
    /// Acknowledged publishes never applied.
    pub lost: Vec<Published>,
    /// Overlapping runs that are not fenced stragglers.
    pub overlaps: Vec<Overlap>,
    /// Fenced stragglers (an old generation's run still going when the new
    /// owner started; one entry per straggling run).
    pub stragglers: Vec<Overlap>,
    /// Instances that applied nothing though spread was required.
    pub idle_instances: Vec<String>,
    /// Applied runs beyond the first of a message (at-least-once repeats).
    pub duplicates: usize,
    /// Applied runs in all.
    pub applied: usize,
    /// Stragglers allowed.
    pub max_stragglers: Option<usize>,
}

impl Verdict {
    /// The names of the defects found: `order`, `loss`, `overlap`, `spread`, `stragglers`.
    pub fn defects(&self) -> Vec<&'static str> {
        let mut d = Vec::new();
        if !self.order.is_empty() {
            d.push("order");
        }
        if !self.lost.is_empty() {
            d.push("loss");
        }
        if !self.overlaps.is_empty() {
            d.push("overlap");
        }
        if !self.idle_instances.is_empty() {
            d.push("spread");
        }
        if self.max_stragglers.is_some_and(|m| self.stragglers.len() > m) {
            d.push("stragglers");
        }
        d
    }

    /// Whether the log keeps the promise.
    pub fn is_ok(&self) -> bool {
        self.defects().is_empty()
    }

    /// `Ok(())` or an error that lists every defect with examples.
    pub fn assert_ok(&self) -> Result<(), String> {
        if self.is_ok() {
            Ok(())
        } else {
            Err(self.to_string())
        }
    }
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "violations={} lost={} duplicates={} overlaps={} stragglers={} idle_instances={} applied={}",
            self.order.len(),
            self.lost.len(),
            self.duplicates,
            self.overlaps.len(),
            self.stragglers.len(),
            self.idle_instances.len(),
            self.applied
        )?;
        if let Some(v) = self.order.first() {
            write!(
                f,
                "\n  order: key {} applied seq {} after seq {}",
                v.key, v.after, v.before
            )?;
        }
        if let Some(p) = self.lost.first() {
            write!(f, "\n  loss: key {} seq {} (id {}) never applied", p.key, p.seq, p.id)?;
        }
        if let Some(o) = self.overlaps.first() {
            write!(
                f,
                "\n  overlap: key {} seq {:?} and seq {:?} ran at once",
                o.key, o.first, o.second
            )?;
        }
        if !self.idle_instances.is_empty() {
            write!(f, "\n  spread: instances {:?} applied nothing", self.idle_instances)?;
        }
        Ok(())
    }
}

/// Judges `events` against `expect`.
pub fn check(events: &[Event], expect: &Expectation) -> Verdict {
    let kills: HashMap<&str, u64> = expect.kills.iter().map(|(i, t)| (i.as_str(), *t)).collect();
    let mut by_key: BTreeMap<String, Vec<Event>> = BTreeMap::new();
    for e in events {
        let mut e = e.clone();
        if e.end.is_none() {
            if let Some(t) = kills.get(e.instance.as_str()) {
                e.end = Some((*t).max(e.start));
            }
        }
        by_key.entry(e.key.clone()).or_default().push(e);
    }
    let mut v = Verdict {
        max_stragglers: expect.max_stragglers,
        ..Verdict::default()
    };
    let mut applied_ids: HashMap<&str, usize> = HashMap::new();
    for e in events.iter().filter(|e| e.ok && e.end.is_some()) {
        *applied_ids.entry(e.message_id.as_str()).or_default() += 1;
    }
    v.applied = applied_ids.values().sum();
    v.duplicates = applied_ids.values().map(|n| n - 1).sum();

    for (key, runs) in &mut by_key {
        runs.sort_by_key(|e| (e.start, e.end.unwrap_or(u64::MAX)));
        // Order: applied runs by start, immediate repeats removed, strictly increasing.
        let mut last: Option<u64> = None;
        for e in runs.iter().filter(|e| e.ok && e.end.is_some()) {
            match last {
                Some(prev) if e.seq == prev => {}
                Some(prev) if e.seq < prev => v.order.push(OrderViolation {
                    key: key.to_string(),
                    before: prev,
                    after: e.seq,
                }),
                _ => {}
            }
            last = Some(last.map_or(e.seq, |p| p.max(e.seq)));
        }
        // Per instance, its runs' starts in order with the lowest generation
        // of the runs from each on: "does this instance start a run after t
        // under a generation <= g" is then a binary search.
        let mut later: HashMap<&str, (Vec<u64>, Vec<u64>)> = HashMap::new();
        for c in runs.iter() {
            let (starts, gens) = later.entry(c.instance.as_str()).or_default();
            starts.push(c.start);
            gens.push(c.generation);
        }
        for (_, gens) in later.values_mut() {
            for i in (0..gens.len().saturating_sub(1)).rev() {
                gens[i] = gens[i].min(gens[i + 1]);
            }
        }
        let starts_later_at_most = |instance: &str, t: u64, g: u64| {
            later.get(instance).is_some_and(|(starts, min_gen)| {
                let i = starts.partition_point(|s| *s <= t);
                i < starts.len() && min_gen[i] <= g
            })
        };
        let mut straggler_seen: HashSet<(u64, String, u64)> = HashSet::new();
        // Overlap: any two runs of one key whose intervals intersect.
        for (i, a) in runs.iter().enumerate() {
            let a_end = a.end.unwrap_or(u64::MAX);
            for b in runs[i + 1..].iter().take_while(|b| b.start < a_end) {
                let pair = Overlap {
                    key: key.to_string(),
                    first: (a.seq, a.instance.clone(), a.generation),
                    second: (b.seq, b.instance.clone(), b.generation),
                };
                // A fenced straggler: an older generation on another instance,
                // already running when the new owner started, and its old
                // owner starts nothing of the key afterwards under a
                // generation not newer than the new owner's (it may be handed
                // the key back later, under a newer one).
                let straggler = a.generation < b.generation
                    && a.instance != b.instance
                    && !starts_later_at_most(&a.instance, b.start, b.generation);
                if straggler {
                    if straggler_seen.insert(pair.first.clone()) {
                        v.stragglers.push(pair);
                    }
                } else {
                    v.overlaps.push(pair);
                }
            }
        }
    }
    for p in &expect.published {
        if !applied_ids.contains_key(p.id.as_str()) && !expect.excused.contains(&p.id) {
            v.lost.push(p.clone());
        }
    }
    let active: HashSet<&str> = events.iter().filter(|e| e.ok).map(|e| e.instance.as_str()).collect();
    v.idle_instances = expect
        .spread_over
        .iter()
        .filter(|i| !active.contains(i.as_str()))
        .cloned()
        .collect();
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(key: &str, seq: u64, inst: &str, gen: u64, start: u64, end: Option<u64>) -> Event {
        Event {
            message_id: format!("{key}-{seq}"),
            key: key.into(),
            seq,
            instance: inst.into(),
            generation: gen,
            start,
            end,
            ok: end.is_some(),
        }
    }

    fn published(key: &str, n: u64) -> Vec<Published> {
        (0..n)
            .map(|seq| Published {
                id: format!("{key}-{seq}"),
                key: key.into(),
                seq,
            })
            .collect()
    }

    #[test]
    fn a_clean_log_passes() {
        let log = vec![ev("a", 0, "i1", 1, 0, Some(5)), ev("a", 1, "i2", 2, 6, Some(9))];
        let expect = Expectation {
            published: published("a", 2),
            spread_over: vec!["i1".into(), "i2".into()],
            ..Default::default()
        };
        let v = check(&log, &expect);
        assert!(v.is_ok(), "{v}");
    }

    #[test]
    fn each_defect_is_named() {
        let reorder = vec![ev("a", 1, "i1", 1, 0, Some(5)), ev("a", 0, "i1", 1, 6, Some(9))];
        let expect = Expectation {
            published: published("a", 2),
            ..Default::default()
        };
        assert_eq!(check(&reorder, &expect).defects(), vec!["order"]);

        let lose = vec![ev("a", 0, "i1", 1, 0, Some(5))];
        assert_eq!(check(&lose, &expect).defects(), vec!["loss"]);

        let twice = vec![ev("a", 0, "i1", 1, 0, Some(10)), ev("a", 1, "i2", 1, 5, Some(12))];
        assert_eq!(check(&twice, &expect).defects(), vec!["overlap"]);

        let idle = Expectation {
            published: published("a", 2),
            spread_over: vec!["i1".into(), "i3".into()],
            ..Default::default()
        };
        let fine = vec![ev("a", 0, "i1", 1, 0, Some(5)), ev("a", 1, "i1", 1, 6, Some(9))];
        assert_eq!(check(&fine, &idle).defects(), vec!["spread"]);
    }

    #[test]
    fn a_fenced_straggler_is_counted_not_failed_and_repeats_are_allowed() {
        // i1 (gen 1) stalls inside seq 1; i2 (gen 2) re-runs seq 1, then seq 2;
        // i1's handler ends late. i1 starts nothing afterwards.
        let log = vec![
            ev("a", 0, "i1", 1, 0, Some(2)),
            ev("a", 1, "i1", 1, 3, Some(100)),
            ev("a", 1, "i2", 2, 50, Some(55)),
            ev("a", 2, "i2", 2, 56, Some(60)),
        ];
        let expect = Expectation {
            published: published("a", 3),
            max_stragglers: Some(1),
            ..Default::default()
        };
        let v = check(&log, &expect);
        assert!(v.is_ok(), "{v}");
        assert_eq!(
            v.stragglers.len(),
            1,
            "one straggling run, overlapping two runs of the new owner"
        );
        assert_eq!(v.duplicates, 1);
        // ... but if the stale owner starts anything later, it is an overlap.
        let mut bad = log.clone();
        bad.push(ev("a", 3, "i1", 1, 101, Some(102)));
        let v = check(&bad, &expect);
        assert!(v.defects().contains(&"overlap"), "{v}");
        // Handed the key back later under a newer generation, it may run it.
        let mut back = log.clone();
        back.push(ev("a", 3, "i1", 3, 101, Some(102)));
        let v = check(
            &back,
            &Expectation {
                published: published("a", 4),
                ..expect
            },
        );
        assert!(v.is_ok(), "{v}");
    }

    #[test]
    fn a_killed_instance_interval_is_closed_at_the_kill() {
        // Same generation on both: only the kill time separates the runs.
        let log = vec![ev("a", 0, "i1", 1, 0, None), ev("a", 0, "i2", 1, 50, Some(55))];
        let expect = Expectation {
            published: published("a", 1),
            kills: vec![("i1".into(), 40)],
            ..Default::default()
        };
        let v = check(&log, &expect);
        assert!(v.is_ok(), "{v}");
        let unkilled = Expectation {
            kills: vec![],
            ..expect
        };
        assert!(!check(&log, &unkilled).is_ok());
    }
}
