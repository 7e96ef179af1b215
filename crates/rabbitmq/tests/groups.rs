//! Consumer groups on the real RabbitMQ: every group of a category receives
//! every message, in per-key order (each group has queues of its own behind
//! the category's entry exchange).

// Shared set-up; this file uses only part of it.
#[allow(dead_code)]
mod common;

use common::base;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use keyorder_core::{Client, Delivery, HandlerResult, KeySource, LeaseConfig, Message};
use keyorder_rabbitmq::RabbitTransport;

const KEYS: usize = 10;
const PER_KEY: usize = 5;

fn url(topology: &str) -> String {
    // consumer_timeout_ms: what scripts/services configures.
    format!(
        "{}?{topology}&queue_type=classic&expires_ms=600000&consumer_timeout_ms=3600000",
        base()
    )
}

async fn client(url: &str) -> Client {
    let t = common::connect(url).await;
    Client::new(Arc::new(t))
}

fn category(prefix: &str) -> String {
    format!("{prefix}-{}", &uuid::Uuid::new_v4().simple().to_string()[..12])
}

fn lease() -> LeaseConfig {
    LeaseConfig {
        ttl: Duration::from_secs(4),
        heartbeat: Duration::from_millis(500),
        margin: Duration::from_millis(1500),
    }
}

/// Per group: `(key index, sequence)` in the order its handler ran them.
type Applied = Arc<Mutex<Vec<(usize, usize)>>>;

struct Running {
    applied: Applied,
    stop: tokio::sync::oneshot::Sender<()>,
    run: tokio::task::JoinHandle<keyorder_core::Result<keyorder_core::RunReport>>,
}

/// Builds (and so declares) `group`'s subscription, then runs it.
async fn start(client: &Client, category: &str, group: &str) -> Running {
    let sub = client
        .subscribe(category, group)
        .ordered_by(KeySource::routing_key())
        .instance_id(format!("{group}-1"))
        .lease(lease())
        .build()
        .await
        .unwrap();
    let applied: Applied = Arc::default();
    let log = applied.clone();
    let handler = move |d: Delivery| {
        let log = log.clone();
        async move {
            let body = String::from_utf8_lossy(d.payload()).into_owned();
            let (k, s) = body.split_once('/').expect("body is key/seq");
            log.lock().unwrap().push((k.parse().unwrap(), s.parse().unwrap()));
            HandlerResult::Ok(())
        }
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(sub.run(handler, async move {
        let _ = stopped.await;
    }));
    Running { applied, stop, run }
}

impl Running {
    async fn stop(self) {
        let _ = self.stop.send(());
        self.run.await.unwrap().unwrap();
    }
}

async fn publish_all(client: &Client, category: &str) {
    let publisher = client.publisher(category).await.unwrap();
    for seq in 0..PER_KEY {
        for k in 0..KEYS {
            publisher
                .publish(Message::new(format!("{k}/{seq}")).with_key(format!("key-{k}")).unwrap())
                .await
                .unwrap();
        }
    }
}

/// Waits (with a deadline) until every group applied every message, then
/// checks each group's per-key order and that nothing ran twice.
async fn every_group_gets_everything(groups: &[(&str, &Running)]) {
    let total = KEYS * PER_KEY;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let counts: Vec<(String, usize)> = groups
            .iter()
            .map(|(g, r)| (g.to_string(), r.applied.lock().unwrap().len()))
            .collect();
        if counts.iter().all(|(_, n)| *n >= total) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "every group must receive all {total} messages; within 30 s they received {counts:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for (g, r) in groups {
        let applied = r.applied.lock().unwrap().clone();
        assert_eq!(applied.len(), total, "group {g}: each message once");
        let mut per_key: HashMap<usize, Vec<usize>> = HashMap::new();
        for (k, s) in applied {
            per_key.entry(k).or_default().push(s);
        }
        for k in 0..KEYS {
            assert_eq!(
                per_key.get(&k).cloned().unwrap_or_default(),
                (0..PER_KEY).collect::<Vec<_>>(),
                "group {g}: key {k} in publish order"
            );
        }
    }
}

async fn two_groups_each_receive_every_message(topology: &str) {
    let url = url(topology);
    let cat = category("groups");
    let consumer = client(&url).await;
    let shipping = start(&consumer, &cat, "shipping").await;
    let billing = start(&consumer, &cat, "billing").await;
    publish_all(&client(&url).await, &cat).await;
    every_group_gets_everything(&[("shipping", &shipping), ("billing", &billing)]).await;
    shipping.stop().await;
    billing.stop().await;
}

/// The regression: two groups on one category competed for one set of
/// queues, so `billing` received what `shipping` did not take.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_groups_on_one_category_each_receive_every_message_hash() {
    two_groups_each_receive_every_message("topology=hash&queues=4").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_groups_on_one_category_each_receive_every_message_sac() {
    two_groups_each_receive_every_message("topology=sac").await;
}

/// A message that no group's queues can take is refused in the `publish`
/// call, with the fix; nothing is stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_no_group_can_receive_fails_in_the_call_naming_the_fix() {
    let cat = category("nogroup");
    let publisher = client(&url("topology=hash&queues=2"))
        .await
        .publisher(&cat)
        .await
        .unwrap();
    let err = publisher
        .publish(Message::new("m").with_key("k").unwrap())
        .await
        .unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, keyorder_core::Error::Config(_)), "{err:?}");
    assert!(text.contains("groups=") && text.contains("not stored"), "{text}");
}

/// `groups=` in a publisher's URL declares those groups before its first
/// publish, so they keep what is published before their first consumer.
/// A group it does not name starts from the messages published after its
/// queues were declared (its first subscription was built).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn groups_named_in_the_url_keep_what_is_published_before_their_first_consumer() {
    let topology = "topology=hash&queues=4";
    let cat = category("declared");
    let producer = client(&format!("{}&groups=shipping,billing", url(topology))).await;
    publish_all(&producer, &cat).await;
    let consumer = client(&url(topology)).await;
    let shipping = start(&consumer, &cat, "shipping").await;
    let billing = start(&consumer, &cat, "billing").await;
    every_group_gets_everything(&[("shipping", &shipping), ("billing", &billing)]).await;

    // `audit` was not named: its queues exist from its first subscription on.
    let audit = start(&consumer, &cat, "audit").await;
    let publisher = producer.publisher(&cat).await.unwrap();
    publisher
        .publish(Message::new("0/0").with_key("after").unwrap())
        .await
        .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while audit.applied.lock().unwrap().is_empty() {
        assert!(tokio::time::Instant::now() < deadline, "audit received nothing");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let wait = tokio::time::Instant::now() + Duration::from_secs(30);
    while shipping.applied.lock().unwrap().len() < KEYS * PER_KEY + 1 {
        assert!(
            tokio::time::Instant::now() < wait,
            "shipping did not receive the later message"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        audit.applied.lock().unwrap().clone(),
        vec![(0, 0)],
        "a new group starts from what is published after its queues were declared"
    );
    for r in [shipping, billing, audit] {
        r.stop().await;
    }
}

#[test]
fn names_of_different_pairs_never_collide() {
    use keyorder_rabbitmq::{Names, Topology};
    let all = |c: &str, g: &str| {
        let n = Names::new(c).unwrap();
        let g = n.group(g).unwrap();
        let mut v = g.queues(Topology::ConsistentHash { queues: 3 });
        v.extend([
            g.sac_queue(),
            g.plain_queue(),
            g.dlq(),
            g.members(),
            g.hash_exchange(),
            g.presence(),
        ]);
        v
    };
    let pairs = [
        ("a.b", "c"),
        ("a", "b.c"),
        ("a", "b"),
        ("a.b", "hash"),
        ("a", "b.hash"),
        ("a.b.c", "g"),
    ];
    let mut seen = std::collections::HashMap::new();
    for (c, g) in pairs {
        for name in all(c, g) {
            if let Some(other) = seen.insert(name.clone(), (c, g)) {
                assert_eq!(other, (c, g), "`{name}` is named by two pairs");
            }
        }
        let n = Names::new(c).unwrap();
        for name in [n.entry(), n.registry(), n.registry_lock()] {
            let other = seen.insert(name.clone(), (c, ""));
            assert!(other.is_none_or(|o| o == (c, "")), "`{name}` collides");
        }
        for legacy in n.legacy_queues() {
            assert!(!seen.contains_key(&legacy), "`{legacy}` is an old-layout name");
        }
    }
    // Names outside the rule are refused, naming it.
    let err = Names::new("a").unwrap().group("b:c").unwrap_err().to_string();
    assert!(err.contains("[A-Za-z0-9._-]"), "{err}");
    assert!(Names::new("a/b").is_err());
    // So is a pair too long for AMQP's 255-byte names.
    let long = "x".repeat(200);
    let err = Names::new(&long)
        .unwrap()
        .group(&"y".repeat(60))
        .unwrap_err()
        .to_string();
    assert!(err.contains("at most 244 bytes together"), "{err}");
    let ok = Names::new(&long).unwrap().group(&"y".repeat(44)).unwrap();
    assert!(ok.hash_queue(1023).len() <= 255);
}

/// A group's topology is recorded with it: declaring the group again with
/// another queue count or another topology is refused with the fix, while
/// another group of the category may choose its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_declared_with_another_topology_is_refused() {
    let cat = category("drift");
    let first = client(&url("topology=hash&queues=4")).await;
    let sub = first
        .subscribe(&cat, "g")
        .ordered_by(KeySource::routing_key())
        .lease(lease())
        .build()
        .await
        .unwrap();
    for other in ["topology=hash&queues=2", "topology=sac"] {
        let err = client(&url(other))
            .await
            .subscribe(&cat, "g")
            .ordered_by(KeySource::routing_key())
            .lease(lease())
            .build()
            .await
            .unwrap_err();
        let text = err.to_string();
        assert!(
            matches!(err, keyorder_core::Error::Config(_)) && text.contains("topology=hash&queues=4"),
            "{other}: {text}"
        );
        // A publisher that would declare it so is refused too.
        let err = client(&format!("{}&groups=g", url(other)))
            .await
            .publisher(&cat)
            .await
            .unwrap_err();
        assert!(err.to_string().contains("topology=hash&queues=4"), "{err}");
    }
    // Another group chooses its own topology.
    let sac = client(&url("topology=sac"))
        .await
        .subscribe(&cat, "h")
        .ordered_by(KeySource::routing_key())
        .lease(lease())
        .build()
        .await
        .unwrap();
    drop((sub, sac));
}

/// Queues of the layout before consumer groups (`{c}.sac`, `{c}.hash.N`,
/// ...) would keep their messages from every group: a category that has
/// them is refused at publish and at subscribe, naming the fix, until
/// `delete_category` (`keyorder delete-queue`) removed them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queues_of_the_layout_before_groups_are_refused_until_deleted() {
    use lapin::options::QueueDeclareOptions;
    use lapin::{Connection, ConnectionProperties};
    let cat = category("legacy");
    let conn = Connection::connect(&base(), ConnectionProperties::default())
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    let durable = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    for q in [format!("{cat}.hash.0"), format!("{cat}.hash.1"), format!("{cat}.dlq")] {
        ch.queue_declare(q.as_str().into(), durable, Default::default())
            .await
            .unwrap();
    }
    let u = format!("{}&groups=g", url("topology=hash&queues=2"));
    let t = RabbitTransport::from_url(&u.parse().unwrap()).await.unwrap();
    let c = Client::new(Arc::new(t.clone()));
    let err = c.publisher(&cat).await.unwrap_err().to_string();
    assert!(
        err.contains("delete-queue") && err.contains(&format!("`{cat}.hash.0`")),
        "{err}"
    );
    let err = c
        .subscribe(&cat, "g")
        .ordered_by(KeySource::routing_key())
        .lease(lease())
        .build()
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("before consumer groups") && err.contains("Drain them"),
        "{err}"
    );

    let gone = t.delete_category(&cat).await.unwrap();
    for q in [format!("{cat}.hash.0"), format!("{cat}.hash.1"), format!("{cat}.dlq")] {
        assert!(gone.contains(&q), "{q} deleted: {gone:?}");
    }
    let publisher = c.publisher(&cat).await.unwrap();
    publisher
        .publish(Message::new("m").with_key("k").unwrap())
        .await
        .unwrap();
    t.delete_category(&cat).await.unwrap();
    let _ = conn.close(200, "done".into()).await;
}

/// `groups` lists every declared group with its live members;
/// `remove_group` is refused while the group runs, deletes only its own
/// queues once it stopped, and an unknown group is `NotFound`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_lists_groups_and_removes_a_stopped_one() {
    use keyorder_core::{Error, GroupInfo};
    let topology = "topology=hash&queues=2";
    let cat = category("admin");
    let t = RabbitTransport::from_url(&url(topology).parse().unwrap())
        .await
        .unwrap();
    let consumer = Client::new(Arc::new(t.clone()));
    let admin = client(&url(topology)).await.admin();
    assert!(admin.groups(&cat).await.unwrap().is_empty(), "no group yet");
    let shipping = start(&consumer, &cat, "shipping").await;
    let billing = start(&consumer, &cat, "billing").await;
    let live = |n: usize| {
        vec![
            GroupInfo {
                name: "billing".into(),
                live_members: n,
            },
            GroupInfo {
                name: "shipping".into(),
                live_members: 1,
            },
        ]
    };
    assert_eq!(admin.groups(&cat).await.unwrap(), live(1));
    // Per group: each group's own queues.
    let scopes = admin.scopes(&cat, "billing").await.unwrap();
    let names = keyorder_rabbitmq::Names::new(&cat).unwrap().group("billing").unwrap();
    assert_eq!(
        scopes.iter().map(|s| s.scope.clone()).collect::<Vec<_>>(),
        (0..2)
            .map(|i| format!("{cat}/{}", names.hash_queue(i)))
            .collect::<Vec<_>>()
    );

    let err = admin.remove_group(&cat, "billing").await.unwrap_err();
    assert!(
        matches!(&err, Error::Config(t) if t.contains("stop its subscriptions")),
        "{err:?}"
    );
    let err = admin.remove_group(&cat, "nope").await.unwrap_err();
    assert!(matches!(err, Error::NotFound(_)), "{err:?}");

    billing.stop().await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while admin.groups(&cat).await.unwrap() != live(0) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "billing never showed 0 live members"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    admin.remove_group(&cat, "billing").await.unwrap();
    assert_eq!(
        admin.groups(&cat).await.unwrap(),
        vec![GroupInfo {
            name: "shipping".into(),
            live_members: 1
        }]
    );
    assert!(matches!(admin.scopes(&cat, "billing").await, Err(Error::NotFound(_))));
    assert!(matches!(
        admin.remove_group(&cat, "billing").await,
        Err(Error::NotFound(_))
    ));
    // The other group keeps receiving everything.
    publish_all(&client(&url(topology)).await, &cat).await;
    every_group_gets_everything(&[("shipping", &shipping)]).await;
    shipping.stop().await;
    t.delete_category(&cat).await.unwrap();
}
