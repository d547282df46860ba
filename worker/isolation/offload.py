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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

__all__ = ["off_loop", "off_loop_soon"]

P = ParamSpec("P")
T = TypeVar("T")

# Two cores here; more threads than concurrent set-ups buys nothing, and a few let a slow
# teardown (an rmdir waiting on the kernel) overlap the next set-up. These threads must live
# as long as the worker: the jails spawned on one die when that thread ends (enter.c's
# parent-death signal follows the spawning thread), and an executor's threads never retire.
_EXECUTOR = ThreadPoolExecutor(max_workers=4, thread_name_prefix="isolation")


async def off_loop(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """Run `fn` on the isolation threads; if cancelled, still wait for it to finish.

    Isolation steps must not overlap their own clean-up: a caller cancelled while a thread
    is creating a cgroup must not start removing it until the creation is over.
    """
    future = off_loop_soon(lambda: fn(*args, **kwargs))
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        while not future.done():
            try:
                await asyncio.shield(future)
            except asyncio.CancelledError:
                continue
            except BaseException:
                break
        raise


def off_loop_soon(fn: Callable[[], T]) -> asyncio.Future[T]:
    """Run `fn` on the isolation threads; its future, for a callback rather than an await
    (so a reader callback can hand work off without a task of its own)."""
    return asyncio.get_running_loop().run_in_executor(_EXECUTOR, fn)
