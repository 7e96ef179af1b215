//! A subscription stopped while a lease acquire is in flight hands that
//! lease back at close, on the real Redis server.
//!
//! The subscription talks to Redis through a loopback relay that can hold
//! the server's replies. Once the acquire script has run at the server (the
//! lease key exists) but before its reply arrives, the test asks for
//! shutdown. A loop that dropped its step there never recorded the lease,
//! so close left it to its TTL and the key's next owner waited that long.

// Shared set-up; this file uses only part of it.
#[allow(dead_code)]
mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use keyorder_core::{Client, Delivery, KeySource, LeaseConfig, Message, Transport};
use keyorder_redis::{Names, RedisTransport};
use keyorder_testkit::until;
use redis::AsyncCommands;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{oneshot, watch};

fn redis_addr() -> String {
    let url = keyorder_testkit::brokers::Broker::Redis.url();
    let url = url::Url::parse(&url).unwrap();
    format!(
        "{}:{}",
        url.host_str().unwrap_or("127.0.0.1"),
        url.port().unwrap_or(6379)
    )
}

/// A loopback relay to Redis. Once `armed`, the first request that names a
/// lease key holds every later reply on that connection until `hold` is
/// cleared.
struct Relay {
    port: u16,
    armed: Arc<AtomicBool>,
    hold: Arc<watch::Sender<bool>>,
}

impl Relay {
    async fn start() -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let armed = Arc::new(AtomicBool::new(false));
        let (hold, hold_rx) = watch::channel(false);
        let hold = Arc::new(hold);
        let (armed_tx, hold_tx) = (armed.clone(), hold.clone());
        tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    return;
                };
                let server = TcpStream::connect(redis_addr()).await.unwrap();
                let (mut cr, mut cw) = client.into_split();
                let (mut sr, mut sw) = server.into_split();
                // Set when this connection carried a lease key while armed.
                let (seen, mut seen_rx) = watch::channel(false);
                let armed = armed_tx.clone();
                let hold_tx = hold_tx.clone();
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 64 * 1024];
                    loop {
                        let n = match cr.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => n,
                        };
                        let chunk = &buf[..n];
                        // One request only: the close's release must get
                        // its reply.
                        if chunk.windows(9).any(|w| w == b"__lease__") && armed.swap(false, Ordering::SeqCst) {
                            hold_tx.send_replace(true);
                            seen.send_replace(true);
                        }
                        if sw.write_all(chunk).await.is_err() {
                            return;
                        }
                    }
                });
                let mut hold_rx = hold_rx.clone();
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 64 * 1024];
                    loop {
                        let n = match sr.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => n,
                        };
                        // Held while this connection's lease request waits.
                        while *seen_rx.borrow_and_update() && *hold_rx.borrow_and_update() {
                            tokio::select! {
                                r = hold_rx.changed() => if r.is_err() { return },
                                r = seen_rx.changed() => if r.is_err() { return },
                            }
                        }
                        if cw.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        Relay { port, armed, hold }
    }
}

/// A running subscription of instance `instance` on `category` (group `g`)
/// over `url`, with a handler that does nothing; send on the sender to stop
/// it.
async fn start(
    url: &str,
    category: &str,
    instance: &str,
    lease: LeaseConfig,
) -> (
    oneshot::Sender<()>,
    tokio::task::JoinHandle<keyorder_core::Result<keyorder_core::RunReport>>,
) {
    let transport = common::connect(url).await;
    let sub = Client::new(Arc::new(transport))
        .subscribe(category, "g")
        .ordered_by(KeySource::routing_key())
        .lease(lease)
        .instance_id(instance)
        .build()
        .await
        .unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let run = tokio::spawn(sub.run(|_d: Delivery| async { Ok(()) }, async move {
        let _ = stopped.await;
    }));
    (stop, run)
}

/// Publishes one message of `key` straight to Redis.
async fn publish(category: &str, key: &str) {
    let t = RedisTransport::from_url(&format!("redis://{}", redis_addr()).parse().unwrap())
        .await
        .unwrap();
    let p = t.publisher(category).await.unwrap();
    p.publish(Message::new("m").with_key(key).unwrap()).await.unwrap();
}

/// The value of `key`, on its own connection.
async fn get(key: &str) -> Option<String> {
    let mut conn = redis::Client::open(format!("redis://{}", redis_addr()))
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    conn.get(key).await.unwrap()
}

/// Removes what a test category left.
async fn clean(names: &Names, key: &str) {
    let mut conn = redis::Client::open(format!("redis://{}", redis_addr()))
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let _: () = redis::cmd("DEL")
        .arg(names.stream(key))
        .arg(names.index())
        .arg(names.generation())
        .arg(names.members("g"))
        .query_async(&mut conn)
        .await
        .unwrap();
}

/// Runs a subscription straight to Redis until it has acquired a
/// partition, so the server has the scripts cached: a held reply must be the
/// acquire's result, not a "no such script" that the client would answer by
/// sending the script.
async fn load_scripts(lease: LeaseConfig) {
    let category = format!("shutdown-warm-{}", uuid::Uuid::new_v4().simple());
    let names = Names::new(&category).unwrap();
    let (stop, run) = start(&format!("redis://{}", redis_addr()), &category, "warm", lease).await;
    publish(&category, "w").await;
    let lease_key = names.lease("w", "g");
    until("the warm-up partition acquired", Duration::from_secs(30), || {
        get(&lease_key)
    })
    .await;
    let _ = stop.send(());
    run.await.unwrap().unwrap();
    clean(&names, "w").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_mid_acquire_hands_the_lease_back() {
    let relay = Relay::start().await;
    let category = format!("shutdown-{}", uuid::Uuid::new_v4().simple());
    let names = Names::new(&category).unwrap();
    // A long lease: a lease left behind would still be there when checked.
    let lease = LeaseConfig {
        ttl: Duration::from_secs(60),
        heartbeat: Duration::from_secs(1),
        margin: Duration::from_secs(10),
    };
    load_scripts(lease).await;
    let (stop, run) = start(&format!("redis://127.0.0.1:{}", relay.port), &category, "a", lease).await;
    // The instance is up once it has announced itself.
    let conn = redis::Client::open(format!("redis://{}", redis_addr()))
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let members = names.members("g");
    until("the instance announced itself", Duration::from_secs(30), || {
        let mut conn = conn.clone();
        let members = members.clone();
        async move {
            let score: Option<f64> = conn.zscore(members, "a").await.unwrap();
            score.map(|_| ())
        }
    })
    .await;

    // From now on, the first request naming a lease key (the acquire of the
    // new key's partition) has its reply held.
    relay.armed.store(true, Ordering::SeqCst);
    publish(&category, "k").await;

    // The acquire ran at the server: the lease is `a`'s.
    let lease_key = names.lease("k", "g");
    let holder = until("the partition acquired", Duration::from_secs(30), || get(&lease_key)).await;
    assert!(holder.starts_with("a:"), "lease holder {holder}");
    assert!(*relay.hold.borrow(), "the acquire's reply is held");

    // Shutdown while the acquire's reply is still on its way; then let it
    // through.
    let _ = stop.send(());
    relay.hold.send_replace(false);
    tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .expect("the subscription stopped")
        .unwrap()
        .unwrap();

    assert_eq!(
        get(&lease_key).await,
        None,
        "the stopped instance left its lease behind (it expires only after the TTL)"
    );
    clean(&names, "k").await;
}
