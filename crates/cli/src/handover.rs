//! The hand-over time on Redis, read from the broker: how long after the
//! instances were launched the last instance held its share of the keys'
//! leases (each key is a lease there, so a join moves thousands of them).

use std::time::{Duration, Instant};

use keyorder::redis::Names;
use tokio::task::JoinHandle;

/// Lease keys read per `MGET`.
const PER_CALL: usize = 1_000;
/// Between two looks at the leases.
const EVERY: Duration = Duration::from_millis(25);

/// Watches the leases of `keys` in `category` for `group` until the
/// instance `who` holds `share` of them; the task's answer is how long that
/// took, or `None` when it did not within `limit` (or Redis could not be
/// read: the bench goes on without the figure).
pub(crate) fn watch(
    url: &str,
    category: &str,
    group: &str,
    keys: &[String],
    who: String,
    share: usize,
    limit: Duration,
) -> anyhow::Result<JoinHandle<Option<Duration>>> {
    let client = redis::Client::open(url)?;
    let names = Names::new(category)?;
    let leases: Vec<String> = keys.iter().map(|k| names.lease(k, group)).collect();
    let prefix = format!("{who}:");
    Ok(tokio::spawn(async move {
        let started = Instant::now();
        let mut conn = client.get_multiplexed_async_connection().await.ok()?;
        while started.elapsed() < limit {
            let mut held = 0;
            for chunk in leases.chunks(PER_CALL) {
                let values: Vec<Option<String>> = redis::cmd("MGET").arg(chunk).query_async(&mut conn).await.ok()?;
                held += values.iter().flatten().filter(|v| v.starts_with(&prefix)).count();
            }
            if held >= share {
                return Some(started.elapsed());
            }
            tokio::time::sleep(EVERY).await;
        }
        None
    }))
}
