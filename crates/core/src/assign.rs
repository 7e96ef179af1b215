//! Spreading scopes over live members: every member computes the same
//! answer from the same inputs, so no coordinator is needed (while two
//! members disagree, one sees a change first, a scope waits: the lease or the
//! broker's single active consumer keeps it from being owned twice).

use std::collections::HashMap;

use crate::key::stable_hash;

/// Which member owns each key: rendezvous hashing with bounded load. Keys
/// are taken in hash order; each goes to its highest-ranked member that has
/// fewer than `ceil(keys / members)`, so every member gets a fair share, and
/// a joining or leaving member moves few keys. Every member computes the same
/// answer from the same index and member list; while two disagree (one saw a
/// change first) a partition waits, it is never owned twice (the lease).
pub fn assign<'a>(live: &'a [String], keys: &'a [String]) -> HashMap<&'a str, &'a str> {
    let mut out = HashMap::with_capacity(keys.len());
    if live.is_empty() {
        return out;
    }
    let cap = keys.len().div_ceil(live.len());
    let mut load = vec![0usize; live.len()];
    let mut order: Vec<&String> = keys.iter().collect();
    order.sort_by_key(|k| (stable_hash(k.as_bytes()), k.as_str()));
    let mut ranked: Vec<(u64, usize)> = Vec::with_capacity(live.len());
    for k in order {
        ranked.clear();
        ranked.extend(
            live.iter()
                .enumerate()
                .map(|(i, m)| (stable_hash(format!("{m}\u{0}{k}").as_bytes()), i)),
        );
        ranked.sort_unstable_by(|a, b| b.cmp(a));
        if let Some(&(_, i)) = ranked.iter().find(|(_, i)| load[*i] < cap) {
            load[i] += 1;
            out.insert(k.as_str(), live[i].as_str());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::assign;

    #[test]
    fn assignment_is_fair_and_moves_few_keys_when_a_member_joins() {
        let keys: Vec<String> = (0..100).map(|i| format!("key-{i}")).collect();
        let two = vec!["a".to_owned(), "b".to_owned()];
        let three = vec!["a".to_owned(), "b".to_owned(), "c".to_owned()];
        let before = assign(&two, &keys);
        let after = assign(&three, &keys);
        for m in ["a", "b"] {
            assert_eq!(before.values().filter(|o| **o == m).count(), 50);
        }
        for m in ["a", "b", "c"] {
            let n = after.values().filter(|o| **o == m).count();
            assert!((32..=34).contains(&n), "{m} owns {n}");
        }
        let moved = keys.iter().filter(|k| before[k.as_str()] != after[k.as_str()]).count();
        assert!(moved < 50, "{moved} of 100 keys moved");
        // Four keys over two members: two each, whatever the hashes.
        let few: Vec<String> = (0..4).map(|i| format!("k{i}")).collect();
        let a = assign(&two, &few);
        assert_eq!(a.values().filter(|o| **o == "a").count(), 2);
        assert!(assign(&[], &few).is_empty());
    }
}
