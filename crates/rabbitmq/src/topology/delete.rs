//! Deleting a category with everything kept for it on the broker, for
//! every group: what `RabbitTransport::delete_category` and the operator's
//! `Admin::delete_category` do.

use keyorder_core::{Error, Result};
use lapin::Connection;

use super::{delete_group, parse_topology, queue_state, Registry};
use crate::conn::Conn;
use crate::error::broker;
use crate::names::Names;

/// Deletes `category` with everything kept for it on the broker, for every
/// group: each recorded group's queues (backlogs and dead letters with
/// them) and exchanges, the entry exchange, the group registry, and the
/// queues and exchanges of the layout before consumer groups (`{c}.hash`,
/// `{c}.hash.N`, `{c}.sac`, `{c}.plain`, `{c}.dlq`). Returns the queues
/// deleted.
pub(crate) async fn delete_category(c: &Conn, category: &str) -> Result<Vec<String>> {
    let n = Names::new(category)?;
    let conn = c.connection().await?;
    // Everything is deleted while the registry's lock is held, the
    // lock queue last: a group declared meanwhile by another process
    // waits, then finds no registry and declares the category anew.
    let registry = Registry::lock(&conn, &n, true).await?;
    let res = async {
        let mut gone = Vec::new();
        for (group, recorded) in registry.records() {
            let g = n.group(&group)?;
            gone.extend(delete_group(&conn, &g, parse_topology(&recorded)).await?);
            c.forget(g.base());
        }
        gone.extend(delete_category_names(&conn, &n).await?);
        Ok::<_, Error>(gone)
    }
    .await;
    match res {
        Ok(mut gone) => {
            registry.delete(&n.registry_lock()).await?;
            gone.push(n.registry_lock());
            c.forget(category);
            Ok(gone)
        }
        Err(e) => {
            let _ = registry.release().await;
            Err(e)
        }
    }
}

/// Deletes the category-level names (registry, entry exchange, the
/// layout before consumer groups) that exist; returns the queues.
async fn delete_category_names(conn: &Connection, n: &Names) -> Result<Vec<String>> {
    use lapin::options::{ExchangeDeleteOptions, QueueDeleteOptions};
    let mut gone = Vec::new();
    let mut queues = vec![n.registry()];
    queues.extend(n.legacy_queues());
    for i in 1..1024 {
        if queue_state(conn, &n.legacy_hash_queue(i)).await?.is_none() {
            break;
        }
        queues.push(n.legacy_hash_queue(i));
    }
    let ch = conn.create_channel().await.map_err(broker)?;
    for q in queues {
        if queue_state(conn, &q).await?.is_some() {
            ch.queue_delete(q.as_str().into(), QueueDeleteOptions::default())
                .await
                .map_err(broker)?;
            gone.push(q);
        }
    }
    for x in [
        n.entry(),
        n.legacy_hash_exchange(),
        format!("{}.presence", n.category()),
    ] {
        ch.exchange_delete(x.as_str().into(), ExchangeDeleteOptions::default())
            .await
            .map_err(broker)?;
    }
    let _ = ch.close(200, "deleted".into()).await;
    Ok(gone)
}
