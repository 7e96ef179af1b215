//! The operator's scripts: resolving a halted head, the view of a group's
//! partitions, the list of groups and removing a stopped group.

use std::sync::LazyLock;

use redis::Script;

use super::lua::{script, ATTEMPTS};

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
