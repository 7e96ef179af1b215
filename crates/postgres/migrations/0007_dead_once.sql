-- Version 7: a dead letter is stored once per event and group. A park
-- retried after a commit whose outcome was unknown (a connection dropped
-- after the commit) used to store a second row; the park and the
-- operator's dead-letter now insert only when no row of the event exists,
-- and this index keeps that check a probe.
create index if not exists dead_event on {s}.dead (queue, grp, event_id);
