-- Version 6: publish fences. Per queue and scope, the highest token a fenced
-- publish carried; a publish with a lower token is refused and stores nothing
-- (a stalled outbox relay's late publish after a newer owner published).
create table if not exists {s}.publish_fences (
    queue text not null, scope text not null, token bigint not null,
    primary key (queue, scope));
