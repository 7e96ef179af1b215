//! Fencing tokens the broker makes monotonic: the virtual host's claims stream.
//!
//! RabbitMQ keeps no counter a consumer could read a generation from, and
//! a host's clock orders nothing across hosts. So the virtual host has a
//! **claims stream** (`keyorder.claims`, `x-queue-type: stream`, durable,
//! bounded by `x-max-length-bytes` and `x-max-age`): a stream gives every
//! message appended to it an offset, assigned by the stream's single
//! writer, one larger than the previous message's, never reused (retention
//! drops old segments, offsets go on from where they were). One stream for
//! every category and group, not one per group: a stream keeps files open
//! on the broker for as long as it exists and cannot expire (`x-expires`),
//! so a stream per group would pile up with groups that come and go (and
//! did, in the test suites, until the broker ran out of file descriptors).
//! Tokens are then comparable across every queue of the virtual host; each
//! source reads every claim (a few bytes per activation or connection).
//!
//! - **A queue's token.** A consumer takes its token when the broker
//!   *activates* it: on the first delivery for its consumer tag, the source
//!   publishes a claim (a fresh unique id, nothing else) to the claims
//!   stream **on that queue's own channel**, and reads the claim back
//!   through the long-lived stream consumer every source keeps on the
//!   stream (from `next`); the claim's offset (`x-stream-offset` of the
//!   delivery) plus one is the token. Deliveries of that consumer wait
//!   until the token is known; none is handed to the dispatcher before.
//! - **Why a later activation always gets a larger token.** Let A be a
//!   queue's active consumer and B the next one. The broker activates B
//!   only after A's channel (or connection) closed or A was cancelled. A
//!   published its claim on that very channel before it could start
//!   anything, so the broker's channel process forwarded A's claim to the
//!   stream before it processed the close (a channel's frames are handled
//!   in order); B's first delivery, hence B's claim, comes after B's
//!   activation, after that close. The stream's writer appends in the
//!   order it receives (within one node the forward of A's claim reaches it
//!   before anything caused by the later close). So A's claim has a smaller
//!   offset than B's. A claim the broker never appended (the channel died
//!   first) is never read back, and its consumer starts nothing.
//! - **Plan order.** A source publishes a *join* claim when it first
//!   connects; its offset, not a wall clock, orders the `hash` plan's
//!   members (the oldest member, the leader, has the smallest).
//!
//! A claim not read back within the lease TTL counts as no activation: the
//! consumer's channel is closed (its deliveries return to the queue) and
//! the queue is taken again at the next maintenance.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use keyorder_core::Result;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Channel, Connection};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::error::broker;

/// The virtual host's claims stream.
pub(crate) const STREAM: &str = "keyorder.claims";

/// The stream's retention (a claim is read back within a lease TTL; older
/// ones are never read again): 16 MB or a day, in 1 MB segments (a stream
/// drops whole segments only).
pub(crate) const MAX_BYTES: i64 = 16 * 1024 * 1024;
pub(crate) const MAX_AGE: &str = "1D";
pub(crate) const SEGMENT_BYTES: i64 = 1024 * 1024;

/// The stream consumer's credit (a stream consumer needs a prefetch).
const CREDIT: u16 = 256;

type Waiters = Arc<Mutex<HashMap<String, oneshot::Sender<u64>>>>;

/// The declaration arguments of a claims stream.
pub(crate) fn stream_args() -> FieldTable {
    let mut args = FieldTable::default();
    args.insert("x-queue-type".into(), AMQPValue::LongString(LongString::from("stream")));
    args.insert("x-max-length-bytes".into(), AMQPValue::LongLongInt(MAX_BYTES));
    args.insert("x-max-age".into(), AMQPValue::LongString(LongString::from(MAX_AGE)));
    args.insert(
        "x-stream-max-segment-size-bytes".into(),
        AMQPValue::LongLongInt(SEGMENT_BYTES),
    );
    args
}

/// A source's reader of the claims stream.
pub(crate) struct Claims {
    stream: String,
    channel: Channel,
    waiters: Waiters,
    task: JoinHandle<()>,
}

impl Drop for Claims {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn offset_of(props: &BasicProperties) -> Option<u64> {
    let h = props.headers().as_ref()?;
    match h.inner().get("x-stream-offset")? {
        AMQPValue::LongLongInt(n) => u64::try_from(*n).ok(),
        AMQPValue::LongInt(n) => u64::try_from(*n).ok(),
        AMQPValue::LongUInt(n) => Some(u64::from(*n)),
        _ => None,
    }
}

impl Claims {
    /// Starts reading `stream` from its end on a channel of its own.
    pub(crate) async fn open(conn: &Connection, stream: &str, tag: lapin::types::ShortString) -> Result<Claims> {
        let channel = conn.create_channel().await.map_err(broker)?;
        channel
            .basic_qos(CREDIT, BasicQosOptions::default())
            .await
            .map_err(broker)?;
        let mut args = FieldTable::default();
        args.insert(
            "x-stream-offset".into(),
            AMQPValue::LongString(LongString::from("next")),
        );
        let mut consumer = channel
            .basic_consume(stream.into(), tag, BasicConsumeOptions::default(), args)
            .await
            .map_err(broker)?;
        let waiters: Waiters = Arc::default();
        let w = waiters.clone();
        let task = tokio::spawn(async move {
            while let Some(Ok(d)) = consumer.next().await {
                let id = String::from_utf8_lossy(&d.data).into_owned();
                if let Some(offset) = offset_of(&d.properties) {
                    if let Some(tx) = w.lock().unwrap_or_else(|e| e.into_inner()).remove(&id) {
                        let _ = tx.send(offset);
                    }
                }
                // The acknowledgement is the stream consumer's credit.
                if d.acker.ack(BasicAckOptions::default()).await.is_err() {
                    break;
                }
            }
            // Nobody will be answered any more: waiting claims fail at once.
            w.lock().unwrap_or_else(|e| e.into_inner()).clear();
        });
        Ok(Claims {
            stream: stream.to_owned(),
            channel,
            waiters,
            task,
        })
    }

    /// Whether the reader still reads.
    pub(crate) fn alive(&self) -> bool {
        !self.task.is_finished() && self.channel.status().connected()
    }

    /// Publishes a claim on `ch` (the channel whose activation it records;
    /// the reader's own for a join claim) and waits up to `wait` for its
    /// offset. `None`: not read back in time (or `ch` or the reader died).
    pub(crate) async fn claim(&self, ch: Option<&Channel>, wait: Duration) -> Option<u64> {
        let id = uuid::Uuid::new_v4().simple().to_string();
        let (tx, rx) = oneshot::channel();
        // Registered before the publish: the read-back may come first.
        self.waiters
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id.clone(), tx);
        let ch = ch.unwrap_or(&self.channel);
        let published = ch
            .basic_publish(
                "".into(),
                self.stream.as_str().into(),
                BasicPublishOptions::default(),
                id.as_bytes(),
                BasicProperties::default(),
            )
            .await
            .is_ok();
        let offset = if published {
            tokio::time::timeout(wait, rx).await.ok().and_then(|r| r.ok())
        } else {
            None
        };
        self.waiters.lock().unwrap_or_else(|e| e.into_inner()).remove(&id);
        offset
    }
}
