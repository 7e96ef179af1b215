//! TLS and passwords on every real broker (issue 37). `scripts/services`
//! starts TLS listeners signed by a throw-away CA, each with a password user
//! (see `KEYORDER_TLS_DIR`, `KEYORDER_TLS_PASSWORD`):
//! - every adapter connects over TLS with the server's certificate verified,
//!   and a key's messages round-trip in order;
//! - a wrong CA, a plaintext port behind a TLS scheme, and a wrong password
//!   are each refused, with an error that says which;
//! - neither password appears in an error, a `Debug` output, the CLI's output
//!   or a log line at any level (TRACE included, with the drivers' own logs).

#![cfg(feature = "all-adapters")]

use std::process::Command;
use std::time::Duration;

use keyorder::{Delivery, KeySource, Message};

fn env(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.into())
}

/// The TLS set-up `scripts/services` made: its directory and password.
fn tls() -> (String, String) {
    let dir = env("KEYORDER_TLS_DIR", "/var/lib/keyorder-tls");
    let password = std::env::var("KEYORDER_TLS_PASSWORD")
        .ok()
        .or_else(|| std::fs::read_to_string(format!("{dir}/password")).ok())
        .map(|p| p.trim().to_owned())
        .filter(|p| !p.is_empty())
        .expect("no TLS set-up: run scripts/services (it prints KEYORDER_TLS_DIR and KEYORDER_TLS_PASSWORD)");
    (dir, password)
}

/// A wrong password that shares nothing with the right one but its length.
fn wrong(password: &str) -> String {
    password
        .chars()
        .rev()
        .map(|c| if c == 'x' { 'y' } else { 'x' })
        .collect()
}

fn unique(prefix: &str) -> String {
    let nonce = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("{prefix}-{}-{nonce}", std::process::id())
}

/// Neither secret in `text`.
fn assert_no_secret(what: &str, text: &str, secrets: &[&str]) {
    for s in secrets {
        assert!(!text.contains(s), "{what}: a password appears: {text:?}");
    }
}

/// Connects over TLS, publishes three messages of one key and reads them
/// back in order through an ordered subscription.
async fn round_trip(url: &str, secrets: &[&str]) -> String {
    let client = keyorder::connect(url)
        .await
        .unwrap_or_else(|e| panic!("TLS connect failed: {}", e));
    assert_no_secret("client Debug", &format!("{client:?}"), secrets);
    let category = unique("tls");
    let sub = client
        .subscribe(&category, "g")
        .ordered_by(KeySource::routing_key())
        .build()
        .await
        .unwrap();
    let stats = sub.stats();
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(sub.run(
        {
            let seen = seen.clone();
            move |d: Delivery| {
                let seen = seen.clone();
                async move {
                    seen.lock()
                        .unwrap()
                        .push(String::from_utf8_lossy(d.payload()).into_owned());
                    Ok::<(), keyorder::HandlerError>(())
                }
            }
        },
        async move {
            let _ = stopped.await;
        },
    ));
    let publisher = client.publisher(&category).await.unwrap();
    for i in 0..3 {
        publisher
            .publish(Message::new(format!("m{i}")).with_key("k").unwrap())
            .await
            .unwrap();
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    while seen.lock().unwrap().len() < 3 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "not delivered over TLS: {:?} {:?}",
            seen.lock().unwrap(),
            stats.snapshot()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = stop.send(());
    run.await.unwrap().unwrap();
    assert_eq!(*seen.lock().unwrap(), ["m0", "m1", "m2"]);
    category
}

/// Connecting with `url` must fail: its error, checked for `hint` (any of
/// the driver's words for the cause, case-insensitive; keyorder's advice
/// after them names none of these words, so a broker that is merely down
/// does not pass) and for the secrets.
async fn refused(what: &str, url: &str, hint: &[&str], secrets: &[&str]) {
    let err = match tokio::time::timeout(Duration::from_secs(60), keyorder::connect(url)).await {
        Err(_) => panic!("{what}: no answer within 60 s; expected a refusal"),
        Ok(Ok(client)) => {
            // Some drivers connect lazily: the first publish must fail.
            let sent = tokio::time::timeout(Duration::from_secs(60), async {
                client
                    .publisher(&unique("tls-refused"))
                    .await?
                    .publish(Message::new("x").with_key("k").unwrap())
                    .await
            })
            .await;
            match sent {
                Ok(Err(e)) => e,
                Ok(Ok(_)) => panic!("{what}: connected and published; expected a refusal"),
                Err(_) => panic!("{what}: publish hung for 60 s; expected a refusal"),
            }
        }
        Ok(Err(e)) => e,
    };
    // The whole chain: the driver's error kept as the source (issue 38)
    // must hold no secret either.
    let mut text = format!("{err} / {err:?}");
    let mut cause = std::error::Error::source(&err);
    while let Some(c) = cause {
        text.push_str(&format!(" / caused by: {c} / {c:?}"));
        cause = c.source();
    }
    let lower = text.to_lowercase();
    assert!(
        hint.iter().any(|h| lower.contains(&h.to_lowercase())),
        "{what}: the error does not say why (expected one of {hint:?}): {text}"
    );
    assert_no_secret(what, &text, secrets);
    eprintln!("{what}: refused: {err}");
}

/// The CLI over the same URLs: a read-only command that succeeds over TLS
/// and one refused for its password; neither output holds a password.
fn cli(url: &str, category: &str, ok: bool, secrets: &[&str]) {
    let out = Command::new(env!("CARGO_BIN_EXE_keyorder"))
        .args(["scopes", "--url", url, "--category", category, "--group", "g"])
        .env_remove("KEYORDER_URL")
        .env("RUST_LOG", "trace")
        .output()
        .expect("the keyorder binary runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.status.success(), ok, "keyorder scopes: {text}");
    assert_no_secret("keyorder scopes", &text, secrets);
}

/// The whole check for one broker: `ok` round-trips; each of `bad` (what,
/// URL, hint words) is refused; the CLI succeeds on `ok` and fails on the
/// last of `bad`; neither output nor the log holds a secret.
async fn check(ok: String, bad: Vec<(&str, String, &[&str])>, secrets: &[&str]) {
    keyorder_testkit::logs::install_every_level();
    let category = round_trip(&ok, secrets).await;
    for (what, url, hint) in &bad {
        refused(what, url, hint, secrets).await;
    }
    let ok2 = ok.clone();
    let wrong_pw = bad.last().map(|b| b.1.clone());
    let secrets2: Vec<String> = secrets.iter().map(|s| s.to_string()).collect();
    tokio::task::spawn_blocking(move || {
        let s: Vec<&str> = secrets2.iter().map(String::as_str).collect();
        cli(&ok2, &category, true, &s);
        if let Some(url) = wrong_pw {
            cli(&url, &category, false, &s);
        }
    })
    .await
    .unwrap();
    let log = keyorder_testkit::logs::text();
    assert!(
        log.contains("TRACE") || log.contains("DEBUG"),
        "the log was captured at every level"
    );
    assert_no_secret("the log (every level)", &log, secrets);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres() {
    let (dir, pw) = tls();
    let bad_pw = wrong(&pw);
    let url = |user_pw: &str, port: u16, ca: &str| {
        format!(
            "postgres://keyorder:{user_pw}@127.0.0.1:{port}/test?sslmode=verify-full&sslrootcert={dir}/{ca}&migrate=true"
        )
    };
    check(
        url(&pw, 5434, "ca.pem"),
        vec![
            (
                "postgres: wrong CA",
                url(&pw, 5434, "other-ca.pem"),
                &["UnknownIssuer"][..],
            ),
            // PgBouncer on 6432 serves no TLS.
            (
                "postgres: plaintext port",
                url(&pw, 6432, "ca.pem"),
                &["does not support TLS"][..],
            ),
            (
                "postgres: wrong password",
                url(&bad_pw, 5434, "ca.pem"),
                &["password authentication failed"][..],
            ),
        ],
        &[&pw, &bad_pw],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis() {
    let (dir, pw) = tls();
    let bad_pw = wrong(&pw);
    let url = |user_pw: &str, port: u16, ca: &str| format!("rediss://:{user_pw}@127.0.0.1:{port}/?ca_file={dir}/{ca}");
    check(
        url(&pw, 6390, "ca.pem"),
        vec![
            (
                "redis: wrong CA",
                url(&pw, 6390, "other-ca.pem"),
                &["UnknownIssuer"][..],
            ),
            ("redis: plaintext port", url(&pw, 6379, "ca.pem"), &["timed out"][..]),
            (
                "redis: wrong password",
                url(&bad_pw, 6390, "ca.pem"),
                &["AuthenticationFailed"][..],
            ),
        ],
        &[&pw, &bad_pw],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq() {
    let (dir, pw) = tls();
    let bad_pw = wrong(&pw);
    let url = |user_pw: &str, port: u16, ca: &str| {
        format!(
            "amqps://keyorder:{user_pw}@127.0.0.1:{port}/%2f?cacertfile={dir}/{ca}&topology=hash&queues=2\
             &queue_type=classic&expires_ms=600000&consumer_timeout_ms=3600000"
        )
    };
    check(
        url(&pw, 5674, "ca.pem"),
        vec![
            (
                "rabbitmq: wrong CA",
                url(&pw, 5674, "other-ca.pem"),
                &["UnknownIssuer"][..],
            ),
            (
                "rabbitmq: plaintext port",
                url(&pw, 5673, "ca.pem"),
                &["InvalidContentType"][..],
            ),
            (
                "rabbitmq: wrong password",
                url(&bad_pw, 5674, "ca.pem"),
                &["ACCESS_REFUSED"][..],
            ),
        ],
        &[&pw, &bad_pw],
    )
    .await;
}

/// tansu keeps no SASL users in memory: TLS only, no password case. The
/// driver says `BrokerTransportFailure` for a wrong CA and a plaintext port
/// alike (librdkafka's log line says which).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka() {
    let (dir, pw) = tls();
    let url = |port: u16, ca: &str| {
        format!(
            "kafka://127.0.0.1:{port}?partitions=2&fetch_wait_ms=10&rdkafka.security.protocol=ssl\
             &rdkafka.ssl.ca.location={dir}/{ca}"
        )
    };
    check(
        url(9095, "ca.pem"),
        vec![
            (
                "kafka: wrong CA",
                url(9095, "other-ca.pem"),
                &["BrokerTransportFailure"][..],
            ),
            (
                "kafka: plaintext port",
                url(9092, "ca.pem"),
                &["BrokerTransportFailure"][..],
            ),
        ],
        &[&pw],
    )
    .await;
}
