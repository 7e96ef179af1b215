//! What a test binary logged (INFO and above, no colours), to check what a
//! user is told: call [`install`] first in each test that logs, then read
//! [`text`].

use std::sync::{Arc, Mutex, OnceLock};

fn sink() -> &'static Arc<Mutex<Vec<u8>>> {
    static LOG: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    LOG.get_or_init(|| {
        let log: Arc<Mutex<Vec<u8>>> = Arc::default();
        let to = log.clone();
        let _ = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::INFO)
            .with_ansi(false)
            .with_writer(move || Writer(to.clone()))
            .try_init();
        log
    })
}

/// Captures this process's log from now on (once per process).
pub fn install() {
    sink();
}

/// Everything captured so far.
pub fn text() -> String {
    String::from_utf8_lossy(&sink().lock().unwrap_or_else(|e| e.into_inner())).into_owned()
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
