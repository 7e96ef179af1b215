//! What `keyorder top` shows, as data: the last answers of the `Admin`
//! trait, the totals and the history behind the sparklines. Pure: a poll's
//! answers go in with the time they came at ([`Model::apply`]), the view
//! reads the fields; no clock, no terminal, no broker.

use std::collections::VecDeque;
use std::time::Duration;

use keyorder::{HaltedKey, HotKey, ScopeInfo};

/// Points kept for each sparkline (at one a second, four minutes).
pub(crate) const HISTORY: usize = 240;

/// One poll's answers: each `Admin` call on its own, so one that fails
/// (a transport without halted keys, a timeout) leaves the others shown.
#[derive(Debug, Default)]
pub(crate) struct Poll {
    /// `Admin::scopes`.
    pub(crate) scopes: Option<Result<Vec<ScopeInfo>, String>>,
    /// `Admin::halted`.
    pub(crate) halted: Option<Result<Vec<HaltedKey>, String>>,
    /// `Admin::hot_keys`.
    pub(crate) hot: Option<Result<Vec<HotKey>, String>>,
    /// A failure before any call (connecting), as one line.
    pub(crate) failed: Option<String>,
}

impl Poll {
    /// A poll that could not start (no connection): `why`, one line.
    pub(crate) fn failed(why: String) -> Poll {
        Poll {
            failed: Some(why),
            ..Poll::default()
        }
    }
}

/// The live view's state.
#[derive(Debug)]
pub(crate) struct Model {
    /// The broker as shown: scheme, host and port, never a credential.
    pub(crate) broker: String,
    pub(crate) category: String,
    pub(crate) group: String,
    pub(crate) interval: Duration,
    /// Scopes, halted first, then by lag (largest first), then by name.
    pub(crate) scopes: Vec<ScopeInfo>,
    pub(crate) halted: Vec<HaltedKey>,
    pub(crate) hot: Vec<HotKey>,
    /// Total lag of each answered poll, oldest first.
    pub(crate) lag_history: VecDeque<u64>,
    /// Net drain per second between answered polls (the fall in total lag
    /// per second, 0 where it rose), oldest first.
    pub(crate) drain_history: VecDeque<u64>,
    /// The last change of the total lag per second (negative: it fell).
    pub(crate) lag_change: Option<f64>,
    /// When the scopes were last answered, and their total lag then.
    last: Option<(Duration, u64)>,
    /// Answered polls of the scopes.
    pub(crate) polls: u64,
    /// What failed in the last poll, one line each (`scopes: ...`).
    pub(crate) errors: Vec<String>,
    /// Polls in a row in which something failed.
    pub(crate) failing: u32,
    /// How old the scopes shown are when the last poll failed to renew them.
    pub(crate) stale_for: Option<Duration>,
    /// The selected row of the scopes table (scrolling).
    pub(crate) selected: usize,
    /// Drawn live (keys work), not as a one-off snapshot.
    pub(crate) live: bool,
}

impl Model {
    pub(crate) fn new(broker: String, category: String, group: String, interval: Duration) -> Model {
        Model {
            broker,
            category,
            group,
            interval,
            scopes: Vec::new(),
            halted: Vec::new(),
            hot: Vec::new(),
            lag_history: VecDeque::new(),
            drain_history: VecDeque::new(),
            lag_change: None,
            last: None,
            polls: 0,
            errors: Vec::new(),
            failing: 0,
            stale_for: None,
            selected: 0,
            live: true,
        }
    }

    /// Takes a poll's answers, received `at` (since the view started).
    pub(crate) fn apply(&mut self, at: Duration, poll: Poll) {
        self.errors.clear();
        if let Some(why) = poll.failed {
            self.errors.push(why);
        }
        // The halted heads first: a scope's halted count is at least the
        // heads listed in it (RabbitMQ counts only its own process's halts
        // per scope, and lists every process's heads).
        match poll.halted {
            Some(Ok(halted)) => self.halted = halted,
            Some(Err(e)) => self.errors.push(format!("halted: {e}")),
            None => {}
        }
        match poll.scopes {
            Some(Ok(mut scopes)) => {
                for s in &mut scopes {
                    let listed = self.halted.iter().filter(|h| h.scope == s.scope).count();
                    s.halted = s.halted.max(listed);
                }
                sort(&mut scopes);
                let total: u64 = scopes.iter().map(|s| s.lag).sum();
                if let Some((then, before)) = self.last {
                    let secs = at.saturating_sub(then).as_secs_f64();
                    if secs > 0.0 {
                        let change = (total as f64 - before as f64) / secs;
                        self.lag_change = Some(change);
                        push(&mut self.drain_history, (-change).max(0.0).round() as u64);
                    }
                }
                push(&mut self.lag_history, total);
                self.last = Some((at, total));
                self.scopes = scopes;
                self.polls += 1;
                self.stale_for = None;
            }
            Some(Err(e)) => {
                self.errors.push(format!("scopes: {e}"));
                self.stale_for = self.last.map(|(then, _)| at.saturating_sub(then));
            }
            None => self.stale_for = self.last.map(|(then, _)| at.saturating_sub(then)),
        }
        match poll.hot {
            Some(Ok(hot)) => self.hot = hot,
            Some(Err(e)) => self.errors.push(format!("hot keys: {e}")),
            None => {}
        }
        self.failing = if self.errors.is_empty() { 0 } else { self.failing + 1 };
        self.clamp();
    }

    /// The sum of the scopes' lag.
    pub(crate) fn total_lag(&self) -> u64 {
        self.scopes.iter().map(|s| s.lag).sum()
    }

    /// Scopes with an owner.
    pub(crate) fn owned(&self) -> usize {
        self.scopes.iter().filter(|s| s.owner.is_some()).count()
    }

    /// Halted keys: the halted heads listed, or the scopes' count where the
    /// list was never answered.
    pub(crate) fn halted_keys(&self) -> usize {
        let counted: usize = self.scopes.iter().map(|s| s.halted).sum();
        counted.max(self.halted.len())
    }

    /// Moves the selection by `rows` (negative: up), within the scopes.
    pub(crate) fn scroll(&mut self, rows: isize) {
        self.selected = self.selected.saturating_add_signed(rows);
        self.clamp();
    }

    /// Selects the first (`false`) or the last (`true`) scope.
    pub(crate) fn jump(&mut self, end: bool) {
        self.selected = if end { usize::MAX } else { 0 };
        self.clamp();
    }

    fn clamp(&mut self) {
        self.selected = self.selected.min(self.scopes.len().saturating_sub(1));
    }
}

/// Halted first (most halted keys first), then by lag (largest first), then
/// by name.
fn sort(scopes: &mut [ScopeInfo]) {
    scopes.sort_by(|a, b| {
        (b.halted > 0)
            .cmp(&(a.halted > 0))
            .then(b.lag.cmp(&a.lag))
            .then(b.halted.cmp(&a.halted))
            .then(a.scope.cmp(&b.scope))
    });
}

fn push(history: &mut VecDeque<u64>, value: u64) {
    if history.len() == HISTORY {
        history.pop_front();
    }
    history.push_back(value);
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn scope(name: &str, owner: Option<&str>, lag: u64, halted: usize) -> ScopeInfo {
        ScopeInfo {
            scope: name.into(),
            owner: owner.map(Into::into),
            generation: 3,
            lag,
            halted,
        }
    }

    fn answered(scopes: Vec<ScopeInfo>) -> Poll {
        Poll {
            scopes: Some(Ok(scopes)),
            halted: Some(Ok(Vec::new())),
            hot: Some(Ok(Vec::new())),
            failed: None,
        }
    }

    fn model() -> Model {
        Model::new(
            "redis://h:6379".into(),
            "orders".into(),
            "billing".into(),
            Duration::from_secs(1),
        )
    }

    #[test]
    fn halted_scopes_come_first_then_the_largest_lag() {
        let mut m = model();
        m.apply(
            Duration::ZERO,
            answered(vec![
                scope("a", Some("i1"), 5, 0),
                scope("b", None, 1, 1),
                scope("c", Some("i2"), 50, 0),
                scope("d", Some("i2"), 0, 2),
                scope("e", Some("i1"), 5, 0),
            ]),
        );
        let order: Vec<&str> = m.scopes.iter().map(|s| s.scope.as_str()).collect();
        assert_eq!(order, ["b", "d", "c", "a", "e"]);
        assert_eq!((m.total_lag(), m.owned(), m.halted_keys()), (61, 4, 3));
    }

    #[test]
    fn a_scope_counts_at_least_the_halted_heads_listed_in_it() {
        let mut m = model();
        let head = |scope: &str| HaltedKey {
            label: "k#1".into(),
            preview: String::new(),
            scope: scope.into(),
            head_id: "1".into(),
            attempts: 1,
            reason: String::new(),
            held: None,
        };
        m.apply(
            Duration::ZERO,
            Poll {
                scopes: Some(Ok(vec![scope("a", None, 9, 0), scope("b", None, 0, 0)])),
                halted: Some(Ok(vec![head("b")])),
                hot: None,
                failed: None,
            },
        );
        assert_eq!((m.scopes[0].scope.as_str(), m.scopes[0].halted), ("b", 1));
        assert_eq!(m.halted_keys(), 1);
    }

    #[test]
    fn the_drain_is_the_fall_in_lag_per_second_and_never_negative() {
        let mut m = model();
        m.apply(Duration::ZERO, answered(vec![scope("a", None, 100, 0)]));
        assert_eq!(m.lag_change, None, "one poll has no rate");
        m.apply(Duration::from_secs(2), answered(vec![scope("a", None, 60, 0)]));
        assert_eq!(m.lag_change, Some(-20.0));
        m.apply(Duration::from_secs(3), answered(vec![scope("a", None, 90, 0)]));
        assert_eq!(m.lag_change, Some(30.0));
        assert_eq!(Vec::from(m.lag_history.clone()), [100, 60, 90]);
        assert_eq!(Vec::from(m.drain_history.clone()), [20, 0]);
    }

    #[test]
    fn a_failed_poll_keeps_the_last_answer_and_says_how_old_it_is() {
        let mut m = model();
        m.apply(Duration::ZERO, answered(vec![scope("a", Some("i1"), 7, 0)]));
        m.apply(
            Duration::from_secs(3),
            Poll {
                scopes: Some(Err("connection refused".into())),
                halted: Some(Err("connection refused".into())),
                hot: None,
                failed: None,
            },
        );
        assert_eq!(m.scopes.len(), 1, "the last answer stays");
        assert_eq!(m.errors, ["halted: connection refused", "scopes: connection refused"]);
        assert_eq!((m.failing, m.stale_for), (1, Some(Duration::from_secs(3))));
        m.apply(Duration::from_secs(4), Poll::failed("connecting: refused".into()));
        assert_eq!(m.failing, 2);
        m.apply(Duration::from_secs(5), answered(vec![scope("a", Some("i1"), 1, 0)]));
        assert!(m.errors.is_empty() && m.failing == 0 && m.stale_for.is_none());
        assert_eq!(m.polls, 2);
    }

    #[test]
    fn scrolling_stays_within_the_scopes() {
        let mut m = model();
        m.scroll(3);
        assert_eq!(m.selected, 0, "no scopes, nothing to select");
        m.apply(
            Duration::ZERO,
            answered((0..5).map(|i| scope(&format!("s{i}"), None, i, 0)).collect()),
        );
        m.scroll(3);
        assert_eq!(m.selected, 3);
        m.scroll(10);
        assert_eq!(m.selected, 4);
        m.scroll(-2);
        assert_eq!(m.selected, 2);
        m.scroll(-10);
        assert_eq!(m.selected, 0);
        m.jump(true);
        assert_eq!(m.selected, 4);
        m.apply(Duration::from_secs(1), answered(vec![scope("s0", None, 0, 0)]));
        assert_eq!(m.selected, 0, "fewer scopes: the selection follows");
    }

    #[test]
    fn history_is_bounded() {
        let mut m = model();
        for i in 0..(HISTORY as u64 + 10) {
            m.apply(Duration::from_secs(i), answered(vec![scope("a", None, i, 0)]));
        }
        assert_eq!(m.lag_history.len(), HISTORY);
        assert_eq!(m.lag_history.back(), Some(&(HISTORY as u64 + 9)));
    }
}
