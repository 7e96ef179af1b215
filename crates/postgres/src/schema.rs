//! The schema's tables: the embedded migrations that create them (sqlx's
//! migrator applies them), and their `VACUUM`. Both run on a connection of
//! their own to the server itself (`direct=`), never through a pooler.

use keyorder_core::{Error, Result};
use sqlx::AssertSqlSafe;

use crate::error::{broker, missing_schema};
use crate::names::TABLES;
use crate::shared::{LeaseSql, TXID_COLUMN};

/// The embedded migrations (`crates/postgres/migrations`), in order: `{s}`
/// stands for the schema.
const MIGRATIONS: [(i64, &str, &str); 10] = [
    (1, "init", include_str!("../migrations/0001_init.sql")),
    (
        2,
        "groups and held keys",
        include_str!("../migrations/0002_groups_and_held.sql"),
    ),
    (3, "plain baseline", include_str!("../migrations/0003_plain.sql")),
    (
        4,
        "acknowledgement positions",
        include_str!("../migrations/0004_acked_position.sql"),
    ),
    (5, "read marks", include_str!("../migrations/0005_read_marks.sql")),
    (
        6,
        "publish fences",
        include_str!("../migrations/0006_publish_fences.sql"),
    ),
    (7, "dead letters once", include_str!("../migrations/0007_dead_once.sql")),
    (
        8,
        "dead letters unique",
        include_str!("../migrations/0008_dead_unique.sql"),
    ),
    (9, "member lease ttl", include_str!("../migrations/0009_member_ttl.sql")),
    (10, "group epochs", include_str!("../migrations/0010_group_epochs.sql")),
];

/// `(version, description, SQL)` of each embedded migration, for `schema`.
fn migrations(schema: &str) -> Vec<(i64, &'static str, String)> {
    let lease = LeaseSql::new(schema);
    MIGRATIONS
        .iter()
        .map(|(version, description, text)| {
            let text = text
                .replace("{create_slots}", &lease.create_slots)
                .replace("{create_members}", &lease.create_members)
                .replace("{txid}", TXID_COLUMN)
                .replace("{s}", schema);
            (*version, *description, text)
        })
        .collect()
}

/// Applies the embedded migrations to `schema` on a connection of its own
/// to `direct_url` (see `PgTransport::migrate`).
pub(crate) async fn migrate(direct_url: &str, schema: &str) -> Result<()> {
    use sqlx::migrate::{Migration, MigrationType, Migrator};
    use sqlx::{Connection, SqlSafeStr};
    let migrations = migrations(schema)
        .into_iter()
        .map(|(version, description, text)| {
            Migration::new(
                version,
                description.into(),
                MigrationType::Simple,
                AssertSqlSafe(text).into_sql_str(),
                false,
            )
        })
        .collect();
    let mut migrator = Migrator::with_migrations(migrations);
    migrator.create_schema(schema.to_owned());
    migrator.dangerous_set_table_name(format!("{schema}._sqlx_migrations"));
    let mut conn = sqlx::PgConnection::connect(direct_url).await.map_err(broker)?;
    // `run_direct` is what `Migrator::run` calls; taking the connection
    // directly keeps this future `Send` for every lifetime (`run`'s
    // `Acquire` bound is not general enough for a spawned task).
    let run = migrator.run_direct(None, &mut conn, false).await;
    let _ = conn.close().await;
    run.map_err(|e| {
        Error::Config(format!(
            "postgres: migrating schema `{schema}` failed: {e} (a changed or unknown migration means this schema \
             was migrated by another keyorder version)"
        ))
    })
}

/// `VACUUM (ANALYZE)` of every keyorder table of `schema`, on a connection
/// of its own to `direct_url` (see `PgTransport::vacuum`).
pub(crate) async fn vacuum(direct_url: &str, schema: &str) -> Result<()> {
    use sqlx::{Connection, Executor};
    let list = TABLES
        .iter()
        .map(|t| format!("{schema}.{t}"))
        .collect::<Vec<_>>()
        .join(", ");
    let mut conn = sqlx::PgConnection::connect(direct_url).await.map_err(broker)?;
    let res = conn.execute(AssertSqlSafe(format!("vacuum (analyze) {list}"))).await;
    let _ = conn.close().await;
    res.map_err(|e| missing_schema(schema, e))?;
    Ok(())
}
