-- Version 9: each member row carries the lease TTL its subscription runs
-- with, so a process that knows no subscription's configuration (the admin:
-- `keyorder groups`, removing a group) tells a live member from one that
-- stopped without leaving. Rows of earlier versions count as live for a
-- minute after their last heartbeat.
alter table {s}.members add column if not exists ttl_ms bigint not null default 60000;
