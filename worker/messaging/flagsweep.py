"""The stored start and kill flags of every parked job, and the kill flag of every started
one, read in one round trip.

A job hears its start or kill on its ctrl subscription. The flags stored in Redis are the
durable copy, for a message the subscription lost: one lost with a replaced connection, or
one that went unnoticed (a half-open connection lives until its health check). Read by each
job on a timer of its own, a thousand parked jobs made a hundred round trips and a hundred
wake-ups a second, and every started job cost a task and its waits. The sweep reads them
all in one pipelined trip: at once when the connection has been replaced, and every SWEEP_S
besides. A job whose flag is set gets it as the message it missed, in its ctrl inbox (a
started job only its kill: its start flag stays set).
"""

from __future__ import annotations

import asyncio
import logging

from redis.exceptions import RedisError

from shared.messages import CtrlMessage
from worker.messaging.control import ControlBus
from worker.messaging.queue import WorkerQueue

__all__ = ["SWEEP_S", "FlagSweep"]

log = logging.getLogger(__name__)

SWEEP_S = 10.0
# After a sweep that could not read everything (Redis away), the next comes this soon.
RETRY_S = 1.0
# Jobs per pipeline: a thousand parked jobs are four trips, none holding Redis for long.
BATCH = 256


class FlagSweep:
    def __init__(self, queue: WorkerQueue, control: ControlBus, every_s: float = SWEEP_S) -> None:
        self._queue = queue
        self._control = control
        self._every_s = every_s
        # Each watched job's inbox, and whether only its kill counts (a started job's).
        self._watched: dict[str, tuple[asyncio.Queue[CtrlMessage], bool]] = {}

    def __len__(self) -> int:
        return len(self._watched)

    def add(self, job_id: str, inbox: asyncio.Queue[CtrlMessage], kill_only: bool = False) -> None:
        """Watch `job_id`'s flags for the job parked on `inbox` (from the next sweep on);
        with `kill_only`, its kill flag alone, for a job that has started."""
        self._watched[job_id] = (inbox, kill_only)

    def discard(self, job_id: str, inbox: asyncio.Queue[CtrlMessage]) -> None:
        """Stop watching; a newer watch of the same job (claimed again) keeps its entry."""
        entry = self._watched.get(job_id)
        if entry is not None and entry[0] is inbox:
            del self._watched[job_id]

    async def run(self) -> None:
        """Sweep when the pub/sub connection is replaced and every `every_s` (`RETRY_S` after
        a sweep that missed some jobs), until cancelled."""
        watch = self._control.watch(self._control.generation)
        pause_s = self._every_s
        while True:
            replacement = watch.look()
            if replacement is not None:
                await asyncio.wait({replacement}, timeout=pause_s)
                if replacement.done():
                    continue  # the next look takes the replacement in, and sweeps
            try:
                complete = await self.sweep()
            except Exception:
                # Never the end of the sweep: every parked job's fallback depends on it.
                log.exception("the parked jobs' flag sweep failed")
                complete = False
            pause_s = self._every_s if complete else min(RETRY_S, self._every_s)

    async def sweep(self) -> bool:
        """Read the flags of every job watched now; hand each job with one set its message.
        Whether every job's flags were read (a batch Redis failed stays watched, looked at
        again by the next sweep)."""
        ids = list(self._watched)
        failed = 0
        for first in range(0, len(ids), BATCH):
            batch = ids[first : first + BATCH]
            try:
                found = await self._queue.flags_of(batch)
            except (RedisError, OSError) as exc:
                failed += 1
                log.warning("reading the flags of %d parked jobs failed: %s", len(batch), exc)
                continue
            for job_id, (start, kill) in zip(batch, found, strict=True):
                entry = self._watched.get(job_id)
                if entry is None:
                    continue
                inbox, kill_only = entry
                if kill or (start and not kill_only):
                    # Told once: its park or its run ends now (a kill wins, as on the channel).
                    del self._watched[job_id]
                    inbox.put_nowait(CtrlMessage(type="kill" if kill else "start"))
        return failed == 0
