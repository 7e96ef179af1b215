//! `keyorder groups` on the real Redis server: lists a category's groups
//! with their live members, refuses to remove one without `--yes` or while
//! it has a live member, then removes it.

#![cfg(feature = "all-adapters")]

use std::process::Command;
use std::time::Duration;

use keyorder::raw::{SourceSpec, Transport};
use keyorder::redis::RedisTransport;
use keyorder::{KeyRules, LeaseConfig};

fn url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

fn keyorder(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_keyorder"))
        .args(args)
        .env_remove("KEYORDER_URL")
        .output()
        .expect("the keyorder binary runs")
}

fn spec(category: &str, group: &str) -> SourceSpec {
    SourceSpec {
        category: category.into(),
        correlated: Vec::new(),
        group: group.into(),
        instance: format!("{group}-1"),
        ordered: true,
        lease: LeaseConfig {
            ttl: Duration::from_secs(1),
            heartbeat: Duration::from_millis(300),
            margin: Duration::from_millis(400),
        },
        key_rules: KeyRules::default(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn groups_lists_and_removes_a_stopped_group() {
    let t = RedisTransport::from_url(&url().parse().unwrap())
        .await
        .expect("Redis must be reachable (run scripts/services)");
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let category = format!("cli-groups-{}-{nanos}", std::process::id());
    let mut billing = t.open(&spec(&category, "billing")).await.unwrap();
    let mut shipping = t.open(&spec(&category, "shipping")).await.unwrap();
    billing.maintain().await.unwrap();
    shipping.close().await.unwrap();
    drop(shipping);
    let u = url();

    let list = keyorder(&["groups", "list", "--url", &u, "--category", &category]);
    let text = String::from_utf8_lossy(&list.stdout);
    assert!(list.status.success(), "{}", String::from_utf8_lossy(&list.stderr));
    assert!(text.contains("billing live_members=1"), "{text}");
    assert!(text.contains("shipping"), "{text}");

    let unconfirmed = keyorder(&[
        "groups",
        "remove",
        "--url",
        &u,
        "--category",
        &category,
        "--group",
        "billing",
    ]);
    assert!(!unconfirmed.status.success());
    assert!(String::from_utf8_lossy(&unconfirmed.stderr).contains("--yes"));
    let live = keyorder(&[
        "groups",
        "remove",
        "--url",
        &u,
        "--category",
        &category,
        "--group",
        "billing",
        "--yes",
    ]);
    assert!(!live.status.success());
    let why = String::from_utf8_lossy(&live.stderr);
    assert!(why.contains("live member"), "{why}");

    // shipping's member entry lapses with its 1 s lease.
    let until = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let out = keyorder(&[
            "groups",
            "remove",
            "--url",
            &u,
            "--category",
            &category,
            "--group",
            "shipping",
            "--yes",
        ]);
        if out.status.success() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < until,
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        billing.maintain().await.unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let list = keyorder(&["groups", "list", "--url", &u, "--category", &category]);
    let text = String::from_utf8_lossy(&list.stdout);
    assert!(text.contains("billing") && !text.contains("shipping"), "{text}");
    billing.close().await.unwrap();
}
