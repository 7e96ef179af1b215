//! Channels in confirm mode, and publishing through one with the
//! broker's confirm (an unroutable or refused message is an error).

use keyorder_core::{Error, Result};
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::Confirmation;
use lapin::{BasicProperties, Channel, Connection};

use crate::error::broker;

/// A confirm-mode channel.
pub(crate) async fn confirm_channel(conn: &Connection) -> Result<Channel> {
    let ch = conn.create_channel().await.map_err(broker)?;
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(broker)?;
    Ok(ch)
}

/// Publishes with `mandatory` and waits for the broker's confirm; an
/// unroutable or refused message is an error, never a silent drop.
pub(crate) async fn publish_confirmed(
    ch: &Channel,
    exchange: &str,
    routing_key: &str,
    payload: &[u8],
    props: BasicProperties,
) -> Result<()> {
    let confirm = ch
        .basic_publish(
            exchange.into(),
            routing_key.into(),
            BasicPublishOptions {
                mandatory: true,
                ..Default::default()
            },
            payload,
            props,
        )
        .await
        .map_err(broker)?
        .await
        .map_err(broker)?;
    match confirm {
        Confirmation::Ack(None) => Ok(()),
        Confirmation::Ack(Some(_)) => Err(Error::NotFound(format!(
            "rabbitmq: message unroutable through exchange `{exchange}` (no queue bound: declare the topology)"
        ))),
        Confirmation::Nack(_) => Err(Error::broker("rabbitmq: the broker refused the message (nack)")),
        // A channel keyorder opened without confirms: retrying on it fails
        // the same way.
        Confirmation::NotRequested => Err(Error::Broker(
            keyorder_core::BrokerError::new("rabbitmq: publisher confirms are off").with_temporary(false),
        )),
    }
}
