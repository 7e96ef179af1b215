//! The fault proxy's three faults against a local echo server: a cut ends
//! the connection, a blackhole holds bytes until it closes, latency delays
//! each way.

use std::time::Duration;

use keyorder_testkit::proxy::FaultProxy;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

async fn echo() -> std::net::SocketAddr {
    let server = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = server.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = server.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 64];
                while let Ok(n) = s.read(&mut buf).await {
                    if n == 0 || s.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
            });
        }
    });
    addr
}

async fn round_trip(c: &mut TcpStream, msg: &[u8]) {
    c.write_all(msg).await.unwrap();
    let mut back = vec![0u8; msg.len()];
    c.read_exact(&mut back).await.unwrap();
    assert_eq!(back, msg);
}

#[tokio::test]
async fn cut_blackhole_and_latency() {
    let proxy = FaultProxy::start("127.0.0.1:0".parse().unwrap(), echo().await)
        .await
        .unwrap();
    let mut c = TcpStream::connect(proxy.addr()).await.unwrap();
    round_trip(&mut c, b"one").await;

    // Blackhole: nothing comes back while it is open, all of it after.
    proxy.blackhole(true);
    c.write_all(b"two").await.unwrap();
    let mut back = [0u8; 3];
    assert!(
        tokio::time::timeout(Duration::from_millis(300), c.read_exact(&mut back))
            .await
            .is_err()
    );
    proxy.blackhole(false);
    c.read_exact(&mut back).await.unwrap();
    assert_eq!(&back, b"two");

    // Latency: a round trip takes at least twice the delay.
    proxy.latency(Duration::from_millis(150));
    let t = std::time::Instant::now();
    round_trip(&mut c, b"three").await;
    assert!(t.elapsed() >= Duration::from_millis(300), "{:?}", t.elapsed());
    proxy.latency(Duration::ZERO);

    // Cut: the connection ends; a new one goes through.
    proxy.cut();
    let mut one = [0u8; 1];
    assert!(matches!(c.read(&mut one).await, Ok(0) | Err(_)));
    let mut again = TcpStream::connect(proxy.addr()).await.unwrap();
    round_trip(&mut again, b"four").await;
    assert_eq!(proxy.accepted(), 2);
}
