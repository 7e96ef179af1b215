//! Shared by `demo` and `bench`: instances with a recording handler, and a
//! producer that stamps per-key sequences and send times.

use crate::clock::Clock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use keyorder::{Client, Delivery, HandlerError, KeySource, Message, RunReport, SubscriptionBuilder};
use keyorder_check::{EventLog, EventStart, MemoryEventLog, Published};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// The consumer group of every `demo` and `bench` subscription.
pub(crate) const GROUP: &str = "keyorder";

/// The URL with the set-up `demo` and `bench` do themselves, as the
/// transport's adapter declares it ([`keyorder::raw::BenchHints::setup`]):
/// PostgreSQL's migrations, RabbitMQ's consistent-hash topology with the
/// run's group declared by its publishers, unless the URL says otherwise.
pub(crate) fn with_setup(url: &str) -> String {
    keyorder::bench_hints(url).setup(url, GROUP)
}

/// The URL of the plain, unordered baseline on the same broker, as the
/// transport's adapter declares it ([`keyorder::raw::BenchHints::baseline`]):
/// Redis reads one stream with a competing-consumer group, RabbitMQ one
/// queue with competing consumers that share the ordered side's total
/// prefetch, PostgreSQL one table with `FOR UPDATE SKIP LOCKED` competing
/// consumers; every other transport's unordered subscription is already its
/// plain path.
pub(crate) fn baseline_url(url: &str, instances: usize) -> String {
    keyorder::bench_hints(url).baseline(url, GROUP, instances)
}

/// One client per instance: each its own connections. Where every connect
/// is a broker of its own (`memory://`), the instances share one client.
pub(crate) async fn clients(url: &str, n: usize) -> anyhow::Result<Vec<Client>> {
    let url = &with_setup(url);
    let first = keyorder::connect(url).await.with_context(|| "connecting")?;
    let shared = keyorder::bench_hints(url).connects_share_broker();
    let mut out = vec![first.clone()];
    for _ in 1..n {
        out.push(if shared {
            keyorder::connect(url).await?
        } else {
            first.clone()
        });
    }
    // The URL without its password and query values (`redact::url`).
    tracing::debug!(
        transport = first.transport_name(),
        url = %keyorder::redact::url(url),
        clients = n,
        "connected"
    );
    Ok(out)
}

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// A compact payload: `seq sent_us sleep_ms probe`.
pub(crate) fn payload(seq: u64, sleep_ms: u64, probe: bool) -> Vec<u8> {
    format!("{seq} {} {sleep_ms} {}", now_us(), u8::from(probe)).into_bytes()
}

struct Parsed {
    seq: u64,
    sent_us: u64,
    sleep_ms: u64,
    probe: bool,
}

fn parse(bytes: &[u8]) -> Option<Parsed> {
    let text = std::str::from_utf8(bytes).ok()?;
    let mut it = text.split(' ').map(|s| s.parse::<u64>().ok());
    Some(Parsed {
        seq: it.next()??,
        sent_us: it.next()??,
        sleep_ms: it.next()??,
        probe: it.next()?? == 1,
    })
}

/// What the handlers of one run recorded.
#[derive(Debug)]
pub(crate) struct Recorder {
    pub(crate) log: MemoryEventLog,
    pub(crate) applied: AtomicU64,
    pub(crate) probes: AtomicU64,
    window: Mutex<(Option<std::time::Instant>, Option<std::time::Instant>)>,
    latency_us: Mutex<hdrhistogram::Histogram<u64>>,
    /// The timer the handler sleeps on.
    clock: Clock,
    /// How long the handlers' sleeps took, in µs.
    slept_us: Mutex<hdrhistogram::Histogram<u64>>,
    /// When each running message's handler returned (message id), until
    /// its settlement is reported.
    returned: Mutex<std::collections::HashMap<String, std::time::Instant>>,
    /// From a handler's return to its acknowledgement being durable (the
    /// settlement reported by `on_settled`), in µs.
    settle_us: Mutex<hdrhistogram::Histogram<u64>>,
    /// How long the handlers took, in µs.
    handler_us: Mutex<hdrhistogram::Histogram<u64>>,
}

impl Recorder {
    pub(crate) fn new() -> Arc<Self> {
        Self::with_clock(Clock::Tokio)
    }

    /// A recorder whose handlers sleep on `clock`.
    pub(crate) fn with_clock(clock: Clock) -> Arc<Self> {
        Arc::new(Recorder {
            log: MemoryEventLog::default(),
            applied: AtomicU64::new(0),
            probes: AtomicU64::new(0),
            window: Mutex::new((None, None)),
            latency_us: Mutex::new(hdrhistogram::Histogram::new(3).expect("sigfig 3 is valid")),
            clock,
            slept_us: Mutex::new(hdrhistogram::Histogram::new(3).expect("sigfig 3 is valid")),
            returned: Mutex::default(),
            settle_us: Mutex::new(hdrhistogram::Histogram::new(3).expect("sigfig 3 is valid")),
            handler_us: Mutex::new(hdrhistogram::Histogram::new(3).expect("sigfig 3 is valid")),
        })
    }

    /// Median handler time and median settle wait (handler return to
    /// durable acknowledgement), in ms; `None` before any was settled.
    pub(crate) fn cycle_ms(&self) -> Option<(f64, f64)> {
        let (h, s) = (self.handler_us.lock().unwrap(), self.settle_us.lock().unwrap());
        (!h.is_empty() && !s.is_empty()).then(|| {
            (
                h.value_at_quantile(0.5) as f64 / 1000.0,
                s.value_at_quantile(0.5) as f64 / 1000.0,
            )
        })
    }

    /// Seconds from the first handler start to the last handler end.
    pub(crate) fn busy_secs(&self) -> f64 {
        match *self.window.lock().unwrap() {
            (Some(a), Some(b)) => b.duration_since(a).as_secs_f64(),
            _ => 0.0,
        }
    }

    /// Publish-to-handler latency quantile of the probe messages, in ms.
    pub(crate) fn latency_ms(&self, q: f64) -> f64 {
        let h = self.latency_us.lock().unwrap();
        if h.is_empty() {
            return 0.0;
        }
        h.value_at_quantile(q) as f64 / 1000.0
    }

    /// Quantile of how long the handlers' sleeps took, in ms (0 with no
    /// sleeps).
    pub(crate) fn slept_ms(&self, q: f64) -> f64 {
        let h = self.slept_us.lock().unwrap();
        if h.is_empty() {
            return 0.0;
        }
        h.value_at_quantile(q) as f64 / 1000.0
    }
}

/// A running instance.
pub(crate) struct Running {
    pub(crate) stats: std::sync::Arc<keyorder::Stats>,
    stop: oneshot::Sender<()>,
    join: JoinHandle<keyorder::Result<RunReport>>,
}

impl Running {
    pub(crate) async fn stop(self) -> anyhow::Result<RunReport> {
        let _ = self.stop.send(());
        Ok(self.join.await??)
    }
}

/// Builds and runs one instance whose handler records into `rec`.
pub(crate) async fn start(
    builder: SubscriptionBuilder,
    instance: String,
    rec: Arc<Recorder>,
) -> anyhow::Result<Running> {
    Ok(build(builder, instance, rec).await?.launch())
}

/// An instance whose subscription is built (its transport open) but whose
/// handlers have not started: `bench` builds every instance of a side first
/// and then launches them together, so that no side's timing includes one
/// instance's start-up while another already works.
pub(crate) struct Built {
    subscription: keyorder::Subscription,
    instance: String,
    rec: Arc<Recorder>,
}

/// Builds the subscription of `instance` (see [`Built`]).
pub(crate) async fn build(builder: SubscriptionBuilder, instance: String, rec: Arc<Recorder>) -> anyhow::Result<Built> {
    let settled = rec.clone();
    let admin = builder.admin();
    let subscription = builder
        .instance_id(instance.clone())
        .on_settled(move |s| {
            let returned = settled.returned.lock().unwrap().remove(&s.id);
            if let (Some(at), keyorder::Settlement::Acknowledged) = (returned, &s.settlement) {
                let us = at.elapsed().as_micros() as u64;
                let _ = settled.settle_us.lock().unwrap().record(us.max(1));
            }
        })
        .build()
        .await?;
    crate::watch(&subscription, admin);
    Ok(Built {
        subscription,
        instance,
        rec,
    })
}

impl Built {
    /// Starts the recording handlers.
    pub(crate) fn launch(self) -> Running {
        let Built {
            subscription,
            instance,
            rec,
        } = self;
        let stats = subscription.stats();
        let (stop, stopped) = oneshot::channel::<()>();
        let handler = move |d: Delivery| {
            let rec = rec.clone();
            let instance = instance.clone();
            async move {
                let started = std::time::Instant::now();
                let p = parse(d.payload()).ok_or_else(|| HandlerError::poison("not a keyorder bench payload"))?;
                if p.probe {
                    let lat = now_us().saturating_sub(p.sent_us);
                    let _ = rec.latency_us.lock().unwrap().record(lat.max(1));
                    rec.probes.fetch_add(1, Ordering::Relaxed);
                }
                let id = rec
                    .log
                    .start(EventStart {
                        message_id: d.id().to_owned(),
                        key: d.key().map_or_else(String::new, |k| k.as_str().to_owned()),
                        seq: p.seq,
                        instance,
                        generation: d.fencing_token(),
                    })
                    .await
                    .map_err(HandlerError::retry)?;
                if p.sleep_ms > 0 {
                    let slept = std::time::Instant::now();
                    rec.clock.sleep(Duration::from_millis(p.sleep_ms)).await;
                    let us = slept.elapsed().as_micros() as u64;
                    let _ = rec.slept_us.lock().unwrap().record(us.max(1));
                }
                rec.log.end(id, true).await.map_err(HandlerError::retry)?;
                {
                    let mut w = rec.window.lock().unwrap();
                    w.0 = Some(w.0.map_or(started, |a| a.min(started)));
                    let end = std::time::Instant::now();
                    w.1 = Some(w.1.map_or(end, |b| b.max(end)));
                }
                if !p.probe {
                    rec.applied.fetch_add(1, Ordering::Relaxed);
                }
                let _ = rec
                    .handler_us
                    .lock()
                    .unwrap()
                    .record((started.elapsed().as_micros() as u64).max(1));
                rec.returned
                    .lock()
                    .unwrap()
                    .insert(d.id().to_owned(), std::time::Instant::now());
                Ok(())
            }
        };
        let join = tokio::spawn(subscription.run(handler, async move {
            let _ = stopped.await;
        }));
        Running { stats, stop, join }
    }
}

/// The builder every run uses.
pub(crate) fn builder(client: &Client, category: &str, ordered: bool, concurrency: usize) -> SubscriptionBuilder {
    let b = client
        .subscribe(category, GROUP)
        .concurrency(concurrency)
        .budget(concurrency * 16);
    if ordered {
        b.ordered_by(KeySource::routing_key())
    } else {
        b
    }
}

/// Publishes `per_key` messages to each key from `producers` tasks (each
/// task owns a subset of the keys, so per-key publish order holds).
pub(crate) async fn produce(
    clients: &[Client],
    category: &str,
    keys: &[String],
    total: u64,
    sleep_ms: impl Fn() -> u64 + Send + Sync + Clone + 'static,
    producers: usize,
    progress: Option<indicatif::ProgressBar>,
) -> anyhow::Result<Vec<Published>> {
    let producers = producers.clamp(1, keys.len().max(1));
    let n_keys = keys.len() as u64;
    let mut tasks = Vec::new();
    for p in 0..producers {
        let client = clients[p % clients.len()].clone();
        let category = category.to_owned();
        // Message i goes to key i % K; this task owns keys p, p + P, ...
        let mine: Vec<(String, u64)> = keys
            .iter()
            .enumerate()
            .skip(p)
            .step_by(producers)
            .map(|(k, key)| (key.clone(), total / n_keys + u64::from((k as u64) < total % n_keys)))
            .collect();
        let sleep_ms = sleep_ms.clone();
        let progress = progress.clone();
        tasks.push(tokio::spawn(async move {
            let publisher = client.publisher(&category).await?;
            let mut out = Vec::new();
            let rounds = mine.iter().map(|(_, n)| *n).max().unwrap_or(0);
            for seq in 0..rounds {
                for (key, n) in &mine {
                    if seq >= *n {
                        continue;
                    }
                    let msg = Message::new(payload(seq, sleep_ms(), false)).with_key(key)?;
                    out.push(Published {
                        id: msg.id().to_owned(),
                        key: key.clone(),
                        seq,
                    });
                    publisher.publish(msg).await?;
                    // Interleave with the other producers even where a publish
                    // completes without waiting (memory://).
                    tokio::task::yield_now().await;
                    if let Some(pb) = &progress {
                        pb.inc(1);
                    }
                }
            }
            anyhow::Ok(out)
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await??);
    }
    Ok(all)
}

/// Polls `cond` every 50 ms until it holds or `deadline` passes.
pub(crate) async fn wait_for(what: &str, deadline: Duration, cond: impl Fn() -> bool) -> anyhow::Result<()> {
    let until = tokio::time::Instant::now() + deadline;
    while !cond() {
        if tokio::time::Instant::now() > until {
            anyhow::bail!("timed out after {deadline:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

/// Polls an async `cond` every 50 ms until it holds or `deadline` passes.
pub(crate) async fn wait_for_async<F, Fut>(what: &str, deadline: Duration, cond: F) -> anyhow::Result<()>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let until = tokio::time::Instant::now() + deadline;
    while !cond().await {
        if tokio::time::Instant::now() > until {
            anyhow::bail!("timed out after {deadline:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::baseline_url;

    // The adapters declare the baselines (`keyorder::bench_hints`).
    #[cfg(feature = "all-adapters")]
    #[test]
    fn the_baseline_of_postgres_is_the_plain_layout() {
        assert_eq!(
            baseline_url("postgres://postgres@127.0.0.1:5432/test", 2),
            "postgres://postgres@127.0.0.1:5432/test?layout=plain"
        );
        assert_eq!(
            baseline_url("postgresql://h/db?migrate=true", 2),
            "postgresql://h/db?migrate=true&layout=plain"
        );
        // An explicit layout is the caller's choice.
        assert_eq!(
            baseline_url("postgres://h/db?layout=slots", 2),
            "postgres://h/db?layout=slots"
        );
        assert_eq!(
            baseline_url("redis://127.0.0.1:6379", 2),
            "redis://127.0.0.1:6379/?layout=single"
        );
        assert_eq!(baseline_url("memory://", 2), "memory://");
    }

    #[cfg(feature = "all-adapters")]
    #[test]
    fn the_rabbitmq_baseline_shares_the_ordered_total_prefetch() {
        // 8 hash queues x 32 over 2 instances: 128 each.
        assert_eq!(
            baseline_url("amqp://h/%2f?topology=hash&queues=8&consumer_timeout_ms=off", 2),
            "amqp://h/%2f?consumer_timeout_ms=off&groups=keyorder&topology=plain&prefetch=128"
        );
        // The default topology of bench is hash with 8 queues.
        assert_eq!(
            baseline_url("amqp://h/%2f", 4),
            "amqp://h/%2f?groups=keyorder&topology=plain&prefetch=64"
        );
        // One single-active-consumer queue at prefetch 20 over 2 instances.
        assert_eq!(
            baseline_url("amqp://h/%2f?topology=sac&prefetch=20", 2),
            "amqp://h/%2f?groups=keyorder&topology=plain&prefetch=10"
        );
        // A queue count without a topology is kept (it was doubled).
        assert_eq!(
            baseline_url("amqp://h/%2f?queues=16", 2),
            "amqp://h/%2f?groups=keyorder&topology=plain&prefetch=256"
        );
    }
}
