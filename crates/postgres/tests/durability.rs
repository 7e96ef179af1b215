//! `PgTransport::durability` reports what the transport's own sessions
//! commit with, on the real server: the server's settings by default, and a
//! relaxation passed in the URL's `options` when there is one.

use keyorder_postgres::PgTransport;
use sqlx::Row;

// Shared set-up; this file uses only part of it.
#[allow(dead_code)]
mod common;
use common::url;

async fn reported(url: &str) -> Vec<(String, String)> {
    let t = keyorder_testkit::brokers::Broker::Postgres
        .require(url, PgTransport::from_url(&url.parse().unwrap()))
        .await;
    t.durability().await.unwrap()
}

#[tokio::test]
async fn durability_reports_the_sessions_settings() {
    // What a plain session of the server says, asked independently.
    let pool = sqlx::PgPool::connect(&url()).await.unwrap();
    let row = sqlx::query("select current_setting('synchronous_commit'), current_setting('fsync')")
        .fetch_one(&pool)
        .await
        .unwrap();
    let server: (String, String) = (row.get(0), row.get(1));
    pool.close().await;

    let plain = reported(&url()).await;
    assert_eq!(
        plain,
        vec![
            ("synchronous_commit".to_owned(), server.0),
            ("fsync".to_owned(), server.1.clone()),
        ]
    );

    let sep = if url().contains('?') { '&' } else { '?' };
    let relaxed = reported(&format!("{}{sep}options=-c%20synchronous_commit%3Doff", url())).await;
    assert_eq!(
        relaxed,
        vec![
            ("synchronous_commit".to_owned(), "off".to_owned()),
            ("fsync".to_owned(), server.1),
        ]
    );
}
