//! Nothing forged in an operator's terminal or a log (issue 37): a message
//! whose id, key, correlation id and a header carry ESC, OSC, BEL and line
//! breaks, failed with a poison reason carrying the same, is parked on
//! every real broker (on Kafka and RabbitMQ the id and the reason travel
//! back as headers of the dead letter); `keyorder dead-letters` prints each
//! dead letter as one inert line, and the library's own log lines stay
//! inert too.

#![cfg(feature = "all-adapters")]

use std::process::Command;
use std::time::Duration;

use keyorder::{Delivery, HandlerError, KeySource, Message, PoisonPolicy, RetryPolicy};

/// An id that would clear the screen, set the terminal's title, and start
/// a forged log line.
const EVIL_ID: &str = "id-\u{1b}[2J\u{1b}]0;pwned\u{7}\" reason=\"handled ok\nFORGED INFO keyorder: all good";
const EVIL_REASON: &str = "boom\r\n\u{1b}[31mFORGED\u{9b}1m";
/// A key (keys may hold control characters) and a header value that would
/// do the same.
const EVIL_KEY: &str = "key-\u{1b}]0;pwned\u{7}\nFORGED INFO keyorder: key ok";
const EVIL_HEADER: &str = "h-\u{1b}[2J\r\nFORGED WARN keyorder: header";

fn env(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.into())
}

/// No control character but line ends, and no forged line of its own.
fn assert_inert(what: &str, text: &str) {
    assert!(
        !text.chars().any(|c| c.is_control() && c != '\n'),
        "{what}: a control character got through: {text:?}"
    );
    assert!(
        !text.lines().any(|l| l.starts_with("FORGED")),
        "{what}: a forged line: {text:?}"
    );
}

async fn park_and_list(url: &str) {
    keyorder_testkit::logs::install();
    let nonce = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let category = format!("hostile-{}-{nonce}", std::process::id());
    let client = keyorder::connect(url)
        .await
        .expect("the broker answers (run scripts/services)");
    let sub = client
        .subscribe(&category, "g")
        .ordered_by(KeySource::routing_key())
        .poison(PoisonPolicy::Park { max_attempts: 1 })
        .retry(RetryPolicy {
            max_attempts: 1,
            initial_backoff: Duration::from_millis(10),
            max_backoff: Duration::from_millis(10),
        })
        .build()
        .await
        .unwrap();
    let stats = sub.stats();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(sub.run(
        |_d: Delivery| async move { Err::<(), _>(HandlerError::poison(EVIL_REASON)) },
        async move {
            let _ = stopped.await;
        },
    ));
    client
        .publisher(&category)
        .await
        .unwrap()
        .publish(
            Message::new("x")
                .with_key(EVIL_KEY)
                .unwrap()
                .with_id(EVIL_ID)
                .with_correlation_id(EVIL_HEADER)
                .with_header("x-note", EVIL_HEADER),
        )
        .await
        .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    while stats.snapshot().parked < 1 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{url}: not parked: {:?}",
            stats.snapshot()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = stop.send(());
    run.await.unwrap().unwrap();
    let scheme = url.split(':').next().unwrap().to_owned();
    let out = tokio::task::spawn_blocking({
        let (url, category) = (url.to_owned(), category.clone());
        move || {
            Command::new(env!("CARGO_BIN_EXE_keyorder"))
                .args(["dead-letters", "--url", &url, "--category", &category, "--group", "g"])
                .env_remove("KEYORDER_URL")
                .output()
                .expect("the keyorder binary runs")
        }
    })
    .await
    .unwrap();
    assert!(
        out.status.success(),
        "{scheme}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert_eq!(
        stdout.lines().count(),
        1,
        "{scheme}: one line per dead letter: {stdout:?}"
    );
    assert!(
        stdout.contains("id-"),
        "{scheme}: the dead letter is listed: {stdout:?}"
    );
    assert_inert(&format!("{scheme}: dead-letters"), &stdout);
    assert_inert(
        &format!("{scheme}: dead-letters stderr"),
        &String::from_utf8_lossy(&out.stderr),
    );
    // The id is quoted whole: no field can be forged after it.
    assert!(stdout.starts_with("id=\"id-\\u{1b}[2J"), "{scheme}: {stdout:?}");
    assert_eq!(
        stdout.matches(" reason=\"").count(),
        1,
        "{scheme}: a forged field: {stdout:?}"
    );
    let log = keyorder_testkit::logs::text();
    assert!(
        log.contains("id-\\u{1b}"),
        "{scheme}: the park was logged, escaped: {log:?}"
    );
    assert_inert(&format!("{scheme}: the library's log"), &log);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis() {
    park_and_list(&env("REDIS_URL", "redis://127.0.0.1:6379")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres() {
    park_and_list(&format!(
        "{}?migrate=true",
        env("POSTGRES_URL", "postgres://postgres@127.0.0.1:5432/test")
    ))
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq() {
    park_and_list(&format!(
        "{}?topology=hash&queues=2&queue_type=classic&expires_ms=600000&consumer_timeout_ms=3600000",
        env("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f")
    ))
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka() {
    park_and_list(&format!(
        "kafka://{}?partitions=2&fetch_wait_ms=10",
        env("KAFKA_BROKERS", "127.0.0.1:9092")
    ))
    .await;
}
