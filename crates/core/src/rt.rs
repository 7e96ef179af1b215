//! The runtime the dispatcher and the self-fence run on.
//!
//! Every concurrency primitive of [`crate::dispatch`] and [`crate::lease`]
//! comes from here: locks, atomics, task spawning, an async notification, the
//! shutdown flag, sleeping, time-outs and racing two futures.
//!
//! * Normally (no `keyorder_shuttle` cfg) these are plain re-exports of std
//!   and tokio, or wrappers that inline to exactly the calls the dispatcher
//!   made before the shim existed: no cost, the same semantics.
//! * Built with `RUSTFLAGS='--cfg keyorder_shuttle'`, they map to the
//!   [shuttle](https://docs.rs/shuttle) schedule explorer: `shuttle::sync`
//!   locks and atomics (each operation a point where shuttle may switch
//!   tasks), `shuttle::future::spawn`, a small waker-list notification built
//!   on the shuttle mutex, and a time model in which a sleep or a time-out
//!   may fire at any scheduling point (one `yield_now`): an
//!   over-approximation of real timers, so code that is correct under it is
//!   correct whatever the timers do. `crates/core/tests/SHUTTLE.md` says
//!   how the schedule tests use it.
//!
//! The shuttle build is a `--cfg`, not a cargo feature, on purpose: a feature
//! would be switched on by `--all-features` and put every tokio test of the
//! workspace on shuttle primitives, which only work inside a shuttle run.

use std::future::Future;

pub(crate) use futures::future::Either;
#[cfg(keyorder_shuttle)]
pub use imp::plant_bug;
pub(crate) use imp::*;

/// Runs `a` and `b` concurrently; the first to finish wins and the other is
/// dropped. With tokio, ties are broken at random (as `tokio::select!`
/// does); under shuttle, in favour of `a`, so every schedule replays.
pub(crate) async fn race<A: Future, B: Future>(a: A, b: B) -> Either<A::Output, B::Output> {
    #[cfg(not(keyorder_shuttle))]
    {
        tokio::select! {
            x = a => Either::Left(x),
            y = b => Either::Right(y),
        }
    }
    #[cfg(keyorder_shuttle)]
    {
        use std::pin::pin;
        use std::task::Poll;
        let mut a = pin!(a);
        let mut b = pin!(b);
        std::future::poll_fn(|cx| {
            if let Poll::Ready(x) = a.as_mut().poll(cx) {
                return Poll::Ready(Either::Left(x));
            }
            if let Poll::Ready(y) = b.as_mut().poll(cx) {
                return Poll::Ready(Either::Right(y));
            }
            Poll::Pending
        })
        .await
    }
}

#[cfg(not(keyorder_shuttle))]
mod imp {
    use std::future::Future;

    pub(crate) use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
    pub(crate) use std::sync::{Mutex, MutexGuard};
    pub(crate) use tokio::sync::Notify;
    pub(crate) use tokio::time::{sleep, timeout};

    /// Spawns a detached task.
    #[inline]
    pub(crate) fn spawn<F: Future<Output = ()> + Send + 'static>(task: F) {
        tokio::spawn(task);
    }

    /// A one-way shutdown flag that tasks can wait on.
    #[derive(Debug)]
    pub(crate) struct Stop(tokio::sync::watch::Sender<bool>);

    impl Stop {
        pub(crate) fn new() -> Self {
            Stop(tokio::sync::watch::channel(false).0)
        }
        #[inline]
        pub(crate) fn is_set(&self) -> bool {
            *self.0.borrow()
        }
        #[inline]
        pub(crate) fn set(&self) {
            self.0.send_replace(true);
        }
        /// Resolves once the flag is set. Subscribes now, not at the first
        /// poll, so a `set` between this call and the first poll is seen.
        #[inline]
        pub(crate) fn stopped(&self) -> impl Future<Output = ()> + Send + 'static {
            let mut rx = self.0.subscribe();
            async move {
                let _ = rx.wait_for(|s| *s).await;
            }
        }
    }
}

#[cfg(keyorder_shuttle)]
mod imp {
    use std::cell::Cell;
    use std::future::Future;
    use std::pin::Pin;
    use std::sync::atomic::Ordering;
    use std::sync::Arc;
    use std::task::{Context, Poll, Waker};
    use std::time::Duration;

    pub(crate) use shuttle::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
    pub(crate) use shuttle::sync::{Mutex, MutexGuard};

    /// Spawns a detached shuttle task.
    pub(crate) fn spawn<F: Future<Output = ()> + Send + 'static>(task: F) {
        drop(shuttle::future::spawn(task));
    }

    /// A sleep that may end at any scheduling point.
    pub(crate) async fn sleep(_d: Duration) {
        shuttle::future::yield_now().await;
    }

    /// The time-out fired before `fut` finished.
    #[derive(Debug)]
    pub(crate) struct Elapsed;

    /// `fut`, or [`Elapsed`] at any scheduling point after the first poll.
    pub(crate) async fn timeout<F: Future>(d: Duration, fut: F) -> Result<F::Output, Elapsed> {
        match super::race(fut, sleep(d)).await {
            super::Either::Left(out) => Ok(out),
            super::Either::Right(()) => Err(Elapsed),
        }
    }

    #[derive(Debug, Default)]
    struct Waiters {
        /// Bumped by every `notify_waiters`.
        generation: u64,
        wakers: Vec<Waker>,
    }

    /// The part of `tokio::sync::Notify` the dispatcher uses: a
    /// [`Notified`] future completes once `notify_waiters` was called after
    /// it was *created* (polled or not), like tokio's.
    #[derive(Debug, Default)]
    pub(crate) struct Notify {
        waiters: Mutex<Waiters>,
    }

    impl Notify {
        pub(crate) fn new() -> Self {
            Notify::default()
        }

        pub(crate) fn notified(&self) -> Notified<'_> {
            let generation = self.waiters.lock().unwrap_or_else(|e| e.into_inner()).generation;
            Notified {
                notify: self,
                generation,
            }
        }

        pub(crate) fn notify_waiters(&self) {
            let wakers = {
                let mut w = self.waiters.lock().unwrap_or_else(|e| e.into_inner());
                w.generation += 1;
                std::mem::take(&mut w.wakers)
            };
            for waker in wakers {
                waker.wake();
            }
        }
    }

    /// See [`Notify::notified`].
    #[derive(Debug)]
    pub(crate) struct Notified<'a> {
        notify: &'a Notify,
        generation: u64,
    }

    impl Notified<'_> {
        /// Tokio's `enable`; a no-op here (registration happens at creation).
        pub(crate) fn enable(self: Pin<&mut Self>) {}
    }

    impl Future for Notified<'_> {
        type Output = ();
        fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
            let mut w = self.notify.waiters.lock().unwrap_or_else(|e| e.into_inner());
            if w.generation != self.generation {
                return Poll::Ready(());
            }
            if !w.wakers.iter().any(|k| k.will_wake(cx.waker())) {
                w.wakers.push(cx.waker().clone());
            }
            Poll::Pending
        }
    }

    /// A one-way shutdown flag that tasks can wait on.
    #[derive(Debug)]
    pub(crate) struct Stop {
        inner: Arc<(AtomicBool, Notify)>,
    }

    impl Stop {
        pub(crate) fn new() -> Self {
            Stop {
                inner: Arc::new((AtomicBool::new(false), Notify::new())),
            }
        }
        pub(crate) fn is_set(&self) -> bool {
            self.inner.0.load(Ordering::SeqCst)
        }
        pub(crate) fn set(&self) {
            self.inner.0.store(true, Ordering::SeqCst);
            self.inner.1.notify_waiters();
        }
        /// Resolves once the flag is set; a `set` after this call is seen.
        pub(crate) fn stopped(&self) -> impl Future<Output = ()> + Send + 'static {
            let inner = self.inner.clone();
            let generation = inner.1.notified().generation;
            async move {
                let notified = Notified {
                    notify: &inner.1,
                    generation,
                };
                if !inner.0.load(Ordering::SeqCst) {
                    notified.await;
                }
            }
        }
    }

    std::thread_local! {
        static PLANTED_BUG: Cell<bool> = const { Cell::new(false) };
    }

    /// Whether the planted dispatcher bug is switched on for the shuttle runs
    /// of this thread ([`crate::plant_bug`]), or for every run of the process
    /// (`KEYORDER_PLANTED_BUG=1`).
    pub(crate) fn planted_bug() -> bool {
        static ENV: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        PLANTED_BUG.with(Cell::get)
            || *ENV.get_or_init(|| std::env::var_os("KEYORDER_PLANTED_BUG").is_some_and(|v| v == "1"))
    }

    /// See [`crate::plant_bug`].
    pub fn plant_bug(on: bool) {
        PLANTED_BUG.with(|c| c.set(on));
    }
}
