//! Keys that look like names, on the real Redis server: a key holding `:`,
//! a lane token, a `__name__` sentinel, braces, control characters or NUL
//! runs under its own key, in its own order, and collides with no other
//! key's stream, lane, dead letters or lease, nor with the category's
//! internal names (index, keyless stream, dead-letter index); the operator
//! sees each key under its own label, and halts and dead letters of such
//! keys are found again.

// Shared set-up; this file uses only part of it.
#[allow(dead_code)]
mod common;

use common::url;
use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::time::Duration;

use keyorder_core::key::{label, redact};
use keyorder_core::raw::Room;
use keyorder_core::{
    HeadAction, Inbound, KeyRules, LeaseConfig, Message, SourceEvent, SourceSpec, Transport, TransportSource,
};
use keyorder_redis::{Names, RedisTransport};

async fn transport() -> RedisTransport {
    common::connect(&url()).await
}

fn spec(category: &str, group: &str, ordered: bool) -> SourceSpec {
    SourceSpec {
        category: category.into(),
        correlated: Vec::new(),
        group: group.into(),
        instance: "i1".into(),
        ordered,
        lease: LeaseConfig {
            ttl: Duration::from_secs(2),
            heartbeat: Duration::from_millis(500),
            margin: Duration::from_millis(700),
        },
        key_rules: KeyRules::default().with_lane("backfill"),
    }
}

fn category(name: &str) -> String {
    format!("keys-{name}-{}", uuid::Uuid::new_v4().simple())
}

async fn conn() -> redis::aio::MultiplexedConnection {
    redis::Client::open(url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

/// Keys that would collide with another key, a lane, a dead-letter stream,
/// a lease or an internal name if they went into names unencoded.
const KEYS: &[&str] = &[
    "a",
    "a:dlq",
    "a:backfill",
    "a:__lease__:g",
    "a:__attempts__:g",
    "a:",
    ":a",
    "::",
    "dlq",
    "backfill",
    "__partitions__",
    "__keyless__",
    "__dlq__",
    "__wake__",
    "__groups__",
    "__generation__",
    "__halted__:g",
    "customer:42",
    "tag{x}",
    "{a}",
    "%",
    "%3Aa",
    "%253A",
    "line\u{1}break",
    "\u{1}0",
    "nul\u{0}key",
    "\u{0}",
    "\u{fffd}ff",
    "\u{7f}",
    "ключ:1",
];

/// What a consumer saw: per message id, the keys it ran under; per key,
/// the sequence numbers in the order they ran; the errors it met.
#[derive(Default)]
struct Seen {
    keys_of: BTreeMap<String, Vec<Option<String>>>,
    order: BTreeMap<String, Vec<u32>>,
    errors: BTreeSet<String>,
}

/// Maintains, fetches and acknowledges until every id of `sent` ran or the
/// deadline passed (errors are recorded and retried).
async fn consume(
    source: &mut Box<dyn TransportSource>,
    sent: &BTreeMap<String, (String, u32)>,
    within: Duration,
) -> Seen {
    let until = tokio::time::Instant::now() + within;
    let mut seen = Seen::default();
    while sent.keys().any(|id| !seen.keys_of.contains_key(id)) && tokio::time::Instant::now() < until {
        if let Err(e) = source.maintain().await {
            seen.errors.insert(format!("maintain: {e}"));
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        }
        let batch = match source.fetch(&Room::up_to(100), Duration::from_millis(100)).await {
            Ok(batch) => batch,
            Err(e) => {
                seen.errors.insert(format!("fetch: {e}"));
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        for d in batch {
            record(&mut seen, &d, sent);
            if let Err(e) = d.settle.begin_attempt().await {
                seen.errors.insert(format!("attempt: {e}"));
            }
            if let Err(e) = d.settle.ack().await {
                seen.errors.insert(format!("ack: {e}"));
            }
        }
    }
    seen
}

fn record(seen: &mut Seen, d: &Inbound, sent: &BTreeMap<String, (String, u32)>) {
    let id = d.message.id().to_owned();
    let key = d.message.key().map(|k| k.as_str().to_owned());
    if let (Some(k), Some((want, seq))) = (&key, sent.get(&id)) {
        if k == want {
            seen.order.entry(k.clone()).or_default().push(*seq);
        }
    }
    seen.keys_of.entry(id).or_default().push(key);
}

/// Every problem of what a consumer saw, keys shown redacted.
fn problems(
    what: &str,
    seen: &Seen,
    sent: &BTreeMap<String, (String, u32)>,
    ordered: bool,
    per_key: u32,
) -> Vec<String> {
    let mut out: Vec<String> = seen.errors.iter().map(|e| format!("{what}: {e}")).collect();
    for (id, (key, _)) in sent {
        match seen.keys_of.get(id).map(Vec::as_slice) {
            None => out.push(format!("{what}: {id} of key {} never ran", redact(key))),
            Some([Some(k)]) if k == key => {}
            Some(got) => out.push(format!(
                "{what}: {id} of key {} ran under {:?}",
                redact(key),
                got.iter()
                    .map(|k| k.as_deref().map_or("no key".to_owned(), redact))
                    .collect::<Vec<_>>()
            )),
        }
    }
    for id in seen.keys_of.keys().filter(|id| !sent.contains_key(*id)) {
        out.push(format!("{what}: an unknown message {id} ran"));
    }
    if ordered {
        for key in KEYS {
            let got = seen.order.get(*key).cloned().unwrap_or_default();
            if got != (0..per_key).collect::<Vec<_>>() {
                out.push(format!("{what}: key {} ran in the order {got:?}", redact(key)));
            }
        }
    }
    out
}

/// Publishes `per_key` messages to every key of [`KEYS`], interleaved;
/// returns id -> (key, sequence) and every failed publish as a problem.
async fn publish_all(t: &RedisTransport, cat: &str, per_key: u32) -> (BTreeMap<String, (String, u32)>, Vec<String>) {
    let p = t.publisher(cat).await.unwrap();
    let mut sent = BTreeMap::new();
    let mut failed = Vec::new();
    for seq in 0..per_key {
        for (i, key) in KEYS.iter().enumerate() {
            let id = format!("k{i:02}-{seq}");
            let m = Message::new(id.clone()).with_key(*key).unwrap().with_id(id.clone());
            match p.publish(m).await {
                Ok(()) => {
                    sent.insert(id, ((*key).to_owned(), seq));
                }
                Err(e) => failed.push(format!("publish {id} to key {}: {e}", redact(key))),
            }
        }
    }
    (sent, failed)
}

async fn type_of(name: &str) -> String {
    redis::cmd("TYPE")
        .arg(name)
        .query_async(&mut conn().await)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_key_runs_under_its_own_key_and_collides_with_nothing() {
    let t = transport().await;
    let cat = category("own");
    let names = Names::new(&cat).unwrap();
    let per_key = 3;
    // Both groups are registered before anything is published.
    let mut ordered = t.open(&spec(&cat, "g", true)).await.unwrap();
    let mut plain = t.open(&spec(&cat, "p", false)).await.unwrap();
    let (sent, mut bad) = publish_all(&t, &cat, per_key).await;
    // A keyless message still goes to the keyless stream only.
    let p = t.publisher(&cat).await.unwrap();
    p.publish(Message::new("keyless").with_id("keyless")).await.unwrap();

    // Both groups also read the keyless message, with no key.
    let mut seen = consume(&mut ordered, &sent, Duration::from_secs(15)).await;
    if !matches!(seen.keys_of.remove("keyless").as_deref(), None | Some([None])) {
        bad.push("ordered: the keyless message ran under a key or more than once".into());
    }
    bad.extend(problems("ordered", &seen, &sent, true, per_key));
    let mut seen = consume(&mut plain, &sent, Duration::from_secs(15)).await;
    if !matches!(seen.keys_of.remove("keyless").as_deref(), None | Some([None])) {
        bad.push("unordered: the keyless message ran under a key or more than once".into());
    }
    bad.extend(problems("unordered", &seen, &sent, false, per_key));

    for (name, want) in [
        (names.index(), "zset"),
        (names.keyless(), "stream"),
        (names.groups(), "hash"),
        (names.generation(), "string"),
    ] {
        let got = type_of(&name).await;
        if got != want {
            bad.push(format!("{} is a {got}, not a {want}", name.replace(&cat, "{c}")));
        }
    }
    let keyless_len: usize = redis::cmd("XLEN")
        .arg(names.keyless())
        .query_async(&mut conn().await)
        .await
        .unwrap();
    if keyless_len != 1 {
        bad.push(format!("the keyless stream holds {keyless_len} entries, not 1"));
    }
    // Every key has its own stream, holding only its messages.
    for key in KEYS {
        let n: redis::RedisResult<usize> = redis::cmd("XLEN")
            .arg(names.stream(key))
            .query_async(&mut conn().await)
            .await;
        match n {
            Ok(n) if n == per_key as usize => {}
            Ok(n) => bad.push(format!(
                "the stream of key {} holds {n} entries, not {per_key}",
                redact(key)
            )),
            Err(e) => bad.push(format!(
                "the stream of key {}: {}",
                redact(key),
                e.code().unwrap_or("error")
            )),
        }
    }
    // The operator sees every key under its own label.
    match t.admin().scopes(&cat, "g").await {
        Ok(scopes) => {
            let scopes: HashSet<String> = scopes.into_iter().map(|s| s.scope).collect();
            let want: HashSet<String> = KEYS.iter().map(|k| format!("{cat}/{}", label(k))).collect();
            if scopes != want {
                bad.push(format!(
                    "the operator's scopes differ: {} unexpected, {} missing",
                    scopes.difference(&want).count(),
                    want.difference(&scopes).count()
                ));
            }
        }
        Err(e) => bad.push(format!("the operator's scopes: {e}")),
    }
    for mut s in [ordered, plain] {
        if let Err(e) = s.close().await {
            bad.push(format!("close: {e}"));
        }
    }
    assert!(bad.is_empty(), "{} problems:\n{}", bad.len(), bad.join("\n"));
}

/// Key `a`'s dead letters are `{c}:a:dlq`; the key `a:dlq` must not read
/// them as its messages, nor add its messages to them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_named_like_a_dead_letter_stream_is_not_one() {
    let t = transport().await;
    let cat = category("dlq");
    let mut source = t.open(&spec(&cat, "g", true)).await.unwrap();
    let p = t.publisher(&cat).await.unwrap();
    p.publish(Message::new("0").with_key("a").unwrap().with_id("poison"))
        .await
        .unwrap();
    let only = |id: &str, key: &str| {
        let mut m = BTreeMap::new();
        m.insert(id.to_owned(), (key.to_owned(), 0));
        m
    };
    let until = tokio::time::Instant::now() + Duration::from_secs(15);
    let head = loop {
        assert!(tokio::time::Instant::now() < until, "the message of key `a` never ran");
        source.maintain().await.unwrap();
        let mut got = source
            .fetch(&Room::up_to(10), Duration::from_millis(100))
            .await
            .unwrap();
        if let Some(d) = got.pop() {
            break d;
        }
    };
    head.settle.begin_attempt().await.unwrap();
    head.settle.park("poison").await.unwrap();

    p.publish(Message::new("1").with_key("a:dlq").unwrap().with_id("colliding"))
        .await
        .unwrap();
    let sent = only("colliding", "a:dlq");
    let seen = consume(&mut source, &sent, Duration::from_secs(10)).await;
    let mut bad: Vec<String> = seen.errors.iter().cloned().collect();
    for (id, keys) in &seen.keys_of {
        if id != "colliding" || keys.len() != 1 || keys[0].as_deref() != Some("a:dlq") {
            bad.push(format!(
                "{id} ran {} time(s) under {:?}",
                keys.len(),
                keys.iter()
                    .map(|k| k.as_deref().map_or("no key".into(), redact))
                    .collect::<Vec<_>>()
            ));
        }
    }
    if !seen.keys_of.contains_key("colliding") {
        bad.push("the message of key `a:dlq` never ran".into());
    }
    let dead = t.admin().dead_letters(&cat, "g").await.unwrap();
    let dead: Vec<(String, String)> = dead.into_iter().map(|d| (d.id, d.label)).collect();
    if dead != [("poison".to_owned(), label("a"))] {
        bad.push(format!(
            "dead letters: {:?}, not only `poison` of key `a` ({})",
            dead,
            label("a")
        ));
    }
    source.close().await.unwrap();
    assert!(bad.is_empty(), "{} problems:\n{}", bad.len(), bad.join("\n"));
}

/// A halted head of a key holding `:` and NUL is listed under its own
/// label, resolved by the operator through its value or its label, and the
/// owner releases that very key; a parked one is listed as its dead letter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn halts_and_dead_letters_of_encoded_keys_are_found_again() {
    let t = transport().await;
    let cat = category("halt");
    let admin = t.admin();
    let mut source = t.open(&spec(&cat, "g", true)).await.unwrap();
    let p = t.publisher(&cat).await.unwrap();
    let (halting, parking) = ("x:__lease__:g\u{0}", "{y}:dlq");
    p.publish(Message::new("h").with_key(halting).unwrap().with_id("h"))
        .await
        .unwrap();
    p.publish(Message::new("d").with_key(parking).unwrap().with_id("d"))
        .await
        .unwrap();
    let until = tokio::time::Instant::now() + Duration::from_secs(15);
    let mut got: Vec<Inbound> = Vec::new();
    while got.len() < 2 {
        assert!(tokio::time::Instant::now() < until, "only {} of 2 ran", got.len());
        source.maintain().await.unwrap();
        got.extend(
            source
                .fetch(&Room::up_to(10), Duration::from_millis(100))
                .await
                .unwrap(),
        );
    }
    for d in &got {
        d.settle.begin_attempt().await.unwrap();
        match d.message.id() {
            "h" => d.settle.halt("poison").await.unwrap(),
            _ => d.settle.park("poison").await.unwrap(),
        }
    }
    let halted = admin.halted(&cat, "g").await.unwrap();
    assert_eq!(halted.len(), 1);
    assert_eq!(halted[0].label, label(halting));
    assert_eq!(halted[0].scope, format!("{cat}/{}", label(halting)));
    assert!(!halted[0].head_id.is_empty());
    let dead = admin.dead_letters(&cat, "g").await.unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!((dead[0].id.as_str(), dead[0].label.clone()), ("d", label(parking)));

    admin.resolve(&cat, "g", halting, HeadAction::Skip).await.unwrap();
    assert!(admin.halted(&cat, "g").await.unwrap().is_empty());
    let until = tokio::time::Instant::now() + Duration::from_secs(15);
    let released = loop {
        assert!(
            tokio::time::Instant::now() < until,
            "the owner never released the halted key"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
        let events = source.maintain().await.unwrap();
        if let Some(key) = events.into_iter().find_map(|e| match e {
            SourceEvent::Resolved { key, drop_head } => Some((key, drop_head)),
            SourceEvent::Revoke(_) => None,
        }) {
            break key;
        }
    };
    assert!(
        released.0 == halting && released.1,
        "released another key or kept the head"
    );

    // Through the label too.
    p.publish(Message::new("h2").with_key(halting).unwrap().with_id("h2"))
        .await
        .unwrap();
    let until = tokio::time::Instant::now() + Duration::from_secs(15);
    let d = loop {
        assert!(
            tokio::time::Instant::now() < until,
            "the next message of the halted key never ran"
        );
        source.maintain().await.unwrap();
        let mut got = source
            .fetch(&Room::up_to(10), Duration::from_millis(100))
            .await
            .unwrap();
        if let Some(d) = got.pop() {
            break d;
        }
    };
    assert_eq!(d.message.id(), "h2");
    d.settle.begin_attempt().await.unwrap();
    d.settle.halt("poison").await.unwrap();
    admin
        .resolve(&cat, "g", &label(halting), HeadAction::DeadLetter)
        .await
        .unwrap();
    let mut dead: Vec<(String, String)> = admin
        .dead_letters(&cat, "g")
        .await
        .unwrap()
        .into_iter()
        .map(|d| (d.id, d.label))
        .collect();
    dead.sort();
    assert_eq!(
        dead,
        [("d".to_owned(), label(parking)), ("h2".to_owned(), label(halting))]
    );
    source.close().await.unwrap();
}
