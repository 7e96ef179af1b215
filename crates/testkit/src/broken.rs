//! A deliberately broken transport: the in-memory transport with one defect,
//! so tests can prove the checker catches each defect by name.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use keyorder_core::raw::Room;
use keyorder_core::{
    Admin, Capabilities, Inbound, MemoryTransport, Result, SourceEvent, SourceSpec, Transport, TransportPublisher,
    TransportSource,
};

/// The defect to plant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Defect {
    /// Each fetched batch is handed over in reverse.
    Reorder,
    /// Every fifth delivery is acknowledged without being handed over.
    Lose,
    /// Every instance gets every message (no ownership): a key runs in two
    /// instances at once.
    DoubleRun,
}

/// The in-memory transport with a [`Defect`].
#[derive(Debug, Clone)]
pub struct BrokenTransport {
    inner: MemoryTransport,
    defect: Defect,
}

impl BrokenTransport {
    /// A fresh broken transport.
    pub fn new(defect: Defect) -> Self {
        BrokenTransport {
            inner: MemoryTransport::new(),
            defect,
        }
    }
}

#[async_trait]
impl Transport for BrokenTransport {
    fn name(&self) -> &str {
        "broken"
    }
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
    fn affinity_fix(&self) -> String {
        self.inner.affinity_fix()
    }
    async fn publisher(&self, category: &str) -> Result<Arc<dyn TransportPublisher>> {
        self.inner.publisher(category).await
    }
    async fn open(&self, spec: &SourceSpec) -> Result<Box<dyn TransportSource>> {
        let mut spec = spec.clone();
        if self.defect == Defect::DoubleRun {
            spec.group = format!("{}-{}", spec.group, spec.instance);
        }
        Ok(Box::new(BrokenSource {
            inner: self.inner.open(&spec).await?,
            defect: self.defect,
            seen: 0,
        }))
    }
    fn admin(&self) -> Arc<dyn Admin> {
        self.inner.admin()
    }
}

struct BrokenSource {
    inner: Box<dyn TransportSource>,
    defect: Defect,
    seen: u64,
}

impl fmt::Debug for BrokenSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BrokenSource").field("defect", &self.defect).finish()
    }
}

#[async_trait]
impl TransportSource for BrokenSource {
    async fn fetch(&mut self, room: &Room, wait: Duration) -> Result<Vec<Inbound>> {
        let mut batch = self.inner.fetch(room, wait).await?;
        match self.defect {
            Defect::Reorder => batch.reverse(),
            Defect::Lose => {
                let mut kept = Vec::with_capacity(batch.len());
                for inbound in batch {
                    self.seen += 1;
                    if self.seen % 5 == 0 {
                        inbound.settle.ack().await?;
                    } else {
                        kept.push(inbound);
                    }
                }
                batch = kept;
            }
            Defect::DoubleRun => {}
        }
        Ok(batch)
    }
    async fn maintain(&mut self) -> Result<Vec<SourceEvent>> {
        self.inner.maintain().await
    }
    async fn release(&mut self, scope: &str) -> Result<()> {
        self.inner.release(scope).await
    }
    async fn close(&mut self) -> Result<()> {
        self.inner.close().await
    }
}
