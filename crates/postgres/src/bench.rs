//! `PgBenchHints`: how a demo or bench runs `postgres://`.

use keyorder_core::raw::{with_default, BenchHints};

/// The [`BenchHints`] of `postgres://`: a demo or bench applies the
/// migrations itself (`migrate=true`), and its baseline is one table with
/// `FOR UPDATE SKIP LOCKED` competing consumers (`layout=plain`), unless the
/// URL says otherwise.
#[derive(Debug, Clone, Copy, Default)]
pub struct PgBenchHints;

impl BenchHints for PgBenchHints {
    fn setup(&self, url: &str, _group: &str) -> String {
        with_default(url, "migrate", "true")
    }

    fn baseline(&self, url: &str, _group: &str, _instances: usize) -> String {
        with_default(url, "layout", "plain")
    }
}
