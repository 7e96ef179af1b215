//! `keyorder outbox`: the transactional outbox's status, held keys and
//! abandoned records, the operator's retry and discard, and the relay
//! benchmark. Keys show as labels (`k#...`), never as values.

use std::time::Duration;

use clap::{Args, Subcommand};
use keyorder::redact::{quoted, text};
use keyorder_outbox::{Outbox, OutboxConfig, DEFAULT_SCHEMA};

/// Where the outbox lives.
#[derive(Debug, Args)]
pub(crate) struct Db {
    /// The outbox's PostgreSQL URL (a plain `postgres://` URL).
    #[arg(long, hide_env_values = true, env = "KEYORDER_OUTBOX_URL")]
    url: String,
    /// The outbox's schema.
    #[arg(long, default_value = DEFAULT_SCHEMA)]
    schema: String,
}

#[derive(Debug, Args)]
pub(crate) struct OutboxArgs {
    #[command(subcommand)]
    pub(crate) verb: Verb,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Verb {
    /// Pending records, the oldest one's age, abandoned and parked records, held keys.
    Status(Db),
    /// Keys held on a poison record (policy `Halt`): their head record and why.
    Held(Db),
    /// Records given up on (abandoned or parked), by id.
    Abandoned {
        #[command(flatten)]
        db: Db,
        /// List records after this id (paging).
        #[arg(long, default_value_t = 0)]
        after: i64,
        /// How many to list (at most 10000).
        #[arg(long, default_value_t = 100)]
        limit: usize,
    },
    /// Put an abandoned, parked or held record back to pending: the relays
    /// publish it again, in its key's sequence order.
    Retry {
        #[command(flatten)]
        db: Db,
        /// The record id (`held` or `abandoned` prints it).
        id: i64,
    },
    /// Discard a held, abandoned or parked record: never published; a held
    /// key's later records flow.
    Discard {
        #[command(flatten)]
        db: Db,
        /// The record id (`held` or `abandoned` prints it).
        id: i64,
    },
    /// Relay throughput into a transport: the ordered relay beside one that
    /// ignores per-key order, same records and settings, same run; prints
    /// records/s of both and the ratio.
    Bench(crate::outbox_bench::OutboxBenchArgs),
}

async fn open(db: &Db) -> anyhow::Result<Outbox> {
    let cfg = OutboxConfig {
        schema: db.schema.clone(),
        ..OutboxConfig::default()
    };
    Ok(Outbox::connect(&db.url, 1, cfg).await?)
}

fn age(d: Option<Duration>) -> String {
    d.map_or_else(|| "-".to_owned(), |d| format!("{:.1}s", d.as_secs_f64()))
}

pub(crate) async fn run(a: OutboxArgs) -> anyhow::Result<()> {
    match a.verb {
        Verb::Status(db) => {
            let s = open(&db).await?.status().await?;
            println!("pending             {}", s.pending);
            println!("oldest pending age  {}", age(s.oldest_pending_age));
            println!("abandoned           {}", s.abandoned);
            println!("parked              {}", s.parked);
            println!("held keys           {}", s.held_keys);
        }
        Verb::Held(db) => {
            let held = open(&db).await?.halted().await?;
            if held.is_empty() {
                println!("no held keys");
            }
            for h in held {
                println!(
                    "{} {} record={} attempts={} reason={}",
                    text(&h.category),
                    h.label,
                    h.record_id,
                    h.attempts,
                    quoted(&h.reason)
                );
            }
        }
        Verb::Abandoned { db, after, limit } => {
            let list = open(&db).await?.abandoned(after, limit).await?;
            if list.is_empty() {
                println!("no abandoned or parked records");
            }
            for r in list {
                println!(
                    "{} {} {} seq={} {} reason={}",
                    r.record_id,
                    text(&r.category),
                    r.label,
                    r.seq,
                    r.state,
                    quoted(&r.reason)
                );
            }
        }
        Verb::Retry { db, id } => {
            let acted = open(&db).await?.retry(id).await?;
            println!("retried: {acted}, now pending");
        }
        Verb::Discard { db, id } => {
            let acted = open(&db).await?.discard(id).await?;
            println!("discarded: {acted}");
        }
        Verb::Bench(b) => crate::outbox_bench::run(b).await?,
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::Verb;
    use crate::{Cli, Command};

    fn verb(args: &[&str]) -> Verb {
        let mut all = vec!["keyorder", "outbox"];
        all.extend_from_slice(args);
        match Cli::try_parse_from(all).unwrap().command {
            Command::Outbox(a) => a.verb,
            other => panic!("parsed as {other:?}"),
        }
    }

    #[test]
    fn outbox_commands_parse() {
        let url = "postgres://postgres@127.0.0.1:5432/test";
        match verb(&["status", "--url", url]) {
            Verb::Status(db) => assert_eq!((db.url.as_str(), db.schema.as_str()), (url, "keyorder_outbox")),
            other => panic!("{other:?}"),
        }
        assert!(matches!(verb(&["held", "--url", url, "--schema", "s"]), Verb::Held(db) if db.schema == "s"));
        assert!(matches!(
            verb(&["abandoned", "--url", url, "--after", "7", "--limit", "5"]),
            Verb::Abandoned { after: 7, limit: 5, .. }
        ));
        assert!(matches!(
            verb(&["retry", "--url", url, "42"]),
            Verb::Retry { id: 42, .. }
        ));
        assert!(matches!(
            verb(&["discard", "42", "--url", url]),
            Verb::Discard { id: 42, .. }
        ));
    }

    #[test]
    fn bad_outbox_commands_are_refused() {
        for bad in [
            vec!["keyorder", "outbox", "retry", "--url", "postgres://x"],
            vec!["keyorder", "outbox", "retry", "--url", "postgres://x", "abc"],
            vec!["keyorder", "outbox", "vacuum", "--url", "postgres://x"],
        ] {
            assert!(Cli::try_parse_from(bad).is_err());
        }
    }
}
