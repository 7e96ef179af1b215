//! Read-only operator commands create nothing (issue 37), on the real
//! Redis: no key naming the category exists after every one of them ran.

// Shared set-up; this file uses only part of it.
#[allow(dead_code)]
mod common;

use common::url;
use std::sync::Arc;

use keyorder_core::Client;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_only_commands_create_nothing() {
    let category = format!("ro-{}", uuid::Uuid::new_v4().simple());
    let t = common::connect(&url()).await;
    let c = Client::new(Arc::new(t));
    keyorder_testkit::run_read_only_commands(&*c.admin(), &category).await;
    let mut conn = redis::Client::open(url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let mut found: Vec<String> = Vec::new();
    let mut cursor: u64 = 0;
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(format!("*{category}*"))
            .arg("COUNT")
            .arg(1000)
            .query_async(&mut conn)
            .await
            .unwrap();
        found.extend(keys);
        if next == 0 {
            break;
        }
        cursor = next;
    }
    assert!(found.is_empty(), "read-only commands created {found:?}");
}
