//! Reading the owned slots: one statement reads every readable slot, the
//! room shared out so that the slots holding the least get the most, and
//! each row becomes a delivery with its settlement (`PgSettle`).

use std::collections::HashMap;
use std::sync::atomic::AtomicU32;
use std::sync::Arc;

use keyorder_core::raw::Room;
use keyorder_core::{Inbound, Result};
use sqlx::Row;
use tokio::time::Instant;

use super::own::Ownership;
use crate::error::broker;
use crate::exec::q;
use crate::settle::PgSettle;
use crate::track::{lock, Pos};
use crate::wire::row_message;

/// Reads the slots an [`Ownership`] holds.
#[derive(Debug, Default)]
pub(super) struct Reader {
    /// The slot number where the next read's ties start (modulo the slot count).
    rotate: usize,
}

impl Reader {
    /// Reads the readable owned slots. When only slots with no dry mark
    /// were read and they had nothing, the dry ones are read at once.
    pub(super) async fn read(&mut self, own: &mut Ownership, room: &Room) -> Result<Vec<Inbound>> {
        let (batch, skipped_dry) = self.read_once(own, room).await?;
        if !batch.is_empty() || !skipped_dry {
            return Ok(batch);
        }
        own.touch();
        own.all_wet();
        Ok(self.read_once(own, room).await?.0)
    }

    /// One read statement; also says whether slots with a dry mark were
    /// left out.
    async fn read_once(&mut self, own: &mut Ownership, room: &Room) -> Result<(Vec<Inbound>, bool)> {
        let max = room.max();
        let mut out = Vec::new();
        // Every readable owned slot in one round trip (one statement per
        // slot cost a round trip each on every fetch: milliseconds of
        // latency with a few slots).
        let readable: Vec<(u32, i64, Pos, Arc<str>)> = own
            .owned
            .iter()
            .filter(|(_, o)| !o.revoking && !room.is_paused(o.lease.scope()) && !o.lease.is_lost())
            .map(|(slot, o)| (*slot, o.generation, o.read, o.lease.scope().clone()))
            .collect();
        if readable.is_empty() || max == 0 {
            return Ok((out, false));
        }
        // What was settled here before this point committed before the
        // statement below takes its snapshot, which shows it settled; what
        // settles from here on is remembered until the next read (see
        // `Track::settled`).
        for o in own.owned.values() {
            lock(&o.track).settled.clear();
        }
        // Slots that a recent read took to their end get no share while
        // others may have more: at 64 slots, the slots that had run out took
        // nearly all the room, those with a backlog got none once the room
        // was smaller than the slot count, the read came back empty, and
        // the fetch waited for a notification (100 ms gaps in a key's run).
        let now = Instant::now();
        let wet: Vec<(u32, i64, Pos, Arc<str>)> = readable
            .iter()
            .filter(|r| !own.owned.get(&r.0).is_some_and(|o| o.is_dry(now)))
            .cloned()
            .collect();
        let skipped_dry = !wet.is_empty() && wet.len() < readable.len();
        let readable = if wet.is_empty() { readable } else { wet };
        // The room is shared by the one policy (`Room::split`: the slots
        // the dispatcher holds least of get the most). Ties start at the
        // slot after the last read's start (by slot number, whichever slots
        // are readable), so every slot gets its turn when there is less
        // room than slots.
        let from = (self.rotate % own.slots.max(1) as usize) as u32;
        let start = readable.iter().position(|r| r.0 >= from).unwrap_or(0);
        let scopes: Vec<&Arc<str>> = readable.iter().map(|r| &r.3).collect();
        let limits = room.split(&scopes, max, start);
        self.rotate = self.rotate.wrapping_add(1);
        let readable: Vec<(u32, i64, Pos, i32)> = readable
            .iter()
            .zip(&limits)
            .filter(|(_, lim)| **lim > 0)
            .map(|(r, lim)| (r.0, r.1, r.2, *lim as i32))
            .collect();
        if readable.is_empty() {
            return Ok((out, skipped_dry));
        }
        let rows = own
            .t
            .db
            .all(
                q(&own.t.sql.read)
                    .bind(&own.spec.category)
                    .bind(&own.spec.group)
                    .bind(readable.iter().map(|r| r.0 as i32).collect::<Vec<_>>())
                    .bind(readable.iter().map(|r| r.1).collect::<Vec<_>>())
                    .bind(readable.iter().map(|r| r.2 .0.to_string()).collect::<Vec<_>>())
                    .bind(readable.iter().map(|r| r.2 .1).collect::<Vec<_>>())
                    .bind(&own.spec.instance)
                    .bind(readable.iter().map(|r| r.3).collect::<Vec<_>>()),
            )
            .await
            .map_err(broker)?;
        let mut got: HashMap<u32, i32> = HashMap::new();
        for r in &rows {
            *got.entry(r.get::<i32, _>(0) as u32).or_default() += 1;
        }
        for (slot, _, _, lim) in &readable {
            if let Some(o) = own.owned.get_mut(slot) {
                o.dry = (got.get(slot).copied().unwrap_or(0) < *lim).then_some(now);
            }
        }
        for r in rows {
            let slot = r.get::<i32, _>(0) as u32;
            let Some(o) = own.owned.get_mut(&slot) else { continue };
            {
                let id: i64 = r.get(1);
                let txid: u64 = r.get::<String, _>(2).parse().unwrap_or(0);
                o.read = o.read.max((txid, id));
                // After a rewind (a resolved halt), what is still in flight
                // comes round again: it is delivered once; and what was
                // settled after this read's snapshot is not delivered again.
                {
                    let mut track = lock(&o.track);
                    if track.settled.contains(&(txid, id)) || !track.unsettled.insert((txid, id)) {
                        continue;
                    }
                }
                let (msg, key) = row_message(&r, 3, &own.spec.key_rules);
                let message_id = msg.id().to_owned();
                let recorded: i32 = r.get(8);
                // Attempts made before this delivery: as recorded, or one
                // if an earlier owner read it and recorded nothing.
                let before = if recorded > 0 {
                    recorded as u32
                } else {
                    u32::from((txid, id) <= o.prior_mark)
                };
                out.push(Inbound {
                    message: msg,
                    lease: o.lease.clone(),
                    settle: Box::new(PgSettle {
                        t: own.t.clone(),
                        queue: own.spec.category.clone(),
                        grp: own.spec.group.clone(),
                        me: own.spec.instance.clone(),
                        slot,
                        generation: o.generation,
                        pos: (txid, id),
                        made: AtomicU32::new(before),
                        message_id,
                        key,
                        track: o.track.clone(),
                    }),
                });
            }
        }
        Ok((out, skipped_dry))
    }
}
