"""Admission of jobs' memory limits against the host's ceiling for all jobs.

Every jail sits under one memory ceiling (the deployment's cgroup: host memory less a
reserve, or SANDBOX_MEMORY_TOTAL_MB). Each job also has a limit of its own, but the limits
of the jails running at once may add up to more than the ceiling (8 slots of 2 GiB on a
host with 8 GiB for jobs). When the ceiling then fills, the kernel's OOM killer picks its
victim by resident memory across every job under it, and memory charged to a job that no
process holds as resident (socket and pipe buffers, tmpfs) counts against the ceiling but
not toward that choice. One job could then keep its own usage under its limit and have
another job killed as `memory_exceeded`.

So user code runs only while the limits of everything running fit the ceiling: each step
(a compile, a run, one test case) holds its jail's memory limit from the gate's release
until its last process is gone, and waits for room first. The wait comes before its clocks
start. Steps are admitted in the order they asked; one whose limit alone is more than the
room there is ever runs alone.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator

__all__ = ["UNBOUNDED_BYTES", "MemoryAdmission"]

UNBOUNDED_BYTES = 1 << 62


class MemoryAdmission:
    def __init__(self, room_bytes: int) -> None:
        # The host's room for running steps, which the workers on it share (share_with).
        self.room_bytes = room_bytes
        self._capacity = room_bytes
        self.held_bytes = 0
        self._holders = 0
        self._waiting: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @capacity_bytes.setter
    def capacity_bytes(self, value: int) -> None:
        """The room this worker may fill."""
        self._capacity = value
        self._admit()

    def share_with(self, workers: int) -> None:
        """Every worker on the host admits against the same ceiling: each takes its part."""
        self.capacity_bytes = self.room_bytes // max(1, workers)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def _fits(self, size: int) -> bool:
        return self._holders == 0 or self.held_bytes + size <= self._capacity

    def _admit(self) -> None:
        while self._waiting:
            size, admitted = self._waiting[0]
            if admitted.done():  # its waiter gave up
                self._waiting.popleft()
                continue
            if not self._fits(size):
                return  # in order: nobody overtakes the first in line
            self._waiting.popleft()
            self._take(size)
            admitted.set_result(None)

    def _take(self, size: int) -> None:
        self.held_bytes += size
        self._holders += 1

    def _release(self, size: int) -> None:
        self.held_bytes -= size
        self._holders -= 1
        self._admit()

    def try_admit(self, size: int) -> bool:
        """Take `size` bytes if they fit now and nobody waits before them."""
        while self._waiting and self._waiting[0][1].done():
            self._waiting.popleft()  # (a waiter that gave up)
        if self._waiting or not self._fits(size):
            return False
        self._take(size)
        return True

    async def admit(self, size: int) -> None:
        """Wait until `size` bytes fit, and take them (give them back with `release`)."""
        if self.try_admit(size):
            return
        admitted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append((size, admitted))
        try:
            await admitted
        except asyncio.CancelledError:
            if admitted.done() and not admitted.cancelled():
                self._release(size)  # admitted as it was cancelled: not held after all
            else:
                admitted.cancel()
                self._admit()  # (it may have been first in line)
            raise

    def release(self, size: int) -> None:
        self._release(size)

    @contextlib.asynccontextmanager
    async def hold(self, size: int) -> AsyncIterator[None]:
        await self.admit(size)
        try:
            yield
        finally:
            self.release(size)
