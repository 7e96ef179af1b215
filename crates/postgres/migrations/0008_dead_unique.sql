-- Version 8: one dead letter per event, group and message id, enforced.
-- Version 7's check (insert only when no row of the event exists) does not
-- hold against two overlapping parks (a retry that starts while the first
-- attempt's transaction still runs on the server): both see no row. Earlier
-- duplicates (the same event, group and message id; the first one stays)
-- are removed, then a unique index replaces version 7's. The message id is
-- part of the key because the baseline layout (`layout=plain`) stores ids of
-- its own table in the same column.
delete from {s}.dead d using {s}.dead e where d.queue = e.queue and d.grp = e.grp
    and d.event_id = e.event_id and d.message_id = e.message_id and d.id > e.id;
create unique index if not exists dead_once on {s}.dead (queue, grp, event_id, message_id);
drop index if exists {s}.dead_event;
