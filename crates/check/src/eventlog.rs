//! The event log the scenarios' handlers write, and that the checker reads.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use async_trait::async_trait;
use keyorder_core::Result;

/// One handler run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// The message id.
    pub message_id: String,
    /// The key the message was ordered by (test keys are synthetic).
    pub key: String,
    /// The per-key sequence the producer stamped.
    pub seq: u64,
    /// The instance that ran the handler.
    pub instance: String,
    /// The fencing token (owner generation) of the delivery.
    pub generation: u64,
    /// Start, in microseconds on the store's clock.
    pub start: u64,
    /// End, in microseconds on the store's clock (`None`: still running or killed).
    pub end: Option<u64>,
    /// Whether the handler returned `Ok`.
    pub ok: bool,
}

/// What a handler records when it starts.
#[derive(Debug, Clone)]
pub struct EventStart {
    /// The message id.
    pub message_id: String,
    /// The key.
    pub key: String,
    /// The per-key sequence.
    pub seq: u64,
    /// The instance.
    pub instance: String,
    /// The fencing token.
    pub generation: u64,
}

/// A store every instance of a scenario shares. Times come from the store's
/// own clock, never from the instances'.
#[async_trait]
pub trait EventLog: Send + Sync + std::fmt::Debug {
    /// Records a handler start; returns the event's id in the store.
    async fn start(&self, event: EventStart) -> Result<u64>;
    /// Records the handler's end and whether it returned `Ok`.
    async fn end(&self, id: u64, ok: bool) -> Result<()>;
    /// Every event so far, in start order.
    async fn events(&self) -> Result<Vec<Event>>;
    /// The store clock now, in microseconds (for kill times).
    async fn now(&self) -> Result<u64>;
}

/// An event log in this process's memory (for in-process instances).
#[derive(Debug, Clone)]
pub struct MemoryEventLog {
    inner: Arc<Mutex<Vec<Event>>>,
    epoch: Instant,
}

impl Default for MemoryEventLog {
    fn default() -> Self {
        MemoryEventLog {
            inner: Arc::default(),
            epoch: Instant::now(),
        }
    }
}

impl MemoryEventLog {
    fn clock(&self) -> u64 {
        self.epoch.elapsed().as_micros() as u64
    }

    /// Appends a finished event as is (for checker tests).
    pub fn push(&self, event: Event) {
        self.inner.lock().unwrap().push(event);
    }
}

#[async_trait]
impl EventLog for MemoryEventLog {
    async fn start(&self, e: EventStart) -> Result<u64> {
        let mut log = self.inner.lock().unwrap();
        let start = self.clock();
        log.push(Event {
            message_id: e.message_id,
            key: e.key,
            seq: e.seq,
            instance: e.instance,
            generation: e.generation,
            start,
            end: None,
            ok: false,
        });
        Ok(log.len() as u64 - 1)
    }

    async fn end(&self, id: u64, ok: bool) -> Result<()> {
        let end = self.clock();
        let mut log = self.inner.lock().unwrap();
        if let Some(e) = log.get_mut(id as usize) {
            e.end = Some(end);
            e.ok = ok;
        }
        Ok(())
    }

    async fn events(&self) -> Result<Vec<Event>> {
        Ok(self.inner.lock().unwrap().clone())
    }

    async fn now(&self) -> Result<u64> {
        Ok(self.clock())
    }
}
