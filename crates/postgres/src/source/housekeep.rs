//! Housekeeping off the read path, once a heartbeat: the acknowledgements
//! below this member's durable cursors, and the events every group of the
//! queue has passed (retention).

use std::time::Duration;

use keyorder_core::Result;
use tokio::task::JoinHandle;

use super::own::Ownership;
use crate::error::broker;
use crate::exec::{bound_idle, q, Exec, PgQuery};
use crate::sql::Sql;

/// Starts the housekeeping off the read path: the acknowledgements below this
/// owner's durable cursors, then, in a bounded batch per owned slot,
/// the events every group of the queue has passed. On a task of its
/// own, one at a time (a heartbeat that finds the last one running
/// skips it). Done inline, the two statements (100-130 ms together at
/// 14,000 acknowledgements a second per instance, on 2 cores) held up
/// the reads until the dispatcher's buffered work ran out. Off the read
/// path the reads go on, though the sweep's own work still slows every
/// key while it runs (BENCHMARKS.md, 2026-12-04, fourth session).
/// Neither statement moves a cursor or needs the lease, so a sweep that
/// outlives its slot is harmless; failures are logged and the next
/// heartbeat tries again.
pub(super) fn start(running: &mut Option<JoinHandle<()>>, own: &Ownership) {
    if own.owned.is_empty() || running.as_ref().is_some_and(|h| !h.is_finished()) {
        return;
    }
    let (db, sql) = (own.t.db.clone(), own.t.sql.clone());
    let (queue, grp, me) = (
        own.spec.category.clone(),
        own.spec.group.clone(),
        own.spec.instance.clone(),
    );
    let batch = own.t.cfg.retention_batch;
    let idle = own.spec.lease.ttl;
    let slots: Vec<i32> = own.owned.keys().map(|s| *s as i32).collect();
    *running = Some(tokio::spawn(async move {
        let sweep = q(&sql.sweep_acked).bind(&queue).bind(&grp).bind(&me);
        housekeeping_step(&db, sweep, "acknowledgement sweep").await;
        if batch > 0 {
            if let Err(e) = retention(&db, &sql, &queue, &slots, batch, idle).await {
                tracing::warn!(error = %e, "postgres: retention failed; retried at the next heartbeat");
            }
        }
    }));
}

/// Runs one housekeeping statement; a failure is logged, and the next
/// heartbeat runs it again.
async fn housekeeping_step(ex: &Exec, query: PgQuery<'_>, what: &str) {
    match ex.exec(query).await {
        Ok(done) if done.rows_affected() > 0 => tracing::debug!(deleted = done.rows_affected(), "{what}"),
        Ok(_) => {}
        Err(e) => tracing::warn!(error = %e, "postgres: {what} failed; retried at the next heartbeat"),
    }
}

/// Deletes, in each of `slots`, up to `batch` events every group of
/// `queue` has passed, in a transaction that first takes the queue's row
/// `for share`: a group created meanwhile waits for it (see
/// `PgTransport::join_group`), and the statement's snapshot, taken after
/// the lock, sees every group that exists. The server ends the transaction
/// if this process stalls in it for `idle` (the lease TTL): its share lock
/// would hold up every member that joins the queue.
async fn retention(ex: &Exec, sql: &Sql, queue: &str, slots: &[i32], batch: u32, idle: Duration) -> Result<()> {
    let mut tx = ex.pool.begin().await.map_err(broker)?;
    bound_idle(&mut tx, idle).await.map_err(broker)?;
    q(&sql.share_queue)
        .bind(queue)
        .persistent(!ex.pooled)
        .execute(&mut *tx)
        .await
        .map_err(broker)?;
    let done = q(&sql.retention)
        .bind(queue)
        .bind(slots)
        .bind(i64::from(batch))
        .persistent(!ex.pooled)
        .execute(&mut *tx)
        .await
        .map_err(broker)?;
    tx.commit().await.map_err(broker)?;
    if done.rows_affected() > 0 {
        tracing::debug!(deleted = done.rows_affected(), "retention");
    }
    Ok(())
}
