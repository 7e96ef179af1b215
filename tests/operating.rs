//! The ops endpoint on every real broker: `/metrics` is scraped during a
//! run and every documented series of a subscription is found with the
//! values the run produced; `/livez` and `/readyz` follow the
//! subscription's health, and a halted key degrades it without failing a
//! probe.

#![cfg(all(feature = "ops", feature = "all-adapters"))]

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use keyorder::{Delivery, HandlerError, HandlerResult, KeySource, Message, PoisonPolicy, RetryPolicy};
use keyorder_testkit::brokers::Broker;
use keyorder_testkit::until;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const DEADLINE: Duration = Duration::from_secs(90);

/// `GET path` on the endpoint: the status and the body.
async fn get(addr: std::net::SocketAddr, path: &str) -> Result<(u16, String), String> {
    let mut stream = tokio::net::TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    stream
        .write_all(format!("GET {path} HTTP/1.1\r\nHost: ops\r\nConnection: close\r\n\r\n").as_bytes())
        .await
        .map_err(|e| e.to_string())?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await.map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("no status line in {text:?}"))?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Ok((status, body))
}

/// The value of the series `name` whose labels include every one of
/// `labels` (`name{a="x",...} value`).
fn value(metrics: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    metrics.lines().find_map(|line| {
        let rest = line.strip_prefix(name)?;
        let (labelset, v) = match rest.strip_prefix('{') {
            Some(r) => r.split_once("} ")?,
            None => ("", rest.strip_prefix(' ')?),
        };
        let have: HashMap<&str, &str> = labelset
            .split(',')
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k, v.trim_matches('"')))
            .collect();
        labels
            .iter()
            .all(|(k, v)| have.get(k) == Some(v))
            .then(|| v.trim().parse().ok())
            .flatten()
    })
}

async fn scrape_on(endpoint: &keyorder::ops::Endpoint, url: &str, broker: &str) {
    let addr = endpoint.local_addr();
    let client = keyorder::connect(url).await.unwrap_or_else(|e| panic!("{broker}: {e}"));
    let category = format!("ops_{broker}_{}", uuid_like());
    let group = "g";
    let subscription = client
        .subscribe(&category, group)
        .ordered_by(KeySource::routing_key())
        .poison(PoisonPolicy::Halt)
        .retry(RetryPolicy {
            max_attempts: 2,
            initial_backoff: Duration::from_millis(10),
            max_backoff: Duration::from_millis(50),
        })
        .build()
        .await
        .unwrap_or_else(|e| panic!("{broker}: {e}"));
    endpoint.register(&subscription, client.admin());
    let health = subscription.health();
    let broken = Arc::new(AtomicBool::new(true));
    let handler = {
        let broken = broken.clone();
        move |d: Delivery| {
            let broken = broken.clone();
            async move {
                if d.payload().as_ref() == b"poison" && broken.load(Ordering::SeqCst) {
                    return Err(HandlerError::retry("poison (test)"));
                }
                HandlerResult::Ok(())
            }
        }
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(subscription.run(handler, async move {
        let _ = stopped.await;
    }));
    let publisher = client.publisher(&category).await.unwrap();
    let keys = ["a", "b", "c", "d"];
    for i in 0..5 {
        for k in keys {
            publisher
                .publish(Message::new(format!("{k}{i}")).with_key(k).unwrap())
                .await
                .unwrap();
        }
    }
    publisher
        .publish(Message::new("poison").with_key("halted").unwrap())
        .await
        .unwrap();
    let labels = [("category", category.as_str()), ("group", group)];
    // Every documented series of the subscription, with the run's values.
    let metrics = until(&format!("{broker}: every series on /metrics"), DEADLINE, async || {
        let (status, body) = get(addr, "/metrics").await?;
        if status != 200 {
            return Err(format!("/metrics answered {status}"));
        }
        let handled = value(&body, "keyorder_handler_seconds_count", &labels).unwrap_or(0.0);
        let settled = value(&body, "keyorder_settle_seconds_count", &labels).unwrap_or(0.0);
        let owned = value(&body, "keyorder_scopes_owned", &labels);
        let degraded = value(&body, "keyorder_health_degraded", &labels);
        // 20 applied + the poison head's 2 failed attempts.
        // RabbitMQ's broker says how many consume a queue, not which
        // instance, and tansu does not report the group's assignment: their
        // owned count is 0 (docs/OPERATING.md).
        let owns = owned.is_some_and(|o| o >= 1.0 || matches!(broker, "rabbitmq" | "kafka"));
        if handled >= 22.0 && settled >= 20.0 && owns && degraded == Some(1.0) {
            Ok(body)
        } else {
            Err(format!(
                "handled {handled}, settled {settled}, owned {owned:?}, degraded {degraded:?}"
            ))
        }
    })
    .await;
    let counted = |name: &str| value(&metrics, name, &labels);
    assert_eq!(
        counted("keyorder_handler_seconds_count"),
        Some(22.0),
        "{broker}: handler runs"
    );
    assert_eq!(
        counted("keyorder_settle_seconds_count"),
        Some(20.0),
        "{broker}: acknowledgements"
    );
    assert!(
        counted("keyorder_handler_seconds_sum").is_some_and(|s| (0.0..220.0).contains(&s)),
        "{broker}: handler seconds sum"
    );
    assert!(
        value(
            &metrics,
            "keyorder_handler_seconds_bucket",
            &[labels[0], labels[1], ("le", "+Inf")]
        ) == Some(22.0),
        "{broker}: the +Inf bucket holds every run"
    );
    assert_eq!(counted("keyorder_health_live"), Some(1.0), "{broker}: live gauge");
    assert_eq!(counted("keyorder_health_ready"), Some(1.0), "{broker}: ready gauge");
    assert!(
        value(&metrics, "keyorder_applied_total", &[]).is_some_and(|v| v >= 20.0),
        "{broker}: applied"
    );
    assert!(
        value(&metrics, "keyorder_halts_total", &[]).is_some_and(|v| v >= 1.0),
        "{broker}: halts"
    );
    // Present from the first lease on; counted by the heartbeats (none on
    // RabbitMQ, whose broker holds a queue while its channel lives).
    assert!(
        value(&metrics, "keyorder_lease_renewals_total", &[]).is_some_and(|v| v >= 1.0 || broker == "rabbitmq"),
        "{broker}: lease renewals"
    );
    assert!(
        value(&metrics, "keyorder_lease_losses_total", &[]).is_some(),
        "{broker}: lease losses"
    );
    assert!(
        metrics.contains("keyorder_scopes_unowned{"),
        "{broker}: unowned scopes gauge"
    );
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("keyorder_scope_lag{") && l.contains(&category)),
        "{broker}: per-scope lag"
    );
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("keyorder_scope_halted_keys{") && l.contains(&category)),
        "{broker}: per-scope halted keys"
    );
    for key in keys.iter().chain(&["halted"]) {
        assert!(
            !metrics.contains(&format!("=\"{key}\"")),
            "{broker}: the key {key} appeared as a label value"
        );
    }
    assert_eq!(
        counted("keyorder_scopes_read"),
        Some(1.0),
        "{broker}: the scopes poll answered"
    );
    // The halted key degrades; the probes stay up and say why on /healthz.
    assert_eq!(
        get(addr, "/livez").await.unwrap().0,
        200,
        "{broker}: livez while degraded"
    );
    assert_eq!(
        get(addr, "/readyz").await.unwrap().0,
        200,
        "{broker}: readyz while degraded"
    );
    let (_, healthz) = get(addr, "/healthz").await.unwrap();
    let line = healthz
        .lines()
        .find(|l| l.starts_with(&category))
        .unwrap_or_default()
        .to_owned();
    assert!(
        line.contains(" degraded ") && line.contains("halted"),
        "{broker}: /healthz {line:?}"
    );
    assert!(health.check().degraded, "{broker}");
    // Stopped: dead, and the probes fail with the reason.
    let _ = stop.send(());
    run.await.unwrap().unwrap_or_else(|e| panic!("{broker}: run: {e}"));
    let (status, body) = get(addr, "/livez").await.unwrap();
    assert_eq!(status, 503, "{broker}: livez after the run ended: {body}");
    assert!(body.contains(&category) && body.contains("stopped"), "{broker}: {body}");
    assert_eq!(get(addr, "/nope").await.unwrap().0, 404);
    broken.store(false, Ordering::SeqCst);
    let _ = client.admin().delete_category(&category).await;
}

/// A short suffix that differs from run to run.
fn uuid_like() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("{:08x}", nanos as u32)
}

/// One endpoint per process (it installs the process's recorder): every
/// broker runs in turn on it, and a stopped subscription stays `dead` on
/// `/livez`, so each broker gets an endpoint of its own port but the same
/// recorder.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ops_endpoint_on_every_broker() {
    let kafka = format!("kafka://{}?partitions=4&fetch_wait_ms=10", Broker::Kafka.url());
    let amqp = format!(
        "{}?topology=hash&queues=4&consumer_timeout_ms=3600000",
        Broker::RabbitMq.url()
    );
    for (broker, url) in [
        ("memory", "memory://".to_owned()),
        ("postgres", format!("{}?migrate=true", Broker::Postgres.url())),
        ("redis", Broker::Redis.url()),
        ("rabbitmq", amqp),
        ("kafka", kafka),
    ] {
        let endpoint = keyorder::ops::serve("127.0.0.1:0").await.unwrap();
        scrape_on(&endpoint, &url, broker).await;
    }
}

/// A client that connects and sends nothing holds its place for at most
/// the head timeout, and many of them do not keep a scrape out for longer.
#[tokio::test]
async fn idle_clients_are_closed_and_bounded() {
    let endpoint = keyorder::ops::serve("127.0.0.1:0").await.unwrap();
    let addr = endpoint.local_addr();
    let mut idle = Vec::new();
    for _ in 0..40 {
        idle.push(tokio::net::TcpStream::connect(addr).await.unwrap());
    }
    let mut first = idle.remove(0);
    let mut rest = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(60), first.read_to_end(&mut rest)).await;
    assert!(
        matches!(closed, Ok(Ok(_))),
        "an idle connection was not closed: {closed:?}"
    );
    let scraped = tokio::time::timeout(Duration::from_secs(60), get(addr, "/metrics")).await;
    assert!(
        matches!(scraped, Ok(Ok((200, _)))),
        "a scrape behind 39 idle clients: {scraped:?}"
    );
}

/// Per-scope series stop at `MAX_SCOPE_SERIES` scopes a subscription: on a
/// layout with a scope per key they would grow with the keys.
#[tokio::test]
async fn per_scope_series_are_bounded() {
    let endpoint = keyorder::ops::serve("127.0.0.1:0").await.unwrap();
    let client = keyorder::connect("memory://?partitions=100").await.unwrap();
    let category = format!("ops_bounded_{}", uuid_like());
    let subscription = client
        .subscribe(&category, "g")
        .ordered_by(KeySource::routing_key())
        .build()
        .await
        .unwrap();
    endpoint.register(&subscription, client.admin());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(
        subscription.run(|_d: Delivery| async { HandlerResult::Ok(()) }, async move {
            let _ = stopped.await;
        }),
    );
    let addr = endpoint.local_addr();
    let lines = until("the scope series of 100 partitions", DEADLINE, async || {
        let (_, body) = get(addr, "/metrics").await?;
        let lines = body
            .lines()
            .filter(|l| l.starts_with("keyorder_scope_lag{") && l.contains(&category))
            .count();
        let unowned = value(&body, "keyorder_scopes_unowned", &[("category", category.as_str())]);
        if lines > 0 && unowned.is_some() {
            Ok(lines)
        } else {
            Err(format!("{lines} lines"))
        }
    })
    .await;
    assert_eq!(lines, keyorder::ops::MAX_SCOPE_SERIES, "per-scope series of 100 scopes");
    let _ = stop.send(());
    run.await.unwrap().unwrap();
}

/// Lease renewals and losses are counted: a Redis subscription's heartbeat
/// renews its partition leases (`keyorder_lease_renewals_total` rises);
/// another holder written over those leases on the server makes the next
/// heartbeat find them lost (`keyorder_lease_losses_total` rises by at
/// least one per overwritten lease).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_renewals_and_losses_are_counted() {
    let endpoint = keyorder::ops::serve("127.0.0.1:0").await.unwrap();
    let addr = endpoint.local_addr();
    let url = format!("{}?lease_ttl_ms=6000", Broker::Redis.url());
    let client = keyorder::connect(&url).await.unwrap();
    let category = format!("ops_lease_{}", uuid_like());
    let subscription = client
        .subscribe(&category, "g")
        .ordered_by(KeySource::routing_key())
        .build()
        .await
        .unwrap();
    let handled = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = {
        let handled = handled.clone();
        tokio::spawn(subscription.run(
            move |_d: Delivery| {
                let handled = handled.clone();
                async move {
                    handled.fetch_add(1, Ordering::SeqCst);
                    HandlerResult::Ok(())
                }
            },
            async move {
                let _ = stopped.await;
            },
        ))
    };
    let publisher = client.publisher(&category).await.unwrap();
    for k in ["a", "b", "c"] {
        publisher.publish(Message::new(k).with_key(k).unwrap()).await.unwrap();
    }
    until("the three messages handled", DEADLINE, async || {
        let n = handled.load(Ordering::SeqCst);
        if n >= 3 {
            Ok(())
        } else {
            Err(format!("{n} handled"))
        }
    })
    .await;
    let series = async |name: &str| -> Result<f64, String> {
        let (_, body) = get(addr, "/metrics").await?;
        value(&body, name, &[]).ok_or_else(|| format!("no {name}"))
    };
    let renewed = series("keyorder_lease_renewals_total").await.unwrap();
    until("a heartbeat renews the leases", DEADLINE, async || {
        let now = series("keyorder_lease_renewals_total").await?;
        if now > renewed {
            Ok(())
        } else {
            Err(format!("renewals still {now}"))
        }
    })
    .await;
    let lost = series("keyorder_lease_losses_total").await.unwrap();
    // Another holder takes every lease of the group on the server.
    let redis = redis::Client::open(Broker::Redis.url()).unwrap();
    let mut conn = redis.get_multiplexed_async_connection().await.unwrap();
    let leases: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{category}:*__lease__:g"))
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(!leases.is_empty(), "no lease keys for {category}");
    for key in &leases {
        let () = redis::cmd("SET")
            .arg(key)
            .arg("intruder:999999")
            .arg("PX")
            .arg(120_000)
            .query_async(&mut conn)
            .await
            .unwrap();
    }
    until("the heartbeat finds the leases lost", DEADLINE, async || {
        let now = series("keyorder_lease_losses_total").await?;
        if now >= lost + 1.0 {
            Ok(())
        } else {
            Err(format!("losses {now} (were {lost})"))
        }
    })
    .await;
    let _ = stop.send(());
    run.await.unwrap().unwrap();
    let () = redis::cmd("DEL").arg(&leases).query_async(&mut conn).await.unwrap();
    let _ = client.admin().delete_category(&category).await;
}

/// A real loss found first by a fenced settlement (the most common way an
/// old owner learns a newer one took its key: its acknowledgement is
/// refused) counts in `keyorder_lease_losses_total`, although the later
/// heartbeat finds the lease already marked lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loss_seen_first_by_a_fenced_ack_is_counted() {
    let endpoint = keyorder::ops::serve("127.0.0.1:0").await.unwrap();
    let addr = endpoint.local_addr();
    let url = format!("{}?lease_ttl_ms=6000", Broker::Redis.url());
    let client = keyorder::connect(&url).await.unwrap();
    let category = format!("ops_fenced_{}", uuid_like());
    let subscription = client
        .subscribe(&category, "g")
        .ordered_by(KeySource::routing_key())
        .build()
        .await
        .unwrap();
    let started = Arc::new(tokio::sync::Notify::new());
    let go = Arc::new(tokio::sync::Notify::new());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = {
        let (started, go) = (started.clone(), go.clone());
        tokio::spawn(subscription.run(
            move |_d: Delivery| {
                let (started, go) = (started.clone(), go.clone());
                async move {
                    started.notify_one();
                    go.notified().await;
                    HandlerResult::Ok(())
                }
            },
            async move {
                let _ = stopped.await;
            },
        ))
    };
    let publisher = client.publisher(&category).await.unwrap();
    publisher
        .publish(Message::new("1").with_key("a").unwrap())
        .await
        .unwrap();
    tokio::time::timeout(DEADLINE, started.notified())
        .await
        .expect("handler started");
    let series = async |name: &str| -> Result<f64, String> {
        let (_, body) = get(addr, "/metrics").await?;
        value(&body, name, &[]).ok_or_else(|| format!("no {name}"))
    };
    let lost = series("keyorder_lease_losses_total").await.unwrap();
    let fenced_before = series("keyorder_fence_rejections_total").await.unwrap_or(0.0);
    // A newer owner takes the lease while the handler runs.
    let redis = redis::Client::open(Broker::Redis.url()).unwrap();
    let mut conn = redis.get_multiplexed_async_connection().await.unwrap();
    let leases: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{category}:*__lease__:g"))
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(leases.len(), 1, "one lease for key a: {leases:?}");
    let () = redis::cmd("SET")
        .arg(&leases[0])
        .arg("intruder:999999")
        .arg("PX")
        .arg(120_000)
        .query_async(&mut conn)
        .await
        .unwrap();
    // The handler returns: its acknowledgement is refused (fenced).
    go.notify_one();
    until("the acknowledgement is fenced", DEADLINE, async || {
        let now = series("keyorder_fence_rejections_total").await.unwrap_or(0.0);
        if now > fenced_before {
            Ok(())
        } else {
            Err(format!("fence rejections {now}"))
        }
    })
    .await;
    // Several heartbeats (lease 6 s) later the loss is still not counted.
    let mut now = lost;
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        now = series("keyorder_lease_losses_total").await.unwrap();
        if now >= lost + 1.0 {
            break;
        }
    }
    let _ = stop.send(());
    let _ = run.await;
    let () = redis::cmd("DEL").arg(&leases).query_async(&mut conn).await.unwrap();
    let _ = client.admin().delete_category(&category).await;
    assert!(
        now >= lost + 1.0,
        "a lease taken by a newer owner (ack fenced) was not counted as a loss: losses {now} (were {lost})"
    );
}
