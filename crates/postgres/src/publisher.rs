//! `PgPublisher`: `impl TransportPublisher` of the slot layout, one
//! statement per publish (fenced publishes record their fence in the same
//! statement).

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;
use keyorder_core::key::stored_text;
use keyorder_core::{Error, Message, PublishFence, Result, TransportPublisher};

use crate::error::broker;
use crate::exec::{q, PgQuery};
use crate::names::slot_of;
use crate::pg::Pg;
use crate::wire::{headers_of, stored_key};

/// A publisher to one queue of the slot layout.
pub(crate) struct PgPublisher {
    t: Pg,
    queue: String,
    slots: u32,
    /// scope -> the token this publisher last recorded in `publish_fences`:
    /// a publish with that token again only share-locks the fence row and
    /// checks it (no row update, so a scope's publishes do not queue on it).
    fences: std::sync::Mutex<HashMap<String, u64>>,
}

impl fmt::Debug for PgPublisher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgPublisher").field("queue", &self.queue).finish()
    }
}

#[async_trait]
impl TransportPublisher for PgPublisher {
    /// One statement records the fence in `publish_fences` and inserts the
    /// event only where the fence held no higher token.
    async fn publish_fenced(&self, message: Message, fence: &PublishFence) -> Result<()> {
        let headers = headers_of(&message)?;
        let token = i64::try_from(fence.token)
            .map_err(|_| Error::Config(format!("publish fence token {} exceeds i64", fence.token)))?;
        let recorded = self.fences.lock().unwrap_or_else(|e| e.into_inner()).get(&fence.scope) == Some(&fence.token);
        // With the token this publisher recorded last, the cheap statement
        // first; when it stores nothing (the fence moved, or the row is
        // gone), the recording statement decides.
        let statements: &[&Arc<str>] = if recorded {
            &[&self.t.sql.publish_fence_held, &self.t.sql.publish_fenced]
        } else {
            &[&self.t.sql.publish_fenced]
        };
        for sql in statements {
            let rows = self
                .t
                .db
                .all(
                    self.event(sql, &message, &headers)
                        .bind(&fence.scope)
                        .bind(token)
                        .bind(self.slots as i32),
                )
                .await
                .map_err(|e| self.t.missing_schema(e))?;
            if !rows.is_empty() {
                self.fences
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(fence.scope.clone(), fence.token);
                return Ok(());
            }
        }
        // Nothing inserted: the fence, or the layout.
        self.t
            .check_layout(&self.queue, self.slots, "this publisher", true)
            .await?;
        Err(Error::Fenced {
            scope: fence.scope.clone(),
            generation: fence.token,
        })
    }

    async fn publish(&self, message: Message) -> Result<()> {
        let headers = headers_of(&message)?;
        let rows = self
            .t
            .db
            .all(
                self.event(&self.t.sql.publish, &message, &headers)
                    .bind(self.slots as i32),
            )
            .await
            .map_err(broker)?;
        if rows.is_empty() {
            // Nothing inserted: the queue's layout is not this publisher's.
            self.t
                .check_layout(&self.queue, self.slots, "this publisher", true)
                .await?;
            return Err(Error::NotFound(format!(
                "postgres: queue `{}` is gone (deleted while publishing)",
                self.queue
            )));
        }
        Ok(())
    }
}

impl PgPublisher {
    /// A publisher to `queue`, whose slot count is `slots`.
    pub(crate) fn new(t: Pg, queue: String, slots: u32) -> PgPublisher {
        PgPublisher {
            fences: std::sync::Mutex::default(),
            t,
            queue,
            slots,
        }
    }

    /// `sql` (a publish statement) with the event's parameters `$1`-`$8`
    /// bound: queue, slot, key, id, correlation id, headers, payload and
    /// the notification channel.
    fn event<'q>(&'q self, sql: &Arc<str>, message: &'q Message, headers: &'q str) -> PgQuery<'q> {
        q(sql)
            .bind(&self.queue)
            .bind(slot_of(message.key(), message.id(), self.slots) as i32)
            .bind(message.key().map(stored_key))
            .bind(message.id())
            .bind(message.correlation_id().map(stored_text))
            .bind(headers)
            .bind(message.payload().as_ref())
            .bind(&self.t.sql.channel)
    }
}
