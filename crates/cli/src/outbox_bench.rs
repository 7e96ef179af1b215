//! `keyorder outbox bench`: the outbox relay's throughput into a transport,
//! per-key ordered beside a relay that ignores ordering
//! (`RelayConfig::ignore_ordering`), same records, publisher, concurrency
//! and pool, in one run.

use std::time::Duration;

use anyhow::Context;
use clap::Args;
use keyorder_outbox::sqlx::{self, AssertSqlSafe, Row};
use keyorder_outbox::{Outbox, OutboxConfig, Outgoing, RelayConfig, RelayStatsSnapshot};
use serde_json::json;
use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::demo::uuid_like;
use crate::{progress, run};

#[derive(Debug, Args)]
pub(crate) struct OutboxBenchArgs {
    /// The outbox's PostgreSQL URL (a plain `postgres://` URL). Each side
    /// gets a fresh schema of its own, dropped at the end unless `--keep`.
    #[arg(long, hide_env_values = true, env = "KEYORDER_OUTBOX_URL")]
    db: String,
    /// The transport the relays publish to (any keyorder URL).
    #[arg(long, default_value = "memory://")]
    to: String,
    /// Distinct keys.
    #[arg(long, default_value_t = 100)]
    keys: usize,
    /// Records per side (ordered, unordered).
    #[arg(long, default_value_t = 20_000)]
    records: u64,
    /// Relays per side (each with its own pool and client).
    #[arg(long, default_value_t = 1)]
    relays: usize,
    /// Publishes at once per relay (`RelayConfig::concurrency`).
    #[arg(long, default_value_t = 64)]
    concurrency: usize,
    /// PostgreSQL connections per relay.
    #[arg(long, default_value_t = 16)]
    pool: u32,
    /// Records staged per transaction (`Outbox::stage_many`).
    #[arg(long, default_value_t = 500)]
    stage_batch: usize,
    /// Published records the relays delete per batch
    /// (`RelayConfig::retention_batch`). The default 0 keeps them, which the
    /// checks read (published count, mark order); with retention on, the
    /// count adds the relays' deleted records and the order check is skipped.
    #[arg(long, default_value_t = 0)]
    retention_batch: usize,
    /// Payload bytes per record.
    #[arg(long, default_value_t = 64)]
    payload: usize,
    /// Keep each side's schema (for inspection).
    #[arg(long)]
    keep: bool,
    /// Print one JSON object as the last line on stdout, and draw no
    /// progress (progress shows only when stderr is a terminal anyway).
    #[arg(long)]
    json: bool,
}

/// What one side measured and checked.
struct Side {
    recs_per_s: f64,
    /// From the first record marked published to the last.
    secs: f64,
    /// From the relays' start to the last record marked published.
    wall_secs: f64,
    stage_secs: f64,
    /// Records marked published (the relays' counters).
    marked: u64,
    /// Rows in state `published` (plus the relays' retention deletes).
    published_rows: u64,
    /// Rows in any other state.
    other_rows: u64,
    /// Per key, a record marked published before an earlier one (None:
    /// not checked, retention deleted rows).
    inversions: Option<u64>,
    stats: RelayStatsSnapshot,
}

/// Stages `records` over `keys` keys from 4 tasks, each owning a subset of
/// the keys, `batch` records per transaction.
async fn stage(
    outbox: &Outbox,
    category: &str,
    a: &OutboxBenchArgs,
    bar: &indicatif::ProgressBar,
) -> anyhow::Result<()> {
    let stagers = 4.min(a.keys);
    let payload = vec![b'x'; a.payload];
    let mut tasks = Vec::new();
    for p in 0..stagers {
        let outbox = outbox.clone();
        let category = category.to_owned();
        let payload = payload.clone();
        // Record i goes to key i % K; this task owns keys p, p + P, ...
        let mine: Vec<(String, u64)> = (0..a.keys)
            .skip(p)
            .step_by(stagers)
            .map(|k| {
                let n = a.records / a.keys as u64 + u64::from((k as u64) < a.records % a.keys as u64);
                (format!("key-{k}"), n)
            })
            .collect();
        let batch = a.stage_batch.max(1);
        let bar = bar.clone();
        tasks.push(tokio::spawn(async move {
            let rounds = mine.iter().map(|(_, n)| *n).max().unwrap_or(0);
            let mut pending: Vec<Outgoing> = Vec::with_capacity(batch);
            for round in 0..rounds {
                for (key, n) in &mine {
                    if round < *n {
                        pending.push(Outgoing::new(&category, key, payload.clone()));
                    }
                    if pending.len() >= batch {
                        let n = pending.len() as u64;
                        stage_tx(&outbox, std::mem::take(&mut pending)).await?;
                        bar.inc(n);
                    }
                }
            }
            if !pending.is_empty() {
                let n = pending.len() as u64;
                stage_tx(&outbox, pending).await?;
                bar.inc(n);
            }
            anyhow::Ok(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    Ok(())
}

async fn stage_tx(outbox: &Outbox, batch: Vec<Outgoing>) -> anyhow::Result<()> {
    let mut tx = outbox.pool().begin().await?;
    outbox.stage_many(&mut tx, batch).await?;
    tx.commit().await?;
    Ok(())
}

async fn scalar(outbox: &Outbox, sql: String) -> anyhow::Result<i64> {
    Ok(sqlx::query_scalar(AssertSqlSafe(sql)).fetch_one(outbox.pool()).await?)
}

fn add(a: RelayStatsSnapshot, b: RelayStatsSnapshot) -> RelayStatsSnapshot {
    RelayStatsSnapshot {
        published: a.published + b.published,
        abandoned: a.abandoned + b.abandoned,
        parked: a.parked + b.parked,
        halted: a.halted + b.halted,
        retries: a.retries + b.retries,
        fenced: a.fenced + b.fenced,
        blocked: a.blocked + b.blocked,
        slots_lost: a.slots_lost + b.slots_lost,
        retention_deleted: a.retention_deleted + b.retention_deleted,
    }
}

async fn side(a: &OutboxBenchArgs, ordered: bool) -> anyhow::Result<Side> {
    let name = if ordered { "ordered" } else { "unordered" };
    let tag = &uuid_like()[..8];
    let schema = format!("ko_obench_{name}_{tag}");
    let category = format!("keyorder-outbox-bench-{name}-{tag}");
    let cfg = OutboxConfig {
        schema: schema.clone(),
        ..OutboxConfig::default()
    };
    let outbox = Outbox::connect(&a.db, a.pool.max(4), cfg.clone())
        .await
        .context("connecting to the outbox database")?;
    outbox.migrate().await?;

    eprintln!("{name}: staging {} records over {} keys", a.records, a.keys);
    let staged_at = Instant::now();
    let bar = progress::bar(a.records, name, "staged", a.json);
    stage(&outbox, &category, a, &bar).await?;
    bar.finish();
    let stage_secs = staged_at.elapsed().as_secs_f64();
    let pending = scalar(
        &outbox,
        format!("select count(*) from {schema}.records where state = 'pending'"),
    )
    .await?;
    anyhow::ensure!(
        pending as u64 == a.records,
        "staged {pending} records, expected {}",
        a.records
    );

    // Each relay: its own pool and client, as separate processes would have.
    let clients = run::clients(&a.to, a.relays).await?;
    let mut relays = Vec::new();
    for (i, client) in clients.into_iter().enumerate() {
        let own = Outbox::connect(&a.db, a.pool.max(1), cfg.clone()).await?;
        let relay = own.relay(
            client,
            RelayConfig {
                instance: Some(format!("bench-{name}-{i}")),
                concurrency: a.concurrency,
                retention_batch: a.retention_batch,
                ignore_ordering: !ordered,
                ..RelayConfig::default()
            },
        );
        relays.push(relay);
    }
    eprintln!("{name}: relaying with {} relay(s)", a.relays);
    let started = Instant::now();
    let mut running = Vec::new();
    for relay in relays {
        let stats = relay.stats();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(relay.run(async move {
            let _ = stopped.await;
        }));
        running.push((stats, stop, task));
    }
    // Timing: from the first record marked published to the last.
    let target = a.records;
    let deadline = started + Duration::from_secs(300 + target / 100);
    let mut first: Option<Instant> = None;
    let bar = progress::bar(target, name, "relayed", a.json);
    let done = loop {
        let now = Instant::now();
        let s = running
            .iter()
            .map(|(stats, _, _)| stats.snapshot())
            .fold(RelayStatsSnapshot::default(), add);
        bar.set_position(s.published);
        if s.published > 0 && first.is_none() {
            first = Some(now);
        }
        if s.published >= target {
            break Ok(now);
        }
        if s.abandoned + s.parked + s.halted > 0 {
            break Err(anyhow::anyhow!(
                "{name}: records given up on (abandoned {}, parked {}, halted keys {})",
                s.abandoned,
                s.parked,
                s.halted
            ));
        }
        if now > deadline {
            break Err(anyhow::anyhow!(
                "{name}: timed out with {} of {target} records published",
                s.published
            ));
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    };
    if done.is_ok() {
        bar.finish();
    } else {
        bar.abandon();
    }
    let mut stats = RelayStatsSnapshot::default();
    for (_, stop, task) in running {
        let _ = stop.send(());
        stats = add(stats, task.await??);
    }
    let last = done?;
    let first = first.unwrap_or(last);
    let secs = last.duration_since(first).as_secs_f64();
    let wall_secs = last.duration_since(started).as_secs_f64();

    // Every record marked published exactly once: the relays' counters
    // (a mark changes a pending row only) and the table agree with the
    // staged count, and no row is in another state.
    let mut published_rows = 0u64;
    let mut other_rows = 0u64;
    let rows = sqlx::query(AssertSqlSafe(format!(
        "select state, count(*) from {schema}.records group by state"
    )))
    .fetch_all(outbox.pool())
    .await?;
    for r in rows {
        let (state, n): (String, i64) = (r.get(0), r.get(1));
        if state == "published" {
            published_rows += n as u64;
        } else {
            other_rows += n as u64;
        }
    }
    published_rows += stats.retention_deleted;
    // The relay marks a record after the broker confirmed it and starts the
    // key's next record only after the mark: per key, marks in sequence
    // order mean publishes in sequence order.
    let inversions = if stats.retention_deleted == 0 {
        let n = scalar(
            &outbox,
            format!(
                "select count(*) from (select resolved_at, lag(resolved_at) over \
                 (partition by category, key order by seq) as prev from {schema}.records) x \
                 where resolved_at < prev"
            ),
        )
        .await?;
        Some(n as u64)
    } else {
        None
    };
    if !a.keep {
        sqlx::query(AssertSqlSafe(format!("drop schema {schema} cascade")))
            .execute(outbox.pool())
            .await?;
    }
    Ok(Side {
        recs_per_s: target as f64 / secs.max(1e-9),
        secs,
        wall_secs,
        stage_secs,
        marked: stats.published,
        published_rows,
        other_rows,
        inversions,
        stats,
    })
}

pub(crate) async fn run(a: OutboxBenchArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        a.relays >= 1 && a.keys >= 1 && a.records >= 1 && a.concurrency >= 1,
        "relays, keys, records and concurrency must be >= 1"
    );
    let transport = keyorder::connect(&run::with_setup(&a.to))
        .await?
        .transport_name()
        .to_owned();
    let ordered = side(&a, true).await?;
    let unordered = side(&a, false).await?;
    let ratio = ordered.recs_per_s / unordered.recs_per_s.max(1e-9);
    println!(
        "outbox relay -> {transport}: keys={} records={} relays={} concurrency={} pool={} retention_batch={}",
        a.keys, a.records, a.relays, a.concurrency, a.pool, a.retention_batch
    );
    for (name, s) in [("ordered", &ordered), ("unordered", &unordered)] {
        let inversions = s.inversions.map_or_else(|| "-".to_owned(), |n| n.to_string());
        println!(
            "  {name:<9} {:>9.0} rec/s ({:.2} s; {:.2} s from relay start; staged in {:.2} s)  \
             published {}/{}  other states {}  mark-order inversions {inversions}  blocked {} retries {} fenced {}",
            s.recs_per_s,
            s.secs,
            s.wall_secs,
            s.stage_secs,
            s.published_rows,
            a.records,
            s.other_rows,
            s.stats.blocked,
            s.stats.retries,
            s.stats.fenced
        );
    }
    println!("  ratio (ordered/unordered) {ratio:.2}");
    if a.json {
        let side_json = |s: &Side| {
            json!({
                "recs_per_s": s.recs_per_s,
                "secs": s.secs,
                "wall_secs": s.wall_secs,
                "stage_secs": s.stage_secs,
                "published": s.published_rows,
                "other_states": s.other_rows,
                "mark_order_inversions": s.inversions,
                "blocked": s.stats.blocked,
                "retries": s.stats.retries,
            })
        };
        println!(
            "{}",
            json!({
                "transport": transport,
                "keys": a.keys,
                "records": a.records,
                "relays": a.relays,
                "concurrency": a.concurrency,
                "pool": a.pool,
                "retention_batch": a.retention_batch,
                "ordered": side_json(&ordered),
                "unordered": side_json(&unordered),
                "ratio": ratio,
            })
        );
    }
    let mut defects = Vec::new();
    for (name, s) in [("ordered", &ordered), ("unordered", &unordered)] {
        if s.marked != a.records || s.published_rows != a.records || s.other_rows > 0 {
            defects.push(format!(
                "{name}: {} marked, {} published rows, {} in other states, of {} staged",
                s.marked, s.published_rows, s.other_rows, a.records
            ));
        }
    }
    if ordered.inversions.is_some_and(|n| n > 0) {
        defects.push("ordered: a key's record was marked published before an earlier one".into());
    }
    anyhow::ensure!(defects.is_empty(), "{}", defects.join("; "));
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::{run, OutboxBenchArgs};
    use crate::{Cli, Command};

    fn parse(args: &[&str]) -> OutboxBenchArgs {
        let mut all = vec!["keyorder", "outbox", "bench"];
        all.extend_from_slice(args);
        match Cli::try_parse_from(all).unwrap().command {
            Command::Outbox(o) => match o.verb {
                crate::outbox::Verb::Bench(b) => b,
                other => panic!("parsed as {other:?}"),
            },
            other => panic!("parsed as {other:?}"),
        }
    }

    #[test]
    fn outbox_bench_parses() {
        let a = parse(&[
            "--db",
            "postgres://postgres@127.0.0.1:5432/test",
            "--to",
            "redis://127.0.0.1:6379",
            "--records",
            "500",
            "--relays",
            "2",
        ]);
        assert_eq!(a.to, "redis://127.0.0.1:6379");
        assert_eq!((a.keys, a.records, a.relays, a.retention_batch), (100, 500, 2, 0));
    }

    /// The whole command on `memory://` and the real PostgreSQL server:
    /// both sides publish and mark every record; the ordered one in order.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn outbox_bench_runs_on_memory() {
        let db = std::env::var("POSTGRES_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
        let a = parse(&[
            "--db",
            &db,
            "--to",
            "memory://",
            "--keys",
            "10",
            "--records",
            "400",
            "--pool",
            "4",
        ]);
        run(a).await.unwrap();
    }
}
