//! The Lua scripts: every step that must be atomic at the server (publish and
//! index, acquire and reclaim, fenced read, fenced acknowledgement, park,
//! trim, reap, operator actions) is one script, so it runs as one step on the
//! Redis server, on the server's clock.
//!
//! A key reaches a script, and is stored by one (index member, halted and
//! resolved field, dead-letter index member, wake-up), as its segment
//! ([`Names::segment`](crate::Names::segment)), never raw: a script that
//! builds a name concatenates `{category}:{segment}`, as `Names` does.
//!
//! A *holder* is `{owner}:{generation}`: the lease's value, and the name of
//! the owner's consumer in the stream's group, so a consumer name always
//! carries its generation.

use std::sync::LazyLock;

use redis::Script;

/// Milliseconds on the server's clock.
const NOW: &str = r"
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
";

fn script(body: &str) -> Script {
    Script::new(&format!("{NOW}\n{body}"))
}

/// Appends one entry to a partition stream and records the partition in the
/// index in the same step, then wakes the consumers.
///
/// KEYS: stream, index. ARGV: key segment, wake channel, field/value pairs...
pub(crate) static PUBLISH: LazyLock<Script> = LazyLock::new(|| {
    script(
        r"
local id = redis.call('XADD', KEYS[1], '*', unpack(ARGV, 3))
redis.call('ZADD', KEYS[2], now_ms(), ARGV[1])
redis.call('PUBLISH', ARGV[2], ARGV[1])
return id
",
    )
});

/// Appends to one stream (the keyless stream or a single-layout stream) and
/// wakes the consumers.
///
/// KEYS: stream. ARGV: wake channel, wake message, field/value pairs...
pub(crate) static APPEND: LazyLock<Script> = LazyLock::new(|| {
    script(
        r"
local id = redis.call('XADD', KEYS[1], '*', unpack(ARGV, 3))
redis.call('PUBLISH', ARGV[1], ARGV[2])
return id
",
    )
});

/// The publish fence: `true` when the fence key holds a token above
/// `token` (a newer owner of the scope published); otherwise records
/// `token` as the highest seen.
const FENCE: &str = r"
local function fenced(fence, token)
  local seen = tonumber(redis.call('GET', fence) or '0')
  local mine = tonumber(token)
  if seen > mine then return true end
  if seen < mine then redis.call('SET', fence, token) end
  return false
end
";

/// [`PUBLISH`] behind a publish fence: returns 0 (and stores nothing) when
/// the fence has seen a higher token, else 1.
///
/// KEYS: stream, index, fence. ARGV: key segment, wake channel, token, field/value pairs...
pub(crate) static PUBLISH_FENCED: LazyLock<Script> = LazyLock::new(|| {
    script(&format!(
        r"{FENCE}
if fenced(KEYS[3], ARGV[3]) then return 0 end
redis.call('XADD', KEYS[1], '*', unpack(ARGV, 4))
redis.call('ZADD', KEYS[2], now_ms(), ARGV[1])
redis.call('PUBLISH', ARGV[2], ARGV[1])
return 1
"
    ))
});

/// [`APPEND`] behind a publish fence: returns 0 (and stores nothing) when
/// the fence has seen a higher token, else 1.
///
/// KEYS: stream, fence. ARGV: wake channel, wake message, token, field/value pairs...
pub(crate) static APPEND_FENCED: LazyLock<Script> = LazyLock::new(|| {
    script(&format!(
        r"{FENCE}
if fenced(KEYS[2], ARGV[3]) then return 0 end
redis.call('XADD', KEYS[1], '*', unpack(ARGV, 4))
redis.call('PUBLISH', ARGV[1], ARGV[2])
return 1
"
    ))
});

/// Joins a stream for a new holder: creates the group at `0` if missing and
/// claims every pending entry of earlier generations (XAUTOCLAIM with
/// min-idle 0 until the cursor is `0-0`), removing the emptied consumers.
const JOIN: &str = r"
-- Whether a partition's stream name holds a stream or nothing: anything
-- else (written by hand, never by keyorder) is no partition, and is left
-- alone rather than failing every script that touches it.
local function usable(stream)
  local kind = redis.call('TYPE', stream)['ok']
  return kind == 'stream' or kind == 'none'
end
local function join(stream, group, holder)
  if not usable(stream) then return end
  redis.pcall('XGROUP', 'CREATE', stream, group, '0', 'MKSTREAM')
  local cursor = '0-0'
  repeat
    local r = redis.call('XAUTOCLAIM', stream, group, holder, 0, cursor, 'COUNT', 1000, 'JUSTID')
    cursor = r[1]
  until cursor == '0-0'
  for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', stream, group)) do
    local name, pending = nil, 0
    for j = 1, #c, 2 do
      if c[j] == 'name' then name = c[j + 1] elseif c[j] == 'pending' then pending = c[j + 1] end
    end
    if name ~= holder and pending == 0 then
      redis.call('XGROUP', 'DELCONSUMER', stream, group, name)
    end
  end
end
";

/// Acquires free leases, each with a fresh generation from the counter
/// (which never expires, so a generation never goes back, not even after a
/// reap), and joins each of the partition's streams that its category's
/// index lists (a correlated partition has one stream per category).
///
/// Fails the script with [`GROUP_REMOVED`] when `group` is missing from
/// one of the registries `KEYS[from..from + n - 1]` (an operator removed it
/// while this member ran).
const REGISTERED: &str = r"
local function registered(from, n, group)
  for i = from, from + n - 1 do
    if redis.call('HEXISTS', KEYS[i], group) == 0 then
      return redis.error_reply('KEYORDER_GROUP_REMOVED')
    end
  end
  return nil
end
";

/// The error text a script answers when this member's group was removed.
pub(crate) const GROUP_REMOVED: &str = "KEYORDER_GROUP_REMOVED";

/// KEYS: generation counter, then the n category registries, then per
/// partition: lease, its n streams, their n indexes. ARGV: owner, ttl ms,
/// group, n, then per partition: key segment, n. Returns per partition
/// `{generation, joined...}`; generation 0 when held by another or no
/// longer indexed anywhere. Fails with [`GROUP_REMOVED`] when the group is
/// no longer registered (no lease of a removed group is ever taken).
pub(crate) static ACQUIRE: LazyLock<Script> = LazyLock::new(|| {
    script(&format!(
        r"{JOIN}{REGISTERED}
local out = {{}}
local owner, ttl, group, nreg = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local removed = registered(2, nreg, group)
if removed then return removed end
local ki, ai = 2 + nreg, 5
while ai <= #ARGV do
  local key, n = ARGV[ai], tonumber(ARGV[ai + 1])
  ai = ai + 2
  local lease = KEYS[ki]
  local res, indexed, any = {{0}}, {{}}, false
  for j = 1, n do
    indexed[j] = redis.call('ZSCORE', KEYS[ki + n + j], key) ~= false and usable(KEYS[ki + j])
    any = any or indexed[j]
    res[j + 1] = 0
  end
  if any and redis.call('EXISTS', lease) == 0 then
    local gen = redis.call('INCR', KEYS[1])
    local holder = owner .. ':' .. gen
    redis.call('SET', lease, holder, 'PX', ttl)
    res[1] = gen
    for j = 1, n do
      if indexed[j] then
        join(KEYS[ki + j], group, holder)
        res[j + 1] = 1
      end
    end
  end
  ki = ki + 1 + 2 * n
  out[#out + 1] = res
end
return out
"
    ))
});

/// Joins a stream that appeared after its partition was acquired (a
/// correlated partition's first event in another category, or a partition
/// recreated after a reap), fenced by the holder.
///
/// KEYS: lease, stream, index. ARGV: holder, group, key segment. Returns 1 when
/// joined, 0 when fenced, -1 when the stream is not indexed (yet).
pub(crate) static JOIN_STREAM: LazyLock<Script> = LazyLock::new(|| {
    script(&format!(
        r"{JOIN}
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if redis.call('ZSCORE', KEYS[3], ARGV[3]) == false then return -1 end
join(KEYS[2], ARGV[2], ARGV[1])
return 1
"
    ))
});

/// The heartbeat: checks that the group is still registered (fails with
/// [`GROUP_REMOVED`] otherwise), records the member on the server's clock,
/// renews every lease still held by this holder, and answers the live
/// members.
///
/// KEYS: members, then the n category registries, then one lease per
/// partition. ARGV: owner, ttl ms, group, n, then one generation per lease.
/// Returns `{renewed flags, live members}`.
pub(crate) static RENEW: LazyLock<Script> = LazyLock::new(|| {
    script(&format!(
        r"{REGISTERED}
local nreg = tonumber(ARGV[4])
local removed = registered(2, nreg, ARGV[3])
if removed then return removed end
local now = now_ms()
local ttl = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - 100 * ttl)
local out = {{}}
for i = 2 + nreg, #KEYS do
  if redis.call('GET', KEYS[i]) == ARGV[1] .. ':' .. ARGV[i + 3 - nreg] then
    redis.call('PEXPIRE', KEYS[i], ttl)
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
return {{out, redis.call('ZRANGEBYSCORE', KEYS[1], now - ttl, '+inf')}}
"
    ))
});

/// Creates `group` on a stream at `0` for a plain (unordered) reader, only
/// while the group is registered (fails with [`GROUP_REMOVED`] otherwise:
/// a member of a removed group never recreates it, which would leave a
/// stream no registered group trims). With `mk` the stream is created when
/// missing; without it a missing stream answers 0.
///
/// KEYS: registry, stream. ARGV: group, `1` to create a missing stream.
/// Returns 1 (created or already there), 0 (no such stream).
pub(crate) static JOIN_PLAIN: LazyLock<Script> = LazyLock::new(|| {
    script(&format!(
        r"{REGISTERED}
local removed = registered(1, 1, ARGV[1])
if removed then return removed end
if ARGV[2] ~= '1' and redis.call('EXISTS', KEYS[2]) == 0 then return 0 end
local r = redis.pcall('XGROUP', 'CREATE', KEYS[2], ARGV[1], '0', 'MKSTREAM')
if type(r) == 'table' and r.err and not string.find(r.err, 'BUSYGROUP', 1, true) then
  return redis.error_reply(r.err)
end
return 1
"
    ))
});

/// Records a group in a category's registry and the member's first
/// heartbeat in one step, so an operator never sees the group registered
/// without a live member while it starts. The entry keeps the members set
/// the group heartbeats in and the longest lease TTL any member registered
/// with. A category without a registry (written by a version before it)
/// first registers every group its keyless stream has (every subscription
/// creates its group there), so an upgrade loses nothing.
///
/// KEYS: registry, members, keyless stream. ARGV: category, group, owner,
/// ttl ms.
pub(crate) static REGISTER: LazyLock<Script> = LazyLock::new(|| {
    script(
        r"
local c, group, owner, ttl = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
if redis.call('EXISTS', KEYS[1]) == 0 and redis.call('EXISTS', KEYS[3]) == 1 then
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', KEYS[3])) do
    for j = 1, #g, 2 do
      if g[j] == 'name' then
        local entry = cjson.encode({members = c .. ':__members__:' .. g[j + 1], ttl = 60000})
        redis.call('HSETNX', KEYS[1], g[j + 1], entry)
      end
    end
  end
end
local old = redis.call('HGET', KEYS[1], group)
if old then
  local ok, e = pcall(cjson.decode, old)
  if ok and type(e) == 'table' and tonumber(e.ttl) then ttl = math.max(ttl, tonumber(e.ttl)) end
end
redis.call('HSET', KEYS[1], group, cjson.encode({members = KEYS[2], ttl = ttl}))
redis.call('ZADD', KEYS[2], now_ms(), owner)
return 1
",
    )
});

/// The delivery count of a pending entry (the attempt count: Redis keeps it
/// in the group's pending entries list, so it survives an owner change and a
/// restart with the stream), or 0 when the entry is not pending.
const DELIVERIES: &str = r"
local function deliveries(stream, group, id)
  local p = redis.call('XPENDING', stream, group, id, id, 1)
  if #p == 0 then return 0 end
  return p[1][4]
end
";

/// Attempts are counted per started attempt, not per delivery: Redis's
/// delivery counter also grows when a new owner claims an entry it never
/// started (XAUTOCLAIM at a join), so a message read beside one that
/// crashed its process reached the poison policy with it (C22). The hash
/// `{stream}:__attempts__:{group}` holds, per entry delivered before, the
/// attempts made: a first attempt is not written (a new entry's first
/// attempt costs no round trip) and counts as made once the entry is
/// delivered again; every later attempt is an `HINCRBY` before the
/// handler starts. A settled entry's field is deleted.
const ATTEMPTS: &str = r"
local function attempts_key(stream, group)
  return stream .. ':__attempts__:' .. group
end
local function attempts_made(stream, group, id)
  return tonumber(redis.call('HGET', attempts_key(stream, group), id) or '1')
end
local function begin_attempt(stream, group, id)
  local h = attempts_key(stream, group)
  redis.call('HSETNX', h, id, 1)
  return redis.call('HINCRBY', h, id, 1)
end
local function forget_attempts(stream, group, id)
  redis.call('HDEL', attempts_key(stream, group), id)
end
";

/// The fenced read: for each partition, only while this holder holds its
/// lease, XREADGROUP (never BLOCK: Redis refuses it in scripts) from `>` or,
/// to re-read the holder's own pending entries, after an id. Each entry comes
/// with 1 when it is new (its first attempt, counted without a round trip)
/// or 0 when it was delivered before (its attempt is counted by SETTLE's
/// `a` before the handler starts, in the attempts hash: see `ATTEMPTS`).
///
/// A successful fenced read also extends the lease by the TTL: it is a
/// renewal, so the consumer's self-fence may count it as a confirmation
/// (a read that only checked the lease would let the self-fence call a
/// scope fresh after the lease expired; see `verification/`).
///
/// A stream without the group (reaped once every registered group had
/// passed its end, then published again) gets the group at `0`; a stream
/// whose read fails answers `{'error', text}` without failing the others.
///
/// KEYS: (lease, stream) per partition. ARGV: group, owner, ttl ms, then
/// (generation, start id, count) per partition. Returns per partition `0`
/// (fenced: the lease is not ours), `{entries, attempts}` or
/// `{'error', text}`.
pub(crate) static READ: LazyLock<Script> = LazyLock::new(|| {
    script(&format!(
        r"{DELIVERIES}
local out = {{}}
local extended = {{}}
for i = 1, #KEYS / 2 do
  local gen, start, count = ARGV[3 * i + 1], ARGV[3 * i + 2], ARGV[3 * i + 3]
  local holder = ARGV[2] .. ':' .. gen
  local lease, stream = KEYS[2 * i - 1], KEYS[2 * i]
  if redis.call('GET', lease) ~= holder then
    out[i] = 0
  else
    if not extended[lease] then
      redis.call('PEXPIRE', lease, ARGV[3])
      extended[lease] = true
    end
    local r = redis.pcall('XREADGROUP', 'GROUP', ARGV[1], holder, 'COUNT', count, 'STREAMS', stream, start)
    if type(r) == 'table' and r.err and string.find(r.err, 'NOGROUP', 1, true) then
      -- The stream was reaped (every registered group had passed its end)
      -- and published again: the group starts at its beginning. A stream
      -- that is gone has nothing to read.
      if redis.call('EXISTS', stream) == 1 then
        redis.call('XGROUP', 'CREATE', stream, ARGV[1], '0')
        r = redis.pcall('XREADGROUP', 'GROUP', ARGV[1], holder, 'COUNT', count, 'STREAMS', stream, start)
      else
        r = false
      end
    end
    if type(r) == 'table' and r.err then
      out[i] = {{'error', r.err}}
    else
      local entries, attempts = {{}}, {{}}
      if r then entries = r[1][2] end
      for j, e in ipairs(entries) do
        if start == '>' then attempts[j] = 1 else attempts[j] = 0 end
      end
      out[i] = {{entries, attempts}}
    end
  end
end
return out
"
    ))
});

/// Attempt increments and acknowledgements of many deliveries in one step,
/// each fenced by its holder (an empty holder is unfenced: the keyless
/// stream). A lease is read once per call. An attempt after the first is
/// counted in the attempts hash (`ATTEMPTS`); XCLAIM to the same consumer
/// resets the entry's idle time.
///
/// KEYS: (lease, stream) per operation. ARGV: (kind `a` or `k`, holder,
/// group, entry id, consumer) per operation. Returns per operation 0 when
/// fenced, -1 when the entry is no longer pending, else the attempt count
/// (`a`) or 1 (`k`: acknowledged).
pub(crate) static SETTLE: LazyLock<Script> = LazyLock::new(|| {
    script(&format!(
        r"{DELIVERIES}{ATTEMPTS}
local out, held = {{}}, {{}}
for i = 1, #ARGV / 5 do
  local kind, holder, group, entry, consumer = ARGV[5 * i - 4], ARGV[5 * i - 3], ARGV[5 * i - 2], ARGV[5 * i - 1], ARGV[5 * i]
  local lease, stream = KEYS[2 * i - 1], KEYS[2 * i]
  local ok = holder == ''
  if not ok then
    local cur = held[lease]
    if cur == nil then
      cur = redis.call('GET', lease) or ''
      held[lease] = cur
    end
    ok = cur == holder
  end
  if not ok then
    out[i] = 0
  elseif kind == 'a' then
    redis.call('XCLAIM', stream, group, consumer, 0, entry)
    if deliveries(stream, group, entry) == 0 then out[i] = -1 else out[i] = begin_attempt(stream, group, entry) end
  else
    redis.call('XACK', stream, group, entry)
    forget_attempts(stream, group, entry)
    out[i] = 1
  end
end
return out
"
    ))
});

/// Records a halted head, fenced (the entry stays pending).
///
/// KEYS: lease, halted hash, stream. ARGV: holder, key segment, entry id, reason,
/// group, category of the stream. Returns 1, or 0 when fenced.
pub(crate) static HALT: LazyLock<Script> = LazyLock::new(|| {
    script(&format!(
        r"{ATTEMPTS}
if ARGV[1] ~= '' and redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
local attempts = attempts_made(KEYS[3], ARGV[5], ARGV[3])
redis.call('HSET', KEYS[2], ARGV[2], cjson.encode({{head = ARGV[3], reason = ARGV[4], attempts = attempts, category = ARGV[6]}}))
return 1
"
    ))
});

/// Copies an entry to the dead-letter stream and acknowledges it in one step.
/// With an empty holder it is the operator's (unfenced) dead-letter action.
/// Idempotent: an entry the group no longer has pending was settled already
/// (a retry after a lost reply, or an operator's action), so nothing more is
/// dead-lettered.
///
/// KEYS: lease, stream, dead-letter stream, dead-letter index, halted hash.
/// ARGV: holder, group, entry id, key segment (`__keyless__` for the keyless
/// stream), reason. Returns 1 (also when already
/// settled), 0 when fenced, -1 when the entry is gone.
pub(crate) static PARK: LazyLock<Script> = LazyLock::new(|| {
    script(&format!(
        r"{DELIVERIES}{ATTEMPTS}
if ARGV[1] ~= '' and redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if deliveries(KEYS[2], ARGV[2], ARGV[3]) == 0 then return 1 end
forget_attempts(KEYS[2], ARGV[2], ARGV[3])
local e = redis.call('XRANGE', KEYS[2], ARGV[3], ARGV[3])
if #e == 0 then
  redis.call('XACK', KEYS[2], ARGV[2], ARGV[3])
  return -1
end
local fields = e[1][2]
table.insert(fields, 'x-reason'); table.insert(fields, ARGV[5])
table.insert(fields, 'x-group'); table.insert(fields, ARGV[2])
table.insert(fields, 'x-entry'); table.insert(fields, ARGV[3])
table.insert(fields, 'x-at'); table.insert(fields, tostring(now_ms()))
redis.call('XADD', KEYS[3], '*', unpack(fields))
redis.call('SADD', KEYS[4], ARGV[4])
redis.call('XACK', KEYS[2], ARGV[2], ARGV[3])
redis.call('HDEL', KEYS[5], ARGV[4])
return 1
"
    ))
});

/// Releases a lease held by this holder.
///
/// KEYS: lease. ARGV: holder. Returns 1 when it was ours.
pub(crate) static RELEASE: LazyLock<Script> = LazyLock::new(|| {
    script(
        r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
",
    )
});

/// The lowest entry some group still needs: its first pending entry, or
/// the one after its last delivered entry; `0-0` (nothing may go) when a
/// group of the category's registry has not joined the stream yet (it will
/// read it from the start). `nil` without any group.
const LOW_WATER: &str = r"
local function next_id(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  return ms .. '-' .. (tonumber(seq) + 1)
end
local function older(a, b)
  local am, as = string.match(a, '^(%d+)-(%d+)$')
  local bm, bs = string.match(b, '^(%d+)-(%d+)$')
  if #am ~= #bm then return #am < #bm end
  if am ~= bm then return am < bm end
  return tonumber(as) < tonumber(bs)
end
local function low_water(stream, registry)
  local low = nil
  local joined = {}
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', stream)) do
    local name, pending, last = nil, 0, '0-0'
    for j = 1, #g, 2 do
      if g[j] == 'name' then name = g[j + 1]
      elseif g[j] == 'pending' then pending = g[j + 1]
      elseif g[j] == 'last-delivered-id' then last = g[j + 1] end
    end
    joined[name] = true
    local need
    if pending > 0 then
      need = redis.call('XPENDING', stream, name)[2]
    else
      need = next_id(last)
    end
    if low == nil or older(need, low) then low = need end
  end
  for _, name in ipairs(redis.call('HKEYS', registry)) do
    if not joined[name] then return '0-0' end
  end
  return low
end
";

/// Trims entries every group has acknowledged: every group on the stream
/// and every group of the category's registry.
///
/// KEYS: stream, group registry. Returns the number of entries removed.
pub(crate) static TRIM: LazyLock<Script> = LazyLock::new(|| {
    script(&format!(
        r"{LOW_WATER}
-- Nothing, or something else than a stream (written by hand): nothing to trim.
if redis.call('TYPE', KEYS[1])['ok'] ~= 'stream' then return 0 end
local low = low_water(KEYS[1], KEYS[2])
if low == nil or low == '0-0' then return 0 end
return redis.call('XTRIM', KEYS[1], 'MINID', low)
"
    ))
});

/// Removes a cold partition atomically with respect to publishing: only
/// when nothing was published for `idle` (the index score is the last
/// publish on the server's clock), no group has anything pending and every
/// group on the stream and every group of the category's registry has read
/// to the end. A publish after it recreates stream and index entry, and the
/// partition is discovered again; a group that still holds the partition
/// gets its group on the new stream at `0` (see [`READ`]).
///
/// KEYS: stream, index, lease, group registry. ARGV: key segment, idle ms, holder,
/// `1` to delete the lease too (a single-stream partition is gone with its
/// stream). Returns 1 when removed.
pub(crate) static REAP: LazyLock<Script> = LazyLock::new(|| {
    script(
        r"
local score = redis.call('ZSCORE', KEYS[2], ARGV[1])
if score and tonumber(score) > now_ms() - tonumber(ARGV[2]) then return 0 end
if redis.call('GET', KEYS[3]) ~= ARGV[3] then return 0 end
local kind = redis.call('TYPE', KEYS[1])['ok']
-- Something else than a stream under a partition's name (written by hand)
-- is never deleted: left alone, it is no partition of keyorder's.
if kind ~= 'stream' and kind ~= 'none' then return 0 end
if kind == 'stream' then
  local last = redis.call('XINFO', 'STREAM', KEYS[1])
  local last_id = '0-0'
  for j = 1, #last, 2 do
    if last[j] == 'last-generated-id' then last_id = last[j + 1] end
  end
  local joined = {}
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
    for j = 1, #g, 2 do
      if g[j] == 'name' then joined[g[j + 1]] = true end
      if g[j] == 'pending' and g[j + 1] > 0 then return 0 end
      if g[j] == 'last-delivered-id' and g[j + 1] ~= last_id then return 0 end
    end
  end
  for _, name in ipairs(redis.call('HKEYS', KEYS[4])) do
    if not joined[name] then return 0 end
  end
end
redis.call('DEL', KEYS[1])
if ARGV[4] == '1' then redis.call('DEL', KEYS[3]) end
redis.call('ZREM', KEYS[2], ARGV[1])
return 1
",
    )
});

/// The operator's skip or resume of a halted head (unfenced: it works with
/// no owner at all), recorded for the owner to release the key.
///
/// KEYS: stream, halted hash, resolved hash. ARGV: group, entry id, key segment,
/// action (`skip` acknowledges, `resume` resets the attempt count to 0
/// at the same consumer, `dlq` only records), wake channel.
pub(crate) static RESOLVE: LazyLock<Script> = LazyLock::new(|| {
    script(&format!(
        r"{ATTEMPTS}
if ARGV[4] == 'skip' then
  redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
  forget_attempts(KEYS[1], ARGV[1], ARGV[2])
elseif ARGV[4] == 'resume' then
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1)
  if #p == 1 then
    redis.call('XCLAIM', KEYS[1], ARGV[1], p[1][2], 0, ARGV[2], 'RETRYCOUNT', 0, 'JUSTID')
    -- The next attempt is the first again.
    redis.call('HSET', attempts_key(KEYS[1], ARGV[1]), ARGV[2], 0)
  end
end
redis.call('HDEL', KEYS[2], ARGV[3])
redis.call('HSET', KEYS[3], ARGV[3], ARGV[4])
redis.call('PUBLISH', ARGV[5], ARGV[3])
return 1
"
    ))
});

/// The operator's view of every partition of a category for one group:
/// `{key segment, lease, pending, lag, halted}` per partition (not-yet-delivered
/// entries count as lag; `lease` is `owner:generation` or empty).
///
/// KEYS: index, halted hash. ARGV: category, group.
pub(crate) static SCOPES: LazyLock<Script> = LazyLock::new(|| {
    script(
        r"
local out = {}
for _, k in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  local stream = ARGV[1] .. ':' .. k
  local lease = redis.call('GET', stream .. ':__lease__:' .. ARGV[2]) or ''
  local pending, lag, found = 0, 0, false
  -- A member whose name holds something else than a stream (written by
  -- hand, not by keyorder) is shown without counts, never an error.
  if redis.call('TYPE', stream)['ok'] == 'stream' then
    for _, g in ipairs(redis.call('XINFO', 'GROUPS', stream)) do
      local name, p, l = nil, 0, 0
      for j = 1, #g, 2 do
        if g[j] == 'name' then name = g[j + 1]
        elseif g[j] == 'pending' then p = g[j + 1]
        elseif g[j] == 'lag' then l = g[j + 1] or 0 end
      end
      if name == ARGV[2] then pending, lag, found = p, l, true end
    end
    if not found then lag = redis.call('XLEN', stream) end
  end
  out[#out + 1] = {k, lease, pending, lag, redis.call('HEXISTS', KEYS[2], k)}
end
return out
",
    )
});

/// A registered group's members set and lease TTL, from its registry entry
/// (only a members set of that group's own form is believed: a damaged
/// entry falls back to the category's), and its live members: heartbeats
/// within the TTL, on the server's clock.
const LIVE: &str = r"
local function entry_of(category, group, entry)
  local own = category .. ':__members__:' .. group
  local suffix = ':__members__:' .. group
  local ok, e = pcall(cjson.decode, entry)
  local members, ttl = own, 60000
  if ok and type(e) == 'table' then
    if type(e.members) == 'string' and #e.members > #suffix
      and string.sub(e.members, -#suffix) == suffix then
      -- Only this category's own name, or a correlated subscription's
      -- combined name that holds it ('{c1}+{c2}...').
      local ctl = string.sub(e.members, 1, #e.members - #suffix)
      if ctl == category then
        members = e.members
      else
        for part in string.gmatch(ctl, '[^+]+') do
          if part == category then members = e.members end
        end
      end
    end
    ttl = tonumber(e.ttl) or ttl
  elseif tonumber(entry) then
    ttl = tonumber(entry)
  end
  -- A damaged TTL never makes a group look dead sooner than a second, nor
  -- live for more than a day after its last heartbeat.
  ttl = math.min(math.max(ttl, 1000), 86400000)
  return members, ttl
end
local function live(category, group, entry)
  local members, ttl = entry_of(category, group, entry)
  return redis.call('ZCOUNT', members, now_ms() - ttl, '+inf'), members
end
";

/// The operator's list of a category's registered groups with their live
/// members.
///
/// KEYS: registry. ARGV: category. Returns `{group, live}` per group.
pub(crate) static GROUPS: LazyLock<Script> = LazyLock::new(|| {
    script(&format!(
        r"{LIVE}
local out = {{}}
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  out[#out + 1] = {{all[i], (live(ARGV[1], all[i], all[i + 1]))}}
end
return out
"
    ))
});

/// The operator's removal of a stopped group, in one step: refused while a
/// member heartbeats within the group's TTL or a lease of the group is
/// still held (a member that stalled holds its leases until they expire);
/// otherwise its group on every indexed stream and on the keyless stream,
/// its leases, members, halted and resolved records (under the category's
/// name and, for a correlated subscription, the combined name its members
/// set carries), and its registry entry go. A member that comes back later
/// finds its group removed at its next heartbeat or acquire and stops.
///
/// KEYS: registry, index. ARGV: category, group. Returns `{1}` when
/// removed, `{0}` when not registered, `{2, n}` while n members are live,
/// `{3, n}` while n leases are held.
pub(crate) static REMOVE_GROUP: LazyLock<Script> = LazyLock::new(|| {
    script(&format!(
        r"{LIVE}
local c, group = ARGV[1], ARGV[2]
local entry = redis.call('HGET', KEYS[1], group)
if not entry then return {{0}} end
local n, members = live(c, group, entry)
if n > 0 then return {{2, n}} end
local ctl = string.sub(members, 1, #members - #(':__members__:' .. group))
local names = {{c}}
if ctl ~= c then names[2] = ctl end
local keys = redis.call('ZRANGE', KEYS[2], 0, -1)
local held = 0
for _, k in ipairs(keys) do
  for _, name in ipairs(names) do
    held = held + redis.call('EXISTS', name .. ':' .. k .. ':__lease__:' .. group)
  end
end
if held > 0 then return {{3, held}} end
for _, k in ipairs(keys) do
  redis.pcall('XGROUP', 'DESTROY', c .. ':' .. k, group)
end
redis.pcall('XGROUP', 'DESTROY', c .. ':__keyless__', group)
for _, name in ipairs(names) do
  redis.call('DEL', name .. ':__members__:' .. group, name .. ':__halted__:' .. group, name .. ':__resolved__:' .. group)
end
redis.call('HDEL', KEYS[1], group)
return {{1}}
"
    ))
});
