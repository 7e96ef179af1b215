//! A broker error keeps its cause (issue 38): librdkafka's error is its
//! `source()`, and it says whether retrying can help.

use std::error::Error as _;

use keyorder_core::Error;
use keyorder_kafka::KafkaTransport;

#[tokio::test]
async fn an_unreachable_broker_is_temporary_and_keeps_the_client_error() {
    let url = "kafka://127.0.0.1:1?partitions=2".parse().unwrap();
    let err = KafkaTransport::from_url(&url).await.unwrap_err();
    assert!(matches!(err, Error::Broker(_)), "{err}");
    assert!(err.is_temporary(), "an unreachable broker may come back: {err}");
    let source = err.source().expect("the client's error is kept as the source");
    assert!(
        source.downcast_ref::<rdkafka::error::KafkaError>().is_some(),
        "{source:?}"
    );
}

/// A record over the client's size limit is refused on every try: the
/// publish's error says so (not temporary) and keeps librdkafka's error.
#[tokio::test]
async fn a_record_too_large_is_permanent_and_keeps_the_client_error() {
    let brokers = keyorder_testkit::brokers::Broker::Kafka.url();
    let url = format!("kafka://{brokers}?partitions=2").parse().unwrap();
    let client = keyorder_core::Client::new(std::sync::Arc::new(KafkaTransport::from_url(&url).await.unwrap()));
    let category = format!("errors-{}", &uuid::Uuid::new_v4().simple().to_string()[..10]);
    let publisher = client.publisher(&category).await.unwrap();
    let big = keyorder_core::Message::new(vec![b'x'; 3 * 1024 * 1024])
        .with_key("k")
        .unwrap();
    let err = publisher.publish(big).await.unwrap_err();
    assert!(matches!(err, Error::Broker(_)), "{err}");
    assert!(!err.is_temporary(), "the same record is refused again: {err}");
    let source = err.source().expect("the client's error is kept as the source");
    assert!(
        source.downcast_ref::<rdkafka::error::KafkaError>().is_some(),
        "{source:?}"
    );
}
