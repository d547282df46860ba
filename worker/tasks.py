"""Cancelling helper tasks without trusting every library to honour the cancellation.

redis-py's asyncio client can swallow a CancelledError that lands while it handles a
connection (seen with 8.1: a few in a hundred cancels of a task looping on XRANGE). A task
that swallows it goes on running, and whoever awaits it after cancelling waits forever:
a job that never reports. So waits on cancelled tasks are bounded; a task that outlives
the bound is logged and left. Tasks that loop on Redis until cancelled check, every turn,
whether a cancellation was asked for and swallowed (`raise_if_cancelled`): otherwise such
a task runs on for good, and the process cannot even exit (asyncio cancels what is left
at the end and waits for it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

__all__ = ["cancel_and_wait", "raise_if_cancelled"]

log = logging.getLogger(__name__)


async def cancel_and_wait(tasks: Iterable[asyncio.Future[object]], timeout_s: float = 2.0) -> None:
    pending = [t for t in tasks if t is not None and not t.done()]
    for task in pending:
        task.cancel()
    if not pending:
        return
    _, stuck = await asyncio.wait(pending, timeout=timeout_s)
    for task in stuck:
        name = task.get_name() if isinstance(task, asyncio.Task) else repr(task)
        log.warning("task %s did not stop when cancelled; leaving it", name)


def raise_if_cancelled() -> None:
    """Raise CancelledError if the current task was asked to cancel and is still running
    (the request was swallowed below it). For loops that run until cancelled, each turn."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
