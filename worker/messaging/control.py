"""Per-job control channels (`ctrl:<id>`, `stdin:<id>`) over one shared pub/sub connection.

Each message goes to the job that subscribed as soon as it is parsed (leanredis.subscriber).
`subscribe` returns only once Redis has confirmed both channels, so a caller that checks the
durable start flag afterwards cannot miss a start published in between.

Pub/sub is only the fast path: every signal it carries is also stored (the start flag,
the kill flag, the stdin stream), and those are read again when a message may be missing:
when the connection was replaced (a ConnectionWatch tells, and wakes the reader then), and
on a slow safety poll. Parked jobs have theirs read all together (worker.messaging.
flagsweep); a running job's kill watch and stdin feeder read their own. A healthy
connection loses nothing, so a job that waits costs Redis nothing meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import weakref

import msgspec

from leanredis import LeanRedis
from leanredis.subscriber import Subscriber
from shared import keys
from shared.codec import decode_stored
from shared.messages import CtrlMessage, StdinFrame
from worker.messaging.inbox import Inbox

__all__ = ["ConnectionWatch", "ControlBus", "Subscription"]

log = logging.getLogger(__name__)


# A finished job's channels are unsubscribed along with the next job's SUBSCRIBE (one write
# and one answer instead of two), or this long after, if no job comes.
UNSUBSCRIBE_WITHIN_S = 0.25


class Subscription:
    def __init__(self, job_id: str, generation: int) -> None:
        self.job_id = job_id
        self.ctrl: Inbox[CtrlMessage] = Inbox()
        self.stdin: Inbox[StdinFrame] = Inbox()
        self._confirmed: dict[str, asyncio.Future[None]] = {}
        # ControlBus.generation when the subscription was asked for: a different one later
        # means the connection was replaced since, and messages may have been lost.
        self.generation = generation


class ConnectionWatch:
    """For one reader of a job's stored signals: whether the pub/sub connection was
    replaced since it last looked (what the old one carried meanwhile is lost)."""

    def __init__(self, bus: ControlBus, seen: int) -> None:
        self._bus = bus
        self._seen = seen
        self._next: asyncio.Future[None] | None = None

    def replaced(self) -> bool:
        """True when it was replaced since the last look (this look takes that in)."""
        now = self._bus.generation
        replaced, self._seen = now != self._seen, now
        return replaced

    def look(self) -> asyncio.Future[None] | None:
        """None when the connection was replaced since the last look (read the stored copy
        now); else a future done at the next replacement, to wait on with asyncio.wait.

        The future is taken before the look, so a replacement while the caller reads or
        waits is never missed. The watch keeps its own from one wait to the next: each wait
        adds and removes one callback on it, where a future shared by a thousand parked
        jobs made every removal a long scan.
        """
        if self._next is None or self._next.done():
            self._next = self._bus.next_replacement()
        return None if self.replaced() else self._next


class ControlBus:
    def __init__(self, redis: LeanRedis) -> None:
        self._subscriber = Subscriber(
            redis, self._on_message, on_ready=self._on_ready, unsubscribe_within_s=UNSUBSCRIBE_WITHIN_S
        )
        self._subs: dict[str, Subscription] = {}
        self._ready = 0
        # The futures next_replacement handed out, done at the next replacement; a reader
        # that is gone takes its future with it.
        self._waiting: weakref.WeakSet[asyncio.Future[None]] = weakref.WeakSet()

    @property
    def generation(self) -> int:
        """How many times the pub/sub connection was (re)established and subscribed."""
        return self._ready

    @property
    def connected(self) -> bool:
        """Whether the pub/sub connection is up (a subscription now is confirmed at once)."""
        return self._subscriber.ready

    def watch(self, since: int) -> ConnectionWatch:
        """A watch that has seen generation `since` (a Subscription's, say)."""
        return ConnectionWatch(self, since)

    def next_replacement(self) -> asyncio.Future[None]:
        """A future of its own, done once the connection is next replaced and subscribed again."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.add(future)
        return future

    def _on_ready(self) -> None:
        self._ready += 1
        waiting = list(self._waiting)
        self._waiting.clear()
        for future in waiting:
            if not future.done():
                future.set_result(None)

    async def start(self) -> None:
        await self._subscriber.start()

    async def aclose(self) -> None:
        await self._subscriber.aclose()

    async def subscribe(self, job_id: str, timeout_s: float = 5.0) -> Subscription:
        sub = Subscription(job_id, self.generation)
        channels = (keys.ctrl_channel(job_id), keys.stdin_channel(job_id))
        loop = asyncio.get_running_loop()
        for channel in channels:
            sub._confirmed[channel] = loop.create_future()
            self._subs[channel] = sub
        try:
            self._subscriber.subscribe(*channels)
            await asyncio.wait_for(asyncio.gather(*sub._confirmed.values()), timeout_s)
        except BaseException:
            await self.unsubscribe(sub)
            raise
        return sub

    async def unsubscribe(self, sub: Subscription) -> None:
        """Drop `sub`'s channels, unless a newer subscription to the same job holds them: a
        job handed back can be claimed again here before its first run has ended."""
        channels = [
            channel
            for channel in (keys.ctrl_channel(sub.job_id), keys.stdin_channel(sub.job_id))
            if self._subs.get(channel) is sub
        ]
        for channel in channels:
            del self._subs[channel]
        if channels:
            self._subscriber.unsubscribe(*channels)

    def _on_message(self, kind: bytes, raw_channel: bytes, data: bytes | int) -> None:
        channel = raw_channel.decode()
        sub = self._subs.get(channel)
        if sub is None:
            return
        if kind == b"subscribe":
            future = sub._confirmed.get(channel)
            if future is not None and not future.done():
                future.set_result(None)
            return
        if kind != b"message":
            return
        try:
            if channel.startswith("ctrl:"):
                sub.ctrl.put_nowait(decode_stored(CtrlMessage, data))  # type: ignore[arg-type]
            else:
                sub.stdin.put_nowait(decode_stored(StdinFrame, data))  # type: ignore[arg-type]
        except msgspec.MsgspecError:
            log.warning("job %s: ignored malformed control message on %s", sub.job_id, channel)
