//! `--metrics-addr`: a long-running command serves `/metrics` while it
//! runs (scraped during a `demo`, whose subscriptions are registered: their
//! health gauges are there), and an address it cannot use is a one-line
//! error.

use std::io::{Read, Write};
use std::process::{Command, Stdio};
use std::time::Duration;

use keyorder_testkit::until;

fn scrape(addr: &str) -> Result<String, String> {
    let mut stream = std::net::TcpStream::connect(addr).map_err(|e| e.to_string())?;
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .map_err(|e| e.to_string())?;
    let mut text = String::new();
    stream.read_to_string(&mut text).map_err(|e| e.to_string())?;
    Ok(text)
}

/// The value of the first series line starting with `prefix`.
fn first(text: &str, prefix: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

#[tokio::test]
async fn demo_serves_metrics_while_it_runs() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    let mut child = Command::new(env!("CARGO_BIN_EXE_keyorder"))
        .args([
            "demo",
            "--url",
            "memory://",
            "--messages",
            "2000000",
            "--max-handler-ms",
            "1",
        ])
        .args(["--metrics-addr", &addr])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let text = until(
        "the demo's /metrics to count applied deliveries",
        Duration::from_secs(60),
        async || {
            let text = scrape(&addr)?;
            let applied = first(&text, "keyorder_applied_total").unwrap_or(0.0);
            let handled = first(&text, "keyorder_handler_seconds_count{").unwrap_or(0.0);
            // The demo's subscriptions are registered: their health is served.
            let live = text
                .lines()
                .filter(|l| l.starts_with("keyorder_health_live{") && l.contains("keyorder-demo-"))
                .count();
            if applied > 0.0 && handled > 0.0 && live > 0 {
                Ok(text)
            } else {
                Err(format!("applied {applied}, handled {handled}, {live} live series"))
            }
        },
    )
    .await;
    let still_running = child.try_wait().unwrap().is_none();
    let _ = child.kill();
    let _ = child.wait();
    assert!(still_running, "scraped after the demo ended");
    assert!(text.starts_with("HTTP/1.1 200"), "{}", &text[..text.len().min(200)]);
    assert!(
        text.lines()
            .any(|l| l.starts_with("keyorder_settle_seconds_bucket{") && l.contains("keyorder-demo-")),
        "settle histogram labelled by the demo's category"
    );
}

#[test]
fn an_address_in_use_is_one_line() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let out = Command::new(env!("CARGO_BIN_EXE_keyorder"))
        .args([
            "demo",
            "--url",
            "memory://",
            "--messages",
            "10",
            "--metrics-addr",
            &addr,
        ])
        .env("RUST_BACKTRACE", "1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    assert!(
        lines[0].starts_with("error:") && lines[0].contains("cannot listen on"),
        "{stderr}"
    );
}

fn get(addr: &str, path: &str) -> Result<String, String> {
    let mut stream = std::net::TcpStream::connect(addr).map_err(|e| e.to_string())?;
    stream
        .write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())
        .map_err(|e| e.to_string())?;
    let mut text = String::new();
    stream.read_to_string(&mut text).map_err(|e| e.to_string())?;
    Ok(text)
}

/// `keyorder bench --metrics-addr` takes a side's subscriptions off the
/// probes before they stop: `/livez` stays 200 while the process goes on
/// running the next side.
#[tokio::test]
async fn bench_livez_stays_ok_while_the_bench_runs() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    let mut child = Command::new(env!("CARGO_BIN_EXE_keyorder"))
        .args([
            "bench",
            "--url",
            "memory://",
            "--messages",
            "30000",
            "--keys",
            "20",
            "--handler-ms",
            "5",
            "--probes",
            "0",
        ])
        .args(["--metrics-addr", &addr])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut failed = None;
    let deadline = std::time::Instant::now() + Duration::from_secs(90);
    while std::time::Instant::now() < deadline && child.try_wait().unwrap().is_none() {
        if let Ok(text) = get(&addr, "/livez") {
            if !text.starts_with("HTTP/1.1 200") && child.try_wait().unwrap().is_none() {
                failed = Some(text);
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let _ = child.kill();
    let _ = child.wait();
    assert!(failed.is_none(), "/livez failed while bench ran: {failed:?}");
}
