//! `impl TransportPublisher`: a message goes to its category's entry
//! exchange on a confirm-mode channel, routed by its key (a keyless one by
//! a hash of its id), and is stored once the broker confirms it.

use std::fmt;

use async_trait::async_trait;
use keyorder_core::{Error, Message, Result, TransportPublisher};
use lapin::Channel;

use crate::channel::{confirm_channel, publish_confirmed};
use crate::conn::Conn;
use crate::names::Names;
use crate::wire::{keyless_routing_key, properties};

pub(crate) struct RabbitPublisher {
    pub(crate) t: Conn,
    pub(crate) names: Names,
    pub(crate) channel: tokio::sync::Mutex<Option<Channel>>,
}

impl fmt::Debug for RabbitPublisher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitPublisher")
            .field("category", &self.names.category())
            .finish()
    }
}

#[async_trait]
impl TransportPublisher for RabbitPublisher {
    async fn publish(&self, message: Message) -> Result<()> {
        // Refused before anything is sent.
        let props = properties(&message)?;
        let mut slot = self.channel.lock().await;
        let ch = match slot.as_ref() {
            Some(ch) if ch.status().connected() => ch.clone(),
            _ => {
                let ch = confirm_channel(&*self.t.connection().await?).await?;
                *slot = Some(ch.clone());
                ch
            }
        };
        drop(slot);
        // Keyless messages spread by a hash of their id (an id may be
        // longer than a routing key can be).
        let key = message
            .key()
            .map_or_else(|| keyless_routing_key(message.id()), |k| k.as_str().to_owned());
        let entry = self.names.entry();
        match publish_confirmed(&ch, &entry, &key, message.payload(), props).await {
            Err(Error::NotFound(_)) => Err(Error::Config(format!(
                "rabbitmq: no consumer group of category `{c}` has its queues declared, so the message was not \
                 stored (nothing was published): each group's queues are declared when its first subscription is \
                 built, and a message published before that does not reach it. Name the groups that must receive \
                 it in the publisher's URL, `groups=<group>,...` (with the groups' topology: it declares them \
                 when the publisher is created), or build each group's subscription once before publishing",
                c = self.names.category()
            ))),
            other => other,
        }
    }
}
