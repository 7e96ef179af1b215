//! Keys PostgreSQL `text` cannot hold as they are (NUL) and keys that look
//! like their stored form (a leading U+0001), on the real server: each
//! message is delivered under exactly its own key, in its key's publish
//! order; a halted NUL key is listed, resolved by its value and
//! dead-lettered under its own label; the plain layout carries them too.
//! (Both the key column and the key header, `jsonb`, hold the key's stored
//! form: neither can hold NUL.)

use common::url;
use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use keyorder_core::key::label;
use keyorder_core::{
    Client, Delivery, HandlerError, HandlerResult, HeadAction, KeyRules, KeySource, LeaseConfig, Message, RetryPolicy,
    SourceSpec, Transport, KEY_HEADER,
};
use keyorder_postgres::PgConfig;
use keyorder_testkit::until;

// Shared set-up; this file uses only part of it.
#[allow(dead_code)]
mod common;

/// The keys under test: NUL inside and alone, the stored form's escape
/// (U+0001) leading, and ordinary keys beside them.
const KEYS: &[&str] = &["nul\u{0}key", "\u{0}", "\u{1}0", "\u{1}", "customer:42", "a"];
/// Messages per key.
const PER_KEY: usize = 5;
/// The key halted on a poison message.
const HALT_KEY: &str = "halt\u{0}me";

/// What the handler saw: (the delivery's key, the payload).
type Seen = Arc<Mutex<Vec<(String, String)>>>;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nul_and_escape_keys_are_delivered_under_their_own_key_in_order() {
    // Two slots: keys share slots, and a key read back as another would
    // also land in another key's order.
    let cfg = PgConfig::from_url(
        &format!("{}?schema=keyorder_nul_keys&slots=2&migrate=true", url())
            .parse()
            .unwrap(),
    )
    .unwrap();
    let client = Client::new(Arc::new(common::connect(cfg.clone()).await));
    let queue = format!("nul-{}", uuid::Uuid::new_v4().simple());
    let publisher = client.publisher(&queue).await.unwrap();
    // The payload names the key (its index) and the message's place in it.
    for seq in 0..PER_KEY {
        for (i, key) in KEYS.iter().enumerate() {
            publisher
                .publish(Message::new(format!("{i}/{seq}")).with_key(*key).unwrap())
                .await
                .unwrap();
        }
    }
    publisher
        .publish(Message::new("poison").with_key(HALT_KEY).unwrap())
        .await
        .unwrap();
    publisher
        .publish(Message::new("after").with_key(HALT_KEY).unwrap())
        .await
        .unwrap();

    let subscription = client
        .subscribe(&queue, "g")
        .ordered_by(KeySource::routing_key())
        .retry(RetryPolicy {
            max_attempts: 1,
            initial_backoff: Duration::from_millis(10),
            max_backoff: Duration::from_millis(10),
        })
        .lease(LeaseConfig {
            ttl: Duration::from_secs(15),
            heartbeat: Duration::from_millis(200),
            margin: Duration::from_secs(5),
        })
        .build()
        .await
        .unwrap();
    let seen: Seen = Arc::default();
    let handler = {
        let seen = seen.clone();
        move |d: Delivery| {
            let seen = seen.clone();
            async move {
                let key = d.key().map(|k| k.as_str().to_owned()).unwrap_or_default();
                let body = String::from_utf8_lossy(d.payload()).into_owned();
                seen.lock().unwrap().push((key, body.clone()));
                if body == "poison" {
                    return Err(HandlerError::poison("poison message"));
                }
                HandlerResult::Ok(())
            }
        }
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(subscription.run(handler, async move {
        let _ = stopped.await;
    }));

    let admin = client.admin();
    until(
        "every message of the carried keys and the halt",
        Duration::from_secs(60),
        async || {
            seen.lock().unwrap().len() > KEYS.len() * PER_KEY && admin.halted(&queue, "g").await.unwrap().len() == 1
        },
    )
    .await;
    // Each message under exactly its own key, each key in publish order.
    let mut per_key: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for (key, body) in seen.lock().unwrap().iter() {
        if key == HALT_KEY {
            assert_eq!(body, "poison", "nothing after the halted head ran");
            continue;
        }
        let (i, seq) = body.split_once('/').expect("a carried key's payload");
        let (i, seq): (usize, usize) = (i.parse().unwrap(), seq.parse().unwrap());
        assert!(
            key == KEYS[i],
            "a message of key {} was delivered under key {}",
            keyorder_core::key::redact(KEYS[i]),
            keyorder_core::key::redact(key)
        );
        per_key.entry(i).or_default().push(seq);
    }
    let want: Vec<usize> = (0..PER_KEY).collect();
    for (i, key) in KEYS.iter().enumerate() {
        assert_eq!(
            per_key.get(&i),
            Some(&want),
            "key {}: each message once, in publish order",
            keyorder_core::key::redact(key)
        );
    }

    // The halted NUL key: listed under its own label, held, resolved by its
    // value, dead-lettered under its label; its next message then runs.
    let halted = admin.halted(&queue, "g").await.unwrap();
    assert_eq!(halted[0].label, label(HALT_KEY), "the label is the key's own");
    assert_eq!(halted[0].held, Some(1), "the key's next message is held");
    admin
        .resolve(&queue, "g", HALT_KEY, HeadAction::DeadLetter)
        .await
        .unwrap();
    until(
        "the held message to run under its key",
        Duration::from_secs(60),
        async || seen.lock().unwrap().iter().any(|(k, b)| k == HALT_KEY && b == "after"),
    )
    .await;
    let dead = admin.dead_letters(&queue, "g").await.unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(
        dead[0].label,
        label(HALT_KEY),
        "the dead letter's label is the key's own"
    );
    assert!(admin.halted(&queue, "g").await.unwrap().is_empty());
    let _ = stop.send(());
    run.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_plain_layout_carries_nul_keys() {
    let cfg = PgConfig::from_url(
        &format!("{}?schema=keyorder_nul_plain&migrate=true&layout=plain", url())
            .parse()
            .unwrap(),
    )
    .unwrap();
    let transport = common::connect(cfg).await;
    let queue = format!("nulplain-{}", uuid::Uuid::new_v4().simple());
    // Through a client: its publisher stamps the key header too.
    let publisher = Client::new(Arc::new(transport.clone()))
        .publisher(&queue)
        .await
        .unwrap();
    for (i, key) in KEYS.iter().enumerate() {
        publisher
            .publish(Message::new(i.to_string()).with_key(*key).unwrap())
            .await
            .unwrap();
    }
    let spec = SourceSpec {
        category: queue.clone(),
        correlated: Vec::new(),
        group: "g".into(),
        instance: "a".into(),
        ordered: false,
        lease: LeaseConfig {
            ttl: Duration::from_secs(10),
            heartbeat: Duration::from_secs(1),
            margin: Duration::from_secs(2),
        },
        key_rules: KeyRules::default(),
    };
    let mut source = transport.open(&spec).await.unwrap();
    let got = common::take(&mut source, KEYS.len()).await;
    let mut indexes = HashSet::new();
    for inbound in got {
        let i: usize = String::from_utf8_lossy(inbound.message.payload()).parse().unwrap();
        let key = inbound.message.key().map(|k| k.as_str().to_owned());
        assert!(
            key.as_deref() == Some(KEYS[i]) && inbound.message.header(KEY_HEADER) == Some(KEYS[i]),
            "a message of key {} came back under another key",
            keyorder_core::key::redact(KEYS[i])
        );
        indexes.insert(i);
        inbound.settle.ack().await.unwrap();
    }
    assert_eq!(indexes.len(), KEYS.len());
}

/// A key taken from a user header (and a correlation id) may hold NUL
/// too: the headers column (`jsonb`) and the correlation id (`text`) keep
/// every value in its stored form. Before, such a publish failed with
/// "unsupported Unicode escape sequence".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_from_a_user_header_and_a_correlation_id_may_hold_nul() {
    let cfg = PgConfig::from_url(
        &format!("{}?schema=keyorder_nul_keys&slots=2&migrate=true", url())
            .parse()
            .unwrap(),
    )
    .unwrap();
    let client = Client::new(Arc::new(common::connect(cfg).await));
    let queue = format!("nulh-{}", uuid::Uuid::new_v4().simple());
    let publisher = client.publisher(&queue).await.unwrap();
    let keys = ["t\u{0}1", "\u{1}1", "plain"];
    for seq in 0..3 {
        for (i, key) in keys.iter().enumerate() {
            publisher
                .publish(
                    Message::new(format!("{i}/{seq}"))
                        .with_key(*key)
                        .unwrap()
                        .with_header("tenant", *key)
                        .with_correlation_id(format!("corr\u{0}{i}")),
                )
                .await
                .unwrap();
        }
    }
    let subscription = client
        .subscribe(&queue, "g")
        .ordered_by(KeySource::header("tenant"))
        .build()
        .await
        .unwrap();
    // Per delivery: its key, its tenant header, its correlation id, payload.
    type Got = (String, String, String, String);
    let seen: Arc<Mutex<Vec<Got>>> = Arc::default();
    let handler = {
        let seen = seen.clone();
        move |d: Delivery| {
            let seen = seen.clone();
            async move {
                seen.lock().unwrap().push((
                    d.key().map(|k| k.as_str().to_owned()).unwrap_or_default(),
                    d.message().header("tenant").unwrap_or_default().to_owned(),
                    d.message().correlation_id().unwrap_or_default().to_owned(),
                    String::from_utf8_lossy(d.payload()).into_owned(),
                ));
                HandlerResult::Ok(())
            }
        }
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(subscription.run(handler, async move {
        let _ = stopped.await;
    }));
    until("every message", Duration::from_secs(60), async || {
        seen.lock().unwrap().len() >= 9
    })
    .await;
    let _ = stop.send(());
    run.await.unwrap().unwrap();
    let mut order: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for (key, tenant, corr, body) in seen.lock().unwrap().iter() {
        let (i, seq) = body.split_once('/').unwrap();
        let i: usize = i.parse().unwrap();
        assert_eq!(key, keys[i], "ran under its header's key");
        assert_eq!(tenant, keys[i], "the header came back as published");
        assert_eq!(
            corr,
            &format!("corr\u{0}{i}"),
            "the correlation id came back as published"
        );
        order.entry(i).or_default().push(seq.parse().unwrap());
    }
    for (i, seqs) in order {
        assert_eq!(seqs, vec![0, 1, 2], "key {i} in order");
    }
}
