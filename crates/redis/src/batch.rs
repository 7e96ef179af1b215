//! Attempt increments and acknowledgements from concurrent deliveries share
//! one fenced script call: what queued while the previous call ran goes in
//! the next, so under load one round trip settles many deliveries, and at
//! low load a call goes out at once.

use futures::stream::{FuturesUnordered, StreamExt};
use keyorder_core::{Error, Result};
use redis::aio::ConnectionManager;
use redis::Value;
use tokio::sync::{mpsc, oneshot};

/// Operations per script call at most.
const MAX_BATCH: usize = 256;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Attempt,
    Ack,
}

#[derive(Debug)]
pub(crate) struct Op {
    pub(crate) kind: Kind,
    pub(crate) lease: String,
    pub(crate) stream: String,
    pub(crate) holder: String,
    pub(crate) group: String,
    pub(crate) entry: String,
    pub(crate) consumer: String,
    pub(crate) reply: oneshot::Sender<Result<i64>>,
}

#[derive(Debug, Clone)]
pub(crate) struct Batcher {
    tx: mpsc::Sender<Op>,
}

impl Batcher {
    /// Starts the batching task on the current runtime; it ends when every
    /// handle is dropped.
    pub(crate) fn start(conn: ConnectionManager) -> Self {
        let (tx, rx) = mpsc::channel(4 * MAX_BATCH);
        tokio::spawn(run(conn, rx));
        Batcher { tx }
    }

    /// Runs one operation in the next batch; the answer is the script's.
    pub(crate) async fn ask(&self, make: impl FnOnce(oneshot::Sender<Result<i64>>) -> Op) -> Result<i64> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(make(reply))
            .await
            .map_err(|_| Error::broker("redis: the settlement task stopped"))?;
        rx.await
            .map_err(|_| Error::broker("redis: the settlement task stopped"))?
    }
}

/// Batches in flight at once: a new batch goes out while earlier ones run
/// (the connection pipelines them), so a delivery waits for its own batch only.
const IN_FLIGHT: usize = 4;

async fn run(conn: ConnectionManager, mut rx: mpsc::Receiver<Op>) {
    let mut running = FuturesUnordered::new();
    loop {
        let mut ops = Vec::with_capacity(MAX_BATCH);
        tokio::select! {
            n = rx.recv_many(&mut ops, MAX_BATCH), if running.len() < IN_FLIGHT => {
                if n == 0 {
                    break;
                }
                running.push(settle(conn.clone(), ops));
            }
            Some(()) = running.next(), if !running.is_empty() => {}
        }
    }
    while running.next().await.is_some() {}
}

async fn settle(mut conn: ConnectionManager, ops: Vec<Op>) {
    let mut inv = crate::scripts::SETTLE.prepare_invoke();
    for op in &ops {
        inv.key(&op.lease).key(&op.stream);
        inv.arg(if op.kind == Kind::Attempt { "a" } else { "k" })
            .arg(&op.holder)
            .arg(&op.group)
            .arg(&op.entry)
            .arg(&op.consumer);
    }
    match inv.invoke_async::<Value>(&mut conn).await {
        Ok(Value::Array(results)) => {
            for (op, r) in ops
                .into_iter()
                .zip(results.into_iter().chain(std::iter::repeat(Value::Nil)))
            {
                let n = match r {
                    Value::Int(n) => Ok(n),
                    other => Err(Error::broker(format!("redis: unexpected settle reply {other:?}"))),
                };
                let _ = op.reply.send(n);
            }
        }
        Ok(other) => {
            for op in ops {
                let _ = op
                    .reply
                    .send(Err(Error::broker(format!("redis: unexpected settle reply {other:?}"))));
            }
        }
        Err(e) => {
            for op in ops {
                let _ = op.reply.send(Err(crate::error::broker(e.clone())));
            }
        }
    }
}
