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
