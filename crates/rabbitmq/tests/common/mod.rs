//! What the RabbitMQ tests share: the test broker's URL, a connect that
//! names a missing broker, and a subscription run that records, per
//! delivery, the key its handler got and the payload.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use keyorder_core::{Delivery, HandlerResult};
use keyorder_rabbitmq::RabbitTransport;
use keyorder_testkit::brokers::Broker;

/// The test broker (`AMQP_URL`, started by `scripts/services`), without
/// the adapter's options.
#[allow(dead_code)]
pub(crate) fn base() -> String {
    Broker::RabbitMq.url()
}

/// A transport on `url` (an `amqp://` URL on [`base`]); a broker that
/// cannot be reached fails the test naming it, the URL and `scripts/services`.
#[allow(dead_code)]
pub(crate) async fn connect(url: &str) -> RabbitTransport {
    Broker::RabbitMq
        .require(url, RabbitTransport::from_url(&url.parse().unwrap()))
        .await
}

/// What a run saw: per delivery, the key the handler got and the payload.
pub(crate) type Seen = Arc<Mutex<Vec<(Option<String>, String)>>>;

pub(crate) struct Run {
    seen: Seen,
    stop: tokio::sync::oneshot::Sender<()>,
    run: tokio::task::JoinHandle<keyorder_core::Result<keyorder_core::RunReport>>,
}

impl Run {
    pub(crate) fn start(sub: keyorder_core::Subscription) -> Run {
        let seen: Seen = Arc::default();
        let log = seen.clone();
        let handler = move |d: Delivery| {
            let log = log.clone();
            async move {
                let key = d.key().map(|k| k.as_str().to_owned());
                log.lock()
                    .unwrap()
                    .push((key, String::from_utf8_lossy(d.payload()).into_owned()));
                HandlerResult::Ok(())
            }
        };
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let run = tokio::spawn(sub.run(handler, async move {
            let _ = stopped.await;
        }));
        Run { seen, stop, run }
    }

    /// What ran so far, in run order.
    #[allow(dead_code)]
    pub(crate) fn snapshot(&self) -> Vec<(Option<String>, String)> {
        self.seen.lock().unwrap().clone()
    }

    pub(crate) async fn until(&self, n: usize, secs: u64) {
        keyorder_testkit::until(&format!("{n} deliveries"), Duration::from_secs(secs), async || {
            let got = self.seen.lock().unwrap().len();
            if got >= n {
                Ok(())
            } else {
                Err(format!("{got} of {n} deliveries"))
            }
        })
        .await;
    }

    pub(crate) async fn stop(self) -> (Vec<(Option<String>, String)>, keyorder_core::RunReport) {
        let _ = self.stop.send(());
        let report = self.run.await.unwrap().unwrap();
        let seen = self.seen.lock().unwrap().clone();
        (seen, report)
    }
}
