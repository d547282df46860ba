"""The warm pool: one ready sandbox per slot, handed to whichever job starts first.

Parked jobs hold no sandbox (a record and a subscription each), so a worker can keep many
of them while its few jails go to jobs that actually run. A job takes a sandbox when its
start arrives, in the order starts arrived; when the job is over the sandbox is destroyed
and its slot builds the next one in the background.
"""

from __future__ import annotations

import asyncio
import collections
import logging

from worker.isolation.sandbox import MAX_IDLE_S, Sandbox, SandboxFactory

__all__ = ["SandboxPool"]

log = logging.getLogger(__name__)

ARM_RETRY_S = 2.0


class SandboxPool:
    def __init__(self, factory: SandboxFactory, owner: str, slots: int) -> None:
        self._factory = factory
        self._owner = owner
        self.slots = slots
        self._ready: collections.deque[Sandbox] = collections.deque()
        self._waiters: collections.deque[asyncio.Future[Sandbox]] = collections.deque()
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        # Set whenever a sandbox becomes ready or a waiter is served (the claimer watches it).
        self.changed = asyncio.Event()

    @property
    def waiting(self) -> int:
        """Started jobs waiting for a sandbox."""
        return sum(1 for w in self._waiters if not w.done())

    @property
    def ready(self) -> int:
        return len(self._ready)

    def start(self) -> None:
        for slot in range(self.slots):
            self._arm(slot)

    def _spawn(self, coro, name: str) -> None:  # type: ignore[no-untyped-def]
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _arm(self, slot: int, delay_s: float = 0.0) -> None:
        """Build a fresh sandbox for `slot` in the background."""

        async def arm() -> None:
            if delay_s:
                await asyncio.sleep(delay_s)
            try:
                sandbox = await self._factory.prepare(self._owner, slot)
            except Exception as exc:
                log.error("slot %d: cannot build a sandbox (%s); retrying in %.0fs", slot, exc, ARM_RETRY_S)
                if not self._closed:
                    self._arm(slot, delay_s=ARM_RETRY_S)
                return
            if self._closed:
                await sandbox.destroy()
                return
            self._offer(sandbox)

        self._spawn(arm(), f"arm-slot-{slot}")

    def _offer(self, sandbox: Sandbox) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(sandbox)
                self.changed.set()
                return
        self._ready.append(sandbox)
        self.changed.set()

    async def take(self) -> Sandbox:
        """The next ready sandbox (first come, first served); waits while none is ready.

        A sandbox that sat idle too long, or whose jail died, is replaced first.
        """
        while True:
            if self._ready and not self._waiters:
                sandbox = self._ready.popleft()
            else:
                waiter: asyncio.Future[Sandbox] = asyncio.get_running_loop().create_future()
                self._waiters.append(waiter)
                try:
                    sandbox = await waiter
                except asyncio.CancelledError:
                    if waiter.done() and not waiter.cancelled():
                        self._offer(waiter.result())  # served as we were cancelled: pass it on
                    raise
            if sandbox.idle_s < MAX_IDLE_S and sandbox.jail.proc.returncode is None:
                return sandbox
            self._spawn(self._replace(sandbox), f"replace-{sandbox.name}")

    async def _replace(self, sandbox: Sandbox) -> None:
        await sandbox.destroy()
        if not self._closed:
            self._arm(sandbox.slot)

    def give_back(self, sandbox: Sandbox) -> None:
        """A job is done with `sandbox`: destroy it and build its slot's next one."""
        self._spawn(self._replace(sandbox), f"retire-{sandbox.name}")

    def rearm(self, slot: int) -> None:
        """A job destroyed its sandbox itself: build the slot's next one."""
        if not self._closed:
            self._arm(slot)

    async def close(self) -> None:
        """Stop building; destroy every ready sandbox."""
        self._closed = True
        for task in list(self._tasks):
            if task.get_name().startswith("arm-slot-"):
                task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        ready = list(self._ready)
        self._ready.clear()
        await asyncio.gather(*(sandbox.destroy() for sandbox in ready), return_exceptions=True)
