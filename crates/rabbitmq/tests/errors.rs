//! A broker error keeps its cause (issue 38): the driver's (lapin) error is
//! its `source()`, and it says whether retrying can help.

use std::error::Error as _;

use keyorder_core::Error;
use keyorder_rabbitmq::RabbitTransport;

#[tokio::test]
async fn a_refused_connection_is_temporary_and_keeps_the_lapin_error() {
    let url = "amqp://guest:guest@127.0.0.1:1/%2f?consumer_timeout_ms=3600000"
        .parse()
        .unwrap();
    let err = RabbitTransport::from_url(&url).await.unwrap_err();
    assert!(matches!(err, Error::Broker(_)), "{err}");
    assert!(err.is_temporary(), "a refused connection may come back: {err}");
    let source = err.source().expect("the driver's error is kept as the source");
    assert!(source.downcast_ref::<lapin::Error>().is_some(), "{source:?}");
    assert!(err.to_string().starts_with("broker: rabbitmq: "), "{err}");
}

#[tokio::test]
async fn a_refused_login_is_permanent_and_its_password_not_shown() {
    let base = keyorder_testkit::brokers::Broker::RabbitMq.url();
    let mut url: url::Url = format!("{base}?consumer_timeout_ms=3600000").parse().unwrap();
    url.set_password(Some("s3cretPw-wrong")).unwrap();
    let err = RabbitTransport::from_url(&url).await.unwrap_err();
    assert!(!err.is_temporary(), "the same password is refused again: {err}");
    let source = err.source().expect("the driver's error is kept as the source");
    assert!(source.downcast_ref::<lapin::Error>().is_some(), "{source:?}");
    let mut chain = vec![err.to_string()];
    let mut cur = err.source();
    while let Some(e) = cur {
        chain.push(format!("{e} {e:?}"));
        cur = e.source();
    }
    assert!(chain.iter().all(|t| !t.contains("s3cretPw")), "{chain:?}");
}
