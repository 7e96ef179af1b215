-- Version 2: the slot count each consumer group started with, and the read
-- position of a halted head, so a halted key's later events are held at the
-- database while the rest of its slot advances.
create table if not exists {s}.groups (
    queue text not null, grp text not null, slots int not null,
    primary key (queue, grp));
insert into {s}.groups (queue, grp, slots)
    select s.queue, s.grp, q.slots from {s}.slots s join {s}.queues q on q.queue = s.queue
    group by s.queue, s.grp, q.slots
    on conflict do nothing;
alter table {s}.halted add column if not exists txid xid8;
update {s}.halted h set txid = e.txid from {s}.events e where e.id = h.event_id and h.txid is null;
create index if not exists events_key on {s}.events (queue, key, txid, id);
