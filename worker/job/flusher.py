"""Output leaves in batches, off the program's critical path.

The pumps only read the program's pipes and hand the text here; one flusher appends it to
the durable log and publishes it. While one append is in flight, what the program writes
meanwhile gathers and goes out together as the next batch, with consecutive pieces of one
stream merged into events of up to 8 KiB. So an idle job's first byte leaves at once, and a
busy one costs one Redis round trip per batch instead of one per pipe read.

Order is kept: pieces are appended in the order they were read, across both streams. A
flusher holds at most MAX_PENDING_BYTES; past that the pumps wait (and the program blocks
on its pipe) until the log has caught up.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from shared.chunking import CHUNK_MAX_BYTES
from worker.job.events import JobEvents

__all__ = ["OutputFlusher"]

MAX_PENDING_BYTES = 1024 * 1024


@dataclass
class _Run:
    """Consecutive text of one event kind, to become one event (at most 8 KiB)."""

    name: str
    text: str
    size: int


class OutputFlusher:
    def __init__(self, events: JobEvents) -> None:
        self._events = events
        self._runs: list[_Run] = []
        self._pending_bytes = 0
        self._wakeup = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()
        self._closing = False
        self._error: BaseException | None = None
        self._task = asyncio.create_task(self._flush_loop(), name=f"flush:{events.job_id}")

    def add(self, name: str, texts: list[str]) -> None:
        """Queue text chunks of one event kind (each whole characters, at most 8 KiB)."""
        for text in texts:
            size = len(text.encode())
            last = self._runs[-1] if self._runs else None
            if last is not None and last.name == name and last.size + size <= CHUNK_MAX_BYTES:
                last.text += text
                last.size += size
            else:
                self._runs.append(_Run(name, text, size))
            self._pending_bytes += size
        if texts:
            if self._pending_bytes >= MAX_PENDING_BYTES:
                self._room.clear()
            self._wakeup.set()

    async def room(self) -> None:
        """Wait while the flusher is full; raises what stopped it (e.g. Fenced), at once:
        once stopped, nothing takes its count down again, so its room may never come."""
        if self._error is None:
            await self._room.wait()
        if self._error is not None:
            raise self._error

    async def _flush_loop(self) -> None:
        try:
            while True:
                if not self._runs:
                    if self._closing:
                        return
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                batch, self._runs, self._pending_bytes = self._runs, [], 0
                self._room.set()
                await self._events.chunk_runs([(run.name, run.text) for run in batch])
        except BaseException as exc:
            self._error = exc
            self._room.set()  # let waiting pumps see the error
            raise

    async def close(self) -> None:
        """Flush everything queued; raises what stopped the flusher. (A cancel of the caller
        leaves the flushing to go on: `drain` then decides how long it may.)"""
        self._closing = True
        self._wakeup.set()
        await asyncio.shield(self._task)

    async def drain(self, timeout_s: float) -> bool:
        """Flush what is queued for at most `timeout_s`, then stop; whether all of it went.
        What stopped the flusher is not raised (the caller is ending already)."""
        self._closing = True
        self._wakeup.set()
        try:
            await asyncio.wait({self._task}, timeout=timeout_s)
        finally:
            self.abort()
        if self._task.cancelled():
            return False
        # (retrieved here: its failure was reported where it happened)
        return self._task.done() and self._task.exception() is None

    @property
    def task(self) -> asyncio.Task[None]:
        """The flushing task (supervise watches it: if it fails, output has nowhere to go)."""
        return self._task

    def abort(self) -> None:
        if not self._task.done():
            self._task.cancel()
