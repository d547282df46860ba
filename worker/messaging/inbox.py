"""A job's inbox: an asyncio.Queue whose next item can be waited for as a plain future.

A job waits on its inboxes (ctrl messages, stdin frames) together with other things, with
asyncio.wait: `ensure_future(queue.get())` makes a task of every such get, about 10 µs of
the worker's CPU each, several a job. `next_item` gives the same future without the task.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TypeVar

__all__ = ["Inbox", "next_item"]

T = TypeVar("T")


class Inbox(asyncio.Queue[T]):
    """An unbounded asyncio.Queue with `next()`: a future of the item after those already
    promised, done as soon as there is one.

    What the future took is out of the queue: cancelling it once done does not put it back
    (as with a get() task, the caller does that with its result). A future cancelled while
    it waited takes nothing.
    """

    def __init__(self) -> None:
        super().__init__()
        self._takers: deque[asyncio.Future[T]] = deque()

    def next(self) -> asyncio.Future[T]:
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        while self._takers and self._takers[0].done():
            self._takers.popleft()  # (cancelled while they waited)
        if not self._takers and not self.empty():
            future.set_result(self.get_nowait())
        else:
            self._takers.append(future)
        return future

    def _put(self, item: T) -> None:
        # (put_nowait's own step: a waiting taker gets the item; a get() woken after it finds
        # the queue empty and waits on, as after any spurious wake-up.)
        while self._takers:
            taker = self._takers.popleft()
            if not taker.done():
                taker.set_result(item)
                return
        super()._put(item)  # type: ignore[misc]


def next_item(queue: asyncio.Queue[T]) -> asyncio.Future[T]:
    """A future of `queue`'s next item: without a task for an Inbox, as a get() task else."""
    if isinstance(queue, Inbox):
        return queue.next()
    return asyncio.ensure_future(queue.get())
