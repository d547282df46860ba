"""How much finished jobs' output one API principal keeps in Redis, and its bound.

Output stays in Redis for RUN_RESULT_TTL after a job ends (its log, and its pullable copy
when `collectOutput` is set). Workers put each finished job's size on its owner's ledger
(`owner:<owner>:retained`, scored by expiry, with the sizes beside it); before a new job is
accepted the API forgets what has expired and refuses the job while the rest is over
MAX_RETAINED_OUTPUT_MB. What one principal keeps is then at most that bound plus the output
of its jobs still running (each at most its `outputKb` budget, twice with collectOutput).
"""

from __future__ import annotations

from redis.asyncio import Redis

from shared import keys

__all__ = ["RetainedOutput"]

# KEYS: retained set, sizes hash. ARGV: now ms. Returns {total bytes, earliest expiry ms or 0}.
# Forgets at most 1000 expired jobs per call; running it twice changes nothing more.
_RETAINED = """
local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, 1000)
for _, id in ipairs(expired) do
  local size = tonumber(redis.call('HGET', KEYS[2], id) or '0')
  if redis.call('HDEL', KEYS[2], id) == 1 then redis.call('HINCRBY', KEYS[2], '_total', -size) end
  redis.call('ZREM', KEYS[1], id)
end
local total = tonumber(redis.call('HGET', KEYS[2], '_total') or '0')
local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
return {total, first[2] or '0'}
"""


class RetainedOutput:
    def __init__(self, redis: Redis) -> None:
        self._script = redis.register_script(_RETAINED)

    async def check(self, owner: str, now_ms: int) -> tuple[int, int]:
        """(bytes `owner` keeps now, ms until the earliest of it expires)."""
        total, first = await self._script(keys=[keys.retained_key(owner), keys.retained_sizes_key(owner)], args=[now_ms])
        first_ms = int(float(first))
        return int(total), max(0, first_ms - now_ms) if first_ms else 0
