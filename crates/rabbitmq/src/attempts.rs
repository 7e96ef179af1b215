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
//! - **Counted once.** A record carries its attempt's id: a record whose
//!   read-back timed out (a reader still catching up) is written again
//!   with the same id when the attempt is begun again, and counts once.
//! - **Forgetting.** Settling a message that has records (acknowledged,
//!   dead-lettered, or skipped by an operator) and an operator's resume
//!   write a *reset* record: its count starts again from nothing. Counts
//!   are kept in memory only for messages with records not reset (a
//!   handful: the messages that failed or were redelivered and are not
//!   settled yet), at most [`MAX_COUNTS`].

use std::collections::{HashMap, HashSet};
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

/// Per subject, the ids of its attempts, with when it was last written
/// (for the bound).
#[derive(Default)]
struct Counts {
    n: HashMap<String, (HashSet<String>, u64)>,
    seq: u64,
}

impl Counts {
    /// Applies a record; returns the subject's attempts counted now.
    fn apply(&mut self, kind: char, attempt: &str, subject: &str) -> u32 {
        match kind {
            ATTEMPT => {
                self.seq += 1;
                let seq = self.seq;
                let e = self.n.entry(subject.to_owned()).or_default();
                e.0.insert(attempt.to_owned());
                e.1 = seq;
                let n = u32::try_from(e.0.len()).unwrap_or(u32::MAX);
                if self.n.len() > MAX_COUNTS {
                    // The least recently written tenth goes at once (one
                    // pass, not one per record).
                    let mut seqs: Vec<u64> = self.n.values().map(|(_, s)| *s).collect();
                    let cut = MAX_COUNTS / 10;
                    seqs.select_nth_unstable(cut);
                    let below = seqs[cut];
                    self.n.retain(|_, (_, s)| *s > below);
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

/// FNV-1a 64: stable across processes (the standard library's hasher is
/// seeded per process).
fn fnv(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for (i, part) in parts.iter().enumerate() {
        if i > 0 {
            h ^= 0xff;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        for b in part.iter() {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

/// The subject of a message's records: its group, a hash of its key, and
/// its identity (the producer's `message_id`, or a hash of its body when
/// it has none or an empty one); never a key. Two messages of one key with
/// one id (or, without one, one body) share a count: a producer's
/// duplicates.
pub(crate) fn subject(group: &str, message_id: Option<&str>, key: Option<&str>, body: &[u8]) -> String {
    let k = fnv(&[key.unwrap_or("").as_bytes()]);
    match message_id.filter(|id| !id.is_empty()) {
        Some(id) => format!("{group}\u{1f}{k:016x}\u{1f}i:{id}"),
        None => format!("{group}\u{1f}{k:016x}\u{1f}h:{:016x}:{}", fnv(&[body]), body.len()),
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
        let channel = conn.create_channel().await.map_err(broker)?;
        channel
            .basic_qos(CREDIT, BasicQosOptions::default())
            .await
            .map_err(broker)?;
        let mut args = FieldTable::default();
        args.insert(
            "x-stream-offset".into(),
            AMQPValue::LongString(LongString::from("first")),
        );
        let mut consumer = channel
            .basic_consume(stream.into(), tag, BasicConsumeOptions::default(), args)
            .await
            .map_err(broker)?;
        let waiters: Waiters = Arc::default();
        let w = waiters.clone();
        let task = tokio::spawn(async move {
            let mut counts = Counts::default();
            while let Some(Ok(d)) = consumer.next().await {
                let text = String::from_utf8_lossy(&d.data);
                // `{kind}\t{record id}\t{attempt id}\t{subject}`; anything
                // else is ignored.
                let mut parts = text.splitn(4, '\t');
                if let (Some(kind), Some(id), Some(attempt), Some(subject)) =
                    (parts.next(), parts.next(), parts.next(), parts.next())
                {
                    if let Some(kind) = kind.chars().next() {
                        let n = counts.apply(kind, attempt, subject);
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

    /// Writes that attempt `attempt` of `subject` begins and waits up to
    /// `wait` for it to be read back; returns the subject's attempts
    /// written so far, this one included (an attempt id counts once).
    /// `None`: not read back in time (begin it again with the same id).
    pub(crate) async fn begin(&self, subject: &str, attempt: &str, wait: Duration) -> Option<u32> {
        self.write(ATTEMPT, attempt, subject, wait).await
    }

    /// Writes that `subject`'s count starts again; with a `wait`, waits for
    /// it to be read back (`false`: not in time).
    pub(crate) async fn reset(&self, subject: &str, wait: Option<Duration>) -> bool {
        match wait {
            Some(wait) => self.write(RESET, "-", subject, wait).await.is_some(),
            None => {
                let id = uuid::Uuid::new_v4().simple().to_string();
                tokio::time::timeout(Duration::from_secs(10), self.publish(RESET, &id, "-", subject))
                    .await
                    .unwrap_or(false)
            }
        }
    }

    async fn publish(&self, kind: char, id: &str, attempt: &str, subject: &str) -> bool {
        let body = format!("{kind}\t{id}\t{attempt}\t{subject}");
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

    async fn write(&self, kind: char, attempt: &str, subject: &str, wait: Duration) -> Option<u32> {
        let id = uuid::Uuid::new_v4().simple().to_string();
        let (tx, rx) = oneshot::channel();
        // Registered before the publish: the read-back may come first.
        self.waiters
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id.clone(), tx);
        // The publish and the read-back within `wait` together.
        let n = tokio::time::timeout(wait, async {
            if self.publish(kind, &id, attempt, subject).await {
                rx.await.ok()
            } else {
                None
            }
        })
        .await
        .ok()
        .flatten();
        self.waiters.lock().unwrap_or_else(|e| e.into_inner()).remove(&id);
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_attempts_per_subject_once_per_attempt_and_forgets_on_reset() {
        let mut c = Counts::default();
        assert_eq!(c.apply(ATTEMPT, "1", "a"), 1);
        assert_eq!(c.apply(ATTEMPT, "1", "b"), 1);
        assert_eq!(c.apply(ATTEMPT, "2", "a"), 2);
        // The same attempt written again (its read-back timed out).
        assert_eq!(c.apply(ATTEMPT, "2", "a"), 2);
        assert_eq!(c.apply(RESET, "-", "a"), 0);
        assert_eq!(c.apply(ATTEMPT, "3", "a"), 1);
        assert_eq!(c.n.len(), 2);
    }

    #[test]
    fn past_the_bound_the_least_recently_written_tenth_goes() {
        let mut c = Counts::default();
        for i in 0..=MAX_COUNTS {
            c.apply(ATTEMPT, "1", &i.to_string());
        }
        assert!(
            c.n.len() < MAX_COUNTS && c.n.len() >= MAX_COUNTS * 8 / 10,
            "{}",
            c.n.len()
        );
        assert!(c.n.contains_key(&MAX_COUNTS.to_string()), "the newest stays");
        assert!(!c.n.contains_key("0"), "the oldest goes");
    }

    #[test]
    fn subjects_are_stable_name_no_key_and_tell_keys_and_ids_apart() {
        let a = subject("g", None, Some("customer-42"), b"body");
        assert_eq!(a, subject("g", None, Some("customer-42"), b"body"));
        assert_ne!(a, subject("g", None, Some("customer-43"), b"body"));
        assert!(!a.contains("customer"));
        // One id on two keys: two counts; an empty id is no id.
        assert_ne!(
            subject("g", Some("m1"), Some("a"), b""),
            subject("g", Some("m1"), Some("b"), b"")
        );
        assert_eq!(
            subject("g", Some(""), Some("a"), b"x"),
            subject("g", None, Some("a"), b"x")
        );
        assert_ne!(
            subject("g", Some(""), Some("a"), b"x"),
            subject("g", Some(""), Some("a"), b"y")
        );
    }
}
