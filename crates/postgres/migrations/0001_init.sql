-- keyorder PostgreSQL transport, version 1. Placeholders in braces are
-- substituted before it runs: s is the configured schema (validated as an
-- identifier), create_slots and create_members the lease tables of
-- `keyorder_postgres::shared`, txid its transaction-id column.
create table if not exists {s}.queues (queue text primary key, slots int not null);
create table if not exists {s}.events (
    id bigserial primary key,
    queue text not null,
    slot int not null,
    key text,
    message_id text not null,
    correlation_id text,
    headers jsonb not null default '{}',
    payload bytea not null,
    {txid},
    enqueued_at timestamptz not null default clock_timestamp());
create index if not exists events_read on {s}.events (queue, slot, txid, id);
{create_slots};
{create_members};
create table if not exists {s}.attempts (
    queue text not null, grp text not null, event_id bigint not null, attempts int not null,
    primary key (queue, grp, event_id));
create table if not exists {s}.acked (
    queue text not null, grp text not null, slot int not null, event_id bigint not null,
    primary key (queue, grp, event_id));
create table if not exists {s}.halted (
    queue text not null, grp text not null, key text not null, slot int not null,
    event_id bigint not null, message_id text not null, reason text not null, action text,
    primary key (queue, grp, key));
create table if not exists {s}.dead (
    id bigserial primary key, queue text not null, grp text not null, event_id bigint not null,
    message_id text not null, key text, reason text not null,
    parked_at timestamptz not null default clock_timestamp());
