//! Attempts counted per *started* attempt, durably: the virtual host's
//! attempts stream.
//!
//! RabbitMQ counts deliveries, not attempts. A classic queue only flags a
//! redelivery (`redelivered`), so every new owner saw attempt 2 and a
//! message that kills its process crash-looped forever (C22). A quorum
//! queue's `x-delivery-count` also counts the prefetched messages a dead
//! consumer never started (all of them return with it), so the keys read
//! beside a crash-looping message used up their attempts and halted or
//! parked although they never ran.
//!
//! So a source writes down an attempt before it starts it, on a **stream**
//! (`keyorder.attempts`, durable, `x-queue-type: stream`, bounded by
//! `x-max-length-bytes` and `x-max-age`), and counts them back:
//!
//! - **What is written.** The first attempt of a message delivered for the
//!   first time is not written (nothing ran it before; writing every
//!   message down would cost a broker round trip per message). Every other
//!   attempt is: a retry, and every attempt of a redelivered message. A
//!   record names the group and the message (its `message_id`, or a hash
//!   of its key and body when the producer set none), never a key.
//! - **How it is counted.** Each source reads the stream from its first
//!   entry, keeping a count per (group, message). An attempt's record is
//!   published and then *read back*; a stream is read in the order it was
//!   appended, so when the record comes back every record appended before
//!   it has been counted. An earlier owner wrote its record and read it
//!   back before it started the handler, hence before it crashed, hence
//!   before the broker redelivered the message: the count read back is
//!   complete. The attempt's number is that count plus one (the unwritten
//!   first attempt).
//! - **What a crash is charged.** A redelivered message that never started
//!   (it was prefetched beside the one that crashed) has no record: its
//!   first start is attempt 2, never more, whatever the number of crashes
//!   beside it (the dispatcher runs redelivered messages alone, so at most
//!   one message runs when a process dies). A message that crashes its
//!   process on every start reaches the poison policy after the configured
//!   attempts.
//! - **Forgetting.** Settling a message that has records (acknowledged or
//!   dead-lettered) and an operator's resume write a *reset* record: its
//!   count starts again from nothing. Counts are kept in memory only for
//!   messages with records not reset (a handful: the messages that failed
//!   or were redelivered and are not settled yet), at most [`MAX_COUNTS`].

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

use crate::topology::amqp;

/// The virtual host's attempts stream.
pub(crate) const STREAM: &str = "keyorder.attempts";

/// The stream's retention: 16 MB or a week, in 1 MB segments. A record
/// matters while its message is unsettled (a halted head may stay so for
/// days); one that aged out makes a redelivered message count from 2
/// again, never lower.
pub(crate) const MAX_BYTES: i64 = 16 * 1024 * 1024;
pub(crate) const MAX_AGE: &str = "7D";
pub(crate) const SEGMENT_BYTES: i64 = 1024 * 1024;

/// Counts kept in memory at most; past it the oldest are dropped (their
/// messages then count from 2 again if redelivered).
pub(crate) const MAX_COUNTS: usize = 100_000;

/// The stream consumer's credit.
const CREDIT: u16 = 256;

/// Record kinds: an attempt began; the count starts again.
const ATTEMPT: char = 'a';
const RESET: char = 'z';

type Waiters = Arc<Mutex<HashMap<String, oneshot::Sender<u32>>>>;

/// Counts per subject, with the order subjects were first seen in (for
/// the bound).
#[derive(Default)]
struct Counts {
    n: HashMap<String, (u32, u64)>,
    seq: u64,
}

impl Counts {
    fn apply(&mut self, kind: char, subject: &str) -> u32 {
        match kind {
            ATTEMPT => {
                self.seq += 1;
                let seq = self.seq;
                let e = self.n.entry(subject.to_owned()).or_insert((0, seq));
                e.0 = e.0.saturating_add(1);
                let n = e.0;
                if self.n.len() > MAX_COUNTS {
                    if let Some(oldest) = self.n.iter().min_by_key(|(_, (_, s))| *s).map(|(k, _)| k.clone()) {
                        self.n.remove(&oldest);
                    }
                }
                n
            }
            _ => {
                self.n.remove(subject);
                0
            }
        }
    }
}

/// The declaration arguments of the attempts stream.
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

/// The subject of a message's records: its group and its identity (the
/// producer's `message_id`, or a hash of key and body), never a key.
pub(crate) fn subject(group: &str, message_id: Option<&str>, key: Option<&str>, body: &[u8]) -> String {
    match message_id {
        Some(id) => format!("{group}\u{1f}i:{id}"),
        None => {
            // FNV-1a over the key and body: stable across processes (the
            // standard library's hasher is seeded per process).
            let mut h: u64 = 0xcbf2_9ce4_8422_2325;
            for b in key.unwrap_or("").bytes().chain([0u8]).chain(body.iter().copied()) {
                h ^= u64::from(b);
                h = h.wrapping_mul(0x0000_0100_0000_01b3);
            }
            format!("{group}\u{1f}h:{h:016x}:{}", body.len())
        }
    }
}

/// A source's reader and writer of the attempts stream.
pub(crate) struct Attempts {
    stream: String,
    channel: Channel,
    waiters: Waiters,
    task: JoinHandle<()>,
}

impl Drop for Attempts {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Attempts {
    /// Starts reading `stream` from its first entry on a channel of its own.
    pub(crate) async fn open(conn: &Connection, stream: &str, tag: lapin::types::ShortString) -> Result<Attempts> {
        let channel = conn.create_channel().await.map_err(amqp)?;
        channel
            .basic_qos(CREDIT, BasicQosOptions::default())
            .await
            .map_err(amqp)?;
        let mut args = FieldTable::default();
        args.insert(
            "x-stream-offset".into(),
            AMQPValue::LongString(LongString::from("first")),
        );
        let mut consumer = channel
            .basic_consume(stream.into(), tag, BasicConsumeOptions::default(), args)
            .await
            .map_err(amqp)?;
        let waiters: Waiters = Arc::default();
        let w = waiters.clone();
        let task = tokio::spawn(async move {
            let mut counts = Counts::default();
            while let Some(Ok(d)) = consumer.next().await {
                let text = String::from_utf8_lossy(&d.data);
                // `{kind}\t{record id}\t{subject}`; anything else is ignored.
                let mut parts = text.splitn(3, '\t');
                if let (Some(kind), Some(id), Some(subject)) = (parts.next(), parts.next(), parts.next()) {
                    if let Some(kind) = kind.chars().next() {
                        let n = counts.apply(kind, subject);
                        if let Some(tx) = w.lock().unwrap_or_else(|e| e.into_inner()).remove(id) {
                            let _ = tx.send(n);
                        }
                    }
                }
                // The acknowledgement is the stream consumer's credit.
                if d.acker.ack(BasicAckOptions::default()).await.is_err() {
                    break;
                }
            }
            w.lock().unwrap_or_else(|e| e.into_inner()).clear();
        });
        Ok(Attempts {
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

    /// Writes that an attempt of `subject` begins and waits up to `wait`
    /// for it to be read back; returns the subject's attempts written so
    /// far, this one included. `None`: not read back in time.
    pub(crate) async fn begin(&self, subject: &str, wait: Duration) -> Option<u32> {
        self.write(ATTEMPT, subject, wait).await
    }

    /// Writes that `subject`'s count starts again; with a `wait`, waits for
    /// it to be read back (`false`: not in time).
    pub(crate) async fn reset(&self, subject: &str, wait: Option<Duration>) -> bool {
        match wait {
            Some(wait) => self.write(RESET, subject, wait).await.is_some(),
            None => {
                self.publish(RESET, &uuid::Uuid::new_v4().simple().to_string(), subject)
                    .await
            }
        }
    }

    async fn publish(&self, kind: char, id: &str, subject: &str) -> bool {
        let body = format!("{kind}\t{id}\t{subject}");
        self.channel
            .basic_publish(
                "".into(),
                self.stream.as_str().into(),
                BasicPublishOptions::default(),
                body.as_bytes(),
                BasicProperties::default(),
            )
            .await
            .is_ok()
    }

    async fn write(&self, kind: char, subject: &str, wait: Duration) -> Option<u32> {
        let id = uuid::Uuid::new_v4().simple().to_string();
        let (tx, rx) = oneshot::channel();
        // Registered before the publish: the read-back may come first.
        self.waiters
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id.clone(), tx);
        let n = if self.publish(kind, &id, subject).await {
            tokio::time::timeout(wait, rx).await.ok().and_then(|r| r.ok())
        } else {
            None
        };
        self.waiters.lock().unwrap_or_else(|e| e.into_inner()).remove(&id);
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_attempts_per_subject_and_forgets_on_reset() {
        let mut c = Counts::default();
        assert_eq!(c.apply(ATTEMPT, "g\u{1f}i:a"), 1);
        assert_eq!(c.apply(ATTEMPT, "g\u{1f}i:b"), 1);
        assert_eq!(c.apply(ATTEMPT, "g\u{1f}i:a"), 2);
        assert_eq!(c.apply(RESET, "g\u{1f}i:a"), 0);
        assert_eq!(c.apply(ATTEMPT, "g\u{1f}i:a"), 1);
        assert_eq!(c.n.len(), 2);
    }

    #[test]
    fn a_subject_without_message_id_is_stable_and_names_no_key() {
        let a = subject("g", None, Some("customer-42"), b"body");
        assert_eq!(a, subject("g", None, Some("customer-42"), b"body"));
        assert_ne!(a, subject("g", None, Some("customer-43"), b"body"));
        assert!(!a.contains("customer"));
        assert_eq!(subject("g", Some("m1"), Some("k"), b""), "g\u{1f}i:m1");
    }
}
