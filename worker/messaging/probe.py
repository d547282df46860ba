"""Whether Redis answers right now, asked once for everyone: a stopping worker's last writes.

A stop hands its parked jobs back, recovers stray claims and unregisters. Each of those
writes retries a lost connection for seconds (the command client's policy, right for a
job's events and result), so with Redis down or frozen a stop spent about 4 s retrying
writes that could not land, and one more for each parked job's hand-back. Whatever they
would have written is recovered anyway once this worker's lease is gone: the others re-queue
its never-started claims. So the stop asks first, with one unretried PING, and leaves the
writes to recovery when Redis does not answer.
"""

from __future__ import annotations

import asyncio
import logging

from redis.exceptions import RedisError

from leanredis import LeanRedis

__all__ = ["PROBE_S", "RedisProbe"]

log = logging.getLogger(__name__)

# How long a PING may take before Redis counts as away (a live one answers in well under a
# millisecond, and one busy with a fork for persistence in tens).
PROBE_S = 1.0
# How long an "away" answer stands: the stop's steps come one after another, and a frozen
# Redis must not cost each of them the whole PROBE_S again.
REMEMBER_AWAY_S = 2.0


class RedisProbe:
    """One unretried PING shared by every caller asking while it is out (a stop hands back
    all its parked jobs at once); an answer of "away" stands for REMEMBER_AWAY_S."""

    def __init__(self, redis: LeanRedis, timeout_s: float = PROBE_S, remember_away_s: float = REMEMBER_AWAY_S) -> None:
        self._redis = redis
        self._timeout_s = timeout_s
        self._remember_away_s = remember_away_s
        self._asking: asyncio.Future[bool] | None = None
        self._away_until = 0.0

    async def answers(self) -> bool:
        if asyncio.get_running_loop().time() < self._away_until:
            return False
        if self._asking is None:
            self._asking = asyncio.ensure_future(self._ask())
        return await asyncio.shield(self._asking)

    async def _ask(self) -> bool:
        loop = asyncio.get_running_loop()
        try:
            await asyncio.wait_for(self._redis.ping_once(), self._timeout_s)
            return True
        except (RedisError, OSError, TimeoutError) as exc:
            log.warning("Redis does not answer (%s): what is left to write is left to recovery", str(exc) or "no reply in time")
            self._away_until = loop.time() + self._remember_away_s
            return False
        finally:
            self._asking = None
