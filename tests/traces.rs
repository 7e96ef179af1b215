//! Traces across the broker (feature `otel`): on every real broker, a
//! message published inside a span is consumed in a `keyorder.delivery`
//! span whose parent is that span, in the same trace, as an OpenTelemetry
//! SDK exports them; through the outbox, the parent is the span that staged
//! the record. The process's subscriber exports only spans of level `INFO`
//! and above, as a default OpenTelemetry set-up does.

#![cfg(all(feature = "otel", feature = "all-adapters"))]

use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use keyorder::{Client, Delivery, HandlerResult, KeySource, Message, TRACEPARENT_HEADER};
use keyorder_outbox::{Outbox, OutboxConfig, Outgoing, RelayConfig};
use keyorder_testkit::brokers::Broker;
use keyorder_testkit::until;
use opentelemetry::trace::{SpanId, TraceContextExt, TraceId, TracerProvider as _};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::Layer;

const DEADLINE: Duration = Duration::from_secs(90);

/// The process's exporter: a subscriber with a `tracing-opentelemetry`
/// layer (level `INFO` and above) over an SDK tracer provider exporting to
/// memory, installed once for every test of this binary.
fn exporter() -> &'static InMemorySpanExporter {
    static EXPORTER: OnceLock<(InMemorySpanExporter, SdkTracerProvider)> = OnceLock::new();
    &EXPORTER
        .get_or_init(|| {
            let exporter = InMemorySpanExporter::default();
            let provider = SdkTracerProvider::builder()
                .with_simple_exporter(exporter.clone())
                .build();
            let layer = tracing_opentelemetry::layer()
                .with_tracer(provider.tracer("keyorder-traces-test"))
                .with_filter(tracing_subscriber::filter::LevelFilter::INFO);
            tracing::subscriber::set_global_default(tracing_subscriber::registry().with(layer))
                .expect("the only subscriber of this test binary");
            (exporter, provider)
        })
        .0
}

/// The trace and span id of `span` (a valid context: the layer is on).
fn ids(span: &tracing::Span) -> (TraceId, SpanId) {
    let cx = span.context();
    let sc = cx.span().span_context().clone();
    assert!(sc.is_valid(), "the test's span has no OpenTelemetry context");
    (sc.trace_id(), sc.span_id())
}

/// The finished `keyorder.delivery` span of trace `trace`, once exported.
async fn delivery_span(what: &str, trace: TraceId) -> SpanData {
    until(&format!("{what}: the delivery span exported"), DEADLINE, async || {
        let spans = exporter().get_finished_spans().map_err(|e| e.to_string())?;
        let mine: Vec<&SpanData> = spans.iter().filter(|s| s.span_context.trace_id() == trace).collect();
        match mine.iter().find(|s| s.name == "keyorder.delivery") {
            Some(s) => Ok((*s).clone()),
            None => Err(format!(
                "spans of the trace so far: {:?}",
                mine.iter().map(|s| s.name.as_ref()).collect::<Vec<_>>()
            )),
        }
    })
    .await
}

/// A subscription on `category` that records each delivery's
/// `traceparent` header; its stop signal and task.
struct Consumer {
    seen: Arc<Mutex<Vec<Option<String>>>>,
    stop: tokio::sync::oneshot::Sender<()>,
    run: tokio::task::JoinHandle<keyorder::Result<keyorder::RunReport>>,
}

async fn consume(client: &Client, category: &str, what: &str) -> Consumer {
    let subscription = client
        .subscribe(category, "g")
        .ordered_by(KeySource::routing_key())
        .build()
        .await
        .unwrap_or_else(|e| panic!("{what}: subscribe: {e}"));
    let seen: Arc<Mutex<Vec<Option<String>>>> = Arc::default();
    let handler = {
        let seen = seen.clone();
        move |d: Delivery| {
            let seen = seen.clone();
            async move {
                seen.lock()
                    .unwrap()
                    .push(d.message().header(TRACEPARENT_HEADER).map(str::to_owned));
                HandlerResult::Ok(())
            }
        }
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(subscription.run(handler, async move {
        let _ = stopped.await;
    }));
    Consumer { seen, stop, run }
}

impl Consumer {
    /// Stops the subscription and answers the `traceparent` of each
    /// delivery it made.
    async fn finish(self, what: &str) -> Vec<Option<String>> {
        let _ = self.stop.send(());
        self.run
            .await
            .unwrap()
            .unwrap_or_else(|e| panic!("{what}: the subscription failed: {e}"));
        let seen = self.seen.lock().unwrap().clone();
        seen
    }
}

/// Publishes one message inside a span on `client` and checks that the
/// delivery span's parent is that span.
async fn parent_is_the_publisher(client: Client, broker: &str) {
    exporter();
    let span = tracing::info_span!("test.publish", broker);
    let (trace, publisher_span) = ids(&span);
    let category = format!("traces_{broker}_{}", &trace.to_string()[..12]);
    let consumer = consume(&client, &category, broker).await;
    let publisher = client.publisher(&category).await.unwrap();
    publisher
        .publish(Message::new("traced").with_key("k").unwrap())
        .instrument(span)
        .await
        .unwrap_or_else(|e| panic!("{broker}: publish: {e}"));
    let delivery = delivery_span(broker, trace).await;
    assert_eq!(
        delivery.parent_span_id, publisher_span,
        "{broker}: the delivery span's parent is not the publisher's span"
    );
    assert!(
        delivery.parent_span_is_remote,
        "{broker}: the parent came from the headers"
    );
    let seen = consumer.finish(broker).await;
    assert_eq!(
        seen,
        [Some(format!("00-{trace}-{publisher_span}-01"))],
        "{broker}: the traceparent header the handler saw"
    );
}

async fn connect(broker: Broker, url: &str) -> Client {
    broker.require(url, keyorder::connect(url)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_delivery_continues_the_publisher_trace() {
    parent_is_the_publisher(Client::memory(), "memory").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_delivery_continues_the_publisher_trace() {
    let url = format!("{}?migrate=true", Broker::Postgres.url());
    parent_is_the_publisher(connect(Broker::Postgres, &url).await, "postgres").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_delivery_continues_the_publisher_trace() {
    let url = Broker::Redis.url();
    parent_is_the_publisher(connect(Broker::Redis, &url).await, "redis").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_delivery_continues_the_publisher_trace() {
    let url = format!("{}?topology=hash&queues=4", Broker::RabbitMq.url());
    parent_is_the_publisher(connect(Broker::RabbitMq, &url).await, "rabbitmq").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_delivery_continues_the_publisher_trace() {
    let url = format!("kafka://{}?partitions=4&fetch_wait_ms=10", Broker::Kafka.url());
    parent_is_the_publisher(connect(Broker::Kafka, &url).await, "kafka").await;
}

/// A message that carries its own `traceparent` (a foreign producer's, or
/// the outbox's) keeps it when published inside another span, and the
/// delivery continues that trace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_traceparent_the_message_carries_wins() {
    exporter();
    // A producer's context that is not the publishing span's.
    let (foreign_trace, foreign_span) = ids(&tracing::info_span!("test.foreign"));
    let client = Client::memory();
    let span = tracing::info_span!("test.publish.other");
    let (other_trace, _) = ids(&span);
    let category = format!("traces_foreign_{}", &other_trace.to_string()[..12]);
    let consumer = consume(&client, &category, "foreign").await;
    let publisher = client.publisher(&category).await.unwrap();
    let traceparent = format!("00-{foreign_trace}-{foreign_span}-01");
    publisher
        .publish(
            Message::new("traced")
                .with_key("k")
                .unwrap()
                .with_header(TRACEPARENT_HEADER, traceparent.clone()),
        )
        .instrument(span)
        .await
        .unwrap();
    let delivery = delivery_span("foreign", foreign_trace).await;
    assert_eq!(
        delivery.parent_span_id, foreign_span,
        "foreign: the delivery span's parent"
    );
    let seen = consumer.finish("foreign").await;
    assert_eq!(
        seen,
        [Some(traceparent)],
        "foreign: the message's own traceparent was replaced"
    );
}

/// Through the outbox: the record staged inside a span in the caller's
/// transaction is relayed later, outside that span, and the delivery span's
/// parent is still the staging span.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outbox_delivery_continues_the_staging_trace() {
    exporter();
    let span = tracing::info_span!("test.stage");
    let (trace, staging_span) = ids(&span);
    let unique = &trace.to_string()[..12];
    let db = Broker::Postgres.url();
    let cfg = OutboxConfig {
        schema: format!("keyorder_outbox_traces_{unique}"),
        ..OutboxConfig::default()
    };
    let outbox = Broker::Postgres.require(&db, Outbox::connect(&db, 4, cfg)).await;
    outbox.migrate().await.unwrap();
    let url = format!("{db}?migrate=true");
    let client = connect(Broker::Postgres, &url).await;
    let category = format!("traces_outbox_{unique}");
    async {
        let mut tx = outbox.pool().begin().await.unwrap();
        outbox
            .stage(&mut tx, Outgoing::new(&category, "k", "traced"))
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }
    .instrument(span)
    .await;
    let consumer = consume(&client, &category, "outbox").await;
    // The relay publishes in a span of its own: the record's context wins.
    let (stop_relay, relay_stopped) = tokio::sync::oneshot::channel::<()>();
    let relay = tokio::spawn(
        outbox
            .relay(client.clone(), RelayConfig::default())
            .run(async move {
                let _ = relay_stopped.await;
            })
            .instrument(tracing::info_span!("test.relay")),
    );
    let delivery = delivery_span("outbox", trace).await;
    assert_eq!(
        delivery.parent_span_id, staging_span,
        "outbox: the delivery span's parent is not the staging span"
    );
    let seen = consumer.finish("outbox").await;
    assert_eq!(
        seen,
        [Some(format!("00-{trace}-{staging_span}-01"))],
        "outbox: traceparent"
    );
    let _ = stop_relay.send(());
    relay.await.unwrap().unwrap();
}

/// A message carrying a `traceparent` that is not one (a foreign
/// producer's garbage, a truncated value) is delivered once, and the
/// publish replaces the invalid header with the publishing span's context:
/// the delivery span is a child of the publisher's span.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_traceparent_does_not_cut_the_trace() {
    exporter();
    let client = Client::memory();
    let span = tracing::info_span!("test.publish.garbage");
    let (trace, publisher_span) = ids(&span);
    let category = format!("traces_garbage_{}", &trace.to_string()[..12]);
    let consumer = consume(&client, &category, "garbage").await;
    let publisher = client.publisher(&category).await.unwrap();
    publisher
        .publish(
            Message::new("traced")
                .with_key("k")
                .unwrap()
                .with_header(TRACEPARENT_HEADER, "00-not-a-trace-context-\u{1F600}")
                .with_header("tracestate", "x".repeat(100_000)),
        )
        .instrument(span)
        .await
        .unwrap();
    let seen = consumer.seen.clone();
    until("garbage: delivered", DEADLINE, async || {
        if seen.lock().unwrap().len() == 1 {
            Ok(())
        } else {
            Err("not yet".into())
        }
    })
    .await;
    let seen = consumer.finish("garbage").await;
    assert_eq!(seen.len(), 1, "garbage: delivered once");
    // The delivery span is exported once it closed: polled, not slept on.
    let parent = until(
        "garbage: the delivery span in the publisher's trace",
        DEADLINE,
        async || {
            exporter()
                .get_finished_spans()
                .unwrap()
                .iter()
                .find(|s| s.name == "keyorder.delivery" && s.span_context.trace_id() == trace)
                .map(|d| d.parent_span_id)
                .ok_or_else(|| "the invalid traceparent was kept: no delivery span in the trace".to_owned())
        },
    )
    .await;
    assert_eq!(parent, publisher_span, "garbage: the delivery span's parent");
}
