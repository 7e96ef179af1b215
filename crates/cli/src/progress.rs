//! Progress for long work, on standard error and only on a terminal.
//!
//! A bar draws on standard error through indicatif's
//! [`ProgressDrawTarget::stderr`], which hides itself when standard error is
//! no terminal (a pipe, a file) or `TERM` is unset or `dumb`: nothing of it
//! reaches a log or standard output. A run with `--json` draws none at all,
//! so a terminal shows only what the command prints. Log lines written while
//! a bar is drawn go through [`LogWriter`], which takes the bar off the
//! screen for the line and draws it again below it.

use std::io::{self, Write};
use std::sync::Mutex;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle, WeakProgressBar};

/// The bar drawn last (one at a time is drawn on the terminal).
static ACTIVE: Mutex<Option<WeakProgressBar>> = Mutex::new(None);

fn register(pb: ProgressBar) -> ProgressBar {
    if !pb.is_hidden() {
        if let Ok(mut active) = ACTIVE.lock() {
            *active = Some(pb.downgrade());
        }
    }
    pb
}

/// Runs `f` (which writes to stderr) with the bar being drawn, if any, taken
/// off the screen, and draws it again after.
pub(crate) fn suspend<R>(f: impl FnOnce() -> R) -> R {
    let bar = ACTIVE
        .lock()
        .ok()
        .and_then(|a| a.as_ref().and_then(WeakProgressBar::upgrade))
        .filter(|b| !b.is_finished());
    match bar {
        Some(b) => b.suspend(f),
        None => f(),
    }
}

/// Log lines held while a full-screen view (`keyorder top`) owns the
/// terminal: `None` when lines go straight to standard error.
static HELD: Mutex<Option<Vec<u8>>> = Mutex::new(None);

/// At most this much of the log is held (the newest lines are dropped past
/// it, and the drop is said once the log is let go).
const HELD_LIMIT: usize = 64 * 1024;

/// Holds log lines back from standard error until dropped, then writes
/// them: for a view that draws on the whole terminal, which a log line
/// would tear.
pub(crate) struct HoldLogs(());

impl HoldLogs {
    pub(crate) fn new() -> HoldLogs {
        if let Ok(mut held) = HELD.lock() {
            held.get_or_insert_with(Vec::new);
        }
        HoldLogs(())
    }
}

impl Drop for HoldLogs {
    fn drop(&mut self) {
        let held = HELD.lock().ok().and_then(|mut h| h.take());
        if let Some(lines) = held.filter(|l| !l.is_empty()) {
            let mut err = io::stderr().lock();
            let _ = err.write_all(&lines);
            if lines.len() >= HELD_LIMIT {
                let _ = writeln!(err, "(log lines after the first {HELD_LIMIT} bytes were dropped)");
            }
        }
    }
}

/// The log's writer: standard error, around the bar being drawn.
pub(crate) struct LogWriter;

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for LogWriter {
    type Writer = LogLine;

    fn make_writer(&'a self) -> LogLine {
        LogLine
    }
}

/// One log line's writes (the formatter writes a line at once).
pub(crate) struct LogLine;

impl Write for LogLine {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if let Ok(mut held) = HELD.lock() {
            if let Some(lines) = held.as_mut() {
                let room = HELD_LIMIT.saturating_sub(lines.len());
                lines.extend_from_slice(&buf[..buf.len().min(room)]);
                return Ok(buf.len());
            }
        }
        suspend(|| io::stderr().lock().write_all(buf))?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        io::stderr().flush()
    }
}

/// A bar counting to `len`: `<prefix> <msg> [=====>    ] pos/len rate`.
/// Hidden with `quiet` (`--json`) and wherever standard error is no terminal.
pub(crate) fn bar(len: u64, prefix: &str, msg: &str, quiet: bool) -> ProgressBar {
    let style = ProgressStyle::with_template("{prefix} {msg} [{bar:40}] {pos}/{len} {per_sec} {elapsed}")
        .expect("a valid template")
        .progress_chars("=> ");
    register(
        ProgressBar::with_draw_target(Some(len), target(quiet))
            .with_style(style)
            .with_prefix(prefix.to_owned())
            .with_message(msg.to_owned()),
    )
}

/// A spinner with a message, for work with no known length (waits).
pub(crate) fn spinner(prefix: &str, msg: &str, quiet: bool) -> ProgressBar {
    let style = ProgressStyle::with_template("{prefix} {spinner} {msg} {elapsed}").expect("a valid template");
    let pb = ProgressBar::with_draw_target(None, target(quiet))
        .with_style(style)
        .with_prefix(prefix.to_owned())
        .with_message(msg.to_owned());
    pb.enable_steady_tick(Duration::from_millis(120));
    register(pb)
}

fn target(quiet: bool) -> ProgressDrawTarget {
    if quiet {
        ProgressDrawTarget::hidden()
    } else {
        // Hidden by indicatif itself when stderr is not a terminal.
        ProgressDrawTarget::stderr()
    }
}

/// Keeps `bar` at `count()` until dropped (every 100 ms): for counters the
/// work updates itself, such as the recorder's applied count.
pub(crate) struct Follow(tokio::task::JoinHandle<()>);

impl Follow {
    pub(crate) fn new(bar: &ProgressBar, count: impl Fn() -> u64 + Send + 'static) -> Follow {
        let bar = bar.clone();
        Follow(tokio::spawn(async move {
            loop {
                bar.set_position(count());
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }))
    }
}

impl Drop for Follow {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_json_run_draws_nothing() {
        assert!(super::bar(10, "p", "m", true).is_hidden());
        assert!(super::spinner("p", "m", true).is_hidden());
    }
}
