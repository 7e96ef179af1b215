//! A broker error keeps its cause (issue 38): the driver's (sqlx) error is
//! its `source()`, and it says whether retrying can help.

use std::error::Error as _;

use keyorder_core::Error;
use keyorder_postgres::{PgCause, PgTransport};

#[tokio::test]
async fn a_refused_connection_is_temporary_and_keeps_the_sqlx_error() {
    let url = "postgres://postgres@127.0.0.1:1/test".parse().unwrap();
    let err = PgTransport::from_url(&url).await.unwrap_err();
    assert!(matches!(err, Error::Broker(_)), "{err}");
    assert!(err.is_temporary(), "a refused connection may come back: {err}");
    let source = err.source().expect("the driver's error is kept as the source");
    let cause = source.downcast_ref::<PgCause>().expect("a PgCause");
    assert!(
        matches!(cause.sqlx(), sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut),
        "{cause:?}"
    );
    assert!(err.to_string().starts_with("broker: postgres: "), "{err}");
}

#[tokio::test]
async fn a_database_that_does_not_exist_is_permanent() {
    let server = keyorder_testkit::brokers::Broker::Postgres.url();
    let mut url: url::Url = server.parse().unwrap();
    url.set_path("/keyorder_no_such_database");
    let err = PgTransport::from_url(&url).await.unwrap_err();
    assert!(matches!(err, Error::Broker(_)), "{err}");
    assert!(!err.is_temporary(), "retrying finds no database either: {err}");
    let source = err.source().expect("the driver's error is kept as the source");
    let cause = source.downcast_ref::<PgCause>().expect("a PgCause");
    assert_eq!(cause.code().as_deref(), Some("3D000"), "{cause}");
    assert!(matches!(cause.sqlx(), sqlx::Error::Database(_)), "{cause:?}");
}
