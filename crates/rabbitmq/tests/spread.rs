//! Spreading a backlog over instances by load, on the real RabbitMQ: two
//! deep queues and two shallow ones, and a second instance joining while
//! the first holds them all. A share by count (two queues each) can leave
//! both deep queues with one instance, which then works on alone while the
//! other idles; the leader's plan splits them.

// Shared set-up; this file uses only part of it.
#[allow(dead_code)]
mod common;

use common::base;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use keyorder_core::{Client, Delivery, HandlerResult, KeySource, LeaseConfig, KEY_HEADER};
use keyorder_rabbitmq::Names;
use keyorder_testkit::until;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Connection, ConnectionProperties};

const QUEUES: u16 = 4;

fn url() -> String {
    // consumer_timeout_ms: what scripts/services configures; groups: the
    // publisher declares group `g`'s queues.
    format!(
        "{}?topology=hash&queues={QUEUES}&queue_type=classic&expires_ms=600000&consumer_timeout_ms=3600000&groups=g",
        base()
    )
}

async fn client() -> Client {
    let t = common::connect(&url()).await;
    Client::new(Arc::new(t))
}

/// `(body, instance)` in the order the handlers ran.
type Applied = Arc<Mutex<Vec<(String, String)>>>;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_joining_instance_is_given_a_fair_share_of_the_backlog_not_of_the_queue_count() {
    let category = format!("spread-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let names = Names::new(&category).unwrap().group("g").unwrap();
    let queues: Vec<String> = (0..QUEUES).map(|i| names.hash_queue(i)).collect();
    let members = vec!["a".to_owned(), "b".to_owned()];
    // The deep queues are the two that the count share gives one instance.
    let share = keyorder_core::assign::assign(&members, &queues);
    let deep: Vec<&String> = queues.iter().filter(|q| share[q.as_str()] == "a").collect();
    let shallow: Vec<&String> = queues.iter().filter(|q| share[q.as_str()] == "b").collect();
    assert_eq!((deep.len(), shallow.len()), (2, 2));

    // The library declares group g's topology; the test then fills chosen queues
    // directly (the ring's placement of a key is the broker's), one key per
    // queue, in the format the library publishes.
    let a = client().await;
    a.publisher(&category).await.unwrap();
    let conn = Connection::connect(&base(), ConnectionProperties::default())
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
    let fill = [
        (deep[0], "d0", 600),
        (deep[1], "d1", 600),
        (shallow[0], "s0", 5),
        (shallow[1], "s1", 5),
    ];
    let total: usize = fill.iter().map(|(_, _, n)| n).sum();
    for (queue, key, n) in fill {
        for seq in 0..n {
            let mut headers = FieldTable::default();
            headers.insert(KEY_HEADER.into(), AMQPValue::LongString(key.into()));
            let props = BasicProperties::default()
                .with_headers(headers)
                .with_message_id(format!("{key}-{seq}").into())
                .with_delivery_mode(2);
            ch.basic_publish(
                "".into(),
                queue.as_str().into(),
                BasicPublishOptions::default(),
                format!("{key}-{seq}").as_bytes(),
                props,
            )
            .await
            .unwrap()
            .await
            .unwrap();
        }
    }

    let applied: Applied = Arc::default();
    let start = |client: Client, id: &'static str| {
        let (applied, category) = (applied.clone(), category.clone());
        async move {
            let sub = client
                .subscribe(&category, "g")
                .ordered_by(KeySource::header(KEY_HEADER))
                .instance_id(id)
                .concurrency(4)
                .lease(LeaseConfig {
                    ttl: Duration::from_secs(4),
                    heartbeat: Duration::from_millis(500),
                    margin: Duration::from_millis(1500),
                })
                .build()
                .await
                .unwrap();
            let handler = move |d: Delivery| {
                let applied = applied.clone();
                async move {
                    // Slow enough that the deep queues outlast the join.
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    let body = String::from_utf8_lossy(d.payload()).into_owned();
                    applied.lock().unwrap().push((body, id.to_owned()));
                    HandlerResult::Ok(())
                }
            };
            let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
            let run = tokio::spawn(sub.run(handler, async move {
                let _ = stopped.await;
            }));
            (stop, run)
        }
    };
    let count = |key: &str, by: Option<&str>| {
        applied
            .lock()
            .unwrap()
            .iter()
            .filter(|(b, i)| b.starts_with(&format!("{key}-")) && by.is_none_or(|by| by == i))
            .count()
    };

    // a alone holds every queue and works on both deep ones.
    let (stop_a, run_a) = start(a, "a").await;
    until("a to run both deep keys", Duration::from_secs(90), async || {
        count("d0", None) >= 5 && count("d1", None) >= 5
    })
    .await;
    let (stop_b, run_b) = start(client().await, "b").await;
    until("the whole backlog", Duration::from_secs(90), async || {
        applied.lock().unwrap().len() >= total
    })
    .await;

    let log = applied.lock().unwrap().clone();
    // Each key in order, each message once.
    for (_, key, n) in fill {
        let seqs: Vec<usize> = log
            .iter()
            .filter_map(|(b, _)| b.strip_prefix(&format!("{key}-")).map(|s| s.parse().unwrap()))
            .collect();
        assert_eq!(seqs, (0..n).collect::<Vec<_>>(), "{key}");
    }
    // The deep queues ended with different instances: b took one over.
    let last = |key: &str| {
        log.iter()
            .rev()
            .find(|(b, _)| b.starts_with(&format!("{key}-")))
            .map(|(_, i)| i.clone())
            .unwrap()
    };
    assert_ne!(
        last("d0"),
        last("d1"),
        "both deep queues stayed with one instance (d0 by b: {}, d1 by b: {})",
        count("d0", Some("b")),
        count("d1", Some("b"))
    );
    assert!(
        count("d0", Some("b")) + count("d1", Some("b")) >= 100,
        "b took over a deep queue early"
    );

    for (stop, run) in [(stop_a, run_a), (stop_b, run_b)] {
        let _ = stop.send(());
        run.await.unwrap().unwrap();
    }
}
