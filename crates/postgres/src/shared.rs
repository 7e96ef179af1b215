//! SQL the PostgreSQL adapter shares with other crates (the transactional
//! outbox, `keyorder-outbox`, relays records with it): commit-safe reads and
//! fenced slot leases. The adapter builds its own statements from these
//! same pieces, so there is one definition of each rule.
//!
//! Every builder takes a schema name that the caller has checked with
//! [`check_schema`]: the text is formatted into SQL (run it with
//! `sqlx::AssertSqlSafe`).
//!
//! ```
//! use keyorder_postgres::shared::{after_position, check_schema, commit_safe, LeaseSql};
//! check_schema("my_outbox")?;
//! let read = format!(
//!     "select r.id from my_outbox.records r where {} and {} order by r.txid, r.id",
//!     after_position("r", 1, 2),
//!     commit_safe("r"),
//! );
//! assert!(read.contains("pg_snapshot_xmin(pg_current_snapshot())"));
//! let lease = LeaseSql::new("my_outbox");
//! assert!(lease.acquire.contains("generation = generation + 1"));
//! # Ok::<(), keyorder_core::Error>(())
//! ```

use keyorder_core::{Error, Result};

/// The column a commit-safe log carries: the inserting transaction's id.
pub const TXID_COLUMN: &str = "txid xid8 not null default pg_current_xact_id()";

/// Commit-safe visibility of the rows aliased `alias`: only rows of
/// transactions below the snapshot's `xmin`, which have all ended, so a read
/// position `(txid, id)` never passes a row whose transaction commits later.
/// The cost: a long-running transaction anywhere in the cluster holds reads
/// back until it ends.
pub fn commit_safe(alias: &str) -> String {
    format!("{alias}.txid < pg_snapshot_xmin(pg_current_snapshot())")
}

/// Rows after a read position: `({alias}.txid, {alias}.id) > ($t::text::xid8, $i)`,
/// with the position's transaction id bound as text at parameter `txid_param`
/// and its row id at `id_param`.
pub fn after_position(alias: &str, txid_param: u8, id_param: u8) -> String {
    after(alias, &format!("${txid_param}::text::xid8"), &format!("${id_param}"))
}

/// Rows after a read position given as SQL expressions (an `xid8` and a
/// `bigint`), for statements that read many positions at once (for example
/// from `unnest` of arrays): `({alias}.txid, {alias}.id) > ({txid}, {id})`.
pub fn after(alias: &str, txid: &str, id: &str) -> String {
    format!("({alias}.txid, {alias}.id) > ({txid}, {id})")
}

/// The read order that goes with [`after_position`]: `order by txid, id`.
pub fn read_order(alias: &str) -> String {
    format!("order by {alias}.txid, {alias}.id")
}

/// Checks a schema name before it is formatted into SQL: a lower-case
/// identifier of `[a-z0-9_]`, not starting with a digit, at most 40 bytes.
pub fn check_schema(schema: &str) -> Result<()> {
    let ok = !schema.is_empty()
        && schema.len() <= 40
        && schema
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        && !schema.starts_with(|c: char| c.is_ascii_digit());
    if ok {
        Ok(())
    } else {
        Err(Error::Url(format!(
            "schema={}: expected a lower-case identifier of [a-z0-9_], at most 40 characters",
            keyorder_core::key::redact(schema)
        )))
    }
}

/// Fenced slot leases: one `slots` row per (queue, group, slot) with owner,
/// generation and expiry on the database's clock (`clock_timestamp()`), and
/// a `members` table of live instances.
///
/// Parameters, in every statement that names them: `$1` queue, `$2` group,
/// `$3` slot, `$4` owner, `$5` generation (the fence) or TTL in milliseconds
/// (acquire, renew: see each field).
#[derive(Debug, Clone)]
pub struct LeaseSql {
    /// DDL of `{schema}.slots` (its cursor columns are the adapter's read
    /// position; other users may ignore them).
    pub create_slots: String,
    /// DDL of `{schema}.members`.
    pub create_members: String,
    /// Records member `$3` of (`$1`, `$2`) as seen now.
    pub heartbeat: String,
    /// Members of (`$1`, `$2`) seen within `$3` milliseconds, by name.
    pub live_members: String,
    /// Removes member `$3` of (`$1`, `$2`).
    pub leave: String,
    /// Renews, for `$4` milliseconds, the slots `$5` (an `int[]`) owner `$3`
    /// still holds unexpired; returns `slot, generation` of each renewed one.
    pub renew: String,
    /// Takes slot `$3` for owner `$4` for `$5` milliseconds when it is free,
    /// expired or already `$4`'s, incrementing the generation; returns
    /// `generation, cursor_txid::text, cursor_id`.
    pub acquire: String,
    /// Frees slot `$3` if owner `$4` still holds it at generation `$5`.
    pub release: String,
    /// Frees every slot of (`$1`, `$2`) that owner `$3` holds, whatever the
    /// generation, taking each row `for update` like `release`. For closing:
    /// an `acquire` that committed after its caller stopped waiting (a
    /// future dropped at shutdown) left a lease the caller never recorded,
    /// which would otherwise stay live until it expires.
    pub release_all: String,
    /// The fence, a CTE named `own` to start a guarded statement with:
    /// one row while owner `$4` holds slot `$3` of (`$1`, `$2`) at
    /// generation `$5`, unexpired on the database's clock (locked `for key
    /// share`, so the owner cannot change under the statement: `acquire`
    /// and `release` take the row `for update` first; a renewal can).
    pub own: String,
}

impl LeaseSql {
    /// The statements over `{schema}.slots` and `{schema}.members`.
    pub fn new(schema: &str) -> LeaseSql {
        let f = |t: &str| t.replace("{s}", schema);
        LeaseSql {
            create_slots: f("create table if not exists {s}.slots (
                queue text not null, grp text not null, slot int not null,
                owner text, generation bigint not null default 0, lease_expiry timestamptz,
                cursor_txid xid8 not null default '0', cursor_id bigint not null default 0,
                primary key (queue, grp, slot))"),
            create_members: f("create table if not exists {s}.members (
                queue text not null, grp text not null, member text not null, last_seen timestamptz not null,
                primary key (queue, grp, member))"),
            heartbeat: f(
                "insert into {s}.members (queue, grp, member, last_seen) values ($1, $2, $3, clock_timestamp()) \
                 on conflict (queue, grp, member) do update set last_seen = clock_timestamp()",
            ),
            live_members: f("select member from {s}.members where queue = $1 and grp = $2 \
                 and last_seen > clock_timestamp() - make_interval(secs => $3::float8 / 1000) order by member"),
            leave: f("delete from {s}.members where queue = $1 and grp = $2 and member = $3"),
            renew: f(
                "update {s}.slots set lease_expiry = clock_timestamp() + make_interval(secs => $4::float8 / 1000) \
                 where queue = $1 and grp = $2 and owner = $3 and slot = any($5) and lease_expiry > clock_timestamp() \
                 returning slot, generation",
            ),
            // An owner change takes the row `for update`, the one lock that
            // conflicts with the fence's `for key share`: it waits for the
            // settlements in flight, and those that come after it see the
            // new generation. Renewals and cursor moves (no-key updates)
            // neither wait for settlements nor hold them up.
            acquire: f(
                "with l as (select 1 from {s}.slots where queue = $1 and grp = $2 and slot = $3 \
                 and (owner is null or lease_expiry is null or lease_expiry <= clock_timestamp() or owner = $4) \
                 for update) \
                 update {s}.slots set owner = $4, generation = generation + 1, \
                 lease_expiry = clock_timestamp() + make_interval(secs => $5::float8 / 1000) \
                 where queue = $1 and grp = $2 and slot = $3 and exists (select 1 from l) \
                 and (owner is null or lease_expiry is null or lease_expiry <= clock_timestamp() or owner = $4) \
                 returning generation, cursor_txid::text, cursor_id",
            ),
            release: f(
                "with l as (select 1 from {s}.slots where queue = $1 and grp = $2 and slot = $3 \
                 and owner = $4 and generation = $5 for update) \
                 update {s}.slots set owner = null, lease_expiry = null \
                 where queue = $1 and grp = $2 and slot = $3 and owner = $4 and generation = $5 \
                 and exists (select 1 from l)",
            ),
            release_all: f(
                "with l as (select slot from {s}.slots where queue = $1 and grp = $2 and owner = $3 for update) \
                 update {s}.slots s set owner = null, lease_expiry = null from l \
                 where s.queue = $1 and s.grp = $2 and s.slot = l.slot and s.owner = $3",
            ),
            own: f(
                "own as (select 1 from {s}.slots where queue = $1 and grp = $2 and slot = $3 and owner = $4 \
                 and generation = $5 and lease_expiry > clock_timestamp() for key share)",
            ),
        }
    }
}

/// The driver's (sqlx) URL options keyorder passes on; `options[...]`
/// (server settings) too.
pub const DRIVER_OPTIONS: &[&str] = &[
    "sslmode",
    "ssl-mode",
    "sslrootcert",
    "ssl-root-cert",
    "ssl-ca",
    "sslcert",
    "ssl-cert",
    "sslkey",
    "ssl-key",
    "application_name",
    "options",
    "statement-cache-capacity",
    "host",
    "hostaddr",
    "port",
    "dbname",
    "user",
    "password",
];

/// Whether `key` is a URL option of the driver keyorder passes on.
pub fn is_driver_option(key: &str) -> bool {
    DRIVER_OPTIONS.contains(&key) || (key.starts_with("options[") && key.ends_with(']'))
}

/// Refuses `sslmode=verify-ca`: the driver trusts the public (webpki) roots
/// beside `sslrootcert=` and checks no host name in that mode, so any
/// publicly trusted certificate for any name would pass. `verify-full`
/// checks the name.
pub fn check_ssl_mode(key: &str, value: &str) -> keyorder_core::Result<()> {
    if matches!(key, "sslmode" | "ssl-mode") && value.eq_ignore_ascii_case("verify-ca") {
        return Err(keyorder_core::Error::Url(
            "postgres: sslmode=verify-ca is refused: the driver trusts the public roots beside sslrootcert= and \
             checks no host name in that mode, so any publicly trusted certificate would pass; use \
             sslmode=verify-full (with sslrootcert= for a private CA)"
                .into(),
        ));
    }
    Ok(())
}

/// Refuses a URL handed to the driver with an option not on the
/// allow-list ([`DRIVER_OPTIONS`]), naming it, never its value: the driver
/// logs an option it does not know at WARN, value and all (a password).
pub fn check_driver_url(url: &url::Url) -> keyorder_core::Result<()> {
    for (k, v) in url.query_pairs() {
        check_ssl_mode(&k, &v)?;
        if !is_driver_option(&k) {
            return Err(keyorder_core::Error::Url(format!(
                "postgres: URL option `{}` is not one the driver takes (it takes: {})",
                keyorder_core::redact::text(&k),
                DRIVER_OPTIONS.join(", ")
            )));
        }
    }
    Ok(())
}
