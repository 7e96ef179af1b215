//! What every room of the adapter works through: the configuration, the
//! client, the shared reconnecting connection and the settle batcher
//! ([`Conn`], which [`RedisTransport`](crate::RedisTransport) holds and
//! hands to its publishers, sources and admin), and the group registry
//! every subscription records itself in before it reads.

use std::sync::Arc;
use std::time::Duration;

use keyorder_core::{BrokerError, Error, Result};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};

use crate::batch;
use crate::config::RedisConfig;
use crate::error::broker;
use crate::names::Names;
use crate::scripts;

/// The connection a transport's rooms share.
#[derive(Clone)]
pub(crate) struct Conn {
    pub(crate) cfg: Arc<RedisConfig>,
    pub(crate) client: redis::Client,
    pub(crate) conn: ConnectionManager,
    pub(crate) batcher: batch::Batcher,
}

/// A reconnecting connection with `timeout` per response.
pub(crate) async fn manager(
    client: &redis::Client,
    cfg: &RedisConfig,
    timeout: Option<std::time::Duration>,
) -> Result<ConnectionManager> {
    let config = ConnectionManagerConfig::new()
        .set_response_timeout(timeout)
        .set_connection_timeout(Some(cfg.response_timeout))
        .set_number_of_retries(2)
        .set_max_delay(std::time::Duration::from_secs(1));
    tokio::time::timeout(
        cfg.response_timeout * 4,
        ConnectionManager::new_with_config(client.clone(), config),
    )
    .await
    .map_err(|_| Error::broker(format!("redis: no answer from {} ({})", cfg.display, cfg.hint())))?
    .map_err(|e| {
        let hint = match e.kind() {
            redis::ErrorKind::AuthenticationFailed => "check the password (and the user name)",
            _ => cfg.hint(),
        };
        let b = BrokerError::new(format!("redis: cannot connect to {}: {e} ({hint})", cfg.display));
        Error::Broker(crate::error::with_cause(b, e))
    })
}

/// Records `group` in the category's group registry, before the group
/// reads anything, with this member's first heartbeat in the same step
/// (see [`scripts::REGISTER`]): trimming and reaping keep what a registered
/// group has not passed. The entry names the sorted set the group's
/// members heartbeat in. Idempotent.
pub(crate) async fn register_group(
    t: &Conn,
    names: &Names,
    group: &str,
    members: &str,
    owner: &str,
    ttl: Duration,
) -> Result<()> {
    let _: i64 = scripts::REGISTER
        .key(names.groups())
        .key(members)
        .key(names.keyless())
        .arg(names.category())
        .arg(group)
        .arg(owner)
        .arg(ttl.as_millis() as u64)
        .invoke_async(&mut t.conn.clone())
        .await
        .map_err(broker)?;
    Ok(())
}
