//! A deliberately broken transport: the in-memory transport with one defect,
//! so tests can prove the checker catches each defect by name. Written on
//! the one forwarding layer ([`crate::wrap`]): it states only the defect.

use std::sync::Arc;

use async_trait::async_trait;
use keyorder_core::{Inbound, MemoryTransport, Result, SourceSpec, Transport, TransportSource};

use crate::wrap::{Hooks, OnFetch, Wrapped, WrappedSource};

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
pub type BrokenTransport = Wrapped<Broken>;

/// The hooks that plant a [`Defect`].
#[derive(Debug)]
pub struct Broken(Defect);

impl Wrapped<Broken> {
    /// A fresh in-memory transport with `defect`.
    pub fn broken(defect: Defect) -> BrokenTransport {
        Wrapped::new(Arc::new(MemoryTransport::new()), Broken(defect))
    }
}

#[async_trait]
impl Hooks for Broken {
    fn name(&self) -> Option<&str> {
        Some("broken")
    }

    async fn open(&self, inner: &dyn Transport, spec: &SourceSpec) -> Result<Box<dyn TransportSource>> {
        let mut spec = spec.clone();
        if self.0 == Defect::DoubleRun {
            spec.group = format!("{}-{}", spec.group, spec.instance);
        }
        Ok(WrappedSource::boxed(
            inner.open(&spec).await?,
            Planted {
                defect: self.0,
                seen: 0,
            },
        ))
    }
}

/// What a broken source does to each fetched batch.
#[derive(Debug)]
struct Planted {
    defect: Defect,
    seen: u64,
}

#[async_trait]
impl OnFetch for Planted {
    async fn fetched(&mut self, mut batch: Vec<Inbound>) -> Result<Vec<Inbound>> {
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
}
