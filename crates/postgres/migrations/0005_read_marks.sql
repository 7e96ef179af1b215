-- Version 5: the furthest position any owner of a slot has read (delivered).
-- A first attempt needs no write of its own: a later owner counts an event
-- at or below the mark with no attempts row as attempted once.
create table if not exists {s}.read_marks (
    queue text not null, grp text not null, slot int not null,
    read_txid xid8 not null, read_id bigint not null,
    primary key (queue, grp, slot));
