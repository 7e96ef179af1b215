//! `RabbitBenchHints`: how a demo or bench runs `amqp://`.

use std::time::Duration;

use keyorder_core::raw::{sets_option, with_default, BenchHints};

/// The [`BenchHints`] of `amqp://` and `amqps://`.
///
/// - Set-up: the consistent-hash topology with 8 queues, what a demo or
///   bench runs by default, and the run's consumer group declared by its
///   publishers (`groups=`): each group has queues of its own, declared when
///   its subscription is built or by a publisher that names it, and a bench
///   publishes its backlog before its subscriptions are built.
/// - Baseline: one queue with competing consumers (`topology=plain`), whose
///   `instances` consumers share the ordered side's total prefetch (its
///   active queues' prefetch, summed), so both sides hold as many
///   unacknowledged messages.
/// - A run's own categories expire after the given time unused
///   (`expires_ms`, the queues' `x-expires`).
#[derive(Debug, Clone, Copy, Default)]
pub struct RabbitBenchHints;

impl BenchHints for RabbitBenchHints {
    fn setup(&self, url: &str, group: &str) -> String {
        // The hash topology with 8 queues unless the URL names a topology;
        // a queue count it names is kept either way.
        let url = if sets_option(url, "topology") {
            url.to_owned()
        } else {
            with_default(&with_default(url, "topology", "hash"), "queues", "8")
        };
        with_default(&url, "groups", group)
    }

    fn baseline(&self, url: &str, group: &str, instances: usize) -> String {
        let mut u = match url::Url::parse(&self.setup(url, group)) {
            Ok(u) => u,
            Err(_) => return url.to_owned(),
        };
        let opt = |name: &str| u.query_pairs().find(|(k, _)| k == name).map(|(_, v)| v.into_owned());
        let prefetch: usize = opt("prefetch").and_then(|v| v.parse().ok()).unwrap_or(32);
        let queues: usize = match opt("topology").as_deref() {
            Some("sac") => 1,
            Some("plain") => instances,
            _ => opt("queues").and_then(|v| v.parse().ok()).unwrap_or(8),
        };
        let share = (prefetch * queues / instances.max(1)).clamp(1, usize::from(u16::MAX));
        let keep: Vec<(String, String)> = u
            .query_pairs()
            .filter(|(k, _)| k != "topology" && k != "queues" && k != "prefetch")
            .map(|(k, v)| (k.into_owned(), v.into_owned()))
            .collect();
        u.set_query(None);
        u.query_pairs_mut()
            .extend_pairs(keep)
            .append_pair("topology", "plain")
            .append_pair("prefetch", &share.to_string());
        u.to_string()
    }

    fn expiring(&self, url: &str, expiry: Duration) -> String {
        with_default(url, "expires_ms", &expiry.as_millis().to_string())
    }
}
