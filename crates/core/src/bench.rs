//! What a tool that demonstrates or measures a transport (the `keyorder`
//! command's `demo` and `bench`) needs to know about it, declared by the
//! adapter, so that the tool never reads a URL's scheme.
//!
//! The hints are declared from the URL alone, without a connection: the
//! set-up ([`BenchHints::setup`]) changes the URL the tool connects with.

use std::fmt;
use std::time::Duration;

/// How a demo or a bench runs a transport: implemented by each adapter (the
/// facade's `keyorder::bench_hints` finds it from a URL's scheme).
///
/// Every method has the default of a transport that needs nothing: the URL
/// as it is, its unordered subscription as the plain baseline, no spacing
/// between instances.
///
/// ```
/// use keyorder_core::raw::{BenchHints, DefaultBenchHints};
/// let hints = DefaultBenchHints;
/// assert_eq!(hints.baseline("memory://", "keyorder", 2), "memory://");
/// assert!(hints.launch_spacing().is_zero());
/// ```
pub trait BenchHints: Send + Sync + fmt::Debug {
    /// The URL a demo or bench connects with: `url` with the set-up the
    /// adapter needs for a run whose subscriptions use consumer group
    /// `group` (migrations, the topology it runs by default), where `url`
    /// does not already say otherwise.
    fn setup(&self, url: &str, group: &str) -> String {
        let _ = group;
        url.to_owned()
    }

    /// The URL of the plain, unordered competing consumers on the same
    /// broker: the bench's baseline beside the ordered side, for `instances`
    /// consumers of group `group`, from `url` as the user gave it (before
    /// [`setup`](Self::setup)). The default is `url` itself: the transport's
    /// unordered subscription is its plain path already.
    fn baseline(&self, url: &str, group: &str, instances: usize) -> String {
        let _ = (group, instances);
        url.to_owned()
    }

    /// `url` for categories made for one run and deleted when it ends: where
    /// the adapter can ask the broker to drop them itself after `expiry`
    /// unused, it does (the fallback for an interrupted run).
    fn expiring(&self, url: &str, expiry: Duration) -> String {
        let _ = expiry;
        url.to_owned()
    }

    /// The time between launching one consumer instance and the next, the
    /// same on both sides of a bench (zero unless the broker's group
    /// handling makes instances that start together wait).
    fn launch_spacing(&self) -> Duration {
        Duration::ZERO
    }

    /// Whether every connect to the URL reaches the same broker. Where each
    /// connect is a broker of its own (`memory://`), a tool's instances
    /// share one client.
    fn connects_share_broker(&self) -> bool {
        true
    }
}

/// The hints of a transport that needs none: every default of
/// [`BenchHints`].
#[derive(Debug, Clone, Copy, Default)]
pub struct DefaultBenchHints;

impl BenchHints for DefaultBenchHints {}

/// Whether `url`'s query string sets the option `name` (an exact key, not
/// a part of another key, a password or a path).
///
/// ```
/// use keyorder_core::raw::sets_option;
/// assert!(sets_option("postgres://h/db?a=1&layout=plain", "layout"));
/// assert!(!sets_option("postgres://u:layout=x@h/db?xlayout=1", "layout"));
/// ```
pub fn sets_option(url: &str, name: &str) -> bool {
    let query = url.split_once('?').map_or("", |(_, q)| q);
    let query = query.split('#').next().unwrap_or("");
    query.split('&').any(|pair| pair.split('=').next() == Some(name))
}

/// `url` with the query option `name=value` added, unless it already sets
/// `name` ([`sets_option`]): how an adapter's [`BenchHints`] add their
/// defaults.
///
/// ```
/// use keyorder_core::raw::with_default;
/// assert_eq!(with_default("postgres://h/db", "migrate", "true"), "postgres://h/db?migrate=true");
/// assert_eq!(with_default("postgres://h/db?migrate=false", "migrate", "true"), "postgres://h/db?migrate=false");
/// assert_eq!(with_default("postgres://h/db?xmigrate=1", "migrate", "true"), "postgres://h/db?xmigrate=1&migrate=true");
/// ```
pub fn with_default(url: &str, name: &str, value: &str) -> String {
    if sets_option(url, name) {
        return url.to_owned();
    }
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}{name}={value}")
}
