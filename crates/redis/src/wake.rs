//! Wake-ups: every publish also publishes its key's segment (see
//! [`Names::segment`]; empty for a keyless message) on the category's wake
//! channel, so an idle consumer reads the partition at once without a
//! blocking read (Redis refuses BLOCK inside the fenced read script). A lost
//! connection or an overflow marks every partition to be read.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use tokio::sync::Notify;
use tokio::task::JoinHandle;

use crate::names::Names;

/// Keys woken since the consumer last looked (decoded; `""` for the keyless
/// stream), bounded.
#[derive(Debug, Default)]
pub(crate) struct Wake {
    keys: Mutex<HashSet<String>>,
    all: AtomicBool,
    /// Ownership moved in the category: an instance joined or left, or
    /// leases were released.
    owners: AtomicBool,
    pub(crate) notify: Notify,
}

/// How the wake-up message that says ownership moved in a group starts
/// (no key's segment is spelled so): `__owners__:{group}`. The group's
/// consumers of the category look at their leases now rather than at their
/// next heartbeat; other groups' consumers ignore it.
pub(crate) const OWNERS: &str = "__owners__:";

/// The ownership wake-up of `group`.
pub(crate) fn owners_message(group: &str) -> String {
    format!("{OWNERS}{group}")
}

const MAX_WOKEN: usize = 65_536;

impl Wake {
    fn push(&self, key: String) {
        {
            let mut keys = self.keys.lock().unwrap_or_else(|e| e.into_inner());
            if keys.len() >= MAX_WOKEN {
                self.all.store(true, Ordering::SeqCst);
            } else {
                keys.insert(key);
            }
        }
        self.notify.notify_one();
    }

    /// Marks everything woken (after a reconnect: wake-ups may be lost).
    pub(crate) fn all(&self) {
        self.all.store(true, Ordering::SeqCst);
        self.notify.notify_one();
    }

    /// Ownership moved: the next upkeep runs at once.
    fn owners(&self) {
        self.owners.store(true, Ordering::SeqCst);
        self.notify.notify_one();
    }

    /// Whether ownership moved since the last call.
    pub(crate) fn take_owners(&self) -> bool {
        self.owners.swap(false, Ordering::SeqCst)
    }

    /// Takes the woken keys, and whether everything must be looked at.
    pub(crate) fn take(&self) -> (HashSet<String>, bool) {
        let keys = std::mem::take(&mut *self.keys.lock().unwrap_or_else(|e| e.into_inner()));
        (keys, self.all.swap(false, Ordering::SeqCst))
    }
}

/// Listens on `channel` until aborted, reconnecting with back-off; an
/// ownership wake-up counts only when it names `group`.
pub(crate) fn listen(client: redis::Client, channel: String, group: &str, wake: Arc<Wake>) -> JoinHandle<()> {
    let mine = owners_message(group);
    tokio::spawn(async move {
        let mut backoff = Duration::from_millis(100);
        loop {
            match client.get_async_pubsub().await {
                Ok(mut pubsub) => {
                    if let Err(e) = pubsub.subscribe(&channel).await {
                        tracing::warn!(error = %e, "redis: wake-up subscription failed; retrying");
                    } else {
                        backoff = Duration::from_millis(100);
                        // Anything published while we were away is read now.
                        wake.all();
                        let mut messages = pubsub.on_message();
                        while let Some(m) = messages.next().await {
                            let segment: String = m.get_payload().unwrap_or_default();
                            if segment == mine {
                                wake.owners();
                            } else if segment.starts_with(OWNERS) {
                                // Another group's hand-over: nothing to read.
                            } else if segment.is_empty() {
                                wake.push(segment);
                            } else if let Some(key) = Names::key_of(&segment) {
                                wake.push(key.into_owned());
                            } else {
                                // Not a segment keyorder writes: look at everything.
                                wake.all();
                            }
                        }
                        tracing::warn!("redis: wake-up connection closed; reconnecting");
                    }
                }
                Err(e) => tracing::debug!(error = %e, "redis: wake-up connection failed; retrying"),
            }
            wake.all();
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(2));
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// No key publishes the ownership wake-up: a key spelled so is encoded.
    #[test]
    fn no_key_is_the_owners_message() {
        for message in [owners_message("g"), owners_message(""), OWNERS.to_owned()] {
            assert!(Names::key_of(&message).is_none(), "{message}");
            assert_ne!(Names::segment(&message), message);
            assert!(!Names::segment(&message).starts_with(OWNERS), "{message}");
        }
    }
}
