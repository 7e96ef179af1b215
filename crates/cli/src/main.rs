//! `keyorder`: the demo, the benchmark, and operator actions over any transport.

mod bench;
mod clock;
mod demo;
mod failover;
mod ops;
mod outbox;
mod outbox_bench;
mod run;

use clap::{Parser, Subcommand};

/// Ordered within a key, parallel across keys, across every instance.
#[derive(Debug, Parser)]
#[command(name = "keyorder", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
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

fn main() -> anyhow::Result<()> {
    // `keyorder failover` re-executes this binary as its worker process.
    keyorder_check::worker::run_if_worker(|url| Box::pin(async move { keyorder::connect(&url).await }));
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("KEYORDER_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        // Colours only on a terminal: a log file or a pipe gets plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = Cli::parse();
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(async move {
        match cli.command {
            Command::Demo(a) => demo::run(a).await,
            Command::Bench(a) => bench::run(a).await,
            Command::Scopes(t) => ops::scopes(t).await,
            Command::Head(a) => ops::head(a).await,
            Command::HotKeys(a) => ops::hot_keys(a).await,
            Command::DeadLetters(t) => ops::dead_letters(t).await,
            Command::Groups(a) => ops::groups(a).await,
            Command::DeleteQueue(a) => ops::delete_queue(a).await,
            Command::Outbox(a) => outbox::run(a).await,
            Command::Failover(a) => failover::run(a).await,
        }
    })
}
