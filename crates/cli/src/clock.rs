//! The bench handler's sleep.
//!
//! `tokio::time::sleep` has millisecond granularity: its timer wheel rounds a
//! deadline up to the next millisecond tick and fires it when a worker next
//! turns the driver, so a 1 ms sleep takes 1-2 ms (2.0-2.3 ms median
//! measured in the bench's event logs). A handler doing 1 ms of I/O is woken
//! by the reactor when its reply arrives, not by the timer wheel. With
//! `--handler-clock precise` one thread per process keeps the deadlines and
//! wakes each handler when its time is up (within the kernel's timer slack,
//! about 0.05 ms, plus the wait for a tokio worker). The default stays
//! [`Clock::Tokio`], which every recorded measurement used.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

/// Which timer a bench handler sleeps on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Clock {
    /// A deadline thread: the handler takes the time it asks for.
    Precise,
    /// `tokio::time::sleep` (millisecond ticks: 1 ms takes 1-2 ms).
    Tokio,
}

impl Clock {
    pub(crate) async fn sleep(self, d: Duration) {
        match self {
            Clock::Precise => precise_sleep(d).await,
            Clock::Tokio => tokio::time::sleep(d).await,
        }
    }
}

/// A deadline waiting to fire; ordered by time, then by arrival.
struct Entry {
    at: Instant,
    seq: u64,
    wake: oneshot::Sender<()>,
}

impl PartialEq for Entry {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}
impl Eq for Entry {}
impl PartialOrd for Entry {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Entry {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.at, self.seq).cmp(&(other.at, other.seq))
    }
}

#[derive(Default)]
struct Deadlines {
    heap: BinaryHeap<Reverse<Entry>>,
    seq: u64,
}

struct Timer {
    deadlines: Mutex<Deadlines>,
    changed: Condvar,
}

fn timer() -> &'static Timer {
    static TIMER: OnceLock<&'static Timer> = OnceLock::new();
    TIMER.get_or_init(|| {
        let t: &'static Timer = Box::leak(Box::new(Timer {
            deadlines: Mutex::new(Deadlines::default()),
            changed: Condvar::new(),
        }));
        std::thread::Builder::new()
            .name("keyorder-bench-clock".into())
            .spawn(move || run(t))
            .expect("spawning the bench clock thread");
        t
    })
}

/// Sleeps for `d` on the deadline thread.
pub(crate) async fn precise_sleep(d: Duration) {
    let at = Instant::now() + d;
    let (wake, woken) = oneshot::channel();
    let t = timer();
    let earliest = {
        let mut s = t.deadlines.lock().unwrap();
        s.seq += 1;
        let seq = s.seq;
        let earlier = s.heap.peek().is_none_or(|Reverse(e)| at < e.at);
        s.heap.push(Reverse(Entry { at, seq, wake }));
        earlier
    };
    // Only a new earliest deadline needs the thread to wait less.
    if earliest {
        t.changed.notify_one();
    }
    // The thread never drops a sender unsent; if it did, the sleep ends early
    // rather than never.
    let _ = woken.await;
}

fn run(t: &Timer) {
    let mut due = Vec::new();
    let mut s = t.deadlines.lock().unwrap();
    loop {
        let now = Instant::now();
        while s.heap.peek().is_some_and(|Reverse(e)| e.at <= now) {
            let Reverse(e) = s.heap.pop().expect("peeked");
            due.push(e.wake);
        }
        if !due.is_empty() {
            // Wake outside the lock: a wake may run a tokio worker's unpark.
            drop(s);
            for w in due.drain(..) {
                let _ = w.send(());
            }
            s = t.deadlines.lock().unwrap();
            continue;
        }
        s = match s.heap.peek() {
            None => t.changed.wait(s).unwrap(),
            Some(Reverse(e)) => {
                let wait = e.at.saturating_duration_since(now);
                t.changed.wait_timeout(s, wait).unwrap().0
            }
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The precise sleep takes at least what it was asked for, and far less
    /// than a second more (no lost wake-up: every sleep ends).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn precise_sleeps_end_after_their_deadline() {
        let mut tasks = Vec::new();
        for i in 0..200u64 {
            tasks.push(tokio::spawn(async move {
                let d = Duration::from_micros(500 + (i % 7) * 300);
                let start = Instant::now();
                Clock::Precise.sleep(d).await;
                (d, start.elapsed())
            }));
        }
        for t in tasks {
            let (asked, took) = tokio::time::timeout(Duration::from_secs(30), t)
                .await
                .expect("a precise sleep never ended")
                .unwrap();
            assert!(took >= asked, "slept {took:?} for {asked:?}");
        }
    }
}
