"""Lua scripts that Redis runs even at its `maxmemory`.

With `maxmemory-policy noeviction` (the setting the README asks for), a Redis at its limit
refuses every command that may grow it, scripts included. Some writes must not wait for
room: a heartbeat that keeps a live worker's lease, the event log and the result of a job
already running, a start or a kill. A script whose first line is `#!lua flags=allow-oom`
is run regardless (Redis 7 and later). Older servers cannot compile that line: there the
script runs without it, refused at the limit as before, and the flag is tried again every
FLAGS_RECHECK_S (a server upgraded in place gets flagged scripts without a restart of ours).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ResponseError

__all__ = ["ALLOW_OOM", "OomRefusedScript", "OomTolerantScript"]

log = logging.getLogger(__name__)

ALLOW_OOM = "#!lua flags=allow-oom\n"
FLAGS_RECHECK_S = 60.0
_clock = time.monotonic  # (its own name: a test moves it on without moving the event loop's)


class _FlaggedScript:
    """`client.register_script(script)` with a first line of flags, run without it where the
    server has no script flags."""

    FIRST_LINE = ""
    WITHOUT_FLAGS = ""  # what the log says once when the server has none

    def __init__(self, client: Redis, script: str) -> None:
        self._flagged = client.register_script(self.FIRST_LINE + script)
        self._plain = client.register_script(script)
        self._plain_until = 0.0  # (monotonic) no flags tried before then
        self._warned = False

    async def __call__(self, keys: Sequence[Any] | None = None, args: Iterable[Any] | None = None) -> Any:
        if self._plain_until and _clock() < self._plain_until:
            return await self._plain(keys, args)
        try:
            return await self._flagged(keys, args)
        except ResponseError as exc:
            if "compiling" not in str(exc):
                raise
        # A server without script flags (before Redis 7) reads the first line as Lua. Should
        # the script itself not compile, the plain text fails the same way and says so.
        # Known before the plain call, which a full Redis refuses (retried, it goes plain).
        self._plain_until = _clock() + FLAGS_RECHECK_S
        if not self._warned:
            self._warned = True
            log.warning("this Redis has no script flags (Redis 7 and later): %s", self.WITHOUT_FLAGS)
        return await self._plain(keys, args)


class OomTolerantScript(_FlaggedScript):
    """Run with the allow-oom flag: at Redis's maxmemory as well."""

    FIRST_LINE = ALLOW_OOM
    WITHOUT_FLAGS = "at its maxmemory, running jobs' writes wait for room"


class OomRefusedScript(_FlaggedScript):
    """Refused whole at Redis's maxmemory, before it runs. A plain script is refused only at
    its first write that may grow memory, and only while it has written nothing: one that
    deletes something first (an expired entry) then grows Redis past its limit unchecked.
    A first line with no flags makes Redis 7 judge the script as one write."""

    FIRST_LINE = "#!lua\n"
    WITHOUT_FLAGS = "at its maxmemory, a script that deletes before it writes may still grow it"
