-- Version 3: the benchmark baseline's queue (`?layout=plain`), a plain
-- FOR UPDATE SKIP LOCKED competing-consumer table with the columns of
-- `events`, plus the claim: who holds a row, until when, and how many
-- claims it has had (the claim's fencing token).
create table if not exists {s}.plain_events (
    id bigserial primary key,
    queue text not null,
    slot int not null default 0,
    key text,
    message_id text not null,
    correlation_id text,
    headers jsonb not null default '{}',
    payload bytea not null,
    {txid},
    enqueued_at timestamptz not null default clock_timestamp(),
    locked_by text,
    locked_until timestamptz,
    attempts int not null default 0);
-- The claim walks a queue's rows in id order, skipping locked ones.
create index if not exists plain_events_claim on {s}.plain_events (queue, id);
