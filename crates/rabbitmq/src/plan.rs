//! Which instance consumes which queue of the `hash` topology.
//!
//! Without a backlog every instance computes the same share from the member
//! list alone (`keyorder_core::assign`, a fair count each). With a backlog a
//! fair count is not a fair load: 100 keys hashed over 8 queues put 9 to 16
//! keys on a queue, and an instance given the heavier half works on while
//! the other one idles. So the oldest live instance (the leader; oldest by
//! its join claim's offset on the virtual host's claims stream, never a clock: see
//! the `claims` module) reads every
//! queue's depth when the member list changes, splits the queues by depth
//! (largest first, each to the member with the least so far) and announces
//! that plan with its presence; the others follow the leader's plan for the
//! member list they see, and fall back to the count share while they have
//! none (a member that just joined, or a leader of an older version). The
//! plan is made once per member list, never from depths alone, so queues
//! are not handed back and forth as depths move. While members disagree a
//! queue may wait a moment; it is never consumed twice (each queue's single
//! active consumer).

use keyorder_core::assign::assign;
use lapin::types::{AMQPValue, FieldTable};
use serde_json::{json, Value};

/// The header of a presence announcement that carries the leader's plan.
pub(crate) const PLAN_HEADER: &str = "x-keyorder-plan";

/// A leader's plan for one member list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Plan {
    /// The live members, oldest (smallest join claim) first, as the leader
    /// saw them.
    pub members: Vec<String>,
    /// For each queue (in the topology's order) the index of its member.
    pub owners: Vec<usize>,
}

impl Plan {
    /// Splits `queues` over `members`: by depth when the queues hold at
    /// least `floor` messages in all, else the count share.
    pub(crate) fn make(members: &[String], queues: &[String], depths: &[u64], floor: u64) -> Plan {
        let total: u64 = depths.iter().sum();
        let owners = if members.is_empty() {
            Vec::new()
        } else if depths.len() != queues.len() || total < floor.max(1) {
            let share = assign(members, queues);
            queues
                .iter()
                .map(|q| {
                    share
                        .get(q.as_str())
                        .and_then(|m| members.iter().position(|x| x == m))
                        .unwrap_or(0)
                })
                .collect()
        } else {
            let mut order: Vec<usize> = (0..queues.len()).collect();
            order.sort_by_key(|&i| (std::cmp::Reverse(depths[i]), i));
            let mut load = vec![(0u64, 0usize); members.len()];
            let mut owners = vec![0; queues.len()];
            for i in order {
                let m = (0..members.len()).min_by_key(|&m| (load[m], m)).unwrap_or(0);
                load[m].0 += depths[i];
                load[m].1 += 1;
                owners[i] = m;
            }
            owners
        };
        Plan {
            members: members.to_vec(),
            owners,
        }
    }

    /// The queues `me` consumes under this plan.
    pub(crate) fn mine<'a>(&self, me: &str, queues: &'a [String]) -> Vec<&'a String> {
        let Some(i) = self.members.iter().position(|m| m == me) else {
            return Vec::new();
        };
        queues
            .iter()
            .zip(&self.owners)
            .filter(|(_, o)| **o == i)
            .map(|(q, _)| q)
            .collect()
    }

    /// The presence header: the plan, or empty from an instance that
    /// follows plans but makes none. A leader makes a plan by depth only
    /// when every live instance sends the header: one that does not (an
    /// older version) computes the count share and would never consume a
    /// queue a depth plan gave it.
    pub(crate) fn header(plan: Option<&Plan>) -> FieldTable {
        let mut t = FieldTable::default();
        let text = plan.map_or_else(String::new, |p| {
            json!({"members": p.members, "owners": p.owners}).to_string()
        });
        t.insert(PLAN_HEADER.into(), AMQPValue::LongString(text.into()));
        t
    }

    /// A plan read from a presence header; `None` for anything malformed or
    /// inconsistent (the reader falls back to the count share).
    pub(crate) fn parse(text: &str, queues: usize) -> Option<Plan> {
        let v: Value = serde_json::from_str(text).ok()?;
        let members: Vec<String> = v
            .get("members")?
            .as_array()?
            .iter()
            .map(|m| m.as_str().map(str::to_owned))
            .collect::<Option<_>>()?;
        let owners: Vec<usize> = v
            .get("owners")?
            .as_array()?
            .iter()
            .map(|o| o.as_u64().map(|o| o as usize))
            .collect::<Option<_>>()?;
        (owners.len() == queues && owners.iter().all(|o| *o < members.len())).then_some(Plan { members, owners })
    }
}

#[cfg(test)]
mod tests {
    use super::Plan;

    fn names(n: usize, p: &str) -> Vec<String> {
        (0..n).map(|i| format!("{p}{i}")).collect()
    }

    #[test]
    fn a_backlog_is_split_by_depth_not_by_count() {
        let members = names(2, "m");
        let queues = names(8, "q");
        // 100 keys over 8 queues, as the consistent-hash ring spread them in
        // one bench run: a count share can give one member 57 of 100.
        let depths = [16_000, 9_000, 15_000, 10_000, 14_000, 12_000, 13_000, 11_000];
        let plan = Plan::make(&members, &queues, &depths, 256);
        let load = |m: &str| -> u64 {
            let mine = plan.mine(m, &queues);
            queues
                .iter()
                .zip(depths)
                .filter(|(q, _)| mine.contains(q))
                .map(|(_, d)| d)
                .sum()
        };
        assert_eq!(load("m0") + load("m1"), 100_000);
        assert!(
            load("m0").abs_diff(load("m1")) <= 2_000,
            "{} vs {}",
            load("m0"),
            load("m1")
        );
        let every: usize = members.iter().map(|m| plan.mine(m, &queues).len()).sum();
        assert_eq!(every, 8, "every queue has one member");
    }

    #[test]
    fn without_a_backlog_the_plan_is_the_count_share() {
        let members = names(3, "m");
        let queues = names(8, "q");
        let plan = Plan::make(&members, &queues, &[0, 3, 0, 1, 0, 0, 2, 0], 256);
        let counts: Vec<usize> = members.iter().map(|m| plan.mine(m, &queues).len()).collect();
        assert_eq!(counts.iter().sum::<usize>(), 8);
        assert!(counts.iter().all(|c| (2..=3).contains(c)), "{counts:?}");
        let share = keyorder_core::assign::assign(&members, &queues);
        for m in &members {
            for q in plan.mine(m, &queues) {
                assert_eq!(share[q.as_str()], m.as_str());
            }
        }
    }

    #[test]
    fn a_plan_round_trips_through_its_header_and_bad_ones_are_refused() {
        let members = names(2, "instance:");
        let queues = names(4, "q");
        let plan = Plan::make(&members, &queues, &[500, 100, 100, 100], 10);
        let h = Plan::header(Some(&plan));
        let text = match h.inner().get(super::PLAN_HEADER) {
            Some(lapin::types::AMQPValue::LongString(s)) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
            other => panic!("header {other:?}"),
        };
        assert_eq!(Plan::parse(&text, 4), Some(plan));
        assert_eq!(Plan::parse(&text, 5), None, "another queue count");
        assert_eq!(Plan::parse(r#"{"members":["a"],"owners":[0,1]}"#, 2), None);
        assert_eq!(Plan::parse("not json", 2), None);
        let follower = Plan::header(None);
        let empty = matches!(
            follower.inner().get(super::PLAN_HEADER),
            Some(lapin::types::AMQPValue::LongString(s)) if s.as_bytes().is_empty()
        );
        assert!(empty, "a follower's header is empty");
        assert_eq!(Plan::parse("", 2), None);
        assert_eq!(Plan::parse(r#"{"members":[1],"owners":[0]}"#, 1), None);
    }
}
