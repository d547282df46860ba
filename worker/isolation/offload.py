"""Blocking isolation work (spawn, mount, cgroup writes, mkdir/rmdir) runs off the event loop.

Building and tearing down a sandbox is a series of syscalls that each take from tens of
microseconds to milliseconds (spawning blocks until the child has exec'd; cgroup and tmpfs
writes take kernel locks), and together they were about half of the worker's loop time
under load: every job's I/O waited behind another job's set-up. They run on a small
dedicated thread pool instead; each of those syscalls releases the GIL, so the loop keeps
serving pipes, Redis and soketi meanwhile.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

__all__ = ["off_loop", "off_loop_quick", "off_loop_soon", "off_loop_stoppable"]

P = ParamSpec("P")
T = TypeVar("T")


class _IsolationThreads:
    """A few threads taking calls from one queue, each result set on the caller's loop.

    Not a ThreadPoolExecutor: its submit, its concurrent future and the chaining of that
    future to an asyncio one cost the loop about 75 us of CPU a call here (40 with four in
    flight), against about 37 (14) for a C queue and one call_soon_threadsafe; a job makes
    four or five such calls. Two cores here; more threads than concurrent set-ups buys
    nothing, and a few let a slow teardown (an rmdir waiting on the kernel) overlap the next
    set-up. The threads live as long as the worker: the jails spawned on one die when that
    thread ends (enter.c's parent-death signal follows the spawning thread). They are daemon
    threads, so an idle one never holds up the interpreter's exit; the worker ends every
    sandbox before it exits.
    """

    def __init__(self, count: int, name: str) -> None:
        self._calls: queue.SimpleQueue[tuple[asyncio.AbstractEventLoop, asyncio.Future[Any], Callable[[], Any]]]
        self._calls = queue.SimpleQueue()
        self._count = count
        self._name = name
        self._started = False
        self._lock = threading.Lock()

    def submit(self, fn: Callable[[], T]) -> asyncio.Future[T]:
        loop = asyncio.get_running_loop()
        if not self._started:
            self._start()
        future: asyncio.Future[T] = loop.create_future()
        self._calls.put((loop, future, fn))
        return future

    def _start(self) -> None:
        with self._lock:
            if self._started:
                return
            for number in range(self._count):
                threading.Thread(target=self._serve, name=f"{self._name}_{number}", daemon=True).start()
            self._started = True

    def _serve(self) -> None:
        while True:
            loop, future, fn = self._calls.get()
            try:
                result, error = fn(), None
            except BaseException as exc:  # (handed to the caller, whatever it is)
                result, error = None, exc
            try:
                loop.call_soon_threadsafe(_settle, future, result, error)
            except RuntimeError:
                pass  # the loop is closed: nobody waits for this any more
            del loop, future, fn, result, error  # (not kept alive until the next call)


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


_THREADS = _IsolationThreads(4, "isolation")
# Every job's own short steps (a sandbox's cgroups and workspace before its spawn, a small
# job's files, nsjail's move out of the job's cgroups, the teardown's first try) go one at
# a time through a thread of their own. Spread over the four, they contended for the GIL
# around each of their syscalls: six interleaved 4-client pairs with a single thread for
# everything had the worker's CPU 0.1-0.2 ms a job lower. Anything that may wait (a
# teardown's stragglers, big files, artifacts, the janitor) stays on the four, so it never
# holds up another job's set-up.
_QUICK = _IsolationThreads(1, "isolation-quick")


async def off_loop(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """Run `fn` on the isolation threads; if cancelled, still wait for it to finish.

    Isolation steps must not overlap their own clean-up: a caller cancelled while a thread
    is creating a cgroup must not start removing it until the creation is over.
    """
    return await _finished(off_loop_soon(lambda: fn(*args, **kwargs)))


async def off_loop_quick(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """`off_loop` for a step that never waits (no sleeps, no retries, no big copies): one
    of a job's own set-up or teardown steps, on the thread kept for those."""
    return await _finished(off_loop_soon(lambda: fn(*args, **kwargs), quick=True))


async def off_loop_stoppable(fn: Callable[[], T], stop: Callable[[], object]) -> T:
    """`off_loop` for a long step that can be cut short: a cancel calls `stop` (on the loop;
    it must make `fn` end soon), then still waits for `fn` to finish."""
    return await _finished(off_loop_soon(fn), stop)


async def _finished(future: asyncio.Future[T], stop: Callable[[], object] | None = None) -> T:
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        if stop is not None:
            stop()
        while not future.done():
            try:
                await asyncio.shield(future)
            except asyncio.CancelledError:
                continue
            except BaseException:
                break
        raise


def off_loop_soon(fn: Callable[[], T], quick: bool = False) -> asyncio.Future[T]:
    """Run `fn` on the isolation threads (with `quick`, a step that never waits: see
    off_loop_quick); its future, for a callback rather than an await (so a reader callback
    can hand work off without a task of its own)."""
    return (_QUICK if quick else _THREADS).submit(fn)
