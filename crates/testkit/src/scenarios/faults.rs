//! C19 (connection faults between a worker and its broker, through the
//! fault proxy) and C20 (a worker whose clock is far off among normal ones).

use std::collections::{BTreeMap, HashSet};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use super::ctx::{ensure, err, Ctx, Outcome};
use crate::checker::Expectation;
use crate::eventlog::{Event, EventLog};
use crate::instance::{keys, publish_range, publish_stream, wait_until};
use crate::proxy::FaultProxy;
use crate::FaultRoute;
use keyorder_check::worker::{Launch, WorkerProcess};

/// The loopback address of the `n`th proxy (each proxy of a scenario on an
/// address of its own, so a broker's advertised port can be reused).
fn proxy_ip(n: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(127, 0, 0, 10 + n))
}

/// Starts proxy `n` for `route` and the launch that sends a worker through it.
async fn proxied(route: &FaultRoute, n: u8) -> Result<(FaultProxy, String, Launch), String> {
    let proxy = FaultProxy::start(SocketAddr::new(proxy_ip(n), route.port), route.upstream)
        .await
        .map_err(|e| format!("starting fault proxy {n}: {e}"))?;
    let launch = Launch {
        env: Vec::new(),
        hosts: route.hosts.iter().map(|h| (h.clone(), proxy_ip(n))).collect(),
    };
    let url = route.url_via(proxy.addr());
    Ok((proxy, url, launch))
}

async fn events(log: &Arc<dyn EventLog>) -> Vec<Event> {
    log.events().await.unwrap_or_default()
}

/// Waits until `instance` applied a message of `key` with a sequence above
/// `seq`; returns when (the log's clock) it started.
async fn wait_applies(ctx: &Ctx<'_>, instance: &str, key: &str, seq: u64) -> Result<u64, String> {
    let log = ctx.log.clone();
    wait_until(
        &format!("{instance} to apply a later message of the key"),
        ctx.h.deadline(),
        || {
            let log = log.clone();
            async move {
                events(&log)
                    .await
                    .iter()
                    .any(|e| e.instance == instance && e.key == key && e.seq > seq && e.ok)
            }
        },
    )
    .await?;
    Ok(events(&ctx.log)
        .await
        .iter()
        .filter(|e| e.instance == instance && e.key == key && e.seq > seq)
        .map(|e| e.start)
        .min()
        .unwrap_or(0))
}

/// Messages `instance` started of `key` after `after` under a generation at
/// most the one it held the key under before `after`.
fn late_starts(events: &[Event], instance: &str, key: &str, after: u64) -> usize {
    let held = events
        .iter()
        .filter(|e| e.instance == instance && e.key == key && e.start < after)
        .map(|e| e.generation)
        .max()
        .unwrap_or(0);
    events
        .iter()
        .filter(|e| e.instance == instance && e.key == key && e.start > after && e.generation <= held)
        .count()
}

/// C19: a worker behind the fault proxy. (a) *latency* of 250 ms each way
/// while it works alone: nothing reordered or lost, and it keeps its
/// ownership (one generation per key). (b) *cut* while it is inside a
/// handler with later messages buffered: it reconnects and the run
/// completes. (c) *blackhole* of a second worker's link, inside a handler,
/// past the lease: a third worker takes the key over; once the link is
/// back the second applies no later message of the key under its lost
/// generation (at most the one fenced straggler). Checker: order, loss,
/// overlap. The times to resume after the cut and to take over after the
/// blackhole are printed beside the lease TTL.
pub(crate) async fn c19(ctx: &Ctx<'_>) -> Outcome {
    let route = ctx
        .h
        .fault_route()
        .ok_or_else(|| format!("harness `{}` gives no fault route", ctx.h.name()))?;
    let cat = ctx.category("orders");
    let client = ctx.client().await?;
    let ks = keys("k", 8);
    let ttl = ctx.h.lease().ttl;

    // (a) Latency: w1 alone behind proxy 1.
    let (p1, url1, launch1) = proxied(&route, 1).await?;
    let mut cfg1 = ctx.worker_config(&cat, "w1", Some(10), Duration::from_secs(1), 4)?;
    cfg1.url = url1;
    let w1 = WorkerProcess::spawn_in(&cfg1, &launch1).await?;
    p1.latency(Duration::from_millis(200));
    let mut published = publish_range(&client, &cat, &ks, 0..3, 0).await.map_err(err)?;
    ctx.wait_applied(&published, &HashSet::new()).await?;
    p1.latency(Duration::ZERO);
    let mut gens: BTreeMap<String, HashSet<u64>> = BTreeMap::new();
    for e in events(&ctx.log).await.iter().filter(|e| e.instance == "w1") {
        gens.entry(e.key.clone()).or_default().insert(e.generation);
    }
    let moved: Vec<_> = gens.iter().filter(|(_, g)| g.len() > 1).collect();
    ensure(moved.is_empty(), || {
        format!(
            "under 200 ms of latency each way the only worker lost and retook {} keys (lease TTL {ttl:?})",
            moved.len()
        )
    })?;

    // (b) Cut, inside a handler of a key with later messages buffered.
    published.extend(publish_range(&client, &cat, &ks, 10..20, 0).await.map_err(err)?);
    ctx.wait_held("w1", 10).await?;
    let cut_at = ctx.log.now().await.map_err(err)?;
    p1.cut();
    ctx.wait_applied(&published, &HashSet::new()).await?;
    let resumed = events(&ctx.log)
        .await
        .iter()
        .filter(|e| e.start > cut_at)
        .map(|e| e.start - cut_at)
        .min()
        .unwrap_or(0);

    // (c) Blackhole of w2's link past the lease, inside a handler. w1 leaves
    // first; w2 joins behind proxy 2 and, alone, applies a message of every
    // key (so it consumes, and owns keys on every topology, a single active
    // consumer's too); then w3 joins directly and must take the held key
    // over. (w1 does not leave while w2 joins: the test Kafka broker, tansu
    // 0.6, wedges a group whose leader leaves while it is forming: every
    // later JoinGroup names the departed leader, for good.)
    let s1 = w1.terminate().await?;
    let (p2, url2, launch2) = proxied(&route, 2).await?;
    let mut cfg2 = ctx.worker_config(&cat, "w2", Some(21), Duration::from_secs(1), 1)?;
    cfg2.url = url2;
    let w2 = WorkerProcess::spawn_in(&cfg2, &launch2).await?;
    published.extend(publish_range(&client, &cat, &ks, 20..21, 0).await.map_err(err)?);
    ctx.wait_applied(&published, &HashSet::new()).await?;
    let w3 = WorkerProcess::spawn(&ctx.worker_config(&cat, "w3", None, Duration::ZERO, 4)?).await?;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let producer = publish_stream(
        client.clone(),
        cat.clone(),
        ks.clone(),
        21,
        0,
        Duration::from_millis(20),
        stop_rx,
    );
    let held = ctx.wait_held("w2", 21).await;
    let key = match held {
        Ok(k) => k,
        Err(e) => {
            let _ = stop_tx.send(true);
            return Err(e);
        }
    };
    let held_seq = events(&ctx.log)
        .await
        .iter()
        .filter(|e| e.instance == "w2" && e.key == key && e.end.is_none())
        .map(|e| e.seq)
        .max()
        .unwrap_or(21);
    let hole_at = ctx.log.now().await.map_err(err)?;
    p2.blackhole(true);
    let taken = wait_applies(ctx, "w3", &key, held_seq).await;
    p2.blackhole(false);
    let _ = stop_tx.send(true);
    let taken_at = taken?;
    let log = ctx.log.clone();
    wait_until(
        "w2's held handler to return after the hole closed",
        ctx.h.deadline(),
        || {
            let log = log.clone();
            async move { !events(&log).await.iter().any(|e| e.instance == "w2" && e.end.is_none()) }
        },
    )
    .await?;
    published.extend(producer.await.map_err(err)?.map_err(err)?);
    ctx.wait_applied(&published, &HashSet::new()).await?;
    let s2 = w2.terminate().await?;
    let s3 = w3.terminate().await?;
    drop((p1, p2));

    let all = events(&ctx.log).await;
    let late = late_starts(&all, "w2", &key, taken_at);
    ensure(late == 0, || {
        format!("after the takeover the blackholed worker started {late} messages of the key under its lost generation")
    })?;
    eprintln!(
        "c19 {}: lease ttl {} ms; first start {} ms after the cut; takeover {} ms after the blackhole opened \
         (w1 {s1}, w2 {s2}, w3 {s3})",
        ctx.h.name(),
        ttl.as_millis(),
        resumed / 1000,
        taken_at.saturating_sub(hole_at) / 1000
    );
    ctx.verdict(&Expectation {
        published,
        max_stragglers: Some(1),
        ..Default::default()
    })
    .await?
    .assert_ok()
}

/// A preload library of this suite's own that shifts the wall clock
/// (`clock_gettime` of the realtime clocks, `gettimeofday`, `time`) by
/// `KEYORDER_SKEW_MS` and leaves the monotonic clocks alone: clock skew
/// between hosts is a wall-clock matter. A C11 timed wait's deadline is
/// shifted back, as a host whose clock is off waits in its own clock's
/// terms (librdkafka computes its waits' deadlines from the wall clock;
/// under libfaketime every one of them lasted the skew longer, so a Kafka
/// worker never started). Compiled once per run with the system C
/// compiler.
const SKEW_C: &str = r#"
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <sys/time.h>
#include <threads.h>
#include <time.h>

static long long skew_ns(void) {
    const char *s = getenv("KEYORDER_SKEW_MS");
    return s ? atoll(s) * 1000000LL : 0;
}

static void shift(struct timespec *ts) {
    long long n = (long long)ts->tv_sec * 1000000000LL + ts->tv_nsec + skew_ns();
    ts->tv_sec = n / 1000000000LL;
    ts->tv_nsec = n % 1000000000LL;
    if (ts->tv_nsec < 0) { ts->tv_nsec += 1000000000LL; ts->tv_sec -= 1; }
}

int clock_gettime(clockid_t id, struct timespec *ts) {
    static int (*real)(clockid_t, struct timespec *) = 0;
    if (!real) real = (int (*)(clockid_t, struct timespec *))dlsym(RTLD_NEXT, "clock_gettime");
    int r = real(id, ts);
    if (r == 0 && (id == CLOCK_REALTIME || id == CLOCK_REALTIME_COARSE)) shift(ts);
    return r;
}

int gettimeofday(struct timeval *tv, void *tz) {
    struct timespec ts;
    int r = clock_gettime(CLOCK_REALTIME, &ts);
    (void)tz;
    if (r == 0 && tv) { tv->tv_sec = ts.tv_sec; tv->tv_usec = ts.tv_nsec / 1000; }
    return r;
}

time_t time(time_t *t) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    if (t) *t = ts.tv_sec;
    return ts.tv_sec;
}

/* A C11 timed wait takes a realtime deadline, computed from the shifted
   clock: the kernel waits on the real one, so shift the deadline back (a
   host whose clock is off waits in its own clock's terms). */
int cnd_timedwait(cnd_t *restrict cond, mtx_t *restrict mtx, const struct timespec *restrict at) {
    static int (*real)(cnd_t *, mtx_t *, const struct timespec *) = 0;
    if (!real) real = (int (*)(cnd_t *, mtx_t *, const struct timespec *))dlsym(RTLD_NEXT, "cnd_timedwait");
    struct timespec back = *at;
    long long n = (long long)back.tv_sec * 1000000000LL + back.tv_nsec - skew_ns();
    back.tv_sec = n / 1000000000LL;
    back.tv_nsec = n % 1000000000LL;
    if (back.tv_nsec < 0) { back.tv_nsec += 1000000000LL; back.tv_sec -= 1; }
    return real(cond, mtx, &back);
}
"#;

/// Builds the skew library (once per process) and returns its path.
fn skew_lib() -> Result<String, String> {
    static BUILT: std::sync::OnceLock<Result<String, String>> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            let dir = std::env::temp_dir().join(format!("keyorder-skew-{}", std::process::id()));
            std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
            let src = dir.join("skew.c");
            let lib = dir.join("libkeyorder_skew.so");
            std::fs::write(&src, SKEW_C).map_err(|e| format!("{}: {e}", src.display()))?;
            let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
            let out = std::process::Command::new(&cc)
                .args(["-shared", "-fPIC", "-O2", "-o"])
                .arg(&lib)
                .arg(&src)
                .arg("-ldl")
                .output()
                .map_err(|e| format!("the clock-skew scenario compiles a preload library with `{cc}`: {e}"))?;
            if !out.status.success() {
                return Err(format!(
                    "compiling the clock-skew library failed: {}",
                    String::from_utf8_lossy(&out.stderr)
                ));
            }
            Ok(lib.display().to_string())
        })
        .clone()
}

/// C20: one worker process with its wall clock 60 s ahead, and in a second
/// run 60 s behind (a preload library shifts its wall clock), among normal
/// workers through a crash
/// (`kill -9` inside a handler), a join and a graceful leave. Checker:
/// order, loss, overlap; and per key, the fencing tokens of its applied
/// messages never go down from one owner to the next.
pub(crate) async fn c20(ctx: &Ctx<'_>) -> Outcome {
    let lib = skew_lib()?;
    for (run, offset) in [("ahead", "60000"), ("behind", "-60000")] {
        skewed_run(ctx, run, offset, &lib)
            .await
            .map_err(|e| format!("clock {offset} ms ({run}): {e}"))?;
    }
    Ok(())
}

async fn skewed_run(ctx: &Ctx<'_>, run: &str, offset: &str, lib: &str) -> Outcome {
    let cat = ctx.category(run);
    let client = ctx.client().await?;
    // Keys of their own per run: the checker reads the scenario's whole log.
    let ks = keys(run, 8);
    let skewed = Launch {
        env: vec![
            ("LD_PRELOAD".into(), lib.to_owned()),
            ("KEYORDER_SKEW_MS".into(), offset.to_owned()),
        ],
        hosts: Vec::new(),
    };
    let n1 = format!("{run}-n1");
    let sk = format!("{run}-skewed");
    let n2 = format!("{run}-n2");
    let wn1 = WorkerProcess::spawn(&ctx.worker_config(&cat, &n1, Some(4), Duration::from_secs(3600), 4)?).await?;
    let ws = WorkerProcess::spawn_in(&ctx.worker_config(&cat, &sk, None, Duration::ZERO, 4)?, &skewed).await?;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let producer = publish_stream(
        client.clone(),
        cat.clone(),
        ks.clone(),
        0,
        0,
        Duration::from_millis(20),
        stop_rx,
    );
    let outcome = async {
        // A crash inside a handler: the skewed worker takes over.
        ctx.wait_held(&n1, 4).await?;
        let killed_at = ctx.log.now().await.map_err(err)?;
        wn1.kill9().await?;
        let log = ctx.log.clone();
        let applied_after = |who: String, t: u64| {
            let log = log.clone();
            move || {
                let (log, who) = (log.clone(), who.clone());
                async move {
                    events(&log)
                        .await
                        .iter()
                        .any(|e| e.instance == who && e.ok && e.start > t)
                }
            }
        };
        wait_until(
            "the skewed worker to apply after the crash",
            ctx.h.deadline(),
            applied_after(sk.clone(), killed_at),
        )
        .await?;
        // A normal worker joins; then the skewed one leaves.
        let joined_at = ctx.log.now().await.map_err(err)?;
        let wn2 = WorkerProcess::spawn(&ctx.worker_config(&cat, &n2, None, Duration::ZERO, 4)?).await?;
        if ctx.h.spreads() {
            wait_until(
                "the joining worker to apply",
                ctx.h.deadline(),
                applied_after(n2.clone(), joined_at),
            )
            .await?;
        }
        ws.terminate().await?;
        let left_at = ctx.log.now().await.map_err(err)?;
        wait_until(
            "the remaining worker to apply after the leave",
            ctx.h.deadline(),
            applied_after(n2.clone(), left_at),
        )
        .await?;
        Ok::<_, String>((killed_at, wn2))
    }
    .await;
    let _ = stop_tx.send(true);
    let published = producer.await.map_err(err)?.map_err(err)?;
    let (killed_at, wn2) = outcome?;
    ctx.wait_applied(&published, &HashSet::new()).await?;
    wn2.terminate().await?;

    let all: Vec<Event> = events(&ctx.log)
        .await
        .into_iter()
        .filter(|e| e.instance.starts_with(run))
        .collect();
    // Tokens per key, in the order the key's messages were applied.
    let mut by_key: BTreeMap<&str, Vec<&Event>> = BTreeMap::new();
    for e in all.iter().filter(|e| e.ok && e.end.is_some()) {
        by_key.entry(e.key.as_str()).or_default().push(e);
    }
    let mut down = Vec::new();
    for (k, mut runs) in by_key {
        runs.sort_by_key(|e| e.start);
        for w in runs.windows(2) {
            if w[1].generation < w[0].generation {
                down.push(format!(
                    "{k}: token {} ({}) then {} ({})",
                    w[0].generation, w[0].instance, w[1].generation, w[1].instance
                ));
            }
        }
    }
    ensure(down.is_empty(), || {
        format!(
            "fencing tokens went down from one owner to the next {} times, e.g. {:?}",
            down.len(),
            down.first()
        )
    })?;
    ctx.verdict(&Expectation {
        published,
        kills: vec![(n1.clone(), killed_at)],
        ..Default::default()
    })
    .await?
    .assert_ok()
}
