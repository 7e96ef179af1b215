//! A halted key is held at the database, on the real server: its later
//! events are neither delivered nor counted as attempts, however many there
//! are, while the other keys of its slot advance; once the halt is recorded,
//! nothing widens to the slot.
//! An operator skip then releases the held events in order.

// Shared set-up; this file uses only part of it.
#[allow(dead_code)]
mod common;

use common::url;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use keyorder_core::{
    Client, Delivery, HandlerError, HandlerResult, HeadAction, KeySource, LeaseConfig, Message, RetryPolicy,
};
use keyorder_postgres::PgConfig;
use keyorder_testkit::until;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_halted_key_is_held_at_the_database_and_its_slot_keeps_going() {
    // One slot: every key shares it, so a halt that widened would stop them all.
    let cfg = PgConfig::from_url(
        &format!("{}?schema=keyorder_hold&slots=1&migrate=true", url())
            .parse()
            .unwrap(),
    )
    .unwrap();
    let client = Client::new(Arc::new(common::connect(cfg.clone()).await));
    let pool = sqlx::PgPool::connect(&cfg.url).await.unwrap();
    let queue = format!("hold-{}", uuid::Uuid::new_v4().simple());
    let publisher = client.publisher(&queue).await.unwrap();
    // The bad key's first event is poison; 30 more follow it, far beyond
    // the per-key depth of 4. Good keys interleave with all of them.
    const BAD_LATER: usize = 30;
    publisher
        .publish(Message::new("poison").with_key("bad").unwrap())
        .await
        .unwrap();
    for seq in 0..BAD_LATER {
        publisher
            .publish(Message::new(format!("{seq}")).with_key("bad").unwrap())
            .await
            .unwrap();
        for key in ["a", "b"] {
            publisher
                .publish(Message::new(format!("{seq}")).with_key(key).unwrap())
                .await
                .unwrap();
        }
    }
    let subscription = client
        .subscribe(&queue, "g")
        .ordered_by(KeySource::routing_key())
        .per_key_depth(4)
        .batch(8)
        .retry(RetryPolicy {
            max_attempts: 1,
            initial_backoff: Duration::from_millis(10),
            max_backoff: Duration::from_millis(10),
        })
        // A lease a loaded machine keeps: a lost one would redeliver what
        // was in flight (at-least-once), which is not what this tests.
        .lease(LeaseConfig {
            ttl: Duration::from_secs(15),
            heartbeat: Duration::from_millis(500),
            margin: Duration::from_secs(5),
        })
        .build()
        .await
        .unwrap();
    let stats = subscription.stats();
    let seen: Arc<Mutex<Vec<(String, String)>>> = Arc::default();
    let log = seen.clone();
    let received = stats.clone();
    let handler = move |d: Delivery| {
        let log = log.clone();
        let received = received.clone();
        async move {
            let body = String::from_utf8_lossy(d.payload()).into_owned();
            let key = d.key().map(|k| k.as_str().to_owned()).unwrap_or_default();
            log.lock().unwrap().push((key, body.clone()));
            if body == "poison" {
                // Fail only once later events are in (the first read takes
                // 8: `bad`'s next ones among them), so some of them wait
                // behind the head when it halts and must go back.
                let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
                while received.received.load(std::sync::atomic::Ordering::Relaxed) < 8 {
                    assert!(
                        tokio::time::Instant::now() < deadline,
                        "timed out waiting for the first read"
                    );
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                return Err(HandlerError::poison("bad message"));
            }
            HandlerResult::Ok(())
        }
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(subscription.run(handler, async move {
        let _ = stopped.await;
    }));
    // At least `n` (a duplicate shows in the exact assertions below).
    let good_done = |seen: &Mutex<Vec<(String, String)>>, n: usize| {
        seen.lock().unwrap().iter().filter(|(k, _)| k != "bad").count() >= n
    };
    let good_count =
        |seen: &Mutex<Vec<(String, String)>>| seen.lock().unwrap().iter().filter(|(k, _)| k != "bad").count();
    let admin = client.admin();
    until(
        "the good keys to finish while `bad` is halted",
        Duration::from_secs(60),
        async || good_done(&seen, 2 * BAD_LATER) && admin.halted(&queue, "g").await.unwrap().len() == 1,
    )
    .await;
    // Once it is halted, as many again arrive: with a per-key depth of 4,
    // a key held in memory would have paused the slot (and with it `a` and
    // `b`) until the halt was resolved.
    for seq in BAD_LATER..2 * BAD_LATER {
        publisher
            .publish(Message::new(format!("{seq}")).with_key("bad").unwrap())
            .await
            .unwrap();
        for key in ["a", "b"] {
            publisher
                .publish(Message::new(format!("{seq}")).with_key(key).unwrap())
                .await
                .unwrap();
        }
    }
    until("the good keys to finish again", Duration::from_secs(60), async || {
        good_done(&seen, 4 * BAD_LATER)
    })
    .await;
    assert_eq!(good_count(&seen), 4 * BAD_LATER, "no good event ran twice");
    // Held: every later `bad` event, none started, none attempted; the
    // slot never paused for it.
    let started_bad: Vec<String> = seen
        .lock()
        .unwrap()
        .iter()
        .filter(|(k, _)| k == "bad")
        .map(|(_, b)| b.clone())
        .collect();
    assert_eq!(started_bad, vec!["poison".to_owned()], "only the head ran");
    let halted = admin.halted(&queue, "g").await.unwrap();
    assert_eq!(halted[0].held, Some(2 * BAD_LATER as u64), "every later event is held");
    let attempts: i64 = sqlx::query_scalar(
        "select count(*) from keyorder_hold.attempts a join keyorder_hold.events e on e.id = a.event_id \
         where e.queue = $1 and e.key = 'bad' and e.payload <> 'poison'::bytea",
    )
    .bind(&queue)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(attempts, 0, "held events are not counted as attempts");
    assert!(
        stats.snapshot().handed_back > 0,
        "the bad key's waiting messages went back to the database"
    );
    // The operator skips the head: the held events run, in order.
    admin.resolve(&queue, "g", "bad", HeadAction::Skip).await.unwrap();
    until("the held events to run", Duration::from_secs(60), async || {
        seen.lock().unwrap().iter().filter(|(k, _)| k == "bad").count() > 2 * BAD_LATER
    })
    .await;
    let bad: Vec<String> = seen
        .lock()
        .unwrap()
        .iter()
        .filter(|(k, b)| k == "bad" && b != "poison")
        .map(|(_, b)| b.clone())
        .collect();
    let want: Vec<String> = (0..2 * BAD_LATER).map(|n| n.to_string()).collect();
    assert_eq!(bad, want, "released in order, each once");
    until("nothing halted", Duration::from_secs(60), async || {
        admin.halted(&queue, "g").await.unwrap().is_empty()
    })
    .await;
    let _ = stop.send(());
    run.await.unwrap().unwrap();
    // Each good event ran once (a rewind re-reads, it does not redeliver).
    assert_eq!(good_count(&seen), 4 * BAD_LATER, "good keys ran exactly once each");
}
