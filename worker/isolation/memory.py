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
start. Steps are admitted in the order they asked, those of started jobs before the compiles
of parked jobs (which may never start); one whose limit alone is more than the room there
is ever runs alone.
"""

from __future__ import annotations

import asyncio
import collections

__all__ = ["SLOT_RESERVE_BYTES", "UNBOUNDED_BYTES", "MemoryAdmission", "steps_memory_bytes"]

UNBOUNDED_BYTES = 1 << 62

# What a slot holds of the ceiling outside any step: a warm jail's waiting runtime, and
# what a finished step's program left charged in its workspace tmpfs until the sandbox goes.
SLOT_RESERVE_BYTES = 64 << 20


def steps_memory_bytes(ceiling: int, slots: int) -> int:
    """What the memory limits of one worker's steps running at once may add up to, under
    its part of the ceiling, with `slots` sandboxes of its own."""
    return max(ceiling // 2, ceiling - slots * SLOT_RESERVE_BYTES)


_Waiter = tuple[int, "asyncio.Future[None]"]


class MemoryAdmission:
    def __init__(self, ceiling_bytes: int, slots: int = 0) -> None:
        self._ceiling = ceiling_bytes
        self._slots = slots
        self._capacity = steps_memory_bytes(ceiling_bytes, slots)
        self.held_bytes = 0
        self._holders = 0
        self._started: collections.deque[_Waiter] = collections.deque()
        self._speculative: collections.deque[_Waiter] = collections.deque()

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    def share_with(self, workers: int) -> None:
        """Every worker on the host admits against the same ceiling: each takes its part,
        less its own slots' reserve."""
        self._capacity = steps_memory_bytes(self._ceiling // max(1, workers), self._slots)
        self._admit()

    @property
    def waiting(self) -> int:
        return sum(not admitted.done() for line in (self._started, self._speculative) for _, admitted in line)

    def _fits(self, size: int) -> bool:
        return self._holders == 0 or self.held_bytes + size <= self._capacity

    @staticmethod
    def _prune(line: collections.deque[_Waiter]) -> None:
        while line and line[0][1].done():
            line.popleft()  # (a waiter that gave up)

    def _admit(self) -> None:
        for line in (self._started, self._speculative):
            while True:
                self._prune(line)
                if not line or not self._fits(line[0][0]):
                    break
                size, admitted = line.popleft()
                self._take(size)
                admitted.set_result(None)
            if line:
                return  # in order: nothing overtakes the first in line

    def _take(self, size: int) -> None:
        self.held_bytes += size
        self._holders += 1

    def try_admit(self, size: int, speculative: bool = False) -> bool:
        """Take `size` bytes if they fit now and nobody waits before them."""
        self._prune(self._started)
        self._prune(self._speculative)
        if self._started or (speculative and self._speculative) or not self._fits(size):
            return False
        self._take(size)
        return True

    async def admit(self, size: int, speculative: bool = False, started: asyncio.Event | None = None) -> None:
        """Wait until `size` bytes fit, and take them (give them back with `release`).
        A `speculative` step (a parked job's compile) lets every started job's go first;
        once `started` is set (its job's start came while it waited) it queues with them,
        behind those already waiting."""
        speculative = speculative and not (started is not None and started.is_set())
        if self.try_admit(size, speculative):
            return
        admitted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiter = (size, admitted)
        (self._speculative if speculative else self._started).append(waiter)
        promoted = asyncio.ensure_future(started.wait()) if speculative and started is not None else None
        try:
            if promoted is not None:
                await asyncio.wait({admitted, promoted}, return_when=asyncio.FIRST_COMPLETED)
                if not admitted.done():
                    self._speculative.remove(waiter)
                    self._started.append(waiter)
                    self._admit()
            await admitted
        except asyncio.CancelledError:
            if admitted.done() and not admitted.cancelled():
                self.release(size)  # admitted as it was cancelled: not held after all
            else:
                admitted.cancel()
                self._admit()  # (it may have been first in line)
            raise
        finally:
            if promoted is not None:
                promoted.cancel()

    def release(self, size: int) -> None:
        self.held_bytes -= size
        self._holders -= 1
        self._admit()
