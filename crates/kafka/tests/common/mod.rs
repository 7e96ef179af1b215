//! What the Kafka tests share: the test broker's address, a connect that
//! names a missing broker, and the lease its consumer groups are timed by.

use std::time::Duration;

use keyorder_core::LeaseConfig;
use keyorder_kafka::KafkaTransport;
use keyorder_testkit::brokers::Broker;

/// The test broker (`KAFKA_BROKERS`, started by `scripts/services`).
pub(crate) fn brokers() -> String {
    Broker::Kafka.url()
}

/// A transport on `url` (a `kafka://` URL on [`brokers`]); a broker that
/// cannot be reached fails the test naming it, the URL and `scripts/services`.
#[allow(dead_code)]
pub(crate) async fn connect(url: &str) -> KafkaTransport {
    Broker::Kafka
        .require(url, KafkaTransport::from_url(&url.parse().unwrap()))
        .await
}

/// The lease TTL is the group's session timeout; the test broker assigns
/// partitions after about half of it.
pub(crate) fn lease() -> LeaseConfig {
    LeaseConfig {
        ttl: Duration::from_secs(6),
        heartbeat: Duration::from_millis(500),
        margin: Duration::from_secs(2),
    }
}

/// Creates `topics` as another client would (each must not exist yet).
#[allow(dead_code)]
pub(crate) async fn create_topics(topics: &[keyorder_kafka::rdkafka::admin::NewTopic<'_>]) {
    use keyorder_kafka::rdkafka::admin::{AdminClient, AdminOptions};
    use keyorder_kafka::rdkafka::client::DefaultClientContext;
    let mut cfg = keyorder_kafka::rdkafka::ClientConfig::new();
    cfg.set("bootstrap.servers", brokers());
    let admin: AdminClient<DefaultClientContext> = cfg.create().unwrap();
    for r in admin
        .create_topics(
            topics,
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
        )
        .await
        .unwrap()
    {
        r.unwrap();
    }
}

/// A subscription running with a handler that records each payload as text.
// Not every test file runs one.
#[allow(dead_code)]
pub(crate) struct Recording {
    applied: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    stop: tokio::sync::oneshot::Sender<()>,
    run: tokio::task::JoinHandle<keyorder_core::Result<keyorder_core::RunReport>>,
}

#[allow(dead_code)]
impl Recording {
    pub(crate) fn start(sub: keyorder_core::Subscription) -> Self {
        let applied = std::sync::Arc::<std::sync::Mutex<Vec<String>>>::default();
        let log = applied.clone();
        let handler = move |d: keyorder_core::Delivery| {
            let log = log.clone();
            async move {
                log.lock()
                    .unwrap()
                    .push(String::from_utf8_lossy(d.payload()).into_owned());
                keyorder_core::HandlerResult::Ok(())
            }
        };
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let run = tokio::spawn(sub.run(handler, async move {
            let _ = stopped.await;
        }));
        Recording { applied, stop, run }
    }

    /// How many payloads were recorded so far.
    pub(crate) fn len(&self) -> usize {
        self.applied.lock().unwrap().len()
    }

    /// Waits (polling, up to `limit`) until `n` payloads were recorded;
    /// panics with `what` and the count otherwise.
    pub(crate) async fn until(&self, n: usize, limit: Duration, what: &str) {
        self.until_matching(n, |_| true, limit, what).await;
    }

    /// The payloads recorded so far, in run order.
    pub(crate) fn snapshot(&self) -> Vec<String> {
        self.applied.lock().unwrap().clone()
    }

    /// Waits (polling, up to `limit`) until `n` payloads that `pick`
    /// accepts were recorded; panics with `what` and the count otherwise.
    pub(crate) async fn until_matching(&self, n: usize, pick: impl Fn(&str) -> bool, limit: Duration, what: &str) {
        keyorder_testkit::until(what, limit, async || {
            let got = self.applied.lock().unwrap().iter().filter(|p| pick(p)).count();
            if got >= n {
                Ok(())
            } else {
                Err(format!("{got} of {n} messages ran"))
            }
        })
        .await;
    }

    /// Ends the run (draining it) and returns the payloads in run order.
    pub(crate) async fn stop(self) -> Vec<String> {
        let _ = self.stop.send(());
        self.run.await.unwrap().unwrap();
        let log = self.applied.lock().unwrap().clone();
        log
    }
}
