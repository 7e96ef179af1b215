//! `correlated_with` is checked at build time: it needs correlated ownership.

use keyorder_core::{Client, Error, KeySource};

#[tokio::test]
async fn correlated_categories_need_the_capability() {
    let client = Client::memory();
    let err = client
        .subscribe("orders", "saga")
        .correlated_with("payments")
        .ordered_by(KeySource::routing_key())
        .build()
        .await
        .unwrap_err();
    match err {
        Error::Unsupported { capability, fix, .. } => {
            assert_eq!(capability, "correlated_ownership");
            assert!(fix.contains("Redis"), "{fix}");
        }
        other => panic!("expected Unsupported, got {other}"),
    }
}
