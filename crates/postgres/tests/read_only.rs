//! Read-only operator commands create nothing (issue 37), on the real
//! PostgreSQL: in a schema of its own, every table holds the same rows,
//! and the schema the same tables, before and after each of them ran.

#[allow(dead_code)]
mod common;

use std::sync::Arc;

use keyorder_core::Client;
use sqlx::Row;

/// `(table, rows)` for every table of `schema`, sorted.
async fn census(pool: &sqlx::PgPool, schema: &str) -> Vec<(String, i64)> {
    let tables: Vec<String> = sqlx::query("select tablename from pg_tables where schemaname = $1 order by 1")
        .bind(schema)
        .fetch_all(pool)
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let mut out = Vec::new();
    for t in tables {
        let n: i64 = sqlx::query(sqlx::AssertSqlSafe(format!(
            "select count(*) from \"{schema}\".\"{t}\""
        )))
        .fetch_one(pool)
        .await
        .unwrap()
        .get(0);
        out.push((t, n));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_only_commands_create_nothing() {
    let schema = format!("ro_{}", &uuid::Uuid::new_v4().simple().to_string()[..10]);
    let t = common::transport(&schema, 4).await;
    let pool = sqlx::PgPool::connect(&common::url()).await.unwrap();
    let before = census(&pool, &schema).await;
    assert!(!before.is_empty(), "the schema was migrated");
    let c = Client::new(Arc::new(t));
    keyorder_testkit::run_read_only_commands(&*c.admin(), "cat").await;
    let after = census(&pool, &schema).await;
    sqlx::query(sqlx::AssertSqlSafe(format!("drop schema \"{schema}\" cascade")))
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(before, after, "read-only commands changed the schema's tables or rows");
}
