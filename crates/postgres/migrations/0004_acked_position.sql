-- Version 4: acknowledgements carry their event's transaction id, so a
-- cursor advance deletes the ones it passed by position alone (no join with
-- the log, which a planner with stale statistics joined badly); the key
-- index of version 2 goes (it tempted the planner into that join).
drop index if exists {s}.events_key;
alter table {s}.acked add column if not exists txid xid8 not null default '0';
