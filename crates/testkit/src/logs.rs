//! What a test binary logged (INFO and above, or every level; no colours),
//! to check what a user is told: call [`install`] (or [`install_every_level`])
//! first in each test that logs, then read [`text`].

use std::sync::{Arc, Mutex, OnceLock};

fn sink(level: tracing::Level) -> &'static Arc<Mutex<Vec<u8>>> {
    static LOG: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    LOG.get_or_init(|| {
        let log: Arc<Mutex<Vec<u8>>> = Arc::default();
        let to = log.clone();
        let _ = tracing_subscriber::fmt()
            .with_max_level(level)
            .with_ansi(false)
            .with_writer(move || Writer(to.clone()))
            .try_init();
        log
    })
}

/// Captures this process's log from now on, INFO and above (the first
/// install in a process decides the level).
pub fn install() {
    sink(tracing::Level::INFO);
}

/// Captures this process's log from now on at every level, TRACE included,
/// with the `log` records of the drivers (the first install in a process
/// decides the level).
pub fn install_every_level() {
    sink(tracing::Level::TRACE);
}

/// Everything captured so far.
pub fn text() -> String {
    String::from_utf8_lossy(&sink(tracing::Level::INFO).lock().unwrap_or_else(|e| e.into_inner())).into_owned()
}

struct Writer(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Writer {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
