//! The keyed dispatcher against a plain unordered tokio worker pool: same
//! work, same concurrency, same run, at 1, 100 and 10,000 keys, with a no-op
//! handler and a 1 ms handler. After criterion's own output, a table of
//! throughput ratios (ordered / baseline) is printed from its estimates.
//!
//! `cargo bench -p keyorder-core --bench dispatch`

#![allow(missing_docs)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use criterion::{criterion_group, BenchmarkId, Criterion, Throughput};
use keyorder_core::{
    DispatchConfig, Dispatcher, Handler, HandlerResult, Inbound, Job, LeaseConfig, Message, OrderingKey, ScopeLease,
    Settle, Stats, Submit,
};
use tokio::sync::{Notify, Semaphore};

const CONCURRENCY: usize = 64;

#[derive(Debug)]
struct NullSettle;

#[async_trait]
impl Settle for NullSettle {
    async fn begin_attempt(&self) -> keyorder_core::Result<u32> {
        Ok(1)
    }
    async fn ack(&self) -> keyorder_core::Result<()> {
        Ok(())
    }
    async fn park(&self, _: &str) -> keyorder_core::Result<()> {
        Ok(())
    }
    async fn halt(&self, _: &str) -> keyorder_core::Result<()> {
        Ok(())
    }
}

struct Work {
    done: AtomicUsize,
    total: usize,
    all_done: Notify,
    sleep: Option<Duration>,
}

impl Work {
    async fn run(&self) {
        if let Some(d) = self.sleep {
            tokio::time::sleep(d).await;
        }
        if self.done.fetch_add(1, Ordering::AcqRel) + 1 == self.total {
            self.all_done.notify_one();
        }
    }
}

struct CountingHandler(Arc<Work>);

#[async_trait]
impl Handler for CountingHandler {
    async fn handle(&self, _: keyorder_core::Delivery) -> HandlerResult {
        self.0.run().await;
        Ok(())
    }
}

fn messages(n: usize, keys: usize) -> Vec<(Message, OrderingKey)> {
    (0..n)
        .map(|i| {
            let key = OrderingKey::new(format!("key-{}", i % keys)).unwrap();
            (Message::new(&b"x"[..]).with_ordering_key(key.clone()), key)
        })
        .collect()
}

async fn ordered(msgs: Vec<(Message, OrderingKey)>, sleep: Option<Duration>) {
    let work = Arc::new(Work {
        done: AtomicUsize::new(0),
        total: msgs.len(),
        all_done: Notify::new(),
        sleep,
    });
    let cfg = DispatchConfig {
        concurrency: CONCURRENCY,
        ..DispatchConfig::default()
    };
    let dispatcher = Dispatcher::new(cfg, Arc::new(CountingHandler(work.clone())), Arc::new(Stats::default()));
    let lease = ScopeLease::new("bench", 1, &LeaseConfig::default(), tokio::time::Instant::now());
    let done = work.all_done.notified();
    tokio::pin!(done);
    done.as_mut().enable();
    for (message, key) in msgs {
        let mut job = Job::new(
            Inbound {
                message,
                lease: lease.clone(),
                settle: Box::new(NullSettle),
            },
            Some(key),
        );
        loop {
            let epoch = dispatcher.room_epoch();
            match dispatcher.submit(job) {
                Submit::Accepted => break,
                Submit::Full(back, _) => {
                    job = back;
                    dispatcher.wait_room_since(epoch, Duration::from_millis(100)).await;
                }
            }
        }
    }
    done.await;
}

async fn baseline(msgs: Vec<(Message, OrderingKey)>, sleep: Option<Duration>) {
    let work = Arc::new(Work {
        done: AtomicUsize::new(0),
        total: msgs.len(),
        all_done: Notify::new(),
        sleep,
    });
    let permits = Arc::new(Semaphore::new(CONCURRENCY));
    let done = work.all_done.notified();
    tokio::pin!(done);
    done.as_mut().enable();
    for (message, _key) in msgs {
        let permit = permits.clone().acquire_owned().await.unwrap();
        let work = work.clone();
        tokio::spawn(async move {
            let _message = message;
            work.run().await;
            drop(permit);
        });
    }
    done.await;
}

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    for (handler, sleep, n) in [
        ("noop", None, 20_000usize),
        ("1ms", Some(Duration::from_millis(1)), 2_000),
    ] {
        let mut group = c.benchmark_group(format!("dispatch-{handler}"));
        group.throughput(Throughput::Elements(n as u64));
        group.sample_size(if handler == "noop" { 40 } else { 10 });
        group.measurement_time(Duration::from_secs(if handler == "noop" { 4 } else { 8 }));
        for keys in [1usize, 100, 10_000] {
            if handler == "1ms" && keys == 1 {
                // One key at 1 ms is serial by definition (2 s an iteration);
                // measured with fewer messages below.
                continue;
            }
            group.bench_with_input(BenchmarkId::new("ordered", keys), &keys, |b, &keys| {
                b.to_async(&rt).iter_batched(
                    || messages(n, keys),
                    |m| ordered(m, sleep),
                    criterion::BatchSize::PerIteration,
                )
            });
            group.bench_with_input(BenchmarkId::new("baseline", keys), &keys, |b, &keys| {
                b.to_async(&rt).iter_batched(
                    || messages(n, keys),
                    |m| baseline(m, sleep),
                    criterion::BatchSize::PerIteration,
                )
            });
        }
        group.finish();
    }
    let mut group = c.benchmark_group("dispatch-1ms-one-key");
    group.throughput(Throughput::Elements(200));
    group.sample_size(10);
    group.bench_function(BenchmarkId::new("ordered", 1), |b| {
        b.to_async(&rt).iter_batched(
            || messages(200, 1),
            |m| ordered(m, Some(Duration::from_millis(1))),
            criterion::BatchSize::PerIteration,
        )
    });
    group.bench_function(BenchmarkId::new("baseline", 1), |b| {
        b.to_async(&rt).iter_batched(
            || messages(200, 1),
            |m| baseline(m, Some(Duration::from_millis(1))),
            criterion::BatchSize::PerIteration,
        )
    });
    group.finish();
}

/// Reads criterion's mean estimate (ns) of one benchmark.
fn mean_ns(group: &str, id: &str) -> Option<f64> {
    let dir = std::env::var("CARGO_TARGET_DIR").unwrap_or_else(|_| {
        let manifest = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        manifest.join("../../target").to_string_lossy().into_owned()
    });
    let path = std::path::Path::new(&dir)
        .join("criterion")
        .join(group)
        .join(id)
        .join("new/estimates.json");
    let text = std::fs::read_to_string(path).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    v["mean"]["point_estimate"].as_f64()
}

fn report() {
    println!("\nordered vs. baseline (throughput ratio = baseline time / ordered time)");
    println!(
        "{:<24} {:>8} {:>14} {:>14} {:>7}",
        "handler", "keys", "ordered msg/s", "baseline msg/s", "ratio"
    );
    let rows = [
        ("dispatch-noop", 20_000.0, vec!["1", "100", "10000"]),
        ("dispatch-1ms", 2_000.0, vec!["100", "10000"]),
        ("dispatch-1ms-one-key", 200.0, vec!["1"]),
    ];
    for (group, n, keys) in rows {
        for k in keys {
            let (Some(o), Some(b)) = (
                mean_ns(group, &format!("ordered/{k}")),
                mean_ns(group, &format!("baseline/{k}")),
            ) else {
                continue;
            };
            let rate = |ns: f64| n / (ns / 1e9);
            println!(
                "{:<24} {:>8} {:>14.0} {:>14.0} {:>7.2}",
                group,
                k,
                rate(o),
                rate(b),
                b / o
            );
        }
    }
}

criterion_group!(benches, bench);

fn main() {
    benches();
    criterion::Criterion::default().configure_from_args().final_summary();
    report();
}
