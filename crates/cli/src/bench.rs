//! `keyorder bench`: the ordered subscription beside the transport's plain
//! unordered competing consumers, same transport, handler, concurrency,
//! prefetch and instance count, in one run.

use crate::clock::Clock;
use std::sync::atomic::Ordering;
use std::time::Duration;

use clap::Args;
use keyorder_check::{check, EventLog, Expectation};
use serde_json::json;

use crate::demo::uuid_like;
use crate::{progress, run};

#[derive(Debug, Args)]
pub(crate) struct BenchArgs {
    /// The transport URL.
    #[arg(long, hide_env_values = true, env = "KEYORDER_URL", default_value = "memory://")]
    url: String,
    /// Distinct keys.
    #[arg(long, default_value_t = 100)]
    keys: usize,
    /// Messages per side (ordered, baseline).
    #[arg(long, default_value_t = 20_000)]
    messages: u64,
    /// Consumer instances per side.
    #[arg(long, default_value_t = 2)]
    instances: usize,
    /// Handler time in ms (0: no-op).
    #[arg(long, default_value_t = 0)]
    handler_ms: u64,
    /// Random handler time, uniform in 0..=N ms per message (overrides
    /// `--handler-ms`; the Parallel Consumer comparison uses 5).
    #[arg(long)]
    handler_max_ms: Option<u64>,
    /// Also run partition order (one message at a time per instance: with
    /// one partition and one instance, what a plain Kafka consumer does).
    #[arg(long)]
    partition_order: bool,
    /// The timer the handler sleeps on: `tokio` (`tokio::time::sleep`, what
    /// every recorded measurement used; its millisecond ticks make a 1 ms
    /// sleep take 1-2 ms, 2.0-2.4 ms median as measured) or `precise` (a
    /// deadline thread: 1 ms takes about 1.1 ms on an idle machine, as 1 ms
    /// of I/O woken by the reactor would). The output reports what the
    /// sleeps took on each side.
    #[arg(long, value_enum, default_value_t = Clock::Tokio)]
    handler_clock: Clock,
    /// Handlers running at once per instance (prefetch is 16x this). The
    /// default keeps total concurrency below the default key count, so the
    /// comparison measures ordering, not a key shortage.
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
    /// Probe messages for the publish-to-handler latency at low load.
    #[arg(long, default_value_t = 200)]
    probes: u64,
    /// Probe rate (messages per second).
    #[arg(long, default_value_t = 200)]
    probe_rate: u64,
    /// Print one JSON object as the last line on stdout, and draw no
    /// progress (progress shows only when stderr is a terminal anyway).
    #[arg(long)]
    json: bool,
    /// Rounds of ordered-then-baseline, each reported; with more than one
    /// the median ratio is reported too (a shared machine's noise moves
    /// single runs of either side by 10-30%).
    #[arg(long, default_value_t = 1)]
    rounds: u32,
}

struct Side {
    msgs_per_s: f64,
    p50_ms: f64,
    p99_ms: f64,
    /// Median and p99 of the handlers' sleeps (ms).
    slept_p50_ms: f64,
    slept_p99_ms: f64,
    violations: usize,
    lost: usize,
    secs: f64,
    /// Median handler time and median settle wait (from the handler's
    /// return to its acknowledgement reported durable), in ms.
    cycle: Option<(f64, f64)>,
    /// Each applied message's start, in µs after the side's first start,
    /// sorted, and the last end on the same clock: the steady-state window.
    starts_us: Vec<u64>,
    end_us: u64,
    /// Ordered side: when ownership settled, in µs after the first start
    /// (the joining instances' last taken-over key started), if any joined.
    settled_us: Option<u64>,
}

impl Side {
    /// Messages per second among those that started at or after `from_us`
    /// (µs after the side's first start), and the window's length in s.
    fn rate_from(&self, from_us: u64) -> (f64, f64) {
        let n = self.starts_us.len() - self.starts_us.partition_point(|&t| t < from_us);
        let window = self.end_us.saturating_sub(from_us) as f64 / 1e6;
        (n as f64 / window.max(1e-9), window)
    }
}

/// When the joining instance `who` started the first handler of the last key
/// it took over (store clock, µs): until then ownership was still moving.
fn last_takeover(events: &[keyorder_check::eventlog::Event], who: &str) -> Option<u64> {
    first_starts(events, who).into_values().max()
}

/// Per key that `who` ran: when it started the key's first handler.
fn first_starts<'a>(
    events: &'a [keyorder_check::eventlog::Event],
    who: &str,
) -> std::collections::HashMap<&'a str, u64> {
    let mut first: std::collections::HashMap<&str, u64> = Default::default();
    for e in events.iter().filter(|e| e.instance == who) {
        let t = first.entry(e.key.as_str()).or_insert(u64::MAX);
        *t = (*t).min(e.start);
    }
    first
}

/// How long a bench side's categories outlive their last use where the
/// broker can drop them itself (RabbitMQ's `x-expires`, 30 minutes): the
/// fallback that removes an interrupted run's queues, long enough for any
/// publish.
const BENCH_CATEGORY_EXPIRY: Duration = Duration::from_secs(30 * 60);

/// At most this many concurrent publishers of the backlog, each owning a
/// subset of the keys (so each key's publish order holds). A publish awaits
/// its broker's durable acknowledgement, so more of them fill the broker's
/// group commits: with 4, publishing 100,000 messages took about a minute on
/// RabbitMQ quorum queues and on PostgreSQL here.
const MAX_PRODUCERS: usize = 16;

/// Publishers for `keys` keys: the largest count up to [`MAX_PRODUCERS`]
/// that divides the keys evenly. Every publisher then owns as many keys as
/// the others, so every key's messages spread evenly over the backlog; with
/// uneven shares (16 publishers for 100 keys: 6 or 7 keys each), the keys
/// of fuller publishers end later in the backlog, and an ordered consumer,
/// which runs a key's messages one at a time, ends on a tail of those keys.
fn producers(keys: usize) -> usize {
    (1..=MAX_PRODUCERS.min(keys.max(1)))
        .rev()
        .find(|p| keys % p == 0)
        .unwrap_or(1)
}

async fn side(a: &BenchArgs, ordered: bool, concurrency: usize) -> anyhow::Result<Side> {
    let label = match (ordered, concurrency == 1) {
        (true, true) => "partition",
        (true, false) => "ordered",
        _ => "baseline",
    };
    let url = if ordered {
        a.url.clone()
    } else {
        run::baseline_url(&a.url, a.instances)
    };
    // Each run makes categories of its own. On RabbitMQ a side deletes its
    // queues when it ends; `x-expires` is the fallback for an interrupted
    // run. It must outlast the publish: publishing does not count as use, so
    // a queue that expires while its backlog is published is deleted with
    // the messages (a minute was too short on a slow machine: the broker
    // closed the publishing channels with INTERNAL_ERROR mid-publish).
    let hints = keyorder::bench_hints(&url);
    let url = hints.expiring(&url, BENCH_CATEGORY_EXPIRY);
    let clients = run::clients(&url, a.instances).await?;
    let category = format!("keyorder-bench-{label}-{}", &uuid_like()[..8]);
    let keys: Vec<String> = (0..a.keys).map(|i| format!("key-{i}")).collect();
    // Throughput: the backlog is published first; timing runs from the first
    // message consumed to the last.
    eprintln!("{label}: publishing {} messages over {} keys", a.messages, a.keys);
    let h = a.handler_ms;
    let max = a.handler_max_ms;
    let sleep = move || match max {
        Some(m) => rand::random_range(0..=m),
        None => h,
    };
    let bar = progress::bar(a.messages, label, "published", a.json);
    let published = run::produce(
        &clients,
        &category,
        &keys,
        a.messages,
        sleep,
        producers(keys.len()),
        Some(bar.clone()),
    )
    .await?;
    bar.finish();
    // `VACUUM (ANALYZE)` of keyorder's tables on PostgreSQL (`Admin::vacuum`;
    // nothing elsewhere) once the backlog is published and before it is
    // consumed, so that each side starts on tables without the dead rows of
    // the sides before it and with statistics that count its backlog (what
    // autovacuum does on a server where it is on; measured here, where it is
    // off, the ratio fell run by run). Analyzed before publishing, on a
    // near-empty table, the baseline's claim sorted the whole backlog on
    // every call.
    clients[0].admin().vacuum().await?;
    let rec = run::Recorder::with_clock(a.handler_clock);
    // Every instance is built (its transport open) first and then all are
    // launched together (`launch_spacing` apart where the transport asks
    // for it), on both sides: a side's timing (first handler to last) then
    // holds no instance's start-up (16 queues declared and verified take an
    // ordered RabbitMQ instance 0.1-0.2 s) while another instance already
    // consumes. The spreading of scopes over the instances still happens
    // inside the timing.
    let mut built = Vec::new();
    for (i, client) in clients.iter().enumerate() {
        let b = run::builder(client, &category, ordered, concurrency);
        built.push(run::build(b, format!("{label}-{i}"), rec.clone()).await?);
    }
    // The transport's spacing between launches (Kafka: its group handling),
    // the same on both sides of a run.
    let spacing = hints.launch_spacing();
    // On Redis (a lease per key): when the last instance holds its share.
    let last = format!("{label}-{}", built.len().saturating_sub(1));
    let handover = (ordered && built.len() > 1 && url.starts_with("redis://"))
        .then(|| {
            let share = keys.len() / built.len();
            crate::handover::watch(
                &url,
                &category,
                run::GROUP,
                &keys,
                last.clone(),
                share,
                Duration::from_secs(120),
            )
        })
        .transpose()?;
    let mut instances = Vec::new();
    for b in built {
        if !instances.is_empty() && !spacing.is_zero() {
            tokio::time::sleep(spacing).await;
        }
        instances.push(b.launch());
    }
    // When the later instances were launched (the store's clock).
    let up = rec.log.now().await?;
    let joins: Vec<_> = (1..instances.len()).map(|i| (format!("{label}-{i}"), up)).collect();
    let target = published.len() as u64;
    let per_msg = a.handler_max_ms.unwrap_or(a.handler_ms) + 1;
    let deadline = Duration::from_secs(120 + target * per_msg / concurrency.clamp(1, 100) as u64);
    let bar = progress::bar(target, label, "consumed", a.json);
    let follow = {
        let rec = rec.clone();
        progress::Follow::new(&bar, move || rec.applied.load(Ordering::Relaxed))
    };
    let res = run::wait_for("the backlog to be consumed", deadline, || {
        rec.applied.load(Ordering::Relaxed) >= target
    })
    .await;
    drop(follow);
    bar.set_position(rec.applied.load(Ordering::Relaxed));
    if res.is_ok() {
        bar.finish();
    } else {
        bar.abandon();
    }
    let secs = rec.busy_secs();
    // Latency at low load: probes paced at `probe_rate`, publish to handler start.
    if res.is_ok() && a.probes > 0 {
        let publisher = clients[0].publisher(&category).await?;
        let gap = Duration::from_secs_f64(1.0 / a.probe_rate.max(1) as f64);
        let mut tick = tokio::time::interval(gap);
        let bar = progress::bar(a.probes, label, "latency probes", a.json);
        let follow = {
            let rec = rec.clone();
            progress::Follow::new(&bar, move || rec.probes.load(Ordering::Relaxed))
        };
        for i in 0..a.probes {
            tick.tick().await;
            let key = &keys[i as usize % keys.len()];
            let msg = keyorder::Message::new(run::payload(u64::MAX / 2 + i, a.handler_ms, true)).with_key(key)?;
            publisher.publish(msg).await?;
        }
        run::wait_for("the latency probes", Duration::from_secs(60), || {
            rec.probes.load(Ordering::Relaxed) >= a.probes
        })
        .await?;
        drop(follow);
        bar.set_position(rec.probes.load(Ordering::Relaxed));
        bar.finish();
    }
    // The side ends here, the command goes on: its subscriptions leave the
    // `--metrics-addr` probes before they stop (or they would say `dead`).
    crate::unwatch(&category, run::GROUP);
    for i in instances {
        let s = i.stats.snapshot();
        eprintln!(
            "{label}: applied={} retries={} parked={} halts={} widened={} self_fence_pauses={} \
             self_fence_discards={} fence_rejections={} scopes_released={} handed_back={}",
            s.applied,
            s.retries,
            s.parked,
            s.halts,
            s.widened,
            s.self_fence_pauses,
            s.self_fence_discards,
            s.fence_rejections,
            s.scopes_released,
            s.handed_back
        );
        i.stop().await?;
    }
    // A finished side's category goes where the transport can delete it
    // (`Admin::delete_category`): RabbitMQ's queues would otherwise pile up
    // or expire in the middle of a later side's run, and PostgreSQL's rows
    // stay (the ordered side's retention lags the run).
    match clients[0].admin().delete_category(&category).await {
        Ok(_) | Err(keyorder::Error::Unsupported { .. }) => {}
        Err(e) => eprintln!("{label}: could not delete the side's category `{category}` ({e})"),
    }
    res?;
    let events: Vec<_> = rec
        .log
        .events()
        .await?
        .into_iter()
        .filter(|e| e.seq < u64::MAX / 2)
        .collect();
    let verdict = check(
        &events,
        &Expectation {
            published,
            ..Default::default()
        },
    );
    eprintln!("{label}: {}", timeline(&events));
    // A diagnostic: every applied event as CSV, for analysis outside.
    if let Some(path) = std::env::var_os("KEYORDER_BENCH_EVENTS") {
        let mut out = String::from("key,seq,instance,generation,start,end\n");
        for e in &events {
            let end = e.end.map(|v| v.to_string()).unwrap_or_default();
            out.push_str(&format!(
                "{},{},{},{},{},{end}\n",
                e.key, e.seq, e.instance, e.generation, e.start
            ));
        }
        let path = format!("{}.{label}.csv", path.to_string_lossy());
        if let Err(err) = std::fs::write(&path, out) {
            eprintln!("{label}: could not write {path}: {err}");
        }
    }
    // Unordered consumers compete for every message: no key is taken over.
    for (who, at) in joins.iter().filter(|_| ordered) {
        eprintln!("{label}: {}", join_report(&events, who, *at));
    }
    if let Some(probe) = handover {
        match probe.await.ok().flatten() {
            Some(took) => eprintln!(
                "{label}: hand-over: {last} held the leases of its {} keys {:.0} ms after the instances were launched",
                keys.len() / a.instances.max(1),
                took.as_secs_f64() * 1e3
            ),
            None => eprintln!("{label}: hand-over: {last} did not hold its share of the leases within 120 s"),
        }
    }
    if ordered && !verdict.order.is_empty() {
        // The bench's own keys (`key-N`), not user data.
        for v in verdict.order.iter().take(5) {
            eprintln!(
                "{label}: ORDER VIOLATION key {} applied seq {} after seq {}",
                v.key, v.after, v.before
            );
        }
        if std::env::var_os("KEYORDER_BENCH_DUMP").is_some() {
            for e in events.iter() {
                eprintln!(
                    "DUMP {} {} {} {} {} {:?} {}",
                    e.key, e.seq, e.instance, e.generation, e.start, e.end, e.ok
                );
            }
        }
    }
    let t0 = events.iter().map(|e| e.start).min().unwrap_or(0);
    let mut starts_us: Vec<u64> = events.iter().filter(|e| e.ok).map(|e| e.start - t0).collect();
    starts_us.sort_unstable();
    let end_us = events
        .iter()
        .map(|e| e.end.unwrap_or(e.start))
        .max()
        .unwrap_or(t0)
        .saturating_sub(t0);
    let settled_us = if ordered {
        joins
            .iter()
            .filter_map(|(who, _)| last_takeover(&events, who))
            .max()
            .map(|t| t.saturating_sub(t0))
    } else {
        None
    };
    Ok(Side {
        msgs_per_s: target as f64 / secs.max(1e-9),
        p50_ms: rec.latency_ms(0.5),
        p99_ms: rec.latency_ms(0.99),
        slept_p50_ms: rec.slept_ms(0.5),
        slept_p99_ms: rec.slept_ms(0.99),
        violations: verdict.order.len(),
        lost: verdict.lost.len(),
        secs,
        cycle: rec.cycle_ms(),
        starts_us,
        end_us,
        settled_us,
    })
}

pub(crate) async fn run(a: BenchArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        a.instances >= 1 && a.keys >= 1 && a.messages >= 1,
        "instances, keys and messages must be >= 1"
    );
    let client = keyorder::connect(&run::with_setup(&a.url)).await?;
    let transport = client.transport_name().to_owned();
    anyhow::ensure!(a.rounds >= 1, "rounds must be >= 1");
    // A result measured with durability relaxed says so.
    let durability = client.admin().durability().await?;
    // The sides connect clients of their own.
    drop(client);
    if let Some(d) = &durability {
        println!("{transport}: commits with {d}");
    }
    let mut ratios = Vec::new();
    let mut defects = false;
    for round in 1..=a.rounds {
        if a.rounds > 1 {
            println!("round {round} of {}", a.rounds);
        }
        let (ratio, bad) = round_trip(&a, &transport, durability.as_deref()).await?;
        ratios.push(ratio);
        defects |= bad;
    }
    if a.rounds > 1 {
        let median = median(&ratios);
        let each: Vec<String> = ratios.iter().map(|r| format!("{r:.2}")).collect();
        println!(
            "ratios (ordered/baseline) by round: {}; median {median:.2}",
            each.join(" ")
        );
        if a.json {
            println!(
                "{}",
                json!({"rounds": a.rounds, "ratios": ratios, "median_ratio": median})
            );
        }
    }
    if defects {
        anyhow::bail!("ordering or loss defects found");
    }
    Ok(())
}

/// One round: ordered, then the baseline (then partition order if asked);
/// prints the round and returns its ratio and whether it found a defect.
async fn round_trip(a: &BenchArgs, transport: &str, durability: Option<&str>) -> anyhow::Result<(f64, bool)> {
    let ordered = side(a, true, a.concurrency).await?;
    let baseline = side(a, false, a.concurrency).await?;
    let partition = if a.partition_order {
        Some(side(a, true, 1).await?)
    } else {
        None
    };
    let ratio = ordered.msgs_per_s / baseline.msgs_per_s.max(1e-9);
    let clock = match a.handler_clock {
        Clock::Precise => "precise",
        Clock::Tokio => "tokio",
    };
    let handler = match a.handler_max_ms {
        Some(m) => format!("0-{m}ms random ({clock} clock)"),
        None if a.handler_ms == 0 => "no-op".to_owned(),
        None => format!("{}ms ({clock} clock)", a.handler_ms),
    };
    println!(
        "{transport}: keys={} messages={} instances={} handler={handler} concurrency={}",
        a.keys, a.messages, a.instances, a.concurrency
    );
    let mut sides = vec![("ordered", &ordered), ("baseline", &baseline)];
    if let Some(p) = &partition {
        sides.push(("partition", p));
    }
    for (name, s) in sides {
        println!(
            "  {name:<8} {:>10.0} msg/s ({:.2} s)  latency p50 {:.2} ms  p99 {:.2} ms  order violations {}  lost {}",
            s.msgs_per_s, s.secs, s.p50_ms, s.p99_ms, s.violations, s.lost
        );
    }
    if ordered.slept_p50_ms > 0.0 {
        println!(
            "  handler sleeps took: ordered p50 {:.2} ms p99 {:.2} ms, baseline p50 {:.2} ms p99 {:.2} ms",
            ordered.slept_p50_ms, ordered.slept_p99_ms, baseline.slept_p50_ms, baseline.slept_p99_ms
        );
    }
    println!("  ratio (ordered/baseline) {ratio:.2}");
    // The whole run holds the start-up hand-over (a joining instance takes
    // its share of the keys over while the first already consumes); the
    // steady state starts when the last joiner started its last key, and
    // both sides are timed from that same offset after their first handler.
    // A window under 0.1 s (or a baseline that ended before the ordered
    // side settled) gives no figure: raise --messages.
    const MIN_WINDOW_S: f64 = 0.1;
    let steady = ordered.settled_us.and_then(|at| {
        let (o, window) = ordered.rate_from(at);
        let (b, b_window) = baseline.rate_from(at);
        (window >= MIN_WINDOW_S && b_window >= MIN_WINDOW_S).then(|| (at as f64 / 1e6, window, b_window, o, b, o / b))
    });
    if let Some(at) = ordered.settled_us {
        let at = at as f64 / 1e6;
        match steady {
            Some((_, window, b_window, o, b, r)) => {
                let share = window / (ordered.end_us as f64 / 1e6).max(1e-9);
                println!(
                    "  hand-over: ownership settled {at:.2} s after the first handler; steady state from then to \
                     the end: ordered {o:.0} msg/s over {window:.2} s ({:.0}% of its run), baseline {b:.0} msg/s \
                     over {b_window:.2} s, ratio {r:.2}{}",
                    share * 100.0,
                    if share < 0.5 {
                        " (the hand-over is a large share of this run: raise --messages for a steadier figure)"
                    } else {
                        ""
                    }
                );
            }
            None => println!(
                "  hand-over: ownership settled {at:.2} s after the first handler; too little of a run is left \
                 after it for a steady-state figure: raise --messages"
            ),
        }
    }
    // A key's next message starts only once its previous one is settled, so
    // the ordered side cannot beat keys / (handler + settle wait).
    let bound = ordered.cycle.map(|(handler, wait)| {
        let per_s = a.keys as f64 * 1000.0 / (handler + wait).max(1e-3);
        (handler, wait, per_s)
    });
    if let Some((handler, wait, per_s)) = bound {
        println!(
            "  per-key bound: {} keys / (handler {handler:.2} ms + settle wait {wait:.2} ms, medians) = {per_s:.0} msg/s, \
             {:.2} of the baseline{}",
            a.keys,
            per_s / baseline.msgs_per_s.max(1e-9),
            if per_s < baseline.msgs_per_s {
                ": the bound binds"
            } else {
                ": not binding"
            }
        );
    }
    if let Some(p) = &partition {
        println!(
            "  seconds: partition order {:.2}  key order {:.2}  unordered {:.2}",
            p.secs, ordered.secs, baseline.secs
        );
    }
    if a.json {
        println!(
            "{}",
            json!({
                "transport": transport,
                "durability": durability,
                "keys": a.keys,
                "messages": a.messages,
                "instances": a.instances,
                "handler_ms": a.handler_ms,
                "handler_max_ms": a.handler_max_ms,
                "handler_clock": clock,
                "partition_order_s": partition.as_ref().map(|p| p.secs),
                "concurrency": a.concurrency,
                "ordered": {"msgs_per_s": ordered.msgs_per_s, "p50_ms": ordered.p50_ms, "p99_ms": ordered.p99_ms,
                            "slept_p50_ms": ordered.slept_p50_ms},
                "baseline": {"msgs_per_s": baseline.msgs_per_s, "p50_ms": baseline.p50_ms, "p99_ms": baseline.p99_ms,
                             "slept_p50_ms": baseline.slept_p50_ms, "order_violations": baseline.violations},
                "ratio": ratio,
                "settled_s": ordered.settled_us.map(|at| at as f64 / 1e6),
                "steady": steady.map(|(at, window, b_window, o, b, r)| json!({
                    "settled_s": at, "window_s": window, "baseline_window_s": b_window,
                    "ordered_msgs_per_s": o, "baseline_msgs_per_s": b, "ratio": r,
                })),
                "per_key_bound": bound.map(|(handler, wait, per_s)| json!({
                    "handler_ms": handler, "settle_wait_ms": wait, "msgs_per_s": per_s,
                    "of_baseline": per_s / baseline.msgs_per_s.max(1e-9),
                })),
                "order_violations": ordered.violations,
                "lost": ordered.lost + baseline.lost,
            })
        );
    }
    let partition_bad = partition.as_ref().is_some_and(|p| p.violations > 0 || p.lost > 0);
    let bad = ordered.violations > 0 || ordered.lost > 0 || baseline.lost > 0 || partition_bad;
    Ok((ratio, bad))
}

/// How long a join took to settle, from the event log: from the joining
/// instance's subscription being up to its first handler, and to the first
/// handler of the last key it took over (every key it ran at all).
fn join_report(events: &[keyorder_check::eventlog::Event], who: &str, at: u64) -> String {
    let first = first_starts(events, who);
    let (Some(a), Some(b)) = (first.values().min(), first.values().max()) else {
        return format!("join of {who}: it ran nothing");
    };
    format!(
        "join of {who}: first handler {:.0} ms after its subscription was up, the last of the {} keys it took over {:.0} ms after",
        a.saturating_sub(at) as f64 / 1e3,
        first.len(),
        b.saturating_sub(at) as f64 / 1e3
    )
}

/// Per instance: when it started its first handler and ended its last,
/// relative to the run's first start, and how many it applied in each tenth
/// of the run: shows an instance that idled while the other still worked
/// (a join, a hand-over, an uneven share of the keys).
fn timeline(events: &[keyorder_check::eventlog::Event]) -> String {
    let Some(t0) = events.iter().map(|e| e.start).min() else {
        return "no events".into();
    };
    let t1 = events.iter().filter_map(|e| e.end).max().unwrap_or(t0).max(t0 + 1);
    let tenth = ((t1 - t0) / 10).max(1);
    let mut per: std::collections::BTreeMap<&str, (u64, u64, [u64; 10])> = Default::default();
    // When each key's last message ended: keys that finish early leave
    // handlers idle at the end (the tail).
    let mut last: std::collections::HashMap<&str, u64> = Default::default();
    for e in events.iter().filter(|e| e.ok) {
        let end = e.end.unwrap_or(e.start);
        let s = per.entry(e.instance.as_str()).or_insert((u64::MAX, 0, [0; 10]));
        s.0 = s.0.min(e.start);
        s.1 = s.1.max(end);
        s.2[(((e.start - t0) / tenth) as usize).min(9)] += 1;
        let t = last.entry(e.key.as_str()).or_default();
        *t = (*t).max(end);
    }
    let mut done: Vec<u64> = last.into_values().collect();
    done.sort_unstable();
    let at = |q: f64| (done[((done.len() - 1) as f64 * q) as usize] - t0) as f64 / 1e6;
    let keys = format!(
        "keys done at p10 {:.2} p50 {:.2} p90 {:.2} max {:.2} s",
        at(0.1),
        at(0.5),
        at(0.9),
        at(1.0)
    );
    let each = per
        .iter()
        .map(|(i, (a, b, bins))| {
            format!(
                "{i} {:.2}-{:.2} s [{}]",
                (*a - t0) as f64 / 1e6,
                (*b - t0) as f64 / 1e6,
                bins.iter().map(|n| n.to_string()).collect::<Vec<_>>().join(" ")
            )
        })
        .collect::<Vec<_>>()
        .join("; ");
    format!("{each}; {keys}")
}

/// The median (the mean of the middle two of an even count).
fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let n = sorted.len();
    match n {
        0 => f64::NAN,
        _ if n % 2 == 1 => sorted[n / 2],
        _ => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

#[cfg(test)]
mod median_tests {
    #[test]
    fn an_even_count_takes_the_mean_of_the_middle_two() {
        let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
        assert!(close(super::median(&[0.70, 0.55]), 0.625));
        assert!(close(super::median(&[0.4, 0.9, 0.5]), 0.5));
        assert!(close(super::median(&[0.3, 0.1, 0.4, 0.2]), 0.25));
        assert!(super::median(&[]).is_nan());
    }
}

#[cfg(test)]
mod producer_tests {
    #[test]
    fn every_publisher_owns_as_many_keys_as_the_others() {
        for keys in [1, 7, 10, 16, 17, 100, 1000, 250, 97] {
            let p = super::producers(keys);
            assert!((1..=super::MAX_PRODUCERS).contains(&p), "{keys} keys: {p} publishers");
            assert_eq!(keys % p, 0, "{keys} keys over {p} publishers");
        }
        assert_eq!(super::producers(100), 10);
        assert_eq!(super::producers(1000), 10);
        assert_eq!(super::producers(16), 16);
        assert_eq!(super::producers(97), 1);
        assert_eq!(super::producers(0), 1);
    }
}
