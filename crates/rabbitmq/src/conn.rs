//! What every room of the adapter works through: the configuration, the
//! shared connection (reconnected when the broker closed it), the names
//! declared so far, and the state shared in this process ([`Conn`], which
//! [`RabbitTransport`](crate::RabbitTransport) holds and hands to its
//! publishers, sources and admin); and connecting to the broker.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use keyorder_core::{Error, Result};
use lapin::{Connection, ConnectionProperties};

use crate::config::RabbitConfig;
use crate::shared::Shared;

/// The connection a transport's rooms share.
#[derive(Clone)]
pub(crate) struct Conn {
    pub(crate) cfg: Arc<RabbitConfig>,
    pub(crate) conn: Arc<tokio::sync::Mutex<Arc<Connection>>>,
    pub(crate) shared: Arc<Shared>,
    pub(crate) declared: Arc<Mutex<HashSet<String>>>,
}

/// Connects to `uri` (`cfg`'s, or a variant of it); with TLS, the CA
/// certificates of `cacertfile=` (or the system's roots) verify the server.
pub(crate) async fn connect_uri(uri: &str, cfg: &RabbitConfig) -> Result<Connection> {
    let display = &cfg.display;
    let tls = match &cfg.ca_file {
        Some(path) => {
            let pem = std::fs::read_to_string(path)
                .map_err(|e| Error::Config(format!("rabbitmq: cannot read cacertfile {}: {e}", path.display())))?;
            // The TLS library skips what it cannot parse: a file without a
            // certificate would leave the system's roots alone in charge.
            if !pem.contains("-----BEGIN CERTIFICATE-----") {
                return Err(Error::Config(format!(
                    "rabbitmq: cacertfile {} holds no PEM certificate (-----BEGIN CERTIFICATE-----)",
                    path.display()
                )));
            }
            lapin::tcp::OwnedTLSConfig {
                identity: None,
                cert_chain: Some(pem),
            }
        }
        None => lapin::tcp::OwnedTLSConfig::default(),
    };
    let runtime = lapin::runtime::default_runtime()
        .map_err(|e| Error::broker(format!("rabbitmq: no runtime to connect with: {e}")))?;
    tokio::time::timeout(
        std::time::Duration::from_secs(10),
        Connection::connect_with_config(uri, ConnectionProperties::default(), tls, runtime),
    )
    .await
    .map_err(|_| Error::broker(format!("rabbitmq: no answer from {display} ({})", hint(uri))))?
    .map_err(|e| {
        let text = e.to_string();
        let hint = if text.contains("ACCESS_REFUSED") {
            "check the user name and password, and that the user may use this virtual host"
        } else {
            hint(uri)
        };
        crate::error::broker_as(format!("rabbitmq: cannot connect to {display}: {text} ({hint})"), e)
    })
}

/// What to check when a connection fails.
fn hint(uri: &str) -> &'static str {
    if uri.starts_with("amqps:") {
        "is it running, does that port serve TLS (a plaintext port answers a TLS handshake with a corrupt message), \
         and did the CA of cacertfile= (or a system root) sign its certificate?"
    } else {
        "is it running?"
    }
}

impl Conn {
    /// The shared connection (publishing, declarations, admin), reconnected
    /// when the broker closed it (a restart).
    pub(crate) async fn connection(&self) -> Result<Arc<Connection>> {
        let mut conn = self.conn.lock().await;
        if !conn.status().connected() {
            tracing::info!(broker = %self.cfg.display, "rabbitmq: reconnecting");
            *conn = Arc::new(connect_uri(&self.cfg.uri, &self.cfg).await?);
        }
        Ok(conn.clone())
    }

    pub(crate) fn was_declared(&self, name: &str) -> bool {
        self.declared.lock().unwrap_or_else(|e| e.into_inner()).contains(name)
    }

    pub(crate) fn declared_now(&self, name: &str) {
        self.declared
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(name.to_owned());
    }

    /// Forgets that `name` (a category or a group's base name) was
    /// declared: the next use declares it again.
    pub(crate) fn forget(&self, name: &str) {
        self.declared.lock().unwrap_or_else(|e| e.into_inner()).remove(name);
    }
}
