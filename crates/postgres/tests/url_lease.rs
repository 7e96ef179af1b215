//! `lease_ttl_ms` in the URL is the lease of a subscription whose builder
//! sets none, on the real server: the member row records that TTL and the
//! slot lease rows expire that long after their last renewal.

// Shared set-up; this file uses only part of it.
#[allow(dead_code)]
mod common;

use std::sync::Arc;
use std::time::Duration;

use keyorder_core::{Client, Delivery, HandlerResult, KeySource, LeaseConfig};
use keyorder_postgres::PgConfig;

/// The schema (written out in the queries too: sqlx takes literal SQL only).
const SCHEMA: &str = "keyorder_url_lease";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_url_lease_ttl_is_what_the_rows_record() {
    let cfg = PgConfig::from_url(
        &format!(
            "{}?schema={SCHEMA}&slots=4&migrate=true&lease_ttl_ms=37000",
            common::url()
        )
        .parse()
        .unwrap(),
    )
    .unwrap();
    assert_eq!(cfg.lease, Some(LeaseConfig::from_ttl(Duration::from_secs(37))));
    let client = Client::new(Arc::new(common::connect(cfg).await));
    let queue = format!("url-lease-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let sub = client
        .subscribe(&queue, "g")
        .ordered_by(KeySource::routing_key())
        .instance_id("url-lease-a")
        .build()
        .await
        .unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(sub.run(|_d: Delivery| async { HandlerResult::Ok(()) }, async move {
        let _ = stopped.await;
    }));
    let db = sqlx::PgPool::connect(&common::url()).await.unwrap();
    let (ttl_ms, left_ms) = keyorder_testkit::until(
        "the member row and its slot leases",
        Duration::from_secs(60),
        async || {
            let ttl: Option<i64> = sqlx::query_scalar(
                "select ttl_ms from keyorder_url_lease.members where queue = $1 and grp = 'g' and member = 'url-lease-a'",
            )
            .bind(&queue)
            .fetch_optional(&db)
            .await
            .map_err(|e| e.to_string())?;
            let left: Option<f64> = sqlx::query_scalar(
                "select (extract(epoch from min(lease_expiry) - clock_timestamp()) * 1000)::float8 \
                 from keyorder_url_lease.slots where queue = $1 and grp = 'g' and owner = 'url-lease-a'",
            )
            .bind(&queue)
            .fetch_one(&db)
            .await
            .map_err(|e| e.to_string())?;
            match (ttl, left) {
                (Some(t), Some(l)) => Ok((t, l)),
                other => Err(format!("member ttl and least lease left: {other:?}")),
            }
        },
    )
    .await;
    assert_eq!(ttl_ms, 37_000, "the member row's TTL");
    assert!(
        (20_000.0..=37_000.0).contains(&left_ms),
        "a slot lease expires in {left_ms} ms (lease_ttl_ms=37000; the default is 10000)"
    );
    let _ = stop.send(());
    run.await.unwrap().unwrap();
}

/// A lease TTL past what PostgreSQL's timeouts take (about 24.8 days in
/// ms) still opens a subscription: the join's bound on a stalled
/// transaction is the server's limit, not an error (`Value exceeds integer
/// range`, which failed every build).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_longer_than_the_servers_timeouts_still_joins() {
    let cfg = PgConfig::from_url(
        &format!("{}?schema={SCHEMA}&slots=2&migrate=true", common::url())
            .parse()
            .unwrap(),
    )
    .unwrap();
    let client = Client::new(Arc::new(common::connect(cfg).await));
    let queue = format!("long-lease-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let sub = client
        .subscribe(&queue, "g")
        .ordered_by(KeySource::routing_key())
        .lease(LeaseConfig {
            ttl: Duration::from_secs(30 * 24 * 3600),
            heartbeat: Duration::from_secs(2),
            margin: Duration::from_secs(3),
        })
        .build()
        .await;
    assert!(sub.is_ok(), "a 30-day lease opens: {:?}", sub.err());
}
