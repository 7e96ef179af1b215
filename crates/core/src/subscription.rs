//! Building and running a subscription.

use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::client::{check_name, Client};
use crate::dispatch::{DispatchConfig, Dispatcher, Job, Submit, Widening};
use crate::error::{Error, Result};
use crate::handler::Handler;
use crate::health::Health;
use crate::lease::LeaseConfig;
use crate::message::{KeySource, KeylessPolicy, MessageType};
use crate::stats::{bump, Stats, StatsSnapshot};
use crate::strategy::{GlobalBackoff, PoisonPolicy, Resolved, RetryPolicy, Strategy};
use crate::transport::{Inbound, Room, SourceEvent, SourceSpec, TransportSource};

// `Client::subscribe` lives here, beside what it builds: the client's room
// then imports nothing of the subscription's.
impl Client {
    /// Starts building a subscription of `group` to `category`. Nothing is
    /// checked or opened until [`SubscriptionBuilder::build`].
    pub fn subscribe(&self, category: &str, group: &str) -> SubscriptionBuilder {
        SubscriptionBuilder::new(self.clone(), category, group)
    }
}

/// Builds a subscription; every option is checked in [`build`](Self::build),
/// before any message flows.
///
/// Ordering is off by default: without [`ordered_by`](Self::ordered_by) the
/// subscription is the transport's plain competing consumer.
///
/// ```
/// # async fn demo() -> keyorder_core::Result<()> {
/// use keyorder_core::{Client, KeySource, PoisonPolicy, Strategy};
/// let client = Client::memory();
/// let subscription = client
///     .subscribe("orders", "billing")
///     .ordered_by(KeySource::routing_key())
///     .strategy(Strategy::Auto)
///     .concurrency(64)
///     .poison(PoisonPolicy::Halt)
///     .build()
///     .await?;
/// # drop(subscription); Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct SubscriptionBuilder {
    client: Client,
    category: String,
    correlated: Vec<String>,
    group: String,
    key_source: Option<KeySource>,
    strategy: Strategy,
    types: Vec<MessageType>,
    dispatch: DispatchConfig,
    keyless: KeylessPolicy,
    lease: Option<LeaseConfig>,
    instance: Option<String>,
    batch: usize,
    observer: Option<crate::handler::SettledHook>,
}

impl SubscriptionBuilder {
    pub(crate) fn new(client: Client, category: &str, group: &str) -> Self {
        SubscriptionBuilder {
            client,
            category: category.to_owned(),
            correlated: Vec::new(),
            group: group.to_owned(),
            key_source: None,
            strategy: Strategy::Auto,
            types: Vec::new(),
            dispatch: DispatchConfig::default(),
            keyless: KeylessPolicy::default(),
            lease: None,
            instance: None,
            batch: 256,
            observer: None,
        }
    }

    /// Orders the subscription by the key `source` yields.
    pub fn ordered_by(mut self, source: KeySource) -> Self {
        self.key_source = Some(source);
        self
    }
    /// Also reads `category`, partitioned by the same correlation value: the
    /// subscription's key is the correlation value, and events of one value
    /// never run at once, whichever category they come from; different values
    /// run in parallel. Within one category the key's order is kept; across
    /// categories events of one value are serialised, not ordered.
    ///
    /// Needs an ordered subscription on a transport with
    /// [`crate::Capabilities::correlated_ownership`] (Redis); each category
    /// is then partitioned by this subscription's key (C10).
    ///
    /// ```
    /// # async fn demo(client: keyorder_core::Client) -> keyorder_core::Result<()> {
    /// use keyorder_core::KeySource;
    /// let saga = client
    ///     .subscribe("orders", "fulfilment")
    ///     .correlated_with("payments")
    ///     .ordered_by(KeySource::routing_key())
    ///     .build()
    ///     .await?;
    /// # drop(saga); Ok(()) }
    /// ```
    pub fn correlated_with(mut self, category: &str) -> Self {
        if category != self.category && !self.correlated.iter().any(|c| c == category) {
            self.correlated.push(category.to_owned());
        }
        self
    }
    /// How order is kept ([`Strategy::Auto`] by default).
    pub fn strategy(mut self, strategy: Strategy) -> Self {
        self.strategy = strategy;
        self
    }
    /// Declares a message type the subscription handles (checked against the key source).
    pub fn message_type(mut self, ty: MessageType) -> Self {
        self.types.push(ty);
        self
    }
    /// Handlers running at once (default 64).
    pub fn concurrency(mut self, n: usize) -> Self {
        self.dispatch.concurrency = n;
        self
    }
    /// Messages one key may hold before back-pressure widens to its scope (default 64).
    pub fn per_key_depth(mut self, n: usize) -> Self {
        self.dispatch.per_key_depth = n;
        self
    }
    /// Messages held in this instance at most (default 4096).
    pub fn budget(mut self, n: usize) -> Self {
        self.dispatch.budget = n;
        self
    }
    /// Most deliveries asked of the transport at once (default 256).
    pub fn batch(mut self, n: usize) -> Self {
        self.batch = n.max(1);
        self
    }
    /// The poison policy ([`PoisonPolicy::Halt`] by default).
    pub fn poison(mut self, policy: PoisonPolicy) -> Self {
        self.dispatch.poison = policy;
        self
    }
    /// Retry with back-off.
    pub fn retry(mut self, retry: RetryPolicy) -> Self {
        self.dispatch.retry = retry;
        self
    }
    /// Whole-subscription back-off when failures span many keys.
    pub fn global_backoff(mut self, gb: GlobalBackoff) -> Self {
        self.dispatch.global_backoff = gb;
        self
    }
    /// What to do with keyless messages.
    pub fn keyless(mut self, policy: KeylessPolicy) -> Self {
        self.keyless = policy;
        self
    }
    /// Lease timing (TTL, heartbeat, self-fence margin), checked in
    /// [`build`](Self::build) ([`LeaseConfig::check`]). Without it the
    /// subscription uses the lease the transport's URL states
    /// (`lease_ttl_ms`, see [`crate::lease::LeaseOptions`]), else
    /// [`LeaseConfig::default`]. [`LeaseConfig::from_ttl`] derives the
    /// heartbeat and margin from a TTL.
    ///
    /// ```
    /// # use keyorder_core::{Client, LeaseConfig};
    /// # use std::time::Duration;
    /// let builder = Client::memory()
    ///     .subscribe("orders", "billing")
    ///     .lease(LeaseConfig::from_ttl(Duration::from_secs(30)));
    /// # let _ = builder;
    /// ```
    pub fn lease(mut self, lease: LeaseConfig) -> Self {
        self.lease = Some(lease);
        self
    }
    /// Calls `hook` as each delivery this process ran (or discarded before
    /// running, its scope lost) is settled: acknowledged, parked, halted, or
    /// fenced (not acknowledged: the broker's fence or the handler's store
    /// refused it), for an application that records outcomes per message
    /// rather than reading the aggregate [`crate::Stats`]. Deliveries still
    /// buffered when their scope is handed over or the subscription stops
    /// are not reported (the broker delivers them again). Keep it quick: it
    /// runs on the dispatcher's workers; a panic in it is caught and
    /// counted.
    ///
    /// ```
    /// # use keyorder_core::{Client, MemoryTransport, Settlement};
    /// # use std::sync::Arc;
    /// let client = Client::new(Arc::new(MemoryTransport::new()));
    /// let builder = client.subscribe("orders", "billing").on_settled(|s| {
    ///     if s.settlement == Settlement::Fenced {
    ///         eprintln!("{} not applied here (token {})", s.id, s.fencing_token);
    ///     }
    /// });
    /// # let _ = builder;
    /// ```
    pub fn on_settled(mut self, hook: impl Fn(&crate::Settled) + Send + Sync + 'static) -> Self {
        self.observer = Some(crate::handler::SettledHook::new(hook));
        self
    }

    /// The administration interface of the client this builder came from
    /// (for example to register the subscription with an ops endpoint).
    pub fn admin(&self) -> Arc<dyn crate::Admin> {
        self.client.admin()
    }

    /// This instance's id (default: a fresh UUID).
    pub fn instance_id(mut self, id: impl Into<String>) -> Self {
        self.instance = Some(id.into());
        self
    }

    /// Checks every option, registers the subscription and opens its source.
    ///
    /// # Errors
    /// - [`Error::Unsupported`] when `Auto`/`TransportNative` lack
    ///   cross-instance affinity (C9), or the poison or keyless policy needs a
    ///   capability the transport lacks;
    /// - [`Error::Registration`] when a declared message type cannot yield the
    ///   key (C8), or another subscription in this process orders the
    ///   category by a different key (C10);
    /// - [`Error::Config`] for bad names or limits.
    pub async fn build(self) -> Result<Subscription> {
        check_name("category", &self.category)?;
        for c in &self.correlated {
            check_name("category", c)?;
        }
        check_name("group", &self.group)?;
        let caps = self.client.capabilities();
        let name = self.client.transport_name().to_owned();
        let resolved = match &self.key_source {
            None => None,
            Some(source) => {
                let resolved = self
                    .strategy
                    .resolve(&name, &caps, &self.client.transport.affinity_fix())?;
                let need = |on: bool, capability: &'static str, fix: &str| {
                    if on {
                        Ok(())
                    } else {
                        Err(Error::Unsupported {
                            transport: name.clone(),
                            capability,
                            fix: fix.to_owned(),
                        })
                    }
                };
                match self.dispatch.poison {
                    PoisonPolicy::Halt => need(
                        caps.halt_on_poison,
                        "halt_on_poison",
                        "choose PoisonPolicy::Park { max_attempts } or a transport that can halt a key",
                    )?,
                    PoisonPolicy::Park { max_attempts } => {
                        need(
                            caps.park_and_release,
                            "park_and_release",
                            "choose PoisonPolicy::Halt or configure a dead-letter destination",
                        )?;
                        if max_attempts == 0 {
                            return Err(Error::Config("PoisonPolicy::Park needs max_attempts >= 1".into()));
                        }
                    }
                }
                if !self.correlated.is_empty() {
                    need(
                        caps.correlated_ownership && resolved == Resolved::TransportNative,
                        "correlated_ownership",
                        "one owner per correlation value across categories needs a transport with correlated \
                         ownership (Redis) and Strategy::Auto or TransportNative; otherwise subscribe to each \
                         category separately",
                    )?;
                }
                if self.keyless == KeylessPolicy::Reject {
                    need(
                        caps.park_and_release,
                        "park_and_release",
                        "KeylessPolicy::Reject dead-letters keyless messages; use KeylessPolicy::Parallel",
                    )?;
                }
                for ty in &self.types {
                    if !source.can_yield(ty) {
                        return Err(Error::Registration(format!(
                            "message type `{}` cannot yield an ordering key through `{source}`: declare the field \
                             on the type (MessageType::with_fields) or add a fallback step \
                             (.or_header / .or_correlation_id)",
                            ty.name()
                        )));
                    }
                }
                let mut registry = self.client.registry.lock().unwrap_or_else(|e| e.into_inner());
                let all: Vec<&String> = std::iter::once(&self.category).chain(&self.correlated).collect();
                for category in &all {
                    if let Some(existing) = registry.get(*category) {
                        if existing != source {
                            return Err(Error::Registration(format!(
                                "category `{category}` is already ordered by `{existing}` in this process; a \
                                 category is partitioned by one key or not at all: order this subscription by \
                                 `{existing}` too, or publish to another category"
                            )));
                        }
                    }
                }
                for category in all {
                    registry.entry(category.clone()).or_insert_with(|| source.clone());
                }
                Some(resolved)
            }
        };
        let lease = self
            .lease
            .or_else(|| self.client.transport.default_lease())
            .unwrap_or_default();
        lease.check()?;
        if !self.correlated.is_empty() && resolved.is_none() {
            return Err(Error::Config(
                "correlated_with needs an ordered subscription: add .ordered_by(...) with the correlation value".into(),
            ));
        }
        let spec = SourceSpec {
            category: self.category.clone(),
            correlated: self.correlated.clone(),
            group: self.group.clone(),
            instance: self
                .instance
                .clone()
                .unwrap_or_else(|| uuid::Uuid::new_v4().to_string()),
            ordered: resolved == Some(Resolved::TransportNative),
            lease,
            key_rules: self.client.rules.clone(),
        };
        let source = self.client.transport.open(&spec).await?;
        let stats = Arc::new(Stats::default());
        // A turn waits at most a fetch (100 ms), a broker call or a full
        // dispatcher's refill; one stuck past several lease TTLs has lost
        // its leases anyway.
        let stall = (spec.lease.ttl * 3).max(Duration::from_secs(30));
        Ok(Subscription {
            health: Health::new(stats.clone(), stall),
            spec,
            source,
            key_source: self.key_source,
            resolved,
            dispatch: self.dispatch,
            keyless: self.keyless,
            batch: self.batch,
            stats,
            transport: name,
            observer: self.observer,
        })
    }
}

/// A built subscription: run it with a handler until shutdown.
pub struct Subscription {
    spec: SourceSpec,
    source: Box<dyn TransportSource>,
    key_source: Option<KeySource>,
    resolved: Option<Resolved>,
    dispatch: DispatchConfig,
    keyless: KeylessPolicy,
    batch: usize,
    stats: Arc<Stats>,
    health: Health,
    transport: String,
    observer: Option<crate::handler::SettledHook>,
}

impl fmt::Debug for Subscription {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Subscription")
            .field("transport", &self.transport)
            .field("category", &self.spec.category)
            .field("group", &self.spec.group)
            .field("instance", &self.spec.instance)
            .field("resolved", &self.resolved)
            .finish()
    }
}

/// What a finished run did.
#[derive(Debug, Clone)]
pub struct RunReport {
    /// The counters at the end of the run.
    pub stats: StatsSnapshot,
    /// Waiting deliveries dropped at shutdown (unacknowledged: redelivered).
    pub dropped_at_shutdown: usize,
}

impl Subscription {
    /// The live counters (read them while the subscription runs).
    pub fn stats(&self) -> Arc<Stats> {
        self.stats.clone()
    }
    /// Its health (live, ready, degraded, with reasons), shared: take it
    /// before [`run`](Self::run) and read it from a probe while it runs.
    /// See [`crate::health`].
    pub fn health(&self) -> Health {
        self.health.clone()
    }
    /// The category it reads.
    pub fn category(&self) -> &str {
        &self.spec.category
    }
    /// Its consumer group.
    pub fn group(&self) -> &str {
        &self.spec.group
    }
    /// This instance's id.
    pub fn instance_id(&self) -> &str {
        &self.spec.instance
    }
    /// What the strategy resolved to (`None`: unordered).
    pub fn resolved(&self) -> Option<Resolved> {
        self.resolved
    }

    /// Runs until `shutdown` completes, then drains: running handlers finish
    /// and are acknowledged, waiting deliveries are left to the broker, and
    /// the instance's scopes are handed over.
    pub async fn run<H: Handler>(mut self, handler: H, shutdown: impl Future<Output = ()> + Send) -> Result<RunReport> {
        // A gate of its own: with one shared by the process, a handler hung
        // in one subscription (or a stalled instance beside another in one
        // process) held every other subscription's redelivered messages
        // for the isolation wait (a RabbitMQ take-over went from 2.4 s to
        // 7.4 s). `Dispatcher::new_in_process` shares it.
        let dispatcher = Dispatcher::new(self.dispatch, Arc::new(handler), self.stats.clone());
        dispatcher.metered(&self.spec.category, &self.spec.group);
        if let Some(hook) = self.observer.take() {
            dispatcher.on_settled(hook);
        }
        let mut loop_state = LoopState::default();
        tokio::pin!(shutdown);
        // How long shutdown waits for the step in flight (at most the lease
        // TTL: a step stuck longer has lost its leases anyway).
        let grace = self.spec.lease.ttl.min(Duration::from_secs(10));
        let health = self.health.clone();
        health.running();
        let outcome = loop {
            let stepped = {
                let step = self.step(&dispatcher, &mut loop_state);
                tokio::pin!(step);
                tokio::select! {
                    biased;
                    () = &mut shutdown => {
                        // The step in flight finishes before the source
                        // closes: a broker operation it already sent (a lease
                        // acquired, a scope taken) is then recorded, so
                        // `close` hands it back instead of leaving it to
                        // expire, as dropping the step did. What it fetched
                        // is left to the broker by the drain, like any
                        // waiting delivery.
                        if tokio::time::timeout(grace, &mut step).await.is_err() {
                            tracing::warn!(
                                grace_ms = grace.as_millis() as u64,
                                "shutdown: the step in flight did not finish in time; dropped"
                            );
                        }
                        None
                    }
                    step = &mut step => Some(step),
                }
            };
            match stepped {
                None => break Ok(()),
                Some(Ok(())) => {
                    health.turned(None, dispatcher.backing_off());
                    loop_state.backoff = Duration::ZERO;
                }
                Some(Err(Error::Broker(b))) => {
                    health.turned(Some(b.message().to_owned()), dispatcher.backing_off());
                    tracing::warn!(error = %b.message(), temporary = b.is_temporary(), "transport error; retrying");
                    loop_state.backoff =
                        (loop_state.backoff * 2).clamp(Duration::from_millis(50), Duration::from_secs(5));
                    tokio::select! {
                        biased;
                        () = &mut shutdown => break Ok(()),
                        () = tokio::time::sleep(loop_state.backoff) => {}
                    }
                }
                Some(Err(other)) => break Err(other),
            }
        };
        health.stopping();
        let dropped = dispatcher.drain().await;
        let close = self.source.close().await;
        health.stopped();
        outcome?;
        close?;
        Ok(RunReport {
            stats: self.stats.snapshot(),
            dropped_at_shutdown: dropped,
        })
    }

    async fn step(&mut self, dispatcher: &Dispatcher, st: &mut LoopState) -> Result<()> {
        for event in self.source.maintain().await? {
            match event {
                SourceEvent::Revoke(scope) => {
                    st.paused.remove(&scope);
                    dispatcher.discard_scope(&scope);
                    st.revoking.insert(scope);
                }
                SourceEvent::Resolved { key, drop_head } => {
                    hand_back_resolved(&mut st.paused, &key, &self.stats);
                    dispatcher.release(&key, drop_head);
                }
            }
        }
        // Work of lost leases goes, halted heads included; a revoked scope
        // sheds again what came back since (a handler that halted meanwhile).
        dispatcher.discard_lost();
        for scope in &st.revoking {
            dispatcher.discard_scope(scope);
        }
        let drained: Vec<Arc<str>> = st
            .revoking
            .iter()
            .filter(|s| dispatcher.held_in_scope(s) == 0)
            .cloned()
            .collect();
        if !drained.is_empty() {
            // One call for all: a broker that releases many scopes in one
            // round trip hands thousands over at once.
            self.source.release_all(&drained).await?;
            for scope in drained {
                st.revoking.remove(&scope);
                bump(&self.stats.scopes_released, "keyorder_scopes_released_total");
            }
        }
        // Paused scopes first, in order: a later delivery of a scope never
        // overtakes one that was handed back.
        let scopes: Vec<Arc<str>> = st.paused.keys().cloned().collect();
        for scope in scopes {
            let Some(queue) = st.paused.get_mut(&scope) else {
                continue;
            };
            while let Some(job) = queue.pop_front() {
                if job.is_lost() {
                    bump(&self.stats.self_fence_discards, "keyorder_self_fence_discards_total");
                    continue;
                }
                if let Submit::Full(job, _) = dispatcher.submit(job) {
                    queue.push_front(job);
                    break;
                }
            }
            if queue.is_empty() {
                st.paused.remove(&scope);
            }
        }
        let room = dispatcher.room().min(self.batch);
        if room == 0 {
            // Full: refill in batches once a quarter of the budget is free.
            dispatcher.wait_room(Duration::from_millis(50)).await;
            return Ok(());
        }
        let wait = if st.paused.is_empty() && st.revoking.is_empty() {
            Duration::from_millis(100)
        } else {
            Duration::from_millis(10)
        };
        let room = Room::up_to(room)
            .pausing(st.paused.keys().chain(st.revoking.iter()).cloned())
            .holding(dispatcher.holdings());
        let batch = self.source.fetch(&room, wait).await?;
        for inbound in batch {
            let Some(job) = self.admit(inbound).await? else {
                continue;
            };
            let scope = job.scope().clone();
            if let Some(queue) = st.paused.get_mut(&scope) {
                queue.push_back(job);
                continue;
            }
            match dispatcher.submit(job) {
                Submit::Accepted => {}
                Submit::Full(job, why) => {
                    if why != Widening::Stopping {
                        bump(&self.stats.widened, "keyorder_widened_total");
                        if st.widen_logged.is_none_or(|t| t.elapsed() > Duration::from_secs(10)) {
                            st.widen_logged = Some(Instant::now());
                            tracing::warn!(scope = %scope, reason = ?why, "back-pressure widened from a key to its scope");
                        }
                    }
                    st.paused.entry(scope).or_default().push_back(job);
                }
            }
        }
        Ok(())
    }

    /// Selects the key and applies the keyless and routing-key rules.
    async fn admit(&self, inbound: Inbound) -> Result<Option<Job>> {
        let Some(source) = &self.key_source else {
            return Ok(Some(Job::new(inbound, None)));
        };
        let selected = source.select(&inbound.message, &self.spec.key_rules);
        let routing = inbound.message.key().cloned();
        let native = self.resolved == Some(Resolved::TransportNative);
        let reject = match selected {
            Err(err) => Some((format!("selected key is invalid: {err}"), true)),
            Ok(Some(key)) if native && routing.as_ref() != Some(&key) => Some((
                "selected key differs from the routing key: the broker placed this message by the key it was \
                 routed by, so a key's messages keep their order only when each is routed by that key; publish \
                 with the selected key as the routing key (Kafka: the record key; RabbitMQ: the routing key or \
                 the keyorder-key header), or select the key the producer routes by"
                    .to_owned(),
                true,
            )),
            Ok(Some(key)) => return Ok(Some(Job::new(inbound, Some(key)))),
            Ok(None) if native && routing.is_some() => Some((
                "no key selected but the message was routed by a key: the key source found nothing in this \
                 message; select the key the producer routes by (KeySource::routing_key())"
                    .to_owned(),
                true,
            )),
            Ok(None) => match self.keyless {
                KeylessPolicy::Parallel => {
                    bump(&self.stats.keyless, "keyorder_keyless_total");
                    return Ok(Some(Job::new(inbound, None)));
                }
                KeylessPolicy::Reject => Some(("keyless message rejected by policy".to_owned(), false)),
            },
        };
        let (reason, mismatch) = reject.expect("every accepted case returned above");
        if mismatch {
            bump(&self.stats.key_mismatches, "keyorder_key_mismatches_total");
        } else {
            bump(&self.stats.keyless_rejected, "keyorder_keyless_rejected_total");
        }
        tracing::warn!(
            id = inbound.message.id(),
            reason = reason.as_str(),
            "delivery rejected: never processed under the wrong key"
        );
        let mut delay = Duration::from_millis(50);
        loop {
            match inbound.settle.park(&reason).await {
                Ok(()) => {
                    bump(&self.stats.parked, "keyorder_parked_total");
                    return Ok(None);
                }
                Err(Error::Fenced { .. }) => {
                    bump(&self.stats.fence_rejections, "keyorder_fence_rejections_total");
                    inbound.lease.lose_to_broker();
                    return Ok(None);
                }
                Err(err) => {
                    tracing::warn!(error = %err, "dead-lettering a rejected delivery failed; retrying");
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_secs(5));
                }
            }
        }
    }
}

/// Hands back the resolved key's messages that wait in a paused scope (by
/// value, which is what [`SourceEvent::Resolved`] carries: matched by label
/// as well, a key whose value reads like another key's label, `k#<hash>`,
/// handed back that other key's messages too, which no resolution reads
/// again, and they were lost), where the transport holds
/// a halted key's messages ([`crate::Settle::unread`]). They came after
/// everything the dispatcher holds of the key, and the transport reads them
/// again, in order, from the resolved head. Submitted from the paused queue
/// after the release instead, they ran ahead of the key's messages that the
/// halt had handed back, which that re-read delivers only later (`p0, p2,
/// p1`), and the transport's cursor then passed those for good. Unresolved,
/// they go back when submitted (`Dispatcher::submit` hands a halted key's
/// message back), as ever.
fn hand_back_resolved(paused: &mut HashMap<Arc<str>, VecDeque<Job>>, key: &str, stats: &Stats) {
    for queue in paused.values_mut() {
        queue.retain(|job| {
            let named = job.key.as_ref().is_some_and(|k| k.as_str() == key);
            if named && job.settle.unread() {
                bump(&stats.handed_back, "keyorder_handed_back_total");
                false
            } else {
                true
            }
        });
    }
    paused.retain(|_, queue| !queue.is_empty());
}

#[derive(Default)]
struct LoopState {
    paused: HashMap<Arc<str>, VecDeque<Job>>,
    revoking: HashSet<Arc<str>>,
    backoff: Duration,
    widen_logged: Option<Instant>,
}
