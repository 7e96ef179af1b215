//! Removing a consumer group (`Admin::remove_group`) against members that
//! start, stall or settle at the same time, on the real server: a starting
//! member is seen (removal is refused), a stalled member of a removed group
//! stops with an error naming the removal, generations never go back when
//! the group is created again, a settlement or read in flight leaves no
//! rows behind the removal, and a removal blocked by one fails in bounded
//! time.

// Not every helper of the shared set-up is used here.
#[allow(dead_code)]
mod common;

use std::time::Duration;

use keyorder_core::raw::Room;
use keyorder_core::{Error, KeyRules, LeaseConfig, Message, SourceSpec, Transport};
use keyorder_postgres::PgTransport;
use keyorder_testkit::until;
use sqlx::AssertSqlSafe;

/// A member `instance` of group `g` of `queue`, with a 2 s lease.
fn spec(queue: &str, instance: &str) -> SourceSpec {
    SourceSpec {
        category: queue.to_owned(),
        correlated: Vec::new(),
        group: "g".to_owned(),
        instance: instance.to_owned(),
        ordered: true,
        lease: LeaseConfig {
            ttl: Duration::from_secs(2),
            heartbeat: Duration::from_millis(200),
            margin: Duration::from_millis(500),
        },
        key_rules: KeyRules::default(),
    }
}

fn queue(name: &str) -> String {
    format!("removal-{name}-{}", uuid::Uuid::new_v4().simple())
}

/// How long each poll of these tests waits.
const WAIT: Duration = Duration::from_secs(60);

fn deadline(secs: u64) -> tokio::time::Instant {
    tokio::time::Instant::now() + Duration::from_secs(secs)
}

/// Backends waiting on a lock in a statement that names `schema`.
async fn lock_waiters(pool: &sqlx::PgPool, schema: &str) -> i64 {
    sqlx::query_scalar(
        "select count(*) from pg_stat_activity where wait_event_type = 'Lock' and query like '%' || $1 || '.%'",
    )
    .bind(schema)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Polls until at least `n` statements naming `schema` wait on a lock.
async fn until_waiting(pool: &sqlx::PgPool, schema: &str, n: i64, what: &str) {
    until(&format!("{what} to wait on a lock"), WAIT, async || {
        lock_waiters(pool, schema).await >= n
    })
    .await;
}

/// Polls until no member or slot lease of group `g` is live (the
/// database's clock).
async fn until_expired(t: &PgTransport, queue: &str) {
    let admin = t.admin();
    until("the member's lease to expire", WAIT, async || {
        let members: usize = admin.groups(queue).await.unwrap().iter().map(|g| g.live_members).sum();
        let owned = admin
            .scopes(queue, "g")
            .await
            .unwrap()
            .iter()
            .filter(|s| s.owner.is_some())
            .count();
        members == 0 && owned == 0
    })
    .await;
}

/// Polls `remove_group` until the group's members and leases expired:
/// `Ok` once removed.
async fn remove_once_expired(t: &PgTransport, queue: &str) {
    let admin = t.admin();
    until("the group to be removable", WAIT, async || {
        match admin.remove_group(queue, "g").await {
            Ok(()) => Ok(()),
            Err(Error::Config(msg)) if msg.contains("is running") => Err(format!("never removable: {msg}")),
            Err(e) => panic!("removing the group: {e}"),
        }
    })
    .await;
}

async fn count(pool: &sqlx::PgPool, sql: String, queue: &str) -> i64 {
    sqlx::query_scalar(AssertSqlSafe(sql))
        .bind(queue)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// The group's rows left in each table that holds rows of a group.
async fn leftovers(pool: &sqlx::PgPool, schema: &str, queue: &str) -> Vec<(&'static str, i64)> {
    let mut out = Vec::new();
    for table in [
        "acked",
        "attempts",
        "halted",
        "dead",
        "read_marks",
        "members",
        "slots",
        "groups",
    ] {
        let sql = format!("select count(*) from {schema}.{table} where queue = $1 and grp = 'g'");
        let n = count(pool, sql, queue).await;
        if n > 0 {
            out.push((table, n));
        }
    }
    out
}

fn config_removed(r: Result<Vec<keyorder_core::SourceEvent>, Error>, what: &str) {
    match r {
        Err(Error::Config(msg)) => assert!(
            msg.contains("removed by an operator") && msg.contains("keyorder groups remove"),
            "{what}: {msg}"
        ),
        Err(e) => panic!("{what}: expected a configuration error naming the removal, got {e}"),
        Ok(_) => panic!("{what}: the member of a removed group went on silently"),
    }
}

/// A member that is starting (its group created, its first heartbeat not
/// yet written) is a member: removing the group meanwhile is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_is_not_removed_under_a_member_that_is_starting() {
    let schema = "keyorder_removal_start";
    let t = common::transport(schema, 2).await;
    let pool = sqlx::PgPool::connect(&common::url()).await.unwrap();
    let q = queue("start");
    // The member's first write to the members table waits behind this lock.
    let mut hold = pool.begin().await.unwrap();
    sqlx::query(AssertSqlSafe(format!("lock table {schema}.members in exclusive mode")))
        .execute(&mut *hold)
        .await
        .unwrap();
    let opening = tokio::spawn({
        let (t, s) = (t.clone(), spec(&q, "a"));
        async move { t.open(&s).await }
    });
    until_waiting(&pool, schema, 1, "the starting member").await;
    let removing = tokio::spawn({
        let admin = t.admin();
        let q = q.clone();
        async move { admin.remove_group(&q, "g").await }
    });
    // The removal runs until it finishes or waits (on the member's queue
    // row, or on the lock above).
    until("the removal to finish or wait", WAIT, async || {
        removing.is_finished() || lock_waiters(&pool, schema).await >= 2
    })
    .await;
    hold.rollback().await.unwrap();
    let removed = removing.await.unwrap();
    let mut source = opening.await.unwrap().expect("the member starts");
    match removed {
        Err(Error::Config(msg)) => assert!(msg.contains("stop its subscriptions"), "{msg}"),
        other => panic!("removing a group while its member starts: {other:?}"),
    }
    let groups = t.admin().groups(&q).await.unwrap();
    assert_eq!(groups.len(), 1);
    assert_eq!(groups[0].live_members, 1);
    source.maintain().await.unwrap();
    source.close().await.unwrap();
}

/// A member that stalled past its lease while its group was removed stops
/// at its next step with an error naming the removal, also when the group
/// was created again meanwhile; it never runs on reading nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_member_of_a_removed_group_stops_with_an_error() {
    let t = common::transport("keyorder_removal_stall", 2).await;
    // Removed.
    let q = queue("stall");
    let mut stalled = t.open(&spec(&q, "a")).await.unwrap();
    remove_once_expired(&t, &q).await;
    config_removed(stalled.maintain().await, "removed");
    let _ = stalled.close().await;
    // Removed and created again by a member of the same name (a restarted
    // pod): the stalled one stops, and closing it leaves the new member's
    // leases alone.
    let q = queue("again");
    let mut stalled = t.open(&spec(&q, "a")).await.unwrap();
    remove_once_expired(&t, &q).await;
    let mut fresh = t.open(&spec(&q, "a")).await.unwrap();
    let owned =
        |scopes: Vec<keyorder_core::ScopeInfo>| scopes.into_iter().map(|s| (s.owner, s.generation)).collect::<Vec<_>>();
    let before = owned(t.admin().scopes(&q, "g").await.unwrap());
    assert!(
        before.iter().all(|(owner, _)| owner.as_deref() == Some("a")),
        "{before:?}"
    );
    config_removed(stalled.maintain().await, "removed and created again");
    stalled.close().await.unwrap();
    assert_eq!(
        owned(t.admin().scopes(&q, "g").await.unwrap()),
        before,
        "closing the stopped member released the new member's leases"
    );
    fresh.maintain().await.unwrap();
    fresh.close().await.unwrap();
}

/// A group removed and created again hands out higher generations than
/// the removed one did: a stale handler of the removed group (same
/// instance name) is fenced, and the new group gets its event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generations_never_go_back_when_a_group_is_removed_and_created_again() {
    let t = common::transport("keyorder_removal_gen", 1).await;
    let q = queue("gen");
    let mut old = t.open(&spec(&q, "a")).await.unwrap();
    let p = t.publisher(&q).await.unwrap();
    p.publish(Message::new("k/0").with_key("k").unwrap()).await.unwrap();
    let stale = common::one(&mut old).await;
    stale.settle.begin_attempt().await.unwrap();
    let old_generation = stale.lease.generation();
    // The member stalls; its group is removed and started again under the
    // same instance name (a restarted pod).
    remove_once_expired(&t, &q).await;
    let mut new = t.open(&spec(&q, "a")).await.unwrap();
    let scopes = t.admin().scopes(&q, "g").await.unwrap();
    assert!(
        scopes.iter().all(|s| s.generation > old_generation),
        "the new group's generations {:?} are not above the removed group's {old_generation}",
        scopes.iter().map(|s| s.generation).collect::<Vec<_>>()
    );
    match stale.settle.ack().await {
        Err(Error::Fenced { .. }) => {}
        other => panic!("a stale handler of the removed group settled in the new one: {other:?}"),
    }
    let fresh = common::one(&mut new).await;
    assert_eq!(&fresh.message.payload()[..], b"k/0");
    assert!(fresh.lease.generation() > old_generation);
    fresh.settle.begin_attempt().await.unwrap();
    fresh.settle.ack().await.unwrap();
    new.close().await.unwrap();
    drop(old);
}

/// What stalls a statement of the member after it passed the fence: an
/// uncommitted row of the test on the key the statement writes.
enum Stall {
    /// An acknowledgement (its `acked` row).
    Ack,
    /// A read (its slot's read mark).
    Read,
}

/// A settlement or read that passed the fence and commits late: the
/// removal waits for it (it holds the slot row), so none of its rows
/// outlive the group.
async fn removal_leaves_no_rows_of_a_late_statement(stall: Stall, schema: &str) {
    let t = common::transport(schema, 1).await;
    let pool = sqlx::PgPool::connect(&common::url()).await.unwrap();
    let q = queue("late");
    let mut source = t.open(&spec(&q, "a")).await.unwrap();
    let p = t.publisher(&q).await.unwrap();
    p.publish(Message::new("k/0").with_key("k").unwrap()).await.unwrap();
    let mut hold = pool.begin().await.unwrap();
    let mut kept = None;
    let blocked = match stall {
        Stall::Ack => {
            let d = common::one(&mut source).await;
            d.settle.begin_attempt().await.unwrap();
            let event: i64 = count(
                &pool,
                format!("select max(id) from {schema}.events where queue = $1"),
                &q,
            )
            .await;
            sqlx::query(AssertSqlSafe(format!(
                "insert into {schema}.acked (queue, grp, slot, event_id, txid) values ($1, 'g', 0, $2, '1')"
            )))
            .bind(&q)
            .bind(event)
            .execute(&mut *hold)
            .await
            .unwrap();
            kept = Some(source);
            tokio::spawn(async move { d.settle.ack().await.map(|()| 1) })
        }
        Stall::Read => {
            sqlx::query(AssertSqlSafe(format!(
                "insert into {schema}.read_marks (queue, grp, slot, read_txid, read_id) values ($1, 'g', 0, '1', 1)"
            )))
            .bind(&q)
            .execute(&mut *hold)
            .await
            .unwrap();
            // Reads until a read returns the event (it then moves the
            // slot's read mark, and waits on the row above).
            tokio::spawn(async move {
                loop {
                    source.maintain().await?;
                    let got = source.fetch(&Room::up_to(10), Duration::from_millis(100)).await?;
                    if !got.is_empty() {
                        return Ok(got.len());
                    }
                }
            })
        }
    };
    until_waiting(&pool, schema, 1, "the late statement").await;
    // Its lease expires meanwhile; the removal then either goes through
    // or waits for it.
    until_expired(&t, &q).await;
    let admin = t.admin();
    let end = deadline(60);
    let removing = loop {
        let removing = tokio::spawn({
            let (admin, q) = (admin.clone(), q.clone());
            async move { admin.remove_group(&q, "g").await }
        });
        while !removing.is_finished() && lock_waiters(&pool, schema).await < 2 {
            assert!(
                tokio::time::Instant::now() < end,
                "the removal neither finished nor waited"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if !removing.is_finished() {
            break removing;
        }
        match removing.await.unwrap() {
            Err(Error::Config(msg)) if msg.contains("is running") => {
                assert!(tokio::time::Instant::now() < end, "never removable: {msg}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            done => break tokio::spawn(async move { done }),
        }
    };
    hold.rollback().await.unwrap();
    let late = blocked.await.unwrap();
    removing.await.unwrap().expect("the group is removed");
    assert!(late.is_ok(), "the late statement: {late:?}");
    let left = leftovers(&pool, schema, &q).await;
    assert!(left.is_empty(), "rows of the removed group left behind: {left:?}");
    drop(kept);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removal_leaves_no_rows_of_a_late_acknowledgement() {
    removal_leaves_no_rows_of_a_late_statement(Stall::Ack, "keyorder_removal_late_ack").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removal_leaves_no_rows_of_a_late_read() {
    removal_leaves_no_rows_of_a_late_statement(Stall::Read, "keyorder_removal_late_read").await;
}

/// A settlement stalled with the slot row share-locked: the removal gives
/// up within its lock timeout with an error that says why, rather than
/// holding the queue's row (retention, new groups) for as long as the
/// settlement stalls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removal_blocked_by_a_stalled_settlement_fails_in_bounded_time() {
    let schema = "keyorder_removal_timeout";
    let t = common::transport(schema, 1).await;
    let pool = sqlx::PgPool::connect(&common::url()).await.unwrap();
    let q = queue("timeout");
    let mut source = t.open(&spec(&q, "a")).await.unwrap();
    let p = t.publisher(&q).await.unwrap();
    p.publish(Message::new("k/0").with_key("k").unwrap()).await.unwrap();
    let d = common::one(&mut source).await;
    d.settle.begin_attempt().await.unwrap();
    let event: i64 = count(
        &pool,
        format!("select max(id) from {schema}.events where queue = $1"),
        &q,
    )
    .await;
    let mut hold = pool.begin().await.unwrap();
    sqlx::query(AssertSqlSafe(format!(
        "insert into {schema}.acked (queue, grp, slot, event_id, txid) values ($1, 'g', 0, $2, '1')"
    )))
    .bind(&q)
    .bind(event)
    .execute(&mut *hold)
    .await
    .unwrap();
    let acking = tokio::spawn(async move { d.settle.ack().await });
    until_waiting(&pool, schema, 1, "the stalled acknowledgement").await;
    until_expired(&t, &q).await;
    let admin = t.admin();
    let end = deadline(60);
    let msg = loop {
        let removing = tokio::spawn({
            let (admin, q) = (admin.clone(), q.clone());
            async move { admin.remove_group(&q, "g").await }
        });
        while !removing.is_finished() {
            assert!(
                tokio::time::Instant::now() < end,
                "the removal waited on the stalled settlement without bound"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        match removing.await.unwrap() {
            Err(Error::Config(msg)) if msg.contains("is running") => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(Error::Config(msg)) => break msg,
            other => panic!("removing under a stalled settlement: {other:?}"),
        }
    };
    assert!(msg.contains("settlement") && msg.contains("try again"), "{msg}");
    hold.rollback().await.unwrap();
    acking.await.unwrap().unwrap();
    source.close().await.unwrap();
    admin.remove_group(&q, "g").await.unwrap();
}

/// A queue deleted between a member's slot count check and its group's
/// creation: the group is created with its queue's row (which retention
/// and the group lifecycle lock), never without one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_is_never_created_without_its_queue_row() {
    let schema = "keyorder_removal_queue";
    let t = common::transport(schema, 2).await;
    let pool = sqlx::PgPool::connect(&common::url()).await.unwrap();
    let q = queue("queue");
    t.publisher(&q).await.unwrap();
    // The test takes the queue's row; the member's group creation waits
    // for it; the test deletes the row (as `delete_queue` does) and commits.
    let mut hold = pool.begin().await.unwrap();
    sqlx::query(AssertSqlSafe(format!(
        "select 1 from {schema}.queues where queue = $1 for update"
    )))
    .bind(&q)
    .execute(&mut *hold)
    .await
    .unwrap();
    let opening = tokio::spawn({
        let (t, s) = (t.clone(), spec(&q, "a"));
        async move { t.open(&s).await }
    });
    until_waiting(&pool, schema, 1, "the group's creation").await;
    sqlx::query(AssertSqlSafe(format!("delete from {schema}.queues where queue = $1")))
        .bind(&q)
        .execute(&mut *hold)
        .await
        .unwrap();
    hold.commit().await.unwrap();
    let mut source = opening.await.unwrap().expect("the member starts");
    let slots = count(
        &pool,
        format!("select coalesce(max(slots), 0)::bigint from {schema}.queues where queue = $1"),
        &q,
    )
    .await;
    assert_eq!(slots, 2, "the group was created without its queue's row");
    source.close().await.unwrap();
}

/// A member row whose lease TTL is near `i64::MAX` milliseconds (any
/// value a heartbeat may record) neither breaks the group listing nor
/// the removal check: it counts as live.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_huge_member_ttl_counts_as_live() {
    let schema = "keyorder_removal_ttl";
    let t = common::transport(schema, 1).await;
    let pool = sqlx::PgPool::connect(&common::url()).await.unwrap();
    let q = queue("ttl");
    let mut source = t.open(&spec(&q, "a")).await.unwrap();
    source.close().await.unwrap();
    sqlx::query(AssertSqlSafe(format!(
        "insert into {schema}.members (queue, grp, member, last_seen, ttl_ms) \
         values ($1, 'g', 'forever', clock_timestamp(), $2)"
    )))
    .bind(&q)
    .bind(i64::MAX)
    .execute(&pool)
    .await
    .unwrap();
    let admin = t.admin();
    let groups = admin.groups(&q).await.expect("groups listed");
    assert_eq!(groups.len(), 1);
    assert_eq!(groups[0].live_members, 1);
    match admin.remove_group(&q, "g").await {
        Err(Error::Config(msg)) => assert!(msg.contains("is running"), "{msg}"),
        other => panic!("removing a group with a live member: {other:?}"),
    }
}

/// A member whose group's slot rows are gone (its group row left, as by
/// a hand-made deletion) stops with the same error at its next step,
/// rather than wait for slots that no longer exist.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_whose_slot_rows_are_gone_stops_with_an_error() {
    let schema = "keyorder_removal_slots";
    let t = common::transport(schema, 2).await;
    let pool = sqlx::PgPool::connect(&common::url()).await.unwrap();
    let q = queue("slots");
    let mut source = t.open(&spec(&q, "a")).await.unwrap();
    sqlx::query(AssertSqlSafe(format!("delete from {schema}.slots where queue = $1")))
        .bind(&q)
        .execute(&pool)
        .await
        .unwrap();
    let stopped = until(
        "the member to stop without its slot rows",
        WAIT,
        async || match source.maintain().await {
            Ok(_) => {
                source
                    .fetch(&Room::up_to(10), Duration::from_millis(100))
                    .await
                    .unwrap();
                None
            }
            r => Some(r),
        },
    )
    .await;
    config_removed(stopped, "slot rows gone")
}
