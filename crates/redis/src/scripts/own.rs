//! Ownership: registering a group and its members' heartbeats, acquiring,
//! joining, renewing and releasing leases, and the owner's upkeep of its
//! streams (trimming, reaping).

use std::sync::LazyLock;

use redis::Script;

use super::lua::script;

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

/// Releases leases still held by their holder: KEYS the leases, ARGV
/// their holders in the same order (a lease another holder has now stays).
/// Returns how many went.
pub(crate) static RELEASE_MANY: LazyLock<Script> = LazyLock::new(|| {
    script(
        r"
local n = 0
for i = 1, #KEYS do
  if redis.call('GET', KEYS[i]) == ARGV[i] then
    redis.call('DEL', KEYS[i])
    n = n + 1
  end
end
return n
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
/// gets its group on the new stream at `0` (see [`READ`](super::READ)).
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
