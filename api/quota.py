"""How much finished jobs' output one API principal keeps in Redis, and its bound.

Output stays in Redis for RUN_RESULT_TTL after a job ends (its log, and its pullable copy
when `collectOutput` is set). Workers put each finished job's size on its owner's ledger
(`owner:<owner>:retained`, scored by expiry, with the sizes beside it); the enqueue script
(api/store.py) first forgets what has expired and refuses the job while the rest is over
MAX_RETAINED_OUTPUT_MB, in the same step that queues it, so checking costs no round trip of
its own. What one principal keeps is then at most that bound plus the output of the jobs it
had admitted while under it, queued, parked or running (each at most its `outputKb`
budget, twice with collectOutput): nothing counts a job's output before it ends.
"""

from __future__ import annotations

__all__ = ["RETAINED_OUTPUT_LUA"]

# A Lua function for scripts to include: retained_output(ledger set, sizes hash, now ms)
# returns the bytes the owner keeps and the earliest expiry ms ('0' for none). It forgets
# at most 1000 expired jobs per call; running it twice changes nothing more.
RETAINED_OUTPUT_LUA = """
local function retained_output(ledger, sizes, now_ms)
  local expired = redis.call('ZRANGEBYSCORE', ledger, '-inf', now_ms, 'LIMIT', 0, 1000)
  for _, id in ipairs(expired) do
    local size = tonumber(redis.call('HGET', sizes, id) or '0')
    if redis.call('HDEL', sizes, id) == 1 then redis.call('HINCRBY', sizes, '_total', -size) end
    redis.call('ZREM', ledger, id)
  end
  local total = tonumber(redis.call('HGET', sizes, '_total') or '0')
  local first = redis.call('ZRANGE', ledger, 0, 0, 'WITHSCORES')
  return total, first[2] or '0'
end
"""
