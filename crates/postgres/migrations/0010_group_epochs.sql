-- Version 10: a group removed and created again never goes back. The
-- generation floor is at least every generation a removed group (or a
-- deleted queue) handed out: a group's slot rows start there, so a stale
-- handler of the removed group is fenced by the new one and a fencing token
-- never goes back. Each group row carries an epoch, so a member tells the
-- group it joined from a later one of the same name.
create table if not exists {s}.generation_floor (
    one bool primary key default true check (one), generation bigint not null);
insert into {s}.generation_floor (one, generation)
    select true, coalesce(max(generation), 0) from {s}.slots
    on conflict (one) do nothing;
create sequence if not exists {s}.group_epochs;
alter table {s}.groups add column if not exists epoch bigint not null default nextval('{s}.group_epochs');
