//! One HTTP endpoint for operating keyorder (feature `ops`): Prometheus
//! metrics at `/metrics`, and the health of every subscription registered
//! with it at `/livez`, `/readyz` and `/healthz`.
//!
//! ```no_run
//! # async fn demo() -> keyorder::Result<()> {
//! use keyorder::KeySource;
//! let endpoint = keyorder::ops::serve("127.0.0.1:9000").await?;
//! let client = keyorder::connect("memory://").await?;
//! let subscription = client
//!     .subscribe("orders", "billing")
//!     .ordered_by(KeySource::routing_key())
//!     .build()
//!     .await?;
//! endpoint.register(&subscription, client.admin());
//! // subscription.run(handler, shutdown).await?;
//! # Ok(()) }
//! ```
//!
//! - `/metrics`: every `keyorder_*` series (docs/OPERATING.md lists them),
//!   in the Prometheus text format. The endpoint installs the process's
//!   `metrics` recorder (once per process; [`serve`] refuses when another
//!   recorder is installed, and names the fix).
//! - `/livez`: 200 while every registered subscription is live, 503 with
//!   the reasons otherwise; `/readyz` the same for ready; `/healthz` one
//!   line per subscription (`category group instance status reasons`),
//!   always 200. A halted key degrades a subscription: live and ready stay
//!   200 (see [`keyorder_core::health`]).
//!
//! For every registered subscription the endpoint also polls the broker
//! ([`Admin::scopes`]) every few seconds and sets the gauges
//! `keyorder_lag{category,group}` (all scopes),
//! `keyorder_scope_lag{category,group,scope}`,
//! `keyorder_scope_halted_keys{category,group,scope}`,
//! `keyorder_scopes_owned{category,group}` (scopes this process's instance
//! owns) and `keyorder_scopes_unowned{category,group}`, plus
//! `keyorder_health_{live,ready,degraded}{category,group}` (0 or 1). Labels
//! name categories, groups and scopes, never a key; per-scope series are
//! kept for at most [`MAX_SCOPE_SERIES`] scopes of a subscription (halted
//! first, then by lag), since on Redis a scope is a key's stream.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http_body_util::Full;
use hyper::body::Bytes;
use hyper::{Request, Response, StatusCode};
use keyorder_core::{Admin, Error, Health, Result, Subscription};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// Histogram buckets of the `*_seconds` series: 0.5 ms to 10 s.
const BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// How often the broker is asked for each registered subscription's scopes.
pub const POLL: Duration = Duration::from_secs(5);

static RECORDER: Mutex<Option<PrometheusHandle>> = Mutex::new(None);

/// The process's Prometheus recorder: installed on first use (under the
/// lock, so that two endpoints starting at once install one).
fn recorder() -> Result<PrometheusHandle> {
    let mut installed = RECORDER.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(handle) = installed.as_ref() {
        return Ok(handle.clone());
    }
    let recorder = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), BUCKETS)
        .map_err(|e| Error::Config(format!("metrics buckets: {e}")))?
        .build_recorder();
    let handle = recorder.handle();
    metrics::set_global_recorder(recorder).map_err(|_| {
        Error::Config(
            "a metrics recorder is already installed in this process: keyorder::ops::serve installs its own \
             Prometheus recorder; serve its `/metrics` from yours instead (keyorder's series are plain `metrics` \
             facade series) or call keyorder::ops::serve before installing any other"
                .into(),
        )
    })?;
    *installed = Some(handle.clone());
    describe();
    Ok(handle)
}

/// Help text for every series (Prometheus `# HELP`).
fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_counter!(
        "keyorder_applied_total",
        "Deliveries applied (handler Ok and acknowledged)"
    );
    describe_counter!("keyorder_received_total", "Deliveries handed to the dispatcher");
    describe_gauge!(
        "keyorder_halted_keys",
        "Keys halted at a poison head in this process right now"
    );
    describe_histogram!(
        "keyorder_handler_seconds",
        Unit::Seconds,
        "Handler run time, per attempt (category, group)"
    );
    describe_histogram!(
        "keyorder_settle_seconds",
        Unit::Seconds,
        "From a handler's return to its acknowledgement reported durable (category, group)"
    );
    describe_gauge!(
        "keyorder_scope_lag",
        "Messages of a scope not yet acknowledged, as the broker reports them"
    );
    describe_gauge!(
        "keyorder_scope_halted_keys",
        "Halted keys of a scope, as the broker reports them"
    );
    describe_gauge!("keyorder_scopes_owned", "Scopes this process's instance owns");
    describe_gauge!("keyorder_scopes_unowned", "Scopes no instance owns right now");
    describe_gauge!("keyorder_health_live", "1 while the subscription's loop is turning");
    describe_gauge!(
        "keyorder_health_ready",
        "1 while the subscription is running and connected"
    );
    describe_gauge!(
        "keyorder_health_degraded",
        "1 while keys are halted or the subscription backs off"
    );
}

/// One registered subscription.
#[derive(Clone)]
struct Watched {
    category: String,
    group: String,
    instance: String,
    health: Health,
    admin: Arc<dyn Admin>,
}

/// The running endpoint; dropping it stops it.
pub struct Endpoint {
    addr: SocketAddr,
    handle: PrometheusHandle,
    watched: Arc<Mutex<Vec<Watched>>>,
    tasks: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint").field("addr", &self.addr).finish()
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// Installs the Prometheus recorder (once per process) and serves the
/// endpoint on `addr` (`127.0.0.1:0` picks a free port: see
/// [`Endpoint::local_addr`]).
///
/// # Errors
/// [`Error::Config`] when `addr` cannot be bound (the message names it) or
/// another `metrics` recorder is installed.
pub async fn serve(addr: &str) -> Result<Endpoint> {
    let handle = recorder()?;
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|e| Error::Config(format!("ops endpoint: cannot listen on {addr}: {e}")))?;
    let local = listener
        .local_addr()
        .map_err(|e| Error::Config(format!("ops endpoint: {e}")))?;
    let watched: Arc<Mutex<Vec<Watched>>> = Arc::default();
    let server = tokio::spawn(accept(listener, handle.clone(), watched.clone()));
    let poller = tokio::spawn(poll(watched.clone()));
    tracing::info!(addr = %local, "ops endpoint: /metrics /livez /readyz /healthz");
    Ok(Endpoint {
        addr: local,
        handle,
        watched,
        tasks: vec![server, poller],
    })
}

impl Endpoint {
    /// Where it listens.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The metrics as `/metrics` serves them.
    pub fn render(&self) -> String {
        self.handle.render()
    }

    /// Reports `subscription`'s health on the probes and its scopes' lag and
    /// ownership as gauges (read through `admin`, usually `client.admin()`).
    /// Register before `run` consumes the subscription; a subscription whose
    /// run has ended reports `dead` until the process exits.
    pub fn register(&self, subscription: &Subscription, admin: Arc<dyn Admin>) {
        let watched = Watched {
            category: subscription.category().to_owned(),
            group: subscription.group().to_owned(),
            instance: subscription.instance_id().to_owned(),
            health: subscription.health(),
            admin,
        };
        self.watched.lock().unwrap_or_else(|e| e.into_inner()).push(watched);
    }

    /// Stops reporting the subscriptions registered for `category` and
    /// `group` (every instance): for a process that ends one subscription
    /// by design and goes on, whose probes would otherwise say `dead`.
    /// Their gauges keep their last values.
    pub fn unregister(&self, category: &str, group: &str) {
        self.watched
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|w| w.category != category || w.group != group);
    }
}

/// Connections served at once; more wait in the listener's backlog.
const MAX_CONNECTIONS: usize = 32;
/// How long a client may take to send its request head.
const HEAD_TIMEOUT: Duration = Duration::from_secs(10);

async fn accept(listener: TcpListener, handle: PrometheusHandle, watched: Arc<Mutex<Vec<Watched>>>) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    loop {
        // A slow or idle client holds one of a bounded number of places,
        // and for at most the head timeout (one request per connection).
        let Ok(place) = slots.clone().acquire_owned().await else {
            return;
        };
        let (stream, _) = match listener.accept().await {
            Ok(conn) => conn,
            Err(e) => {
                tracing::warn!(error = %e, "ops endpoint: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let handle = handle.clone();
        let watched = watched.clone();
        tokio::spawn(async move {
            let _place = place;
            let service = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                let response = respond(req.uri().path(), &handle, &watched);
                async move { Ok::<_, Infallible>(response) }
            });
            let io = hyper_util::rt::TokioIo::new(stream);
            let serving = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(HEAD_TIMEOUT)
                .keep_alive(false)
                .serve_connection(io, service);
            // The whole exchange is bounded too: a client that reads the
            // answer slowly does not keep its place.
            match tokio::time::timeout(HEAD_TIMEOUT * 3, serving).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::debug!(error = %e, "ops endpoint: connection ended"),
                Err(_) => tracing::debug!("ops endpoint: a connection took too long; closed"),
            }
        });
    }
}

fn respond(path: &str, handle: &PrometheusHandle, watched: &Mutex<Vec<Watched>>) -> Response<Full<Bytes>> {
    let text = |status: StatusCode, body: String, kind: &'static str| {
        let mut response = Response::new(Full::new(Bytes::from(body)));
        *response.status_mut() = status;
        if let Ok(v) = hyper::header::HeaderValue::from_str(kind) {
            response.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
        }
        response
    };
    let plain = "text/plain; charset=utf-8";
    let watched = watched.lock().unwrap_or_else(|e| e.into_inner()).clone();
    match path {
        "/metrics" => {
            publish_health(&watched);
            text(
                StatusCode::OK,
                handle.render(),
                "text/plain; version=0.0.4; charset=utf-8",
            )
        }
        "/livez" | "/readyz" => {
            let ready = path == "/readyz";
            let mut failing = Vec::new();
            for w in &watched {
                let report = w.health.check();
                if !(if ready { report.ready } else { report.live }) {
                    failing.push(format!("{} {}: {}", w.category, w.group, report.reasons.join("; ")));
                }
            }
            if failing.is_empty() {
                text(StatusCode::OK, "ok\n".into(), plain)
            } else {
                text(StatusCode::SERVICE_UNAVAILABLE, failing.join("\n") + "\n", plain)
            }
        }
        "/healthz" => {
            let mut body = String::new();
            for w in &watched {
                let report = w.health.check();
                body.push_str(&format!(
                    "{} {} {} {} {}\n",
                    w.category,
                    w.group,
                    w.instance,
                    report.status().replace(' ', "-"),
                    report.reasons.join("; ")
                ));
            }
            text(StatusCode::OK, body, plain)
        }
        _ => text(
            StatusCode::NOT_FOUND,
            "not found: /metrics, /livez, /readyz or /healthz\n".into(),
            plain,
        ),
    }
}

/// Health as gauges, set just before a scrape renders them.
fn publish_health(watched: &[Watched]) {
    for w in watched {
        let report = w.health.check();
        let labels = [("category", w.category.clone()), ("group", w.group.clone())];
        metrics::gauge!("keyorder_health_live", &labels).set(f64::from(u8::from(report.live)));
        metrics::gauge!("keyorder_health_ready", &labels).set(f64::from(u8::from(report.ready)));
        metrics::gauge!("keyorder_health_degraded", &labels).set(f64::from(u8::from(report.degraded)));
    }
}

/// Per-scope series kept per subscription at most: on a layout with a
/// scope per key (Redis) the rest would grow with the keys. The scopes
/// with halted keys come first, then the largest lag; a scope that drops
/// out is set to 0 once.
pub const MAX_SCOPE_SERIES: usize = 64;

/// How long one `Admin::scopes` call may take before the poller moves on.
const POLL_TIMEOUT: Duration = Duration::from_secs(10);

/// Asks the broker for every registered subscription's scopes, every
/// [`POLL`].
async fn poll(watched: Arc<Mutex<Vec<Watched>>>) {
    // The scope series each subscription (category, group) has now.
    let mut shown: std::collections::HashMap<(String, String), std::collections::HashSet<String>> =
        std::collections::HashMap::new();
    loop {
        let list = watched.lock().unwrap_or_else(|e| e.into_inner()).clone();
        for w in &list {
            if !w.health.check().live {
                continue;
            }
            let labels = [("category", w.category.clone()), ("group", w.group.clone())];
            let read = tokio::time::timeout(POLL_TIMEOUT, w.admin.scopes(&w.category, &w.group)).await;
            // 0 while the broker does not answer: the scope gauges then
            // hold the last values read, and say so.
            metrics::gauge!("keyorder_scopes_read", &labels).set(f64::from(u8::from(matches!(read, Ok(Ok(_))))));
            let scopes = match read {
                Ok(Ok(scopes)) => scopes,
                Ok(Err(e)) => {
                    tracing::debug!(error = %e, category = %w.category, "ops endpoint: scopes not read");
                    continue;
                }
                Err(_) => {
                    tracing::debug!(category = %w.category, "ops endpoint: scopes not read in time");
                    continue;
                }
            };
            let owned = scopes
                .iter()
                .filter(|s| s.owner.as_deref() == Some(&w.instance))
                .count();
            let unowned = scopes.iter().filter(|s| s.owner.is_none()).count();
            metrics::gauge!("keyorder_scopes_owned", &labels).set(owned as f64);
            metrics::gauge!("keyorder_scopes_unowned", &labels).set(unowned as f64);
            metrics::gauge!("keyorder_lag", &labels).set(scopes.iter().map(|s| s.lag).sum::<u64>() as f64);
            let mut ranked: Vec<&keyorder_core::ScopeInfo> = scopes.iter().collect();
            ranked.sort_by(|a, b| b.halted.cmp(&a.halted).then(b.lag.cmp(&a.lag)));
            ranked.truncate(MAX_SCOPE_SERIES);
            let scope_labels = |scope: &str| {
                [
                    ("category", w.category.clone()),
                    ("group", w.group.clone()),
                    ("scope", scope.to_owned()),
                ]
            };
            let now: std::collections::HashSet<String> = ranked.iter().map(|s| s.scope.clone()).collect();
            let before = shown.entry((w.category.clone(), w.group.clone())).or_default();
            for gone in before.difference(&now) {
                metrics::gauge!("keyorder_scope_lag", &scope_labels(gone)).set(0.0);
                metrics::gauge!("keyorder_scope_halted_keys", &scope_labels(gone)).set(0.0);
            }
            for s in ranked {
                metrics::gauge!("keyorder_scope_lag", &scope_labels(&s.scope)).set(s.lag as f64);
                metrics::gauge!("keyorder_scope_halted_keys", &scope_labels(&s.scope)).set(s.halted as f64);
            }
            *before = now;
        }
        tokio::time::sleep(POLL).await;
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    /// The `keyorder_*` series a text names (histogram suffixes dropped).
    fn series(text: &str) -> BTreeSet<String> {
        let mut out = BTreeSet::new();
        let mut rest = text;
        while let Some(at) = rest.find("keyorder_") {
            let tail = &rest[at..];
            let end = tail
                .find(|c: char| !(c.is_ascii_lowercase() || c == '_'))
                .unwrap_or(tail.len());
            let name = &tail[..end];
            let name = ["_bucket", "_count", "_sum"]
                .iter()
                .find_map(|s| name.strip_suffix(s))
                .unwrap_or(name);
            out.insert(name.to_owned());
            rest = &tail[end..];
        }
        out
    }

    #[test]
    fn the_dashboard_names_only_documented_series() {
        let dashboard = include_str!("../docs/grafana/keyorder.json");
        let doc = include_str!("../docs/OPERATING.md");
        let _: serde_json::Value = serde_json::from_str(dashboard).expect("the dashboard is JSON");
        let documented = series(doc);
        let used = series(dashboard);
        assert!(used.len() >= 10, "{used:?}");
        let missing: Vec<_> = used.difference(&documented).collect();
        assert!(
            missing.is_empty(),
            "the dashboard names undocumented series: {missing:?}"
        );
    }
}
