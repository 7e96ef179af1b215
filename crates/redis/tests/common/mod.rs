//! What the Redis tests share: the test server's URL and a connect that
//! names a missing server.

use keyorder_redis::RedisTransport;
use keyorder_testkit::brokers::Broker;

/// The test server (`REDIS_URL`, started by `scripts/services`).
#[allow(dead_code)]
pub(crate) fn url() -> String {
    Broker::Redis.url()
}

/// A transport on `url` (a `redis://` URL on [`url`]); a server that cannot
/// be reached fails the test naming it, the URL and `scripts/services`.
#[allow(dead_code)]
pub(crate) async fn connect(url: &str) -> RedisTransport {
    Broker::Redis
        .require(url, RedisTransport::from_url(&url.parse().unwrap()))
        .await
}
