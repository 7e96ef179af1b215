//! `keyorder`: the demo, the benchmark, and operator actions over any transport.

mod bench;
mod clock;
mod demo;
mod failover;
mod handover;
mod ops;
mod outbox;
mod outbox_bench;
mod progress;
mod run;
mod top;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Ordered within a key, parallel across keys, across every instance.
#[derive(Debug, Parser)]
#[command(name = "keyorder", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Serve Prometheus metrics (`/metrics`) and probes (`/livez`,
    /// `/readyz`, `/healthz`) on this address while the command runs, e.g.
    /// `127.0.0.1:9000`: for the long-running commands (`bench`, `demo`,
    /// `failover`, `outbox bench`).
    #[arg(long, global = true, value_name = "ADDR")]
    metrics_addr: Option<String>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Several consumer instances, many keys, a randomly slow handler; ends
    /// with the checker's verdict and the throughput.
    Demo(demo::DemoArgs),
    /// Ordered subscription vs. the transport's plain competing consumers, same run.
    Bench(bench::BenchArgs),
    /// Live scopes (partitions, slots, queues) with owner, generation and lag.
    Scopes(ops::Target),
    /// Halted keys: show their heads, skip, dead-letter or resume them.
    Head(ops::HeadArgs),
    /// A live view in the terminal: scopes with owner, generation, lag and
    /// halted heads, the hot keys, and lag over time.
    Top(top::TopArgs),
    /// Keys holding the largest share of the backlog.
    HotKeys(ops::HotKeysArgs),
    /// Dead-lettered messages of a group.
    DeadLetters(ops::Target),
    /// A category's consumer groups: list them, remove a stopped one.
    Groups(ops::GroupsArgs),
    /// Delete a category and everything kept for it (PostgreSQL, RabbitMQ); needs --yes.
    DeleteQueue(ops::DeleteQueueArgs),
    /// The transactional outbox: status, held keys, abandoned records; retry or discard one; relay bench.
    Outbox(outbox::OutboxArgs),
    /// Fail-over time: `kill -9` an owner inside a handler, time the takeover.
    Failover(failover::FailoverArgs),
}

/// The log filter without `KEYORDER_LOG`: warnings, without the clients'
/// own logs that the adapters report in their own words. A directive's
/// target matches by prefix: `lapin::channel=off` alone would also silence
/// `lapin::channels`, where lapin logs a connection's error at ERROR (a
/// reset by a broker that went away), which `lapin::channels=warn` keeps.
const DEFAULT_LOG: &str = "warn,librdkafka=off,rdkafka=off,lapin::channel=off,lapin::channels=warn";

fn main() -> ExitCode {
    // `keyorder failover` re-executes this binary as its worker process.
    keyorder_check::worker::run_if_worker(|url| Box::pin(async move { keyorder::connect(&url).await }));
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("KEYORDER_LOG")
                // librdkafka logs every failed connection attempt (hundreds
                // of lines while a broker is unreachable) and the adapter
                // reports the failure itself: its log is KEYORDER_LOG's to
                // ask for (`KEYORDER_LOG=warn,librdkafka=warn,rdkafka=warn`).
                // lapin logs every channel the broker closes at ERROR, and
                // the RabbitMQ adapter closes channels on purpose (a passive
                // check of a queue that may be missing, a probe of another
                // instance's exclusive queue); the adapter reports what
                // fails itself.
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(DEFAULT_LOG)),
        )
        // Standard error, around a progress bar being drawn.
        .with_writer(progress::LogWriter)
        // Colours only on a terminal, and not under NO_COLOR: a log file or a
        // pipe gets plain text.
        .with_ansi(colours(
            std::io::IsTerminal::is_terminal(&std::io::stderr()),
            std::env::var_os("NO_COLOR").as_deref(),
        ))
        .init();
    // A usage error is clap's: its usage text, exit code 2.
    let cli = Cli::parse();
    match execute(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", one_line(&e));
            ExitCode::FAILURE
        }
    }
}

/// The `--metrics-addr` endpoint, while the command runs.
static ENDPOINT: std::sync::OnceLock<keyorder::ops::Endpoint> = std::sync::OnceLock::new();

/// Registers a subscription with the `--metrics-addr` endpoint (its health
/// on the probes, its scopes' gauges); nothing without one.
pub(crate) fn watch(subscription: &keyorder::Subscription, admin: std::sync::Arc<dyn keyorder::Admin>) {
    if let Some(endpoint) = ENDPOINT.get() {
        endpoint.register(subscription, admin);
    }
}

/// Stops reporting `category`'s subscriptions of `group` on the endpoint
/// (a bench side that ended while the command goes on).
pub(crate) fn unwatch(category: &str, group: &str) {
    if let Some(endpoint) = ENDPOINT.get() {
        endpoint.unregister(category, group);
    }
}

fn execute(cli: Cli) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(async move {
        // Before any subscription starts: its latency histograms bind to
        // the recorder installed now.
        if let Some(addr) = &cli.metrics_addr {
            let endpoint = keyorder::ops::serve(addr).await?;
            tracing::info!(addr = %endpoint.local_addr(), "serving /metrics");
            let _ = ENDPOINT.set(endpoint);
        }
        match cli.command {
            Command::Demo(a) => demo::run(a).await,
            Command::Bench(a) => bench::run(a).await,
            Command::Scopes(t) => ops::scopes(t).await,
            Command::Head(a) => ops::head(a).await,
            Command::Top(a) => top::run(a).await,
            Command::HotKeys(a) => ops::hot_keys(a).await,
            Command::DeadLetters(t) => ops::dead_letters(t).await,
            Command::Groups(a) => ops::groups(a).await,
            Command::DeleteQueue(a) => ops::delete_queue(a).await,
            Command::Outbox(a) => outbox::run(a).await,
            Command::Failover(a) => failover::run(a).await,
        }
    })
}

/// Whether log lines get colours: on a terminal, unless `NO_COLOR` is set
/// to something (<https://no-color.org>: an empty value does not count).
pub(crate) fn colours(terminal: bool, no_color: Option<&std::ffi::OsStr>) -> bool {
    terminal && no_color.is_none_or(|v| v.is_empty())
}

/// A user error as one line: the message and its causes joined by `": "`,
/// a cause left out where the message before it already says it (errors
/// that print their source), with control characters and line breaks
/// escaped, so that nothing a broker or a message said can forge a line.
pub(crate) fn one_line(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain() {
        let text = keyorder::redact::text(&cause.to_string());
        if text.is_empty() || line.contains(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    line
}

#[cfg(test)]
mod tests {
    use std::ffi::OsStr;

    #[test]
    fn causes_join_on_one_line_without_repeats() {
        let root = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "connection refused");
        let e = anyhow::Error::new(root)
            .context("connecting to redis://127.0.0.1:1")
            .context("listing scopes");
        assert_eq!(
            super::one_line(&e),
            "listing scopes: connecting to redis://127.0.0.1:1: connection refused"
        );
        // A message that already holds its cause's text does not repeat it.
        let e = anyhow::Error::new(std::io::Error::other("timed out")).context("connect failed: timed out");
        assert_eq!(super::one_line(&e), "connect failed: timed out");
    }

    #[test]
    fn a_line_break_or_escape_in_a_message_stays_inert() {
        let e = anyhow::anyhow!("bad\nFORGED line \u{1b}[2J");
        let line = super::one_line(&e);
        assert!(!line.contains('\n') && !line.contains('\u{1b}'), "{line:?}");
        assert!(line.contains("FORGED"), "{line:?}");
    }

    /// The default filter drops lapin's `Channel closed` (target
    /// `lapin::channel`) but no other log: an `EnvFilter` target matches
    /// by prefix, so `lapin::channel=off` alone also silenced
    /// `lapin::channels`, where lapin logs a connection's error (a reset
    /// by a broker that went away) at ERROR.
    #[test]
    fn the_default_filter_keeps_lapins_connection_errors() {
        use tracing_subscriber::layer::SubscriberExt;
        let subscriber = tracing_subscriber::registry().with(tracing_subscriber::EnvFilter::new(super::DEFAULT_LOG));
        tracing::subscriber::with_default(subscriber, || {
            assert!(!tracing::enabled!(target: "lapin::channel", tracing::Level::ERROR));
            assert!(!tracing::enabled!(target: "librdkafka", tracing::Level::ERROR));
            assert!(
                tracing::enabled!(target: "lapin::channels", tracing::Level::ERROR),
                "lapin::channels"
            );
            assert!(
                tracing::enabled!(target: "lapin::io_loop", tracing::Level::ERROR),
                "lapin::io_loop"
            );
            assert!(
                tracing::enabled!(target: "keyorder_rabbitmq", tracing::Level::WARN),
                "keyorder_rabbitmq"
            );
        });
    }

    #[test]
    fn colours_only_on_a_terminal_without_no_color() {
        assert!(super::colours(true, None));
        assert!(super::colours(true, Some(OsStr::new(""))));
        assert!(!super::colours(true, Some(OsStr::new("1"))));
        assert!(!super::colours(false, None));
    }
}
