//! The PostgreSQL event log against the real server (POSTGRES_URL, or the
//! loopback default `scripts/services` starts).

use keyorder_testkit::pglog::PgEventLog;
use keyorder_testkit::{EventLog, EventStart};

fn url() -> String {
    std::env::var("POSTGRES_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_round_trip_with_the_database_clock() {
    let run = format!("pglog-{}", uuid::Uuid::new_v4().simple());
    let log = PgEventLog::connect(&url(), &run)
        .await
        .expect("PostgreSQL must be reachable");
    let other = PgEventLog::connect(&url(), &format!("{run}-other")).await.unwrap();
    let before = log.now().await.unwrap();
    let start = |seq| EventStart {
        message_id: format!("m{seq}"),
        key: "k".into(),
        seq,
        instance: "i1".into(),
        generation: 3,
    };
    let a = log.start(start(0)).await.unwrap();
    let b = log.start(start(1)).await.unwrap();
    other.start(start(9)).await.unwrap();
    log.end(a, true).await.unwrap();
    log.end(b, false).await.unwrap();
    let open = log.start(start(2)).await.unwrap();
    let events = log.events().await.unwrap();
    assert_eq!(events.len(), 3, "only this run's events");
    assert_eq!(events.iter().map(|e| e.seq).collect::<Vec<_>>(), vec![0, 1, 2]);
    assert!(events[0].ok && !events[1].ok && events[2].end.is_none());
    assert_eq!(events[0].generation, 3);
    assert!(events.iter().all(|e| e.start >= before));
    assert!(events[0].end.unwrap() >= events[0].start);
    let _ = open;
}
