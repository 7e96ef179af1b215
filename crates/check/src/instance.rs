//! Running instances in a scenario: the logging handler, publishing helpers,
//! and polling with a deadline.

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use keyorder_core::{
    Client, Delivery, Handler, HandlerError, HandlerResult, Health, Message, Result, RunReport, Stats,
    SubscriptionBuilder,
};
use tokio::sync::{oneshot, Barrier};
use tokio::task::JoinHandle;

use crate::checker::Published;
use crate::eventlog::{EventLog, EventStart};

/// What a scenario's test message asks the handler to do (its JSON payload).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Payload {
    /// The key (also the routing key, for checking).
    pub key: String,
    /// The per-key sequence.
    pub seq: u64,
    /// Sleep this long inside the handler.
    pub sleep_ms: u64,
    /// Fail (a retryable error) while the scenario's "broken" flag is set.
    pub poison: bool,
}

impl Payload {
    /// Encodes to the JSON payload bytes.
    pub fn encode(&self) -> Vec<u8> {
        serde_json::json!({"key": self.key, "seq": self.seq, "sleep_ms": self.sleep_ms, "poison": self.poison})
            .to_string()
            .into_bytes()
    }
    /// Decodes from a delivery's payload (`None` if it is not one of ours).
    pub fn decode(bytes: &[u8]) -> Option<Payload> {
        let v: serde_json::Value = serde_json::from_slice(bytes).ok()?;
        Some(Payload {
            key: v.get("key")?.as_str()?.to_owned(),
            seq: v.get("seq")?.as_u64()?,
            sleep_ms: v.get("sleep_ms").and_then(|s| s.as_u64()).unwrap_or(0),
            poison: v.get("poison").and_then(|s| s.as_bool()).unwrap_or(false),
        })
    }
}

/// Shared switches a scenario flips while handlers run.
#[derive(Debug, Default)]
pub struct Switches {
    /// While set, messages with `poison: true` fail as poison.
    pub broken: AtomicBool,
    /// When set, every handler first waits on this barrier.
    pub barrier: std::sync::Mutex<Option<Arc<Barrier>>>,
    /// When set, a handler waits on the barrier at most this long, then
    /// goes on and counts the miss in `barrier_missed`.
    pub barrier_timeout: std::sync::Mutex<Option<Duration>>,
    /// Handlers that gave up waiting on the barrier.
    pub barrier_missed: AtomicUsize,
    /// `(seq, d)`: the first message whose sequence is at least `seq` sleeps
    /// `d` inside the handler, once (a place to kill or stop the process).
    pub hold: std::sync::Mutex<Option<(u64, Duration)>>,
    /// While set, a message with `poison: true` kills its own process
    /// (`SIGKILL`, no core dump, nothing flushed) once its start is logged.
    pub crash: AtomicBool,
}

/// The handler every scenario uses: logs start and end to the event log,
/// sleeps as asked, fails poison messages while broken.
pub fn logging_handler(
    log: Arc<dyn EventLog>,
    instance: String,
    switches: Arc<Switches>,
) -> impl Fn(Delivery) -> std::pin::Pin<Box<dyn Future<Output = HandlerResult> + Send>> + Send + Sync + 'static {
    move |d: Delivery| {
        let log = log.clone();
        let instance = instance.clone();
        let switches = switches.clone();
        Box::pin(async move {
            let p = Payload::decode(d.payload()).unwrap_or_default();
            let key = d.key().map_or_else(String::new, |k| k.as_str().to_owned());
            let id = log
                .start(EventStart {
                    message_id: d.id().to_owned(),
                    key,
                    seq: p.seq,
                    instance,
                    generation: d.fencing_token(),
                })
                .await
                .map_err(HandlerError::retry)?;
            if p.poison && switches.crash.load(Ordering::SeqCst) {
                let _ = std::process::Command::new("kill")
                    .args(["-KILL", &std::process::id().to_string()])
                    .status();
                // Not reached: the signal is delivered before `kill` returns.
                std::process::abort();
            }
            let barrier = switches.barrier.lock().unwrap().clone();
            if let Some(barrier) = barrier {
                let limit = *switches.barrier_timeout.lock().unwrap();
                match limit {
                    Some(d) => {
                        if tokio::time::timeout(d, barrier.wait()).await.is_err() {
                            switches.barrier_missed.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                    None => {
                        barrier.wait().await;
                    }
                }
            }
            let hold = {
                let mut hold = switches.hold.lock().unwrap();
                match *hold {
                    Some((from, d)) if p.seq >= from => {
                        *hold = None;
                        Some(d)
                    }
                    _ => None,
                }
            };
            if let Some(d) = hold {
                tokio::time::sleep(d).await;
            }
            if p.sleep_ms > 0 {
                tokio::time::sleep(Duration::from_millis(p.sleep_ms)).await;
            }
            let fail = p.poison && switches.broken.load(Ordering::SeqCst);
            log.end(id, !fail).await.map_err(HandlerError::retry)?;
            if fail {
                return Err(HandlerError::retry("poison message (scenario)"));
            }
            Ok(())
        })
    }
}

/// A running instance.
#[derive(Debug)]
pub struct Instance {
    /// The instance id.
    pub id: String,
    /// Its live counters.
    pub stats: Arc<Stats>,
    /// Its health, as a probe reads it.
    pub health: Health,
    stop: Option<oneshot::Sender<()>>,
    join: JoinHandle<Result<RunReport>>,
}

impl Instance {
    /// Builds the subscription with `builder` and runs it with the logging handler.
    pub async fn start(
        builder: SubscriptionBuilder,
        id: &str,
        log: Arc<dyn EventLog>,
        switches: Arc<Switches>,
    ) -> Result<Instance> {
        Self::start_with(builder, id, logging_handler(log, id.to_owned(), switches)).await
    }

    /// As [`Instance::start`], under the subscription instance id
    /// `instance_id` and logged as `id` (a restarted process keeps its
    /// instance id; the log tells the incarnations apart).
    pub async fn start_as(
        builder: SubscriptionBuilder,
        instance_id: &str,
        id: &str,
        log: Arc<dyn EventLog>,
        switches: Arc<Switches>,
    ) -> Result<Instance> {
        Self::run_built(
            builder.instance_id(instance_id),
            id,
            logging_handler(log, id.to_owned(), switches),
        )
        .await
    }

    /// Builds the subscription with `builder` and runs it with `handler`.
    pub async fn start_with<H: Handler>(builder: SubscriptionBuilder, id: &str, handler: H) -> Result<Instance> {
        Self::run_built(builder.instance_id(id), id, handler).await
    }

    async fn run_built<H: Handler>(builder: SubscriptionBuilder, id: &str, handler: H) -> Result<Instance> {
        let subscription = builder.build().await?;
        let stats = subscription.stats();
        let health = subscription.health();
        let (stop, stopped) = oneshot::channel::<()>();
        let join = tokio::spawn(subscription.run(handler, async move {
            let _ = stopped.await;
        }));
        Ok(Instance {
            id: id.to_owned(),
            stats,
            health,
            stop: Some(stop),
            join,
        })
    }

    /// Graceful shutdown; returns the run's report.
    pub async fn stop(mut self) -> std::result::Result<RunReport, String> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        match tokio::time::timeout(Duration::from_secs(60), &mut self.join).await {
            Ok(Ok(Ok(report))) => Ok(report),
            Ok(Ok(Err(e))) => Err(format!("instance {} failed: {e}", self.id)),
            Ok(Err(e)) => Err(format!("instance {} panicked: {e}", self.id)),
            Err(_) => Err(format!("instance {} did not drain within 60 s", self.id)),
        }
    }

    /// Whether the run ended (it should not have before `stop`).
    pub fn is_finished(&self) -> bool {
        self.join.is_finished()
    }
}

/// Publishes `per_key` messages for each of `keys`, interleaved round-robin,
/// each awaited before the next; returns what was acknowledged.
pub async fn publish_keys(
    client: &Client,
    category: &str,
    keys: &[String],
    per_key: u64,
    sleep_ms: u64,
) -> Result<Vec<Published>> {
    publish_range(client, category, keys, 0..per_key, sleep_ms).await
}

/// Like [`publish_keys`], with the per-key sequences `seqs`.
pub async fn publish_range(
    client: &Client,
    category: &str,
    keys: &[String],
    seqs: std::ops::Range<u64>,
    sleep_ms: u64,
) -> Result<Vec<Published>> {
    let publisher = client.publisher(category).await?;
    let mut out = Vec::new();
    for seq in seqs {
        for key in keys {
            let payload = Payload {
                key: key.clone(),
                seq,
                sleep_ms,
                poison: false,
            };
            let msg = Message::new(payload.encode()).with_key(key)?;
            let id = msg.id().to_owned();
            publisher.publish(msg).await?;
            out.push(Published {
                id,
                key: key.clone(),
                seq,
            });
        }
    }
    Ok(out)
}

/// Publishes one round of `keys` (sequence `from`, then `from + 1`, ...,
/// handlers sleeping `sleep_ms`) every `every` until `stop` is set, at most
/// 4 minutes so a hung scenario stays bounded; returns what was
/// acknowledged.
pub fn publish_stream(
    client: Client,
    category: String,
    keys: Vec<String>,
    from: u64,
    sleep_ms: u64,
    every: Duration,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> JoinHandle<Result<Vec<Published>>> {
    tokio::spawn(async move {
        let mut all = Vec::new();
        let mut seq = from;
        let started = tokio::time::Instant::now();
        while !*stop.borrow_and_update() && started.elapsed() < Duration::from_secs(240) {
            all.extend(publish_range(&client, &category, &keys, seq..seq + 1, sleep_ms).await?);
            seq += 1;
            tokio::time::sleep(every).await;
        }
        Ok(all)
    })
}

/// `n` distinct test keys with a prefix.
pub fn keys(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}-{i}")).collect()
}

/// What a condition polled by [`wait_until`] answers: whether it holds
/// yet and, once it does, the value the wait returns.
///
/// `bool` holds when `true` (the wait returns `()`); `Option<T>` holds when
/// `Some(value)` (the wait returns `value`); `Result<T, String>` holds when
/// `Ok(value)`, and while it answers `Err(progress)` the last `progress`
/// (say "3 of 5 messages ran") is appended to the timeout's message.
pub trait Ready {
    /// What the wait returns once the condition holds.
    type Value;
    /// `Ok(value)` once the condition holds; `Err(progress)` while not,
    /// with what the timeout message should add (empty: nothing).
    fn ready(self) -> std::result::Result<Self::Value, String>;
}

impl Ready for bool {
    type Value = ();
    fn ready(self) -> std::result::Result<(), String> {
        if self {
            Ok(())
        } else {
            Err(String::new())
        }
    }
}

impl<T> Ready for Option<T> {
    type Value = T;
    fn ready(self) -> std::result::Result<T, String> {
        self.ok_or_else(String::new)
    }
}

impl<T> Ready for std::result::Result<T, String> {
    type Value = T;
    fn ready(self) -> std::result::Result<T, String> {
        self
    }
}

/// Polls `cond` every 20 ms until it holds (see [`Ready`]) or `deadline`
/// passes: the value the condition yielded, or the timeout's message
/// (naming `what` and the condition's last progress).
pub async fn wait_until<O: Ready>(
    what: &str,
    deadline: Duration,
    mut cond: impl AsyncFnMut() -> O,
) -> std::result::Result<O::Value, String> {
    let until = tokio::time::Instant::now() + deadline;
    loop {
        let progress = match cond().await.ready() {
            Ok(value) => return Ok(value),
            Err(progress) => progress,
        };
        if tokio::time::Instant::now() >= until {
            return Err(if progress.is_empty() {
                format!("timed out after {deadline:?} waiting for {what}")
            } else {
                format!("timed out after {deadline:?} waiting for {what} ({progress})")
            });
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
