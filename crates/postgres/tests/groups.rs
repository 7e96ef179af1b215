//! Several consumer groups on one queue, on the real server: a stopped group
//! keeps every event it has not passed while another group consumes and
//! retention deletes; a new group starts at the oldest retained event, even
//! when it is created while a retention statement runs; the groups are
//! listed, and one is removed only while nothing of it is live, after which
//! retention no longer waits for it.

// Not every helper of the shared set-up is used here.
#[allow(dead_code)]
mod common;

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use keyorder_core::raw::Room;
use keyorder_core::{Error, Inbound, KeyRules, LeaseConfig, Message, SourceSpec, Transport, TransportSource};
use keyorder_postgres::PgTransport;
use sqlx::AssertSqlSafe;

fn spec(queue: &str, group: &str) -> SourceSpec {
    SourceSpec {
        category: queue.to_owned(),
        correlated: Vec::new(),
        group: group.to_owned(),
        instance: format!("{group}-i1"),
        ordered: true,
        lease: LeaseConfig {
            ttl: Duration::from_secs(10),
            heartbeat: Duration::from_millis(200),
            margin: Duration::from_secs(2),
        },
        key_rules: KeyRules::default(),
    }
}

fn queue(name: &str) -> String {
    format!("groups-{name}-{}", uuid::Uuid::new_v4().simple())
}

const KEYS: [&str; 4] = ["a", "b", "c", "d"];

/// Publishes `seqs` of every key (payload `key/seq`), key by key within a seq.
async fn publish(t: &PgTransport, queue: &str, seqs: std::ops::Range<u32>) {
    let p = t.publisher(queue).await.unwrap();
    for seq in seqs {
        for key in KEYS {
            p.publish(Message::new(format!("{key}/{seq}")).with_key(key).unwrap())
                .await
                .unwrap();
        }
    }
}

fn body(d: &Inbound) -> (String, u32) {
    let text = String::from_utf8_lossy(d.message.payload()).into_owned();
    let (key, seq) = text.split_once('/').unwrap();
    (key.to_owned(), seq.parse().unwrap())
}

async fn ack_all(got: &[Inbound]) {
    for d in got {
        d.settle.begin_attempt().await.unwrap();
        d.settle.ack().await.unwrap();
    }
}

/// Per key, the sequence numbers in delivery order.
fn per_key(got: &[Inbound]) -> BTreeMap<String, Vec<u32>> {
    let mut out: BTreeMap<String, Vec<u32>> = BTreeMap::new();
    for d in got {
        let (key, seq) = body(d);
        out.entry(key).or_default().push(seq);
    }
    out
}

/// Nothing more arrives within a few polls (after an exact count was taken).
async fn nothing_more(source: &mut Box<dyn TransportSource>) {
    for _ in 0..3 {
        source.maintain().await.unwrap();
        let more = source
            .fetch(&Room::up_to(100), Duration::from_millis(100))
            .await
            .unwrap();
        assert!(more.is_empty(), "{} deliveries more than expected", more.len());
    }
}

async fn count(pool: &sqlx::PgPool, sql: String, queue: &str) -> i64 {
    sqlx::query_scalar(AssertSqlSafe(sql))
        .bind(queue)
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_group_keeps_every_event_while_another_consumes_and_retention_deletes() {
    let schema = "keyorder_groups";
    // Small retention batches: retention runs many times meanwhile.
    let cfg = keyorder_postgres::PgConfig::from_url(
        &format!(
            "{}?schema={schema}&slots=2&migrate=true&retention_batch=7",
            common::url()
        )
        .parse()
        .unwrap(),
    )
    .unwrap();
    let t = common::connect(cfg).await;
    let pool = sqlx::PgPool::connect(&common::url()).await.unwrap();
    let admin = t.admin();
    let q = queue("stopped");
    // Three groups subscribe before anything is published: `fast` keeps
    // consuming, `paused` consumes a little and stops, `idle` subscribes
    // once and stops without consuming anything.
    let mut fast = t.open(&spec(&q, "fast")).await.unwrap();
    let mut paused = t.open(&spec(&q, "paused")).await.unwrap();
    let mut idle = t.open(&spec(&q, "idle")).await.unwrap();
    idle.close().await.unwrap();
    drop(idle);
    publish(&t, &q, 0..25).await;
    let total = 25 * KEYS.len();
    let first = common::take(&mut paused, 10).await;
    ack_all(&first).await;
    paused.close().await.unwrap();
    drop(paused);
    let acked_by_paused: HashSet<(String, u32)> = first.iter().map(body).collect();
    // `fast` consumes everything, and its cursors reach the end.
    let all = common::take(&mut fast, total).await;
    ack_all(&all).await;
    assert!(per_key(&all).values().all(|s| s.windows(2).all(|w| w[0] < w[1])));

    let mut groups = admin.groups(&q).await.unwrap();
    groups.sort_by(|a, b| a.name.cmp(&b.name));
    let listed: Vec<(&str, usize)> = groups.iter().map(|g| (g.name.as_str(), g.live_members)).collect();
    assert_eq!(listed, vec![("fast", 1), ("idle", 0), ("paused", 0)]);
    // Removal is refused while the group runs, and for a group never seen.
    match admin.remove_group(&q, "fast").await {
        Err(Error::Config(msg)) => assert!(msg.contains("stop its subscriptions"), "{msg}"),
        other => panic!("removing a running group: {other:?}"),
    }
    assert!(matches!(
        admin.remove_group(&q, "nobody").await,
        Err(Error::NotFound(_))
    ));

    // `idle` holds every event (its cursors are at the start): nothing goes
    // while it is recorded. Removed, retention waits for `paused` only.
    let below_paused = format!(
        "select count(*) from {schema}.events e join {schema}.slots s on s.queue = e.queue \
         and s.grp = 'paused' and s.slot = e.slot where e.queue = $1 \
         and (e.txid, e.id) <= (s.cursor_txid, s.cursor_id)"
    );
    let passed = count(&pool, below_paused.clone(), &q).await;
    assert!(
        passed > 0,
        "the stopped group's cursors moved over what it acknowledged"
    );
    let events = format!("select count(*) from {schema}.events where queue = $1");
    assert_eq!(
        count(&pool, events.clone(), &q).await,
        total as i64,
        "nothing goes while a group that never consumed is recorded"
    );
    admin.remove_group(&q, "idle").await.unwrap();
    let names: Vec<String> = admin.groups(&q).await.unwrap().into_iter().map(|g| g.name).collect();
    assert_eq!(names, vec!["fast".to_owned(), "paused".to_owned()]);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while count(&pool, below_paused.clone(), &q).await > 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "retention did not delete what every group passed"
        );
        fast.maintain().await.unwrap();
        fast.fetch(&Room::up_to(10), Duration::from_millis(50)).await.unwrap();
    }
    assert_eq!(
        count(&pool, events, &q).await,
        total as i64 - passed,
        "retention deleted exactly what the stopped group had passed"
    );

    // The stopped group comes back: every event it did not acknowledge, in
    // per-key order, each once.
    let mut paused = t.open(&spec(&q, "paused")).await.unwrap();
    let rest = common::take(&mut paused, total - first.len()).await;
    nothing_more(&mut paused).await;
    let mut want: HashSet<(String, u32)> = KEYS
        .iter()
        .flat_map(|k| (0..25).map(move |s| (k.to_string(), s)))
        .collect();
    want.retain(|e| !acked_by_paused.contains(e));
    let got: HashSet<(String, u32)> = rest.iter().map(body).collect();
    assert_eq!(
        got, want,
        "the stopped group receives every event it had not acknowledged"
    );
    for (key, seqs) in per_key(&rest) {
        assert!(seqs.windows(2).all(|w| w[0] < w[1]), "key {key}: {seqs:?}");
    }
    ack_all(&rest).await;
    paused.close().await.unwrap();
    fast.close().await.unwrap();
}

/// Connections of `schema`'s consumers waiting on a lock in a statement
/// that starts with `prefix`.
async fn waiting(pool: &sqlx::PgPool, prefix: &str) -> i64 {
    sqlx::query_scalar("select count(*) from pg_stat_activity where wait_event_type = 'Lock' and query like $1 || '%'")
        .bind(prefix)
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_group_starts_at_the_oldest_retained_event_even_during_retention() {
    let schema = "keyorder_groups_new";
    let t = common::transport(schema, 1).await;
    let pool = sqlx::PgPool::connect(&common::url()).await.unwrap();
    let q = queue("new");
    let mut old = t.open(&spec(&q, "old")).await.unwrap();
    publish(&t, &q, 0..5).await;
    // A transaction of the test holds one of those events, so the
    // retention statement that deletes them waits (with its snapshot
    // taken, when it takes one before the lock).
    let mut hold = pool.begin().await.unwrap();
    sqlx::query(AssertSqlSafe(format!(
        "select 1 from {schema}.events where queue = $1 order by id desc limit 1 for update"
    )))
    .bind(&q)
    .execute(&mut *hold)
    .await
    .unwrap();
    let passed = common::take(&mut old, 20).await;
    ack_all(&passed).await;
    // `old`'s cursor passes them; its retention then waits on the held row.
    let delete = format!("delete from {schema}.events");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while waiting(&pool, &delete).await == 0 {
        assert!(tokio::time::Instant::now() < deadline, "retention never ran");
        old.maintain().await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Later events: no group has passed them.
    publish(&t, &q, 5..8).await;
    // A new group is created meanwhile. Either its creation waits for the
    // retention statement, or (the defect) it starts reading at once.
    let opening = tokio::spawn({
        let t = t.clone();
        let s = spec(&q, "new");
        async move { t.open(&s).await.unwrap() }
    });
    // (`waiting` matches a `like` pattern: any locking read of the row.)
    let lock = format!("select % from {schema}.queues");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while !opening.is_finished() && waiting(&pool, &lock).await == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the new group neither opened nor waited"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut early = Vec::new();
    if opening.is_finished() {
        // Reads ahead of the retention statement, which then deletes what
        // lies after those first events.
        let mut new = opening.await.unwrap();
        early = common::take(&mut new, 3).await;
        hold.rollback().await.unwrap();
        let events = format!("select count(*) from {schema}.events where queue = $1");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        while count(&pool, events.clone(), &q).await > 12 {
            assert!(tokio::time::Instant::now() < deadline, "retention never finished");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        early.extend(common::take(&mut new, 12).await);
        let _ = new.close().await;
    } else {
        hold.rollback().await.unwrap();
        let mut new = opening.await.unwrap();
        early.extend(common::take(&mut new, 12).await);
        nothing_more(&mut new).await;
        new.close().await.unwrap();
    }
    // Whatever the new group started with, it is a suffix of the log
    // with no hole: here, the 12 events no group had passed.
    let got: Vec<(String, u32)> = early.iter().map(body).collect();
    let want: Vec<(String, u32)> = (5..8)
        .flat_map(|seq| KEYS.iter().map(move |k| (k.to_string(), seq)))
        .collect();
    assert_eq!(
        got, want,
        "a new group reads the retained events, in order, with no hole"
    );
    old.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_whose_member_died_is_removed_once_its_lease_expired() {
    let schema = "keyorder_groups_dead";
    let t = common::transport(schema, 2).await;
    let pool = sqlx::PgPool::connect(&common::url()).await.unwrap();
    let admin = t.admin();
    let q = queue("dead");
    let mut s = spec(&q, "gone");
    s.lease = LeaseConfig {
        ttl: Duration::from_secs(2),
        heartbeat: Duration::from_millis(200),
        margin: Duration::from_millis(500),
    };
    // The member owns both slots, then dies without leaving.
    let source = t.open(&s).await.unwrap();
    drop(source);
    let listed = admin.groups(&q).await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!((listed[0].name.as_str(), listed[0].live_members), ("gone", 1));
    assert!(matches!(admin.remove_group(&q, "gone").await, Err(Error::Config(_))));
    // Once its member and leases expired (the database's clock), it goes.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        match admin.remove_group(&q, "gone").await {
            Ok(()) => break,
            Err(Error::Config(_)) => {
                assert!(tokio::time::Instant::now() < deadline, "never removable");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert!(admin.groups(&q).await.unwrap().is_empty());
    let rows = format!("select count(*) from {schema}.slots where queue = $1");
    assert_eq!(count(&pool, rows, &q).await, 0, "its slot rows (and cursors) are gone");
    assert!(matches!(admin.remove_group(&q, "gone").await, Err(Error::NotFound(_))));
}
