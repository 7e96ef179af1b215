//! What every script is built from: the server's clock (`now_ms`) before
//! each body, and the attempts hash that the delivering and the operator's
//! scripts both keep.

use redis::Script;

/// Milliseconds on the server's clock.
const NOW: &str = r"
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
";

pub(super) fn script(body: &str) -> Script {
    Script::new(&format!("{NOW}\n{body}"))
}

/// Attempts are counted per started attempt, not per delivery: Redis's
/// delivery counter also grows when a new owner claims an entry it never
/// started (XAUTOCLAIM at a join), so a message read beside one that
/// crashed its process reached the poison policy with it (C22). The hash
/// `{stream}:__attempts__:{group}` holds, per entry delivered before, the
/// attempts made: a first attempt is not written (a new entry's first
/// attempt costs no round trip) and counts as made once the entry is
/// delivered again; every later attempt is an `HINCRBY` before the
/// handler starts. A settled entry's field is deleted.
pub(super) const ATTEMPTS: &str = r"
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
