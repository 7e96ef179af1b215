//! The SQL text of the slot layout: every statement the transport, its
//! publishers, sources, settlements and operator verbs run, built once per
//! schema. The plain layout's statements are in `plain.rs`, the migrations
//! (the tables themselves) in `schema.rs`, and the pieces other crates share
//! (commit-safe reads, fenced leases) in `shared.rs`.

use std::sync::Arc;

use crate::names::channel;
use crate::shared::{after, after_position, commit_safe, read_order, LeaseSql, TXID_COLUMN};

/// The longest member lease TTL the liveness checks compute with (ten
/// years, in ms): a recorded TTL near `i64::MAX` ms would overflow the
/// interval (and the timestamp it is added to).
const TTL_CAP_MS: &str = "315360000000";

/// The statements of one schema (`AssertSqlSafe`: the schema name is
/// validated as an identifier before it is formatted in).
#[derive(Debug)]
pub(crate) struct Sql {
    pub(crate) channel: String,
    pub(crate) ensure_queue: Arc<str>,
    pub(crate) queue_slots: Arc<str>,
    pub(crate) ensure_group: Arc<str>,
    pub(crate) group_slots: Arc<str>,
    pub(crate) layout: Arc<str>,
    pub(crate) ensure_slots: Arc<str>,
    pub(crate) lock_queue: Arc<str>,
    pub(crate) lock_queue_slots: Arc<str>,
    pub(crate) lock_group: Arc<str>,
    pub(crate) lock_group_slots: Arc<str>,
    pub(crate) lock_queue_group_slots: Arc<str>,
    pub(crate) raise_floor: Arc<str>,
    pub(crate) raise_floor_queue: Arc<str>,
    pub(crate) group_slot_rows: Arc<str>,
    pub(crate) join_member: Arc<str>,
    pub(crate) share_queue: Arc<str>,
    pub(crate) groups: Arc<str>,
    pub(crate) group_live: Arc<str>,
    pub(crate) publish: Arc<str>,
    pub(crate) publish_fenced: Arc<str>,
    pub(crate) publish_fence_held: Arc<str>,
    pub(crate) live_members: Arc<str>,
    pub(crate) leave: Arc<str>,
    pub(crate) acquire_many: Arc<str>,
    pub(crate) read_marks: Arc<str>,
    pub(crate) keep: Arc<str>,
    pub(crate) release: Arc<str>,
    pub(crate) release_all: Arc<str>,
    pub(crate) advance: Arc<str>,
    pub(crate) read: Arc<str>,
    pub(crate) park: Arc<str>,
    pub(crate) halt: Arc<str>,
    pub(crate) resolved: Arc<str>,
    pub(crate) scopes: Arc<str>,
    pub(crate) halted: Arc<str>,
    pub(crate) hot_keys: Arc<str>,
    pub(crate) dead: Arc<str>,
    pub(crate) op_ack: Arc<str>,
    pub(crate) op_dead: Arc<str>,
    pub(crate) op_resume: Arc<str>,
    pub(crate) op_mark: Arc<str>,
    pub(crate) retention: Arc<str>,
    pub(crate) sweep_acked: Arc<str>,
    pub(crate) attempt_batch: Arc<str>,
    pub(crate) ack_batch: Arc<str>,
}

impl Sql {
    pub(crate) fn new(schema: &str) -> Sql {
        let lease = LeaseSql::new(schema);
        let f = |t: &str| -> Arc<str> {
            Arc::from(
                t.replace("{own}", &lease.own)
                    .replace("{after}", &after_position("e", 6, 7))
                    .replace("{after_read}", &after("e", "r.rtx::xid8", "r.rid"))
                    .replace("{commit_safe}", &commit_safe("e"))
                    .replace("{read_order}", &read_order("e"))
                    .replace("{txid}", TXID_COLUMN)
                    .replace("{ttl_cap}", TTL_CAP_MS)
                    .replace("{s}", schema),
            )
        };
        Sql {
            channel: channel(schema),
            ensure_queue: f("insert into {s}.queues (queue, slots) values ($1, $2) on conflict (queue) do nothing"),
            queue_slots: f("select slots from {s}.queues where queue = $1"),
            ensure_group: f("insert into {s}.groups (queue, grp, slots) values ($1, $2, $3) on conflict do nothing"),
            group_slots: f("select slots, epoch from {s}.groups where queue = $1 and grp = $2"),
            // The queue's count and the first group that started with
            // another than $2 (a layout check, C23).
            layout: f(
                "select (select slots from {s}.queues where queue = $1), \
                 (select grp from {s}.groups where queue = $1 and slots <> $2 order by grp limit 1)",
            ),
            // A new group's slot rows start at the generation floor, which
            // is at least every generation a removed group of the same name
            // handed out: its first acquire is above them all.
            ensure_slots: f(
                "insert into {s}.slots (queue, grp, slot, generation) select $1, $2, g, \
                 coalesce((select generation from {s}.generation_floor), 0) from generate_series(0, $3 - 1) g \
                 on conflict do nothing",
            ),
            // Before a group's (or a queue's) slot rows go: the floor rises
            // to their highest generation.
            raise_floor: f(
                "insert into {s}.generation_floor (one, generation) select true, coalesce(max(generation), 0) \
                 from {s}.slots where queue = $1 and grp = $2 on conflict (one) do update \
                 set generation = greatest({s}.generation_floor.generation, excluded.generation)",
            ),
            raise_floor_queue: f(
                "insert into {s}.generation_floor (one, generation) select true, coalesce(max(generation), 0) \
                 from {s}.slots where queue = $1 on conflict (one) do update \
                 set generation = greatest({s}.generation_floor.generation, excluded.generation)",
            ),
            // The slot rows of group $2 of queue $1 while it is the group
            // of epoch $3 (the one a member joined): none once it is gone.
            group_slot_rows: f(
                "select count(*) from {s}.slots s join {s}.groups g on g.queue = s.queue and g.grp = s.grp \
                 where s.queue = $1 and s.grp = $2 and g.epoch = $3",
            ),
            // The member's row, written with the group's creation (in its
            // transaction): a removal that comes after sees a live member.
            join_member: f(
                "insert into {s}.members (queue, grp, member, last_seen, ttl_ms) \
                 values ($1, $2, $3, clock_timestamp(), $4) on conflict (queue, grp, member) \
                 do update set last_seen = clock_timestamp(), ttl_ms = excluded.ttl_ms",
            ),
            // A group's creation and removal take the queue's row `for no
            // key update`, retention takes it `for share` before it reads
            // the groups' cursors: a group is never created (at the oldest
            // retained event) behind a retention statement that did not see
            // it, and never removed under one.
            lock_queue: f("select 1 from {s}.queues where queue = $1 for no key update"),
            lock_queue_slots: f("select slots from {s}.queues where queue = $1 for no key update"),
            // A removal takes the group's row and its slot rows `for
            // update`: a heartbeat (which takes the group row `for key
            // share`) and the fenced statements in flight (settlements,
            // reads and cursor moves take the slot row `for key share`)
            // commit first, and those that come after find nothing.
            lock_group: f("select 1 from {s}.groups where queue = $1 and grp = $2 for update"),
            lock_group_slots: f(
                "select 1 from {s}.slots where queue = $1 and grp = $2 order by slot for update",
            ),
            lock_queue_group_slots: f(
                "select 1 from {s}.slots where queue = $1 order by grp, slot for update",
            ),
            share_queue: f("select 1 from {s}.queues where queue = $1 for share"),
            // Every group of queue $1 with its live members (seen within
            // their own lease TTL, on the database's clock).
            groups: f(
                "select g.grp, (select count(*) from {s}.members m where m.queue = g.queue and m.grp = g.grp \
                 and m.last_seen + make_interval(secs => least(m.ttl_ms, {ttl_cap})::float8 / 1000) \
                 > clock_timestamp()) from {s}.groups g where g.queue = $1 order by g.grp",
            ),
            // Whether group $2 of queue $1 is recorded, and how many of its
            // members and slot leases are live.
            group_live: f(
                "select exists (select 1 from {s}.groups where queue = $1 and grp = $2) \
                 or exists (select 1 from {s}.slots where queue = $1 and grp = $2), \
                 (select count(*) from {s}.members m where m.queue = $1 and m.grp = $2 \
                  and m.last_seen + make_interval(secs => least(m.ttl_ms, {ttl_cap})::float8 / 1000) \
                  > clock_timestamp()), \
                 (select count(*) from {s}.slots where queue = $1 and grp = $2 and owner is not null \
                  and lease_expiry > clock_timestamp())",
            ),
            // The notification names the queue and the slot (`queue\nslot`),
            // so a consumer gives read room back to that slot only.
            // Every publish checks the queue's layout in the same statement:
            // its slot count ($9, or $11 with a fence) is the queue's and
            // every group's, or nothing is inserted (C23: a count changed in
            // the table while in use would move keys).
            publish: f(
                "with ins as (insert into {s}.events (queue, slot, key, message_id, correlation_id, headers, payload) \
                 select $1, $2::int, $3::text, $4::text, $5::text, $6::jsonb, $7::bytea where (select slots from {s}.queues where queue = $1) = $9::int \
                 and not exists (select 1 from {s}.groups where queue = $1 and slots <> $9::int) returning 1) \
                 select pg_notify($8, $1 || chr(10) || $2::int::text) from ins",
            ),
            // The fence row and the event in one statement: no event (and no
            // row back) when the scope's fence holds a higher token.
            // The fence row holds exactly this token: share-lock it (a
            // higher token's update waits for this commit, and an update
            // that committed first is seen: the row then no longer
            // matches) and insert. Publishes sharing a token do not block
            // each other.
            publish_fence_held: f(
                "with f as (select 1 from {s}.publish_fences where queue = $1 and scope = $9 and token = $10 for share), \
                 ins as (insert into {s}.events (queue, slot, key, message_id, correlation_id, headers, payload) \
                 select $1, $2::int, $3::text, $4::text, $5::text, $6::jsonb, $7::bytea from f where (select slots from {s}.queues where queue = $1) = $11::int \
                 and not exists (select 1 from {s}.groups where queue = $1 and slots <> $11::int) \
                 returning 1) \
                 select pg_notify($8, $1 || chr(10) || $2::int::text) from ins",
            ),
            publish_fenced: f(
                "with f as (insert into {s}.publish_fences (queue, scope, token) values ($1, $9, $10) \
                 on conflict (queue, scope) do update set token = excluded.token \
                 where {s}.publish_fences.token <= excluded.token returning 1), \
                 ins as (insert into {s}.events (queue, slot, key, message_id, correlation_id, headers, payload) \
                 select $1, $2::int, $3::text, $4::text, $5::text, $6::jsonb, $7::bytea from f where (select slots from {s}.queues where queue = $1) = $11::int \
                 and not exists (select 1 from {s}.groups where queue = $1 and slots <> $11::int) \
                 returning 1) \
                 select pg_notify($8, $1 || chr(10) || $2::int::text) from ins",
            ),
            live_members: Arc::from(lease.live_members.as_str()),
            leave: Arc::from(lease.leave.as_str()),
            // `acquire` for every slot of $3 (an `int[]`) in one statement
            // (one round trip, not one per slot: at 400 ms round trips the
            // leases taken first expired before the last was taken). The
            // rows are locked in slot order, skipping those locked now (a
            // settlement of the owner in flight): those are taken at the
            // next look, like a slot still held by another member.
            acquire_many: f(
                "with l as (select s.slot from {s}.slots s where s.queue = $1 and s.grp = $2 \
                  and s.slot = any($3) and (s.owner is null or s.lease_expiry is null \
                  or s.lease_expiry <= clock_timestamp() or s.owner = $4) order by s.slot for update skip locked) \
                 update {s}.slots s set owner = $4, generation = s.generation + 1, \
                 lease_expiry = clock_timestamp() + make_interval(secs => $5::float8 / 1000) from l \
                 where s.queue = $1 and s.grp = $2 and s.slot = l.slot and (s.owner is null \
                 or s.lease_expiry is null or s.lease_expiry <= clock_timestamp() or s.owner = $4) \
                 returning s.slot, s.generation, s.cursor_txid::text, s.cursor_id",
            ),
            // The read marks of slots $3, read after their acquisition
            // committed (a statement of its own: its snapshot then sees
            // every read of the earlier owner, which passed the fence
            // before the acquisition).
            read_marks: f(
                "select slot, read_txid::text, read_id from {s}.read_marks where queue = $1 and grp = $2 \
                 and slot = any($3)",
            ),
            // The keeper's round, in one statement (one round trip): the
            // member's heartbeat, with its lease TTL ($4, ms), while the
            // group of epoch $5 (the one the member joined) is recorded
            // (nothing recorded once it was removed, or removed and created
            // again), and the renewal of the slots $6 it holds unexpired.
            // The group row `for key share` first: a removal (which takes
            // it `for update`, then the slot rows) sees this heartbeat, or
            // this waits for it and then finds nothing, and renews nothing.
            // One row: whether the group was seen, the renewed slots and
            // their generations.
            keep: f(
                "with g as (select 1 from {s}.groups where queue = $1 and grp = $2 and epoch = $5 for key share), \
                 hb as (insert into {s}.members (queue, grp, member, last_seen, ttl_ms) \
                  select $1, $2, $3, clock_timestamp(), $4::bigint from g on conflict (queue, grp, member) \
                  do update set last_seen = clock_timestamp(), ttl_ms = excluded.ttl_ms returning 1), \
                 r as (update {s}.slots set lease_expiry = clock_timestamp() \
                  + make_interval(secs => $4::bigint::float8 / 1000) where queue = $1 and grp = $2 and owner = $3 \
                  and slot = any($6) and lease_expiry > clock_timestamp() and exists (select 1 from g) \
                  returning slot, generation) \
                 select (select count(*) from hb), coalesce(array_agg(slot order by slot), '{}'::int[]), \
                 coalesce(array_agg(generation order by slot), '{}'::bigint[]) from r",
            ),
            release: Arc::from(lease.release.as_str()),
            release_all: Arc::from(lease.release_all.as_str()),
            // Every owned slot's cursor in one statement (a round trip per
            // slot stalled the read loop every heartbeat): $3 slots, $4
            // generations, $5/$6 cursor positions (transaction id as text,
            // event id), $7 the owner. Returns the slots still owned.
            advance: f(
                "with req as (select * from unnest($3::int[], $4::bigint[], $5::text[], $6::bigint[]) \
                  as r(slot, gen, ctx, cid)), \
                 own as (select r.slot, r.ctx::xid8 as ctx, r.cid from req r join {s}.slots s on s.queue = $1 \
                  and s.grp = $2 and s.slot = r.slot and s.owner = $7 and s.generation = r.gen \
                  and s.lease_expiry > clock_timestamp() for key share of s), \
                 up as (update {s}.slots s set cursor_txid = o.ctx, cursor_id = o.cid from own o \
                  where s.queue = $1 and s.grp = $2 and s.slot = o.slot returning 1) \
                 select slot from own",
            ),
            // `offset 0` keeps each `not exists` a per-row primary-key probe:
            // flattened into an anti-join, a generic plan with a new queue's
            // (absent) statistics scanned every acknowledgement of the
            // group for every row read.
            // Every owned slot in one statement: $3 slots, $4 generations,
            // $5/$6 read positions (transaction id as text, event id), $7
            // the owner, $8 rows to read from each slot (a slot's own limit). Each row comes with the
            // attempts recorded for it; the statement also moves the slot's
            // read mark to the last row read, durably before any of them is
            // delivered (monotonic, so a stale owner's late mark is harmless).
            // The owned slot rows are taken `for key share`, like a
            // settlement's: a group's removal waits for a read that passed
            // the fence, so its mark never outlives the group.
            // The final order names `got`'s columns: a bare `txid` would be
            // the output column `txid::text`, and text order puts
            // transaction id 100000 before 99999 (a key's events came out
            // of order whenever one read spanned a change in digit count).
            read: f(
                "with req as (select * from unnest($3::int[], $4::bigint[], $5::text[], $6::bigint[], $8::int[]) \
                  as r(slot, gen, rtx, rid, lim)), \
                 r as (select q.* from req q join {s}.slots s on s.queue = $1 and s.grp = $2 and s.slot = q.slot \
                  and s.owner = $7 and s.generation = q.gen and s.lease_expiry > clock_timestamp() \
                  for key share of s), \
                 got as (select r.slot, e.id, e.txid, e.key, e.message_id, e.correlation_id, e.headers, \
                  e.payload, (select a.attempts from {s}.attempts a where a.queue = $1 and a.grp = $2 \
                   and a.event_id = e.id offset 0) as recorded \
                  from r cross join lateral (select e.* from {s}.events e where e.queue = $1 and e.slot = r.slot \
                   and {after_read} \
                   and {commit_safe} \
                   and not exists (select 1 from {s}.acked a where a.queue = $1 and a.grp = $2 \
                    and a.event_id = e.id offset 0) \
                   and not exists (select 1 from {s}.halted h where h.queue = $1 and h.grp = $2 \
                    and h.key = e.key and (e.txid, e.id) > (h.txid, h.event_id)) \
                   {read_order} limit r.lim) e), \
                 last as (select distinct on (slot) slot, txid, id from got order by slot, txid desc, id desc), \
                 mark as (insert into {s}.read_marks (queue, grp, slot, read_txid, read_id) \
                  select $1, $2, slot, txid, id from last on conflict (queue, grp, slot) do update \
                  set read_txid = excluded.read_txid, read_id = excluded.read_id \
                  where (excluded.read_txid, excluded.read_id) > ({s}.read_marks.read_txid, {s}.read_marks.read_id)) \
                 select slot, id, txid::text, key, message_id, correlation_id, headers::text, payload, \
                 coalesce(recorded, 0) from got order by got.slot, got.txid, got.id",
            ),
            park: f(
                "with {own}, d as (insert into {s}.dead (queue, grp, event_id, message_id, key, reason) \
                 select $1, $2, $6, $7, $8, $9 from own \
                 on conflict (queue, grp, event_id, message_id) do nothing), \
                 ins as (insert into {s}.acked (queue, grp, slot, event_id, txid) \
                 select $1, $2, $3, $6, (select e.txid from {s}.events e where e.id = $6) from own \
                 on conflict do nothing), \
                 del as (delete from {s}.attempts where queue = $1 and grp = $2 and event_id = $6 \
                 and exists (select 1 from own)) select count(*) from own",
            ),
            // The head's read position goes with it: the key's later events
            // are held at the database (the read skips them) until resolved.
            halt: f(
                "with {own}, h as (insert into {s}.halted (queue, grp, key, slot, event_id, message_id, reason, txid) \
                 select $1, $2, $8, $3, $6, $7, $9, $10::text::xid8 from own \
                 on conflict (queue, grp, key) do update set slot = excluded.slot, event_id = excluded.event_id, \
                 message_id = excluded.message_id, reason = excluded.reason, action = null, txid = excluded.txid) \
                 select count(*) from own",
            ),
            resolved: f(
                "delete from {s}.halted h where h.queue = $1 and h.grp = $2 and h.slot = any($3) \
                 and h.action is not null and exists (select 1 from {s}.slots s where s.queue = h.queue \
                 and s.grp = h.grp and s.slot = h.slot and s.owner = $4 and s.lease_expiry > clock_timestamp()) \
                 returning h.key, h.action, h.slot, h.event_id, h.txid::text",
            ),
            scopes: f(
                "select s.slot, case when s.lease_expiry > clock_timestamp() then s.owner end, s.generation, \
                 (select count(*) from {s}.events e where e.queue = s.queue and e.slot = s.slot \
                   and (e.txid, e.id) > (s.cursor_txid, s.cursor_id) \
                   and not exists (select 1 from {s}.acked a where a.queue = s.queue and a.grp = s.grp \
                   and a.event_id = e.id)), \
                 (select count(*) from {s}.halted h where h.queue = s.queue and h.grp = s.grp and h.slot = s.slot) \
                 from {s}.slots s where s.queue = $1 and s.grp = $2 order by s.slot",
            ),
            halted: f(
                "select h.key, h.slot, h.message_id, h.reason, greatest(coalesce(a.attempts, 0), 1), \
                 (select count(*) from {s}.events e where e.queue = h.queue and e.key = h.key \
                  and (e.txid, e.id) > (h.txid, h.event_id) and not exists (select 1 from {s}.acked k \
                  where k.queue = h.queue and k.grp = h.grp and k.event_id = e.id)) \
                 from {s}.halted h left join {s}.attempts a on a.queue = h.queue and a.grp = h.grp \
                 and a.event_id = h.event_id where h.queue = $1 and h.grp = $2 and h.action is null order by h.key",
            ),
            hot_keys: f(
                "select e.key, count(*) from {s}.events e join {s}.slots s on s.queue = e.queue \
                 and s.grp = $2 and s.slot = e.slot where e.queue = $1 and e.key is not null \
                 and (e.txid, e.id) > (s.cursor_txid, s.cursor_id) \
                 and not exists (select 1 from {s}.acked a where a.queue = $1 and a.grp = $2 and a.event_id = e.id) \
                 group by e.key order by 2 desc, 1 limit $3",
            ),
            dead: f("select message_id, key, reason from {s}.dead where queue = $1 and grp = $2 order by id"),
            op_ack: f(
                "with h as (select queue, grp, slot, event_id, txid from {s}.halted where queue = $1 and grp = $2 \
                 and key = $3), a as (insert into {s}.acked (queue, grp, slot, event_id, txid) \
                 select queue, grp, slot, event_id, coalesce(txid, '0') from h on conflict do nothing) \
                 delete from {s}.attempts t using h where t.queue = h.queue and t.grp = h.grp \
                 and t.event_id = h.event_id",
            ),
            op_dead: f("insert into {s}.dead (queue, grp, event_id, message_id, key, reason) \
                 select queue, grp, event_id, message_id, key, 'operator: ' || reason from {s}.halted \
                 where queue = $1 and grp = $2 and key = $3 \
                 on conflict (queue, grp, event_id, message_id) do nothing"),
            op_resume: f(
                "delete from {s}.attempts a using {s}.halted h where h.queue = $1 and h.grp = $2 \
                 and h.key = $3 and a.queue = h.queue and a.grp = h.grp and a.event_id = h.event_id",
            ),
            op_mark: f(
                "update {s}.halted set action = $4 where queue = $1 and grp = $2 and key = $3 \
                 and action is null",
            ),
            // Many deliveries at once: $4 slots, $5 generations, $6 event ids
            // (and, for acknowledgements, $7 their transaction ids);
            // only the (slot, generation) pairs this owner still holds count.
            // Records attempt number $7[i] of each event (a first attempt
            // is not asked for: the read mark covers it).
            attempt_batch: f(
                "with req as (select * from unnest($4::int[], $5::bigint[], $6::bigint[], $7::int[]) \
                 as r(slot, gen, event_id, n)), \
                 own as (select r.event_id, r.n from req r join {s}.slots s on s.queue = $1 and s.grp = $2 \
                 and s.slot = r.slot and s.owner = $3 and s.generation = r.gen \
                 and s.lease_expiry > clock_timestamp() for key share of s) \
                 insert into {s}.attempts (queue, grp, event_id, attempts) select $1, $2, event_id, n from own \
                 on conflict (queue, grp, event_id) do update \
                 set attempts = greatest({s}.attempts.attempts, excluded.attempts) \
                 returning event_id, attempts",
            ),
            ack_batch: f(
                "with req as (select * from unnest($4::int[], $5::bigint[], $6::bigint[], $7::text[]) \
                 as r(slot, gen, event_id, txid)), \
                 own as (select r.slot, r.event_id, r.txid from req r join {s}.slots s on s.queue = $1 \
                 and s.grp = $2 and s.slot = r.slot and s.owner = $3 and s.generation = r.gen \
                 and s.lease_expiry > clock_timestamp() for key share of s), \
                 ins as (insert into {s}.acked (queue, grp, slot, event_id, txid) \
                 select $1, $2, slot, event_id, txid::xid8 from own on conflict do nothing), \
                 del as (delete from {s}.attempts a using own o where a.queue = $1 and a.grp = $2 \
                 and a.event_id = o.event_id) \
                 select event_id, 1 from own",
            ),
            // The acknowledgements below the durable cursors of the slots
            // owner $3 holds: nothing reads them again (a read starts past
            // the cursor). Deleting them moves no cursor, so a stale owner's
            // sweep is harmless. One statement, a hash join over the
            // group's acknowledgements (about 1.3 us a row deleted, idle):
            // in ranges of event ids with pauses between, each range a
            // commit, the ratio fell (BENCHMARKS.md, 2026-12-04, fourth
            // session).
            sweep_acked: f(
                "delete from {s}.acked a using {s}.slots s where a.queue = $1 and a.grp = $2 \
                 and s.queue = $1 and s.grp = $2 and s.slot = a.slot and s.owner = $3 \
                 and (a.txid, a.event_id) <= (s.cursor_txid, s.cursor_id)",
            ),
            // Events every group of the queue has passed, in each of the
            // slots $2 (an `int[]`): below the lowest cursor (a halted head
            // is never below a cursor), up to $3 per slot, in one statement.
            // Every group that ever subscribed has its slot rows, running or
            // stopped, so a stopped group's cursor holds retention back
            // until the group is removed. Runs after `share_queue`, in its
            // transaction.
            retention: f(
                "delete from {s}.events where id in (select d.id from unnest($2::int[]) as r(slot) \
                 cross join lateral (select cursor_txid, cursor_id from {s}.slots where queue = $1 \
                  and slot = r.slot order by cursor_txid, cursor_id limit 1) f \
                 cross join lateral (select e.id from {s}.events e where e.queue = $1 and e.slot = r.slot \
                  and (e.txid, e.id) <= (f.cursor_txid, f.cursor_id) order by e.txid, e.id limit $3) d)",
            ),
        }
    }
}
