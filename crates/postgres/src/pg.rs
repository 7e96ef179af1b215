//! `Pg`: the database as every room of the adapter uses it (the transport
//! and its clones, publishers, sources, settlements, the operator's verbs
//! and the plain layout): the pool, the settlement batcher, the statements
//! of the schema and the configuration, and the checks they share (a schema
//! with no keyorder tables, a queue's layout).

use std::sync::Arc;
use std::time::Duration;

use keyorder_core::{Error, Result};
use sqlx::Row;

use crate::batch::Batcher;
use crate::config::PgConfig;
use crate::error::{broker, layout_error, missing_schema};
use crate::exec::{q, Exec};
use crate::sql::Sql;

/// The database handle a transport's clones and everything they make
/// share (one pool).
#[derive(Clone)]
pub(crate) struct Pg {
    pub(crate) db: Exec,
    pub(crate) cfg: Arc<PgConfig>,
    pub(crate) sql: Arc<Sql>,
    pub(crate) batcher: Batcher,
}

impl Pg {
    /// The direct server URL: `direct=` if given, else the pool's URL.
    pub(crate) fn direct_url(&self) -> &str {
        self.cfg.direct.as_deref().unwrap_or(&self.cfg.url)
    }

    /// [`missing_schema`] of this schema.
    pub(crate) fn missing_schema(&self, e: sqlx::Error) -> Error {
        missing_schema(&self.cfg.schema, e)
    }

    /// Fails with [`layout_error`] unless `slots` is `queue`'s count and,
    /// for a publisher (`groups`), every group's (a count edited in the
    /// table while in use, C23). A consumer group checks only the queue's:
    /// a new group may start with a count the queue was re-slotted to,
    /// while publishes wait until the older groups are removed.
    pub(crate) async fn check_layout(&self, queue: &str, slots: u32, who: &str, groups: bool) -> Result<()> {
        let row = self
            .db
            .one(q(&self.sql.layout).bind(queue).bind(slots as i32))
            .await
            .map_err(broker)?;
        let (recorded, other): (Option<i32>, Option<String>) = (row.get(0), row.get(1));
        match (recorded, other) {
            (Some(n), _) if n as u32 != slots => Err(layout_error(queue, n as u32, who, slots)),
            (Some(_), Some(grp)) if groups => Err(Error::Config(format!(
                "postgres: queue `{queue}`'s layout changed: its consumer group `{grp}` started with another slot \
                 count than the queue's {slots}, so keys would move between owners and lose their order; keyorder \
                 refuses to publish. Fix: set the queue's count in the queues table back to the group's; to change \
                 it, stop the publishers, drain every group, remove the groups, and publish to a new queue"
            ))),
            _ => Ok(()),
        }
    }
}

/// A lease TTL in milliseconds, as a member row records it.
pub(crate) fn ttl_ms(ttl: Duration) -> i64 {
    i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX)
}
