//! `RedisBenchHints`: how a demo or bench runs `redis://`.

use keyorder_core::raw::{sets_option, BenchHints};

/// The [`BenchHints`] of `redis://`: the bench's baseline reads one stream
/// with a competing-consumer group (`layout=single`), unless the URL names a
/// layout.
#[derive(Debug, Clone, Copy, Default)]
pub struct RedisBenchHints;

impl BenchHints for RedisBenchHints {
    fn baseline(&self, url: &str, _group: &str, _instances: usize) -> String {
        if sets_option(url, "layout") {
            return url.to_owned();
        }
        let sep = if url.contains('?') {
            "&"
        } else if url.ends_with('/') {
            "?"
        } else {
            "/?"
        };
        format!("{url}{sep}layout=single")
    }
}
