//! Every statement of one outbox schema, built once.

use keyorder_postgres::shared::{after, commit_safe, read_order, LeaseSql, TXID_COLUMN};

/// The `queue` value of the outbox's lease rows (the relay group is `grp`).
pub(crate) const LEASE_QUEUE: &str = "outbox";

/// Every state a record can be in.
const STATES: &str = "('pending', 'published', 'abandoned', 'parked', 'discarded')";

/// Before a publish: the fence, the record still pending, no earlier record
/// of its key pending (`{lower}`), the key not halted; then the attempt is
/// counted durably. Returns (owned, exists, earlier, halted, attempts, lease
/// milliseconds left).
const BEGIN: &str = "with {own}, \
     r as (select id, category, key, seq from {s}.records where id = $6 and state = 'pending'), \
     lower as ({lower}), \
     h as (select 1 from {s}.halted h join r on h.category = r.category and h.key = r.key), \
     up as (update {s}.records set attempts = attempts + 1 where id = $6 and state = 'pending' \
     and exists (select 1 from own) and not exists (select 1 from lower) \
     and not exists (select 1 from h) returning attempts) \
     select (select count(*) from own), (select count(*) from r), (select count(*) from lower), \
     (select count(*) from h), (select attempts from up), \
     (select (extract(epoch from (lease_expiry - clock_timestamp())) * 1000)::bigint \
      from {s}.slots where queue = $1 and grp = $2 and slot = $3)";

/// An earlier record of the key still pending (the per-key order check).
const LOWER: &str = "select 1 from {s}.records p join r on p.category = r.category and p.key = r.key \
     and p.seq < r.seq where p.state = 'pending' limit 1";

/// The statements of one schema (run with `AssertSqlSafe`: the schema name
/// is checked as an identifier before it is formatted in).
#[derive(Debug)]
pub(crate) struct Sql {
    pub(crate) migrate: Vec<String>,
    pub(crate) settings_init: String,
    pub(crate) settings: String,
    pub(crate) settings_epoch: String,
    pub(crate) stage: String,
    pub(crate) lease: LeaseSql,
    pub(crate) ensure_slots: String,
    pub(crate) read: String,
    pub(crate) begin: String,
    pub(crate) begin_unordered: String,
    pub(crate) resolve: String,
    pub(crate) halt: String,
    pub(crate) halted: String,
    pub(crate) unhalt: String,
    pub(crate) reset_attempts: String,
    pub(crate) dead: String,
    pub(crate) purge: String,
    pub(crate) applied_get: String,
    pub(crate) applied_put: String,
    pub(crate) status: String,
    pub(crate) retain: String,
    pub(crate) stuck: String,
    pub(crate) lock_record: String,
    pub(crate) later: String,
    pub(crate) requeue: String,
    pub(crate) discard: String,
    pub(crate) undead: String,
}

impl Sql {
    pub(crate) fn new(schema: &str) -> Sql {
        let lease = LeaseSql::new(schema);
        let f = |t: &str| -> String {
            t.replace("{own}", &lease.own)
                .replace("{after}", &after("e", "c.txid::xid8", "c.id"))
                .replace("{commit_safe}", &commit_safe("e"))
                .replace("{read_order}", &read_order("e"))
                .replace("{txid}", TXID_COLUMN)
                .replace("{states}", STATES)
                .replace("{s}", schema)
        };
        let mut migrate: Vec<String> = [
            "create schema if not exists {s}",
            "create table if not exists {s}.settings (id int primary key check (id = 1), slots int not null)",
            // The outbox's epoch: a random id fixed at the first migration,
            // part of every publish fence scope, so an outbox re-created
            // from scratch (generations from 1 again) never meets the
            // fences its predecessor left on the broker.
            "alter table {s}.settings add column if not exists epoch text",
            "create table if not exists {s}.counters (
                category text not null, key text not null, seq bigint not null,
                primary key (category, key))",
            "create table if not exists {s}.records (
                id bigserial primary key,
                message_id text not null,
                category text not null,
                key text not null,
                slot int not null,
                seq bigint not null,
                correlation_id text,
                headers jsonb not null default '{}',
                payload bytea not null,
                {txid},
                created_at timestamptz not null default clock_timestamp(),
                state text not null default 'pending'
                    constraint records_state check (state in {states}),
                attempts int not null default 0,
                reason text,
                resolved_by text,
                resolved_at timestamptz)",
            "create unique index if not exists records_key_seq on {s}.records (category, key, seq)",
            "create index if not exists records_pending on {s}.records (slot, txid, id) where state = 'pending'",
            // Schemas made before `discarded` existed: swap the unnamed
            // check for the named one (once; later runs find it).
            "do $$ begin
                if not exists (select 1 from pg_constraint
                    where conrelid = '{s}.records'::regclass and conname = 'records_state') then
                    alter table {s}.records drop constraint if exists records_state_check;
                    alter table {s}.records add constraint records_state check (state in {states});
                end if;
            end $$",
            // The age of the oldest pending record, and the records given up
            // on (few), without scanning the table.
            "create index if not exists records_pending_age on {s}.records (created_at) where state = 'pending'",
            "create index if not exists records_stuck on {s}.records (id) where state in ('abandoned', 'parked')",
            "create table if not exists {s}.halted (
                category text not null, key text not null, record_id bigint not null, reason text not null,
                halted_at timestamptz not null default clock_timestamp(),
                primary key (category, key))",
            "create table if not exists {s}.dead (
                id bigserial primary key, record_id bigint not null, message_id text not null,
                category text not null, key text not null, seq bigint not null, reason text not null,
                parked_at timestamptz not null default clock_timestamp())",
            "create table if not exists {s}.applied (
                name text not null, key text not null, seq bigint not null,
                primary key (name, key))",
        ]
        .iter()
        .map(|t| f(t))
        .collect();
        migrate.push(lease.create_slots.clone());
        migrate.push(lease.create_members.clone());
        Sql {
            migrate,
            settings_init: f("insert into {s}.settings (id, slots) values (1, $1) on conflict (id) do nothing"),
            settings: f("select slots, epoch from {s}.settings where id = 1"),
            settings_epoch: f("update {s}.settings set epoch = gen_random_uuid()::text where id = 1 and epoch is null"),
            // One statement: the counter row's lock is held until the
            // caller's transaction ends, so same-key stagers serialise and
            // the sequence is the key's commit order.
            stage: f(
                "with c as (insert into {s}.counters (category, key, seq) values ($1, $2, 1) \
                 on conflict (category, key) do update set seq = {s}.counters.seq + 1 returning seq), \
                 st as (select slots from {s}.settings where id = 1) \
                 insert into {s}.records (message_id, category, key, slot, seq, correlation_id, headers, payload) \
                 select $3, $1, $2, mod($4::bigint, st.slots)::int, c.seq, $5, $6::jsonb, $7 from c, st \
                 returning id, seq",
            ),
            ensure_slots: f(
                "insert into {s}.slots (queue, grp, slot) select $1, $2, g from generate_series(0, $3 - 1) g \
                 on conflict do nothing",
            ),
            // Pending records of every owned slot after its read position,
            // commit-safe, in (txid, id) order: $3 slots, $4 generations,
            // $5 position txids (text), $6 position ids, $7 owner, $8 limit per slot.
            read: f(
                "select c.slot, e.id, e.txid::text, e.message_id, e.category, e.key, e.seq, e.correlation_id, \
                 e.headers::text, e.payload \
                 from unnest($3::int[], $4::bigint[], $5::text[], $6::bigint[]) as c(slot, gen, txid, id) \
                 join {s}.slots s on s.queue = $1 and s.grp = $2 and s.slot = c.slot and s.owner = $7 \
                 and s.generation = c.gen and s.lease_expiry > clock_timestamp() \
                 cross join lateral (select * from {s}.records e where e.slot = c.slot and e.state = 'pending' \
                 and {after} and {commit_safe} {read_order} limit $8) e \
                 order by c.slot, e.txid, e.id",
            ),
            begin: f(&BEGIN.replace("{lower}", LOWER)),
            // The baseline of `RelayConfig::ignore_ordering`: the same
            // statement without the check of the key's earlier records.
            begin_unordered: f(&BEGIN.replace("{lower}", "select 1 where false")),
            // Marks a record published, abandoned or parked ($7) with a
            // reason ($8), only while this owner holds the slot at this
            // generation: the same statement checks the fence.
            resolve: f("with {own}, up as (update {s}.records set state = $7, reason = $8, \
                 resolved_by = $4 || ':' || $5::text, resolved_at = clock_timestamp() \
                 where id = $6 and state = 'pending' and exists (select 1 from own) \
                 returning id, message_id, category, key, seq), \
                 d as (insert into {s}.dead (record_id, message_id, category, key, seq, reason) \
                 select id, message_id, category, key, seq, $8 from up where $7 = 'parked') \
                 select (select count(*) from own), (select count(*) from up)"),
            halt: f(
                "with {own}, r as (select category, key from {s}.records where id = $6 and state = 'pending'), \
                 h as (insert into {s}.halted (category, key, record_id, reason) \
                 select r.category, r.key, $6, $7 from r, own \
                 on conflict (category, key) do update set record_id = excluded.record_id, reason = excluded.reason) \
                 select count(*) from own",
            ),
            halted: f(
                "select h.category, h.key, h.record_id, h.reason, coalesce(r.attempts, 0), r.message_id \
                 from {s}.halted h left join {s}.records r on r.id = h.record_id order by h.category, h.key",
            ),
            unhalt: f("delete from {s}.halted where category = $1 and key = $2"),
            reset_attempts: f(
                "update {s}.records set attempts = 0 where category = $1 and key = $2 and state = 'pending'",
            ),
            dead: f("select record_id, message_id, category, key, seq, reason from {s}.dead order by id"),
            purge: f(
                "delete from {s}.records where id in (select id from {s}.records where state <> 'pending' \
                 and resolved_at < clock_timestamp() - make_interval(secs => $1::float8) limit $2)",
            ),
            applied_get: f("select seq from {s}.applied where name = $1 and key = $2"),
            applied_put: f("insert into {s}.applied (name, key, seq) values ($1, $2, $3) \
                 on conflict (name, key) do update set seq = excluded.seq where {s}.applied.seq < excluded.seq \
                 returning 1"),
            // One cheap statement for the gauges and `Outbox::status`: the
            // pending count and the oldest pending record through their
            // partial indexes, the given-up records through theirs.
            status: f("select (select count(*) from {s}.records where state = 'pending'), \
                 (select extract(epoch from clock_timestamp() - min(created_at))::float8 \
                  from {s}.records where state = 'pending'), \
                 (select count(*) from {s}.records where state = 'abandoned'), \
                 (select count(*) from {s}.records where state = 'parked'), \
                 (select count(*) from {s}.halted)"),
            // One bounded batch of published records, oldest first; rows
            // another relay is deleting are skipped, not waited for.
            retain: f(
                "delete from {s}.records where id = any(array(select id from {s}.records \
                 where state = 'published' order by id limit $1 for update skip locked))",
            ),
            stuck: f(
                "select id, message_id, category, key, seq, state, coalesce(reason, '') from {s}.records \
                 where state in ('abandoned', 'parked') and id > $1 order by id limit $2",
            ),
            // The record an operator names, locked, with whether its key is
            // halted on it, on another record, or not at all.
            lock_record: f("select r.id, r.category, r.key, r.seq, r.state, h.record_id \
                 from {s}.records r left join {s}.halted h on h.category = r.category and h.key = r.key \
                 where r.id = $1 for update of r"),
            // Later records of the key already published, or gone (purged:
            // counted as published), and the key's last staged sequence.
            later: f(
                "select (select count(*) from {s}.records where category = $1 and key = $2 and seq > $3 \
                  and state = 'published'), \
                 (select count(*) from {s}.records where category = $1 and key = $2 and seq > $3), \
                 (select seq from {s}.counters where category = $1 and key = $2)",
            ),
            // Back to pending with a fresh transaction id: the relays' read
            // positions are behind it, so it is read like a newly staged
            // record, in its key's sequence order.
            requeue: f(
                "update {s}.records set state = 'pending', attempts = 0, reason = null, \
                 resolved_by = null, resolved_at = null, txid = pg_current_xact_id() where id = $1",
            ),
            discard: f("update {s}.records set state = 'discarded', \
                 reason = 'discarded by operator' || coalesce(' (was ' || state || ': ' || reason || ')', ''), \
                 resolved_by = 'operator', resolved_at = clock_timestamp() where id = $1"),
            undead: f("delete from {s}.dead where record_id = $1"),
            lease,
        }
    }
}
