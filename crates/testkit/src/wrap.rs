//! One forwarding layer for the tests' altered transports: [`Wrapped`]
//! forwards every call to the transport inside it, and a wrapper states only
//! what it changes, as [`Hooks`] (a publish that waits or fails, a source
//! that drops or reorders what it fetched). The deliberately broken
//! transport, the outbox's held publish and the outbox tests' recording and
//! failing publishers are all written this way.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use keyorder_core::{
    Admin, Capabilities, Inbound, Message, PublishFence, Result, Room, SourceEvent, SourceSpec, Transport,
    TransportPublisher, TransportSource,
};

/// What a wrapper changes; every method's default forwards.
#[async_trait]
pub trait Hooks: Send + Sync + fmt::Debug + 'static {
    /// The transport's name, where it differs from the inner one's.
    fn name(&self) -> Option<&str> {
        None
    }

    /// The capabilities the wrapper declares, given the inner transport's:
    /// a wrapper may take a capability away (to test the path a broker
    /// without it takes), never add one.
    fn capabilities(&self, inner: Capabilities) -> Capabilities {
        inner
    }

    /// Every publish, fenced (`fence`) or not; [`send`] hands it on.
    async fn publish(
        &self,
        inner: &dyn TransportPublisher,
        message: Message,
        fence: Option<&PublishFence>,
    ) -> Result<()> {
        send(inner, message, fence).await
    }

    /// Opens a source; a wrapper that alters what is fetched returns a
    /// [`WrappedSource`].
    async fn open(&self, inner: &dyn Transport, spec: &SourceSpec) -> Result<Box<dyn TransportSource>> {
        inner.open(spec).await
    }
}

/// Hands a publish to `inner` as it was asked for: fenced or not.
pub async fn send(inner: &dyn TransportPublisher, message: Message, fence: Option<&PublishFence>) -> Result<()> {
    match fence {
        Some(f) => inner.publish_fenced(message, f).await,
        None => inner.publish(message).await,
    }
}

/// A transport that forwards to `inner` except where its [`Hooks`] say
/// otherwise. The affinity fix and the admin are always the inner
/// transport's.
#[derive(Debug)]
pub struct Wrapped<H> {
    inner: Arc<dyn Transport>,
    hooks: Arc<H>,
}

impl<H> Clone for Wrapped<H> {
    fn clone(&self) -> Self {
        Wrapped {
            inner: self.inner.clone(),
            hooks: self.hooks.clone(),
        }
    }
}

impl<H: Hooks> Wrapped<H> {
    /// `inner` altered by `hooks`.
    pub fn new(inner: Arc<dyn Transport>, hooks: H) -> Self {
        Wrapped {
            inner,
            hooks: Arc::new(hooks),
        }
    }

    /// The hooks (a test reads what they recorded).
    pub fn hooks(&self) -> &H {
        &self.hooks
    }
}

#[async_trait]
impl<H: Hooks> Transport for Wrapped<H> {
    fn name(&self) -> &str {
        self.hooks.name().unwrap_or_else(|| self.inner.name())
    }
    fn capabilities(&self) -> Capabilities {
        let inner = self.inner.capabilities();
        let wrapped = self.hooks.capabilities(inner);
        for ((name, w), (_, i)) in wrapped.flags().into_iter().zip(inner.flags()) {
            assert!(
                i || !w,
                "{:?} claims {name}, which the transport inside it lacks",
                self.hooks
            );
        }
        wrapped
    }
    fn affinity_fix(&self) -> String {
        self.inner.affinity_fix()
    }
    async fn publisher(&self, category: &str) -> Result<Arc<dyn TransportPublisher>> {
        Ok(Arc::new(WrappedPublisher {
            inner: self.inner.publisher(category).await?,
            hooks: self.hooks.clone(),
        }))
    }
    async fn open(&self, spec: &SourceSpec) -> Result<Box<dyn TransportSource>> {
        self.hooks.open(&*self.inner, spec).await
    }
    fn admin(&self) -> Arc<dyn Admin> {
        self.inner.admin()
    }
    fn default_lease(&self) -> Option<keyorder_core::LeaseConfig> {
        self.inner.default_lease()
    }
}

#[derive(Debug)]
struct WrappedPublisher<H> {
    inner: Arc<dyn TransportPublisher>,
    hooks: Arc<H>,
}

#[async_trait]
impl<H: Hooks> TransportPublisher for WrappedPublisher<H> {
    async fn publish(&self, message: Message) -> Result<()> {
        self.hooks.publish(&*self.inner, message, None).await
    }
    async fn publish_fenced(&self, message: Message, fence: &PublishFence) -> Result<()> {
        self.hooks.publish(&*self.inner, message, Some(fence)).await
    }
}

/// What a source wrapper does with each fetched batch.
#[async_trait]
pub trait OnFetch: Send + Sync + fmt::Debug + 'static {
    /// The batch the source hands over instead of `batch`.
    async fn fetched(&mut self, batch: Vec<Inbound>) -> Result<Vec<Inbound>>;
}

/// A source that forwards to `inner` and passes every fetched batch
/// through its [`OnFetch`].
#[derive(Debug)]
pub struct WrappedSource<F> {
    inner: Box<dyn TransportSource>,
    on_fetch: F,
}

impl<F: OnFetch> WrappedSource<F> {
    /// `inner` with its batches passed through `on_fetch`.
    pub fn boxed(inner: Box<dyn TransportSource>, on_fetch: F) -> Box<dyn TransportSource> {
        Box::new(WrappedSource { inner, on_fetch })
    }
}

#[async_trait]
impl<F: OnFetch> TransportSource for WrappedSource<F> {
    async fn fetch(&mut self, room: &Room, wait: Duration) -> Result<Vec<Inbound>> {
        let batch = self.inner.fetch(room, wait).await?;
        self.on_fetch.fetched(batch).await
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
