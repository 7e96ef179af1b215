//! A TCP fault proxy for the connection-fault scenario (C19): put between a
//! worker process and its broker on 127.0.0.0/8, it forwards bytes both
//! ways and, switched at run time, *cuts* every connection (a reset each
//! way), *blackholes* them (connections stay open and nothing is forwarded
//! until the hole closes; held bytes then go through, as TCP retransmits
//! after a partition heals) or adds *latency* each way.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> std::io::Result<()> {
//! use std::time::Duration;
//! use tokio::io::{AsyncReadExt, AsyncWriteExt};
//! use keyorder_testkit::proxy::FaultProxy;
//!
//! // An echo server stands in for the broker.
//! let server = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
//! let upstream = server.local_addr()?;
//! tokio::spawn(async move {
//!     let (mut s, _) = server.accept().await.unwrap();
//!     let mut buf = [0u8; 4];
//!     while let Ok(n) = s.read(&mut buf).await {
//!         if n == 0 || s.write_all(&buf[..n]).await.is_err() { break; }
//!     }
//! });
//! let proxy = FaultProxy::start("127.0.0.1:0".parse().unwrap(), upstream).await?;
//! let mut c = tokio::net::TcpStream::connect(proxy.addr()).await?;
//! c.write_all(b"ping").await?;
//! let mut back = [0u8; 4];
//! c.read_exact(&mut back).await?;
//! assert_eq!(&back, b"ping");
//! proxy.cut();
//! let mut one = [0u8; 1];
//! assert!(matches!(c.read(&mut one).await, Ok(0) | Err(_)));
//! # Ok(()) }
//! ```

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

struct State {
    upstream: SocketAddr,
    /// `true` while the hole is open (nothing is forwarded).
    hole: watch::Sender<bool>,
    latency_ms: AtomicU64,
    /// The tasks of every live connection (aborted by a cut).
    conns: Mutex<Vec<Conn>>,
    accepted: AtomicU64,
}

struct Conn {
    tasks: Vec<JoinHandle<()>>,
}

/// A running fault proxy (see the module doc). Dropping it stops it and
/// resets every connection.
pub struct FaultProxy {
    addr: SocketAddr,
    state: Arc<State>,
    accept: JoinHandle<()>,
}

impl std::fmt::Debug for FaultProxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FaultProxy")
            .field("addr", &self.addr)
            .field("upstream", &self.state.upstream)
            .finish_non_exhaustive()
    }
}

impl FaultProxy {
    /// Listens on `listen` (port 0 picks one) and forwards each accepted
    /// connection to `upstream`.
    pub async fn start(listen: SocketAddr, upstream: SocketAddr) -> std::io::Result<FaultProxy> {
        let listener = TcpListener::bind(listen).await?;
        let addr = listener.local_addr()?;
        let (hole, _) = watch::channel(false);
        let state = Arc::new(State {
            upstream,
            hole,
            latency_ms: AtomicU64::new(0),
            conns: Mutex::new(Vec::new()),
            accepted: AtomicU64::new(0),
        });
        let st = state.clone();
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                st.accepted.fetch_add(1, Ordering::Relaxed);
                let st2 = st.clone();
                // Connecting upstream waits while the hole is open: a new
                // connection during a partition hangs, like the others.
                let task = tokio::spawn(async move {
                    wait_closed(&st2.hole).await;
                    let Ok(server) = TcpStream::connect(st2.upstream).await else {
                        reset(client);
                        return;
                    };
                    for s in [&client, &server] {
                        let _ = s.set_nodelay(true);
                        // A cut drops the sockets: a reset, not an orderly end.
                        let _ = s.set_zero_linger();
                    }
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    let up = tokio::spawn(pump(cr, sw, st2.clone()));
                    let down = tokio::spawn(pump(sr, cw, st2.clone()));
                    st2.conns
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push(Conn { tasks: vec![up, down] });
                });
                st.conns
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(Conn { tasks: vec![task] });
            }
        });
        Ok(FaultProxy { addr, state, accept })
    }

    /// The address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> u64 {
        self.state.accepted.load(Ordering::Relaxed)
    }

    /// Resets every connection now (each side sees a reset or an end of
    /// stream); new connections go through as before.
    pub fn cut(&self) {
        let conns = std::mem::take(&mut *self.state.conns.lock().unwrap_or_else(|e| e.into_inner()));
        for c in conns {
            for t in c.tasks {
                t.abort();
            }
        }
    }

    /// Opens (`true`) or closes the blackhole: while open, connections stay
    /// up and nothing is forwarded either way; new connections hang.
    pub fn blackhole(&self, open: bool) {
        self.state.hole.send_replace(open);
    }

    /// Delays every chunk by `d` in each direction (zero: none).
    pub fn latency(&self, d: Duration) {
        self.state
            .latency_ms
            .store(d.as_millis().min(u128::from(u64::MAX)) as u64, Ordering::Relaxed);
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.cut();
    }
}

async fn wait_closed(hole: &watch::Sender<bool>) {
    let mut rx = hole.subscribe();
    let _ = rx.wait_for(|open| !*open).await;
}

/// Closes with a reset (SO_LINGER 0) rather than an orderly end.
fn reset(s: TcpStream) {
    let _ = s.set_zero_linger();
    drop(s);
}

/// Forwards one direction: a reader stamps each chunk with its arrival, a
/// writer delivers it `latency` later, and not while the hole is open. Both
/// run inside this future, so aborting its task (a cut) drops both socket
/// halves; with a linger of zero that is a reset.
async fn pump(mut from: tokio::net::tcp::OwnedReadHalf, mut to: tokio::net::tcp::OwnedWriteHalf, st: Arc<State>) {
    let (tx, mut rx) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let reader = async move {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            match from.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if tx.send((Instant::now(), buf[..n].to_vec())).is_err() {
                        break;
                    }
                }
            }
        }
    };
    let writer = async move {
        while let Some((at, chunk)) = rx.recv().await {
            let delay = Duration::from_millis(st.latency_ms.load(Ordering::Relaxed));
            tokio::time::sleep_until(at + delay).await;
            wait_closed(&st.hole).await;
            if to.write_all(&chunk).await.is_err() {
                return;
            }
        }
        let _ = to.shutdown().await;
    };
    tokio::join!(reader, writer);
}
