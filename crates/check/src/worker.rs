//! Instances as separate OS processes, for the scenarios where only a real
//! process makes a kill or a stall real (C6, C7).
//!
//! The conformance runner re-executes itself: its `main` first calls
//! [`run_if_worker`], which, when the process was spawned as a worker, runs
//! one ordered subscription whose handler writes to the shared
//! [`PgEventLog`] and exits. The test side holds a
//! [`WorkerProcess`] and can `kill -9`, `SIGSTOP` and `SIGCONT` it.

use std::future::Future;
use std::pin::Pin;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use keyorder_core::{Client, KeySource, LeaseConfig, Result, StatsSnapshot};
use serde::{Deserialize, Serialize};
use tokio::io::AsyncBufReadExt;
use tokio::process::{Child, Command};

use crate::eventlog::EventLog;
use crate::instance::{logging_handler, Switches};
use crate::pglog::PgEventLog;

/// The environment variable that carries a worker's configuration (JSON).
pub const WORKER_ENV: &str = "KEYORDER_TESTKIT_WORKER";

/// The stdout line (followed by a message id) a worker prints once it holds
/// a message where the test asked it to.
pub const HOLDING_LINE: &str = "KEYORDER_WORKER_HOLDING ";

/// The stdout line (followed by `ok`, `fenced` or `error: ...`) a relay
/// worker prints once its held publish returned.
pub const RELEASED_LINE: &str = "KEYORDER_WORKER_RELEASED ";

/// How a worker process is started beyond its configuration: extra
/// environment (a faked clock: `LD_PRELOAD` of libfaketime and `FAKETIME`)
/// and host names it alone resolves to other addresses (a broker's
/// advertised listener to a fault proxy; needs `unshare` and root).
#[derive(Debug, Clone, Default)]
pub struct Launch {
    /// Extra environment variables.
    pub env: Vec<(String, String)>,
    /// `(host name, IP)` pairs of the worker's private `/etc/hosts`.
    pub hosts: Vec<(String, std::net::IpAddr)>,
}

/// What a worker process runs.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WorkerConfig {
    /// The transport URL.
    pub url: String,
    /// The category.
    pub category: String,
    /// The consumer group.
    pub group: String,
    /// The instance id.
    pub instance: String,
    /// The event log's PostgreSQL URL.
    pub log_url: String,
    /// The event log's run id.
    pub run: String,
    /// The first message whose sequence is at least this one is held inside
    /// the handler for `hold_ms` (once), so the test can kill or stop the
    /// process there.
    pub hold_from_seq: Option<u64>,
    /// How long the held handler sleeps.
    pub hold_ms: u64,
    /// Handlers running at once.
    pub concurrency: usize,
    /// Lease TTL, heartbeat and margin in ms.
    pub lease_ms: (u64, u64, u64),
    /// A poison message (`Payload::poison`) kills the process (`SIGKILL`
    /// to itself) on every attempt, after its start is logged (C22).
    #[serde(default)]
    pub crash_on_poison: bool,
    /// The poison policy: `None` the default (`Halt`), `Some(n)` parks
    /// after `n` attempts.
    #[serde(default)]
    pub park_after: Option<u32>,
    /// Attempts before `Halt` applies (`RetryPolicy::max_attempts`).
    #[serde(default)]
    pub max_attempts: Option<u32>,
}

/// Connects a client from a URL (the runner passes `keyorder::connect`).
pub type Connector = fn(String) -> Pin<Box<dyn Future<Output = Result<Client>> + Send>>;

/// If this process was spawned as a worker, runs it and exits; otherwise
/// returns at once. Call it first in the runner's `main`.
pub fn run_if_worker(connect: Connector) {
    run_from_env(WORKER_ENV, "worker", |cfg: WorkerConfig| async move {
        worker_main(cfg, connect).await.map(|s| stats_json(&s))
    });
}

/// If the environment variable `env` holds a configuration, runs `main`
/// with it on a 2-thread runtime, prints its final counters as
/// `KEYORDER_WORKER_STATS <json>` and exits (1 when `main` failed, 2 on a
/// bad configuration); otherwise returns at once.
pub fn run_from_env<C, F, Fut>(env: &str, what: &str, main: F)
where
    C: serde::de::DeserializeOwned,
    F: FnOnce(C) -> Fut,
    Fut: Future<Output = Result<serde_json::Value>>,
{
    let Ok(raw) = std::env::var(env) else { return };
    // `KEYORDER_LOG` (an `EnvFilter`, e.g. `keyorder_rabbitmq=debug`) logs
    // the worker to stderr, which the test process passes through.
    if let Ok(filter) = tracing_subscriber::EnvFilter::try_from_env("KEYORDER_LOG") {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .try_init();
    }
    let code = match serde_json::from_str::<C>(&raw) {
        Ok(cfg) => {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("a tokio runtime");
            match rt.block_on(main(cfg)) {
                Ok(stats) => {
                    println!("KEYORDER_WORKER_STATS {stats}");
                    0
                }
                Err(e) => {
                    eprintln!("{what} failed: {e}");
                    1
                }
            }
        }
        Err(e) => {
            eprintln!("bad {env}: {e}");
            2
        }
    };
    std::process::exit(code);
}

fn stats_json(s: &StatsSnapshot) -> serde_json::Value {
    serde_json::json!({
        "applied": s.applied,
        "fence_rejections": s.fence_rejections,
        "self_fence_pauses": s.self_fence_pauses,
        "self_fence_discards": s.self_fence_discards,
    })
}

async fn worker_main(cfg: WorkerConfig, connect: Connector) -> Result<StatsSnapshot> {
    let client = connect(cfg.url.clone()).await?;
    let log: Arc<dyn EventLog> = Arc::new(PgEventLog::connect(&cfg.log_url, &cfg.run).await?);
    let switches = Arc::new(Switches::default());
    *switches.hold.lock().unwrap() = cfg.hold_from_seq.map(|seq| (seq, Duration::from_millis(cfg.hold_ms)));
    switches
        .crash
        .store(cfg.crash_on_poison, std::sync::atomic::Ordering::SeqCst);
    let (ttl, heartbeat, margin) = cfg.lease_ms;
    let mut builder = client.subscribe(&cfg.category, &cfg.group);
    if let Some(max_attempts) = cfg.max_attempts {
        builder = builder.retry(keyorder_core::RetryPolicy {
            max_attempts,
            initial_backoff: Duration::from_millis(50),
            max_backoff: Duration::from_millis(200),
        });
    }
    if let Some(max_attempts) = cfg.park_after {
        builder = builder.poison(keyorder_core::PoisonPolicy::Park { max_attempts });
    }
    let subscription = builder
        .ordered_by(KeySource::routing_key())
        .instance_id(&cfg.instance)
        .concurrency(cfg.concurrency)
        .lease(LeaseConfig {
            ttl: Duration::from_millis(ttl),
            heartbeat: Duration::from_millis(heartbeat),
            margin: Duration::from_millis(margin),
        })
        .build()
        .await?;
    let handler = logging_handler(log, cfg.instance.clone(), switches);
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| keyorder_core::Error::Config(format!("SIGTERM handler: {e}")))?;
    println!("KEYORDER_WORKER_READY");
    let report = subscription
        .run(handler, async move {
            term.recv().await;
        })
        .await?;
    Ok(report.stats)
}

/// A worker process the test controls.
#[derive(Debug)]
pub struct WorkerProcess {
    /// The instance id.
    pub id: String,
    child: Child,
    pid: u32,
    stopped: AtomicBool,
    stats: tokio::sync::oneshot::Receiver<Option<String>>,
    held: Arc<std::sync::Mutex<Option<String>>>,
    released: Arc<std::sync::Mutex<Option<String>>>,
}

impl WorkerProcess {
    /// Spawns this executable as a worker with `cfg`; returns once the
    /// worker's subscription is built.
    pub async fn spawn(cfg: &WorkerConfig) -> std::result::Result<WorkerProcess, String> {
        Self::spawn_in(cfg, &Launch::default()).await
    }

    /// [`WorkerProcess::spawn`] with `launch`'s environment and host names.
    pub async fn spawn_in(cfg: &WorkerConfig, launch: &Launch) -> std::result::Result<WorkerProcess, String> {
        let json = serde_json::to_string(cfg).map_err(|e| e.to_string())?;
        Self::spawn_launch(WORKER_ENV, json, &cfg.instance, launch).await
    }

    /// Spawns this executable with `json` in the environment variable `env`
    /// (a consumer worker or an outbox relay); returns once the process
    /// printed `KEYORDER_WORKER_READY`.
    pub async fn spawn_with(env: &str, json: String, instance: &str) -> std::result::Result<WorkerProcess, String> {
        Self::spawn_launch(env, json, instance, &Launch::default()).await
    }

    async fn spawn_launch(
        env: &str,
        json: String,
        instance: &str,
        launch: &Launch,
    ) -> std::result::Result<WorkerProcess, String> {
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let mut command = if launch.hosts.is_empty() {
            Command::new(exe)
        } else {
            // A private /etc/hosts in a mount namespace of its own: the
            // worker resolves these names (a broker's advertised listener)
            // to a fault proxy, every other process to the broker itself.
            let file =
                std::env::temp_dir().join(format!("keyorder-hosts-{instance}-{}", uuid::Uuid::new_v4().simple()));
            let mut text = String::new();
            if !launch.hosts.iter().any(|(name, _)| name == "localhost") {
                text.push_str("127.0.0.1 localhost\n");
            }
            for (name, ip) in &launch.hosts {
                text.push_str(&format!("{ip} {name}\n"));
            }
            std::fs::write(&file, text).map_err(|e| format!("writing {}: {e}", file.display()))?;
            let mut c = Command::new("unshare");
            c.args(["--mount", "--propagation", "private", "sh", "-c"])
                .arg(r#"mount --bind "$1" /etc/hosts && shift && exec "$@""#)
                .arg("sh")
                .arg(&file)
                .arg(exe);
            c
        };
        command.envs(launch.env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        let mut child = command
            .env(env, json)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("spawning worker: {e}"))?;
        let pid = child.id().ok_or("worker exited at once")?;
        let stdout = child.stdout.take().ok_or("no worker stdout")?;
        let mut lines = tokio::io::BufReader::new(stdout).lines();
        let ready = tokio::time::timeout(Duration::from_secs(60), async {
            while let Ok(Some(line)) = lines.next_line().await {
                if line == "KEYORDER_WORKER_READY" {
                    return true;
                }
            }
            false
        })
        .await;
        if ready != Ok(true) {
            return Err(format!("worker {instance} did not become ready"));
        }
        // Keep reading stdout in the background (a hold line may come at
        // any time, the stats line comes at exit).
        let (tx, rx) = tokio::sync::oneshot::channel();
        let held = Arc::new(std::sync::Mutex::new(None));
        let held_by_reader = held.clone();
        let released = Arc::new(std::sync::Mutex::new(None));
        let released_by_reader = released.clone();
        tokio::spawn(async move {
            let mut stats = None;
            while let Ok(Some(line)) = lines.next_line().await {
                if let Some(json) = line.strip_prefix("KEYORDER_WORKER_STATS ") {
                    stats = Some(json.to_owned());
                } else if let Some(id) = line.strip_prefix(HOLDING_LINE) {
                    *held_by_reader.lock().unwrap() = Some(id.trim().to_owned());
                } else if let Some(outcome) = line.strip_prefix(RELEASED_LINE) {
                    *released_by_reader.lock().unwrap() = Some(outcome.trim().to_owned());
                }
            }
            let _ = tx.send(stats);
        });
        Ok(WorkerProcess {
            id: instance.to_owned(),
            child,
            pid,
            stopped: AtomicBool::new(false),
            stats: rx,
            held,
            released,
        })
    }

    /// The message id the process said it holds (`KEYORDER_WORKER_HOLDING
    /// <id>` on its stdout), if it said so yet.
    pub fn held(&self) -> Option<String> {
        self.held.lock().unwrap().clone()
    }

    /// How a relay worker's held publish ended (`KEYORDER_WORKER_RELEASED
    /// <outcome>` on its stdout), once it said so.
    pub fn released(&self) -> Option<String> {
        self.released.lock().unwrap().clone()
    }

    /// `SIGUSR1`: an outbox relay worker lets its held publish go on.
    pub fn release(&self) -> std::result::Result<(), String> {
        self.signal("USR1")
    }

    fn signal(&self, sig: &str) -> std::result::Result<(), String> {
        let status = std::process::Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(self.pid.to_string())
            .status()
            .map_err(|e| format!("kill -{sig}: {e}"))?;
        if status.success() {
            Ok(())
        } else {
            Err(format!("kill -{sig} {} failed", self.pid))
        }
    }

    /// Whether the process has exited (by itself or by a signal).
    pub fn exited(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(Some(_)))
    }

    /// `kill -9`.
    pub async fn kill9(mut self) -> std::result::Result<(), String> {
        self.signal("KILL")?;
        let _ = self.child.wait().await;
        Ok(())
    }

    /// `SIGSTOP`: the process stops wherever it is.
    pub fn stop(&self) -> std::result::Result<(), String> {
        self.stopped.store(true, Ordering::SeqCst);
        self.signal("STOP")
    }

    /// `SIGCONT`.
    pub fn cont(&self) -> std::result::Result<(), String> {
        self.stopped.store(false, Ordering::SeqCst);
        self.signal("CONT")
    }

    /// Waits up to `deadline` for the process to exit by itself (an
    /// operator process), then its final counters.
    pub async fn finish(mut self, deadline: Duration) -> std::result::Result<serde_json::Value, String> {
        let status = tokio::time::timeout(deadline, self.child.wait())
            .await
            .map_err(|_| format!("{} did not finish within {deadline:?}", self.id))?
            .map_err(|e| e.to_string())?;
        if !status.success() {
            return Err(format!("{} exited with {status}", self.id));
        }
        let json = self.stats.await.ok().flatten().ok_or("the process printed no stats")?;
        serde_json::from_str(&json).map_err(|e| e.to_string())
    }

    /// `SIGTERM` (graceful: the worker drains), then its final counters.
    pub async fn terminate(mut self) -> std::result::Result<serde_json::Value, String> {
        if self.stopped.load(Ordering::SeqCst) {
            self.cont()?;
        }
        self.signal("TERM")?;
        let status = tokio::time::timeout(Duration::from_secs(60), self.child.wait())
            .await
            .map_err(|_| format!("worker {} did not exit within 60 s of SIGTERM", self.id))?
            .map_err(|e| e.to_string())?;
        if !status.success() {
            return Err(format!("worker {} exited with {status}", self.id));
        }
        let json = self.stats.await.ok().flatten().ok_or("the worker printed no stats")?;
        serde_json::from_str(&json).map_err(|e| e.to_string())
    }
}
