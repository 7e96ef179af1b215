//! Delivering: the fenced read, and settling what it delivered (attempts,
//! acknowledgements, halting, parking).

use std::sync::LazyLock;

use redis::Script;

use super::lua::{script, ATTEMPTS};

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
