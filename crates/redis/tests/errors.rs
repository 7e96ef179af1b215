//! A broker error keeps its cause (issue 38): the driver's (redis) error is
//! its `source()`, and it says whether retrying can help.

use std::error::Error as _;

use keyorder_core::Error;
use keyorder_redis::RedisTransport;

#[tokio::test]
async fn a_refused_connection_is_temporary_and_keeps_the_redis_error() {
    let url = "redis://127.0.0.1:1/?response_timeout_ms=3000".parse().unwrap();
    let err = RedisTransport::from_url(&url).await.unwrap_err();
    assert!(matches!(err, Error::Broker(_)), "{err}");
    assert!(err.is_temporary(), "a refused connection may come back: {err}");
    let source = err.source().expect("the driver's error is kept as the source");
    assert!(source.downcast_ref::<redis::RedisError>().is_some(), "{source:?}");
    assert!(err.to_string().starts_with("broker: redis: "), "{err}");
}

#[tokio::test]
async fn a_refused_password_is_permanent_and_not_shown() {
    // The shared test server has no password: AUTH is refused, and retrying
    // is refused the same way.
    let server = keyorder_testkit::brokers::Broker::Redis.url();
    let mut url: url::Url = server.parse().unwrap();
    url.set_username("nobody").unwrap();
    url.set_password(Some("s3cretPw")).unwrap();
    let err = RedisTransport::from_url(&url).await.unwrap_err();
    assert!(!err.is_temporary(), "{err}");
    let mut chain = vec![err.to_string()];
    let mut cur = err.source();
    while let Some(e) = cur {
        chain.push(format!("{e} {e:?}"));
        cur = e.source();
    }
    assert!(chain.iter().all(|t| !t.contains("s3cretPw")), "{chain:?}");
}
