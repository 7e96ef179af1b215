//! The messages a source holds per owned partition until the dispatcher
//! takes them: pausing a full partition, and sharing the dispatcher's room
//! among the partitions.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use keyorder_core::raw::Room;
use keyorder_core::Inbound;
use rdkafka::consumer::Consumer;
use rdkafka::{Offset, TopicPartitionList};
use tokio::time::Instant;

use crate::owned::Shared;

/// The messages held for one owned partition.
pub(super) struct Local {
    pub(super) held: VecDeque<Inbound>,
    pub(super) paused: bool,
    /// A static member's partition starts no work before this (see
    /// [`Shared::static_start_wait`]).
    pub(super) start_at: Option<Instant>,
}

/// Pauses a partition whose unfinished messages reached the limit and
/// resumes it (with a seek to where it stopped) once half drained.
pub(super) fn pace(shared: &Shared, parts: &mut HashMap<i32, Local>) {
    let Some(member) = shared.member() else { return };
    let max = shared.t.cfg.max_unfinished;
    for (partition, local) in parts.iter_mut() {
        let Some(part) = shared.part(*partition) else {
            continue;
        };
        let (unfinished, position) = {
            let t = part.track();
            (t.unfinished(), t.position())
        };
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition(shared.names.topic(), *partition);
        if !local.paused && unfinished >= max {
            if member.pause(&tpl).is_ok() {
                local.paused = true;
                metrics::counter!("keyorder_kafka_partition_pauses_total").increment(1);
                tracing::debug!(scope = %part.lease.scope(), unfinished, "kafka: partition paused (full)");
            }
        } else if local.paused && unfinished <= max / 2 && member.resume(&tpl).is_ok() {
            local.paused = false;
            // Without the seek the first message comes 0.5-0.9 s later.
            let _ = member.seek(
                shared.names.topic(),
                *partition,
                Offset::Offset(position),
                Duration::ZERO,
            );
        }
    }
}

/// Hands out up to the room's `max` held messages, shared over the
/// partitions by the one policy ([`Room::split`]: by what the dispatcher
/// holds of each, with a floor for every partition, so one holding a halted
/// key's messages still gets some). What a partition cannot use goes round the
/// others one message at a time. Ties start one partition further each
/// call. Draining partitions in map order gave the dispatcher's whole
/// room to the first ones: their few keys ran while the keys of the
/// others waited for them to finish (one partition of eight started
/// 2.6 s into a 3.5 s run).
pub(super) fn take(parts: &mut HashMap<i32, Local>, turn: &mut usize, room: &Room, out: &mut Vec<Inbound>) {
    let max = room.max();
    let mut order: Vec<i32> = parts
        .iter()
        .filter(|(_, l)| {
            l.held.front().is_some_and(|f| !room.is_paused(f.lease.scope()))
                && l.start_at.is_none_or(|t| t <= Instant::now())
        })
        .map(|(p, _)| *p)
        .collect();
    if order.is_empty() || out.len() >= max {
        return;
    }
    order.sort_unstable();
    *turn = turn.wrapping_add(1);
    let start = *turn % order.len();
    order.rotate_left(start);
    let scopes: Vec<Arc<str>> = order
        .iter()
        .map(|p| {
            parts
                .get(p)
                .and_then(|l| l.held.front())
                .map_or_else(|| Arc::from(""), |f| f.lease.scope().clone())
        })
        .collect();
    let levels = room.split(&scopes, max - out.len(), 0);
    for (p, level) in order.iter().zip(levels) {
        let Some(l) = parts.get_mut(p) else { continue };
        for _ in 0..level {
            match l.held.pop_front() {
                Some(i) => out.push(i),
                None => break,
            }
        }
    }
    while out.len() < max {
        let mut took = false;
        for p in &order {
            if out.len() >= max {
                break;
            }
            if let Some(i) = parts.get_mut(p).and_then(|l| l.held.pop_front()) {
                out.push(i);
                took = true;
            }
        }
        if !took {
            break;
        }
    }
}
