//! `impl TransportPublisher`: one script appends a message to its key's
//! partition stream (recorded in the index) or to the keyless or single
//! stream, behind the publish fence when one is given.

use std::fmt;

use async_trait::async_trait;
use keyorder_core::{Error, Message, PublishFence, Result, TransportPublisher};
use redis::Value;

use crate::config::Layout;
use crate::conn::Conn;
use crate::error::broker;
use crate::names::Names;
use crate::scripts;
use crate::wire::fields;

pub(crate) struct RedisPublisher {
    pub(crate) t: Conn,
    pub(crate) names: Names,
}

impl fmt::Debug for RedisPublisher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisPublisher")
            .field("category", &self.names.category())
            .finish()
    }
}

#[async_trait]
impl TransportPublisher for RedisPublisher {
    async fn publish(&self, message: Message) -> Result<()> {
        self.append(message, None).await.map(|_| ())
    }

    /// One script checks and records the fence and appends, as
    /// [`TransportPublisher::publish`] would (the fence key is
    /// `{category}:__fence__:{scope}`).
    async fn publish_fenced(&self, message: Message, fence: &PublishFence) -> Result<()> {
        if self.append(message, Some(fence)).await? {
            Ok(())
        } else {
            Err(Error::Fenced {
                scope: fence.scope.clone(),
                generation: fence.token,
            })
        }
    }
}

impl RedisPublisher {
    /// Appends with one script: to the key's partition stream (recorded in
    /// the index), or to the single or keyless stream; behind `fence` when
    /// given. Returns whether it was stored (`false`: fenced).
    async fn append(&self, message: Message, fence: Option<&PublishFence>) -> Result<bool> {
        let mut conn = self.t.conn.clone();
        let n = &self.names;
        let single = self.t.cfg.layout == Layout::Single;
        let keyed = message.key().filter(|_| !single);
        let mut inv = match (keyed.is_some(), fence.is_some()) {
            (true, false) => scripts::PUBLISH.prepare_invoke(),
            (true, true) => scripts::PUBLISH_FENCED.prepare_invoke(),
            (false, false) => scripts::APPEND.prepare_invoke(),
            (false, true) => scripts::APPEND_FENCED.prepare_invoke(),
        };
        match keyed {
            Some(key) => inv.key(n.stream(key.as_str())).key(n.index()),
            None => inv.key(if single { n.single() } else { n.keyless() }),
        };
        if let Some(f) = fence {
            inv.key(n.fence(&f.scope));
        }
        match keyed {
            // The index member and the wake-up carry the key's segment.
            Some(key) => inv.arg(&*Names::segment(key.as_str())).arg(n.wake()),
            None => inv.arg(n.wake()).arg(""),
        };
        if let Some(f) = fence {
            inv.arg(f.token);
        }
        for f in fields(&message, single)? {
            inv.arg(f);
        }
        let reply: Value = inv.invoke_async(&mut conn).await.map_err(broker)?;
        Ok(fence.is_none() || reply == Value::Int(1))
    }
}
