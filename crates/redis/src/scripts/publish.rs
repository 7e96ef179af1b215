//! Publishing: appending to a partition stream (with its index entry) or
//! to one stream, each also behind the publish fence.

use std::sync::LazyLock;

use redis::Script;

use super::lua::script;

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
