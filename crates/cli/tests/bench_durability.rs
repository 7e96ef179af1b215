//! `keyorder bench` on the real PostgreSQL server says what its sessions
//! commit with, and flags a run whose URL relaxes it.

#![cfg(feature = "all-adapters")]

use std::process::Command;

use keyorder::postgres::sqlx::{self, Row};

fn url() -> String {
    std::env::var("POSTGRES_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

/// Standard output of a small bench run on `url`.
fn bench(url: &str) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_keyorder"))
        .args([
            "bench",
            "--url",
            url,
            "--keys",
            "2",
            "--messages",
            "20",
            "--handler-ms",
            "0",
            "--probes",
            "0",
        ])
        .env_remove("KEYORDER_URL")
        .output()
        .expect("the keyorder binary runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "bench failed: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

#[tokio::test]
async fn bench_reports_the_sessions_durability() {
    // The server's own setting, asked by a plain session.
    let pool = sqlx::PgPool::connect(&url()).await.unwrap();
    let server: String = sqlx::query("select current_setting('synchronous_commit')")
        .fetch_one(&pool)
        .await
        .unwrap()
        .get(0);
    pool.close().await;

    let sep = if url().contains('?') { '&' } else { '?' };
    let plain = bench(&format!("{}{sep}slots=4", url()));
    let first = plain.lines().next().unwrap_or_default();
    assert!(
        first.starts_with(&format!("postgres: commits with synchronous_commit={server} fsync=")),
        "{plain}"
    );

    let relaxed = bench(&format!("{}{sep}slots=4&options=-c%20synchronous_commit%3Doff", url()));
    let first = relaxed.lines().next().unwrap_or_default();
    assert!(
        first.starts_with("postgres: commits with synchronous_commit=off fsync=") && first.contains("(relaxed:"),
        "{relaxed}"
    );
}
