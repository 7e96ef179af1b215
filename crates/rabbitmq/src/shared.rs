//! What the sources, settles and admin view of one transport share in this
//! process: the halted heads it holds, the operator's actions for their
//! owners, the deliveries held per key, and the state of the responder that
//! answers other processes' operators (the `control` module).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use keyorder_core::SourceEvent;

use crate::held::Held;

/// A halted head held in this process (its delivery stays unacknowledged).
pub(crate) struct Halted {
    pub(crate) scope: String,
    pub(crate) head_id: String,
    pub(crate) attempts: u32,
    pub(crate) reason: String,
    pub(crate) settle: Arc<Held>,
}

/// State the sources of this transport share with its admin view. A
/// (category, group) pair is named by its base name `{category}:{group}`
/// ([`GroupNames::base`](crate::names::GroupNames::base)).
pub(crate) struct Shared {
    /// (group base, key) -> halted head.
    pub(crate) halted: Mutex<HashMap<(String, String), Halted>>,
    /// group base -> operator actions for the owner.
    pub(crate) resolved: Mutex<HashMap<String, Vec<SourceEvent>>>,
    /// Answers other processes' operator requests about these halts.
    pub(crate) responder: Responder,
    /// group base -> key -> deliveries this process holds (delivered by the
    /// broker, not yet settled: in a source's buffer, waiting in the
    /// dispatcher or running), for `hot_keys`. Entries go at zero, so it
    /// is bounded by the consumers' prefetch.
    pub(crate) held_keys: Mutex<HashMap<String, HashMap<String, u64>>>,
    /// This transport's id in operator answers (an answer from itself is
    /// not counted twice).
    pub(crate) id: String,
}

impl Shared {
    pub(crate) fn new() -> Shared {
        Shared {
            halted: Mutex::default(),
            resolved: Mutex::default(),
            responder: Responder::default(),
            held_keys: Mutex::default(),
            id: uuid::Uuid::new_v4().simple().to_string(),
        }
    }

    /// One more delivery of `key` held here.
    pub(crate) fn hold(&self, category: &str, key: &str) {
        let mut map = self.held_keys.lock().unwrap_or_else(|e| e.into_inner());
        let keys = match map.get_mut(category) {
            Some(keys) => keys,
            None => map.entry(category.to_owned()).or_default(),
        };
        match keys.get_mut(key) {
            Some(n) => *n += 1,
            None => {
                keys.insert(key.to_owned(), 1);
            }
        }
    }

    /// A delivery of `key` settled or dropped.
    pub(crate) fn unhold(&self, category: &str, key: &str) {
        let mut map = self.held_keys.lock().unwrap_or_else(|e| e.into_inner());
        let Some(keys) = map.get_mut(category) else { return };
        if let Some(n) = keys.get_mut(key) {
            *n -= 1;
            if *n == 0 {
                keys.remove(key);
            }
        }
        if keys.is_empty() {
            map.remove(category);
        }
    }
}

/// This transport's responder: the groups it answers for, and whether
/// its task runs.
#[derive(Default)]
pub(crate) struct Responder {
    pub(crate) groups: Mutex<HashSet<String>>,
    pub(crate) wake: tokio::sync::Notify,
    pub(crate) started: std::sync::atomic::AtomicBool,
}
